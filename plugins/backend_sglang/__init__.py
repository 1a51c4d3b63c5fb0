"""Inference backend ``sglang`` (extra ``swarmkit[sglang]``). Untested against a real SGLang here."""

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
        description="managed SGLang server process over its HTTP API",
    )
