"""Inference backend ``sglang`` (extra ``swarmkit[sglang]``), experimental: it has only run against a stand-in."""

from swarmkit import hookimpl
from swarmkit_plugins.backend_sglang.schema import SGLangBackendConfig


@hookimpl
def register_backends(register):
    register(
        "sglang",
        "swarmkit_plugins.backend_sglang.engine:SGLangBackend",
        schema=SGLangBackendConfig,
        requires=("sglang",),
        extra="sglang",
        description="managed SGLang server process over its HTTP API (only ever run against a stand-in of SGLang's API)",
        experimental=True,
    )
