"""Inference backend ``hf``: plain transformers, runs anywhere (CPU included)."""

from swarmkit import hookimpl
from swarmkit_plugins.backend_hf.schema import HFBackendConfig


@hookimpl
def register_backends(register):
    register(
        "hf",
        "swarmkit_plugins.backend_hf.engine:HFBackend",
        schema=HFBackendConfig,
        requires=("torch", "transformers"),
        description="transformers generate loop with dynamic batching; CPU or GPU",
    )
