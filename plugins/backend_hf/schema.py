"""Config schema of the ``hf`` backend (group ``backend``, option ``hf``)."""

from dataclasses import dataclass

#: the values of ``backend.pipeline``
PIPELINE_CHOICES = ("auto", "on", "off")


@dataclass
class HFBackendConfig:
    name: str = "hf"
    #: "auto" = bfloat16 on CUDA, float32 on CPU
    dtype: str = "auto"
    #: "auto" = cuda if available else cpu
    device: str = "auto"
    #: most sequences decoded together in one forward pass
    max_batch_size: int = 32
    #: an idle engine's first request waits while others keep arriving this many seconds apart
    batch_wait_s: float = 0.005
    #: ... but no longer than this in all (raised to batch_wait_s if smaller)
    batch_wait_max_s: float = 0.1
    #: most (padded) prompt tokens prefilled in one forward pass
    max_prefill_tokens: int = 16384
    #: on CUDA, capture each decode step's shape once as a CUDA graph and replay it (one launch per step)
    cuda_graphs: bool = True
    #: the most memory the KV cache may take: "auto" (CUDA: half the device memory free after the weights;
    #: CPU: a quarter of the available RAM, at most 4 GiB), a size ("4GiB", "512MB", bytes), or a share of
    #: the free memory ("0.3"). The cache grows to it as requests need; a request that does not fit
    #: beside the running ones waits, one that can never fit is refused (docs/backends.md)
    kv_cache_memory: str = "auto"
    #: decode with one step in flight: step t+1 (forward and plain sampling fused, fed from the device) is
    #: launched before the host processes step t's tokens. "auto" = on where CUDA graphs are used; "on"
    #: also on the CPU (same tokens, no faster there: for tests); "off" = one step at a time
    pipeline: str = "auto"
    #: compute each layer's q/k/v projections (and the MLP's gate/up) as one matmul over their concatenated
    #: weights, the parameters becoming views of it: the same values, fewer kernels per step (fused.py)
    fuse_projections: bool = True

    def problems(self) -> list[str]:
        """What is wrong with these settings (checked with the config, before any model is loaded)."""
        from swarmkit_plugins.backend_hf.budget import parse_memory

        out = []
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as exc:
            out.append(f"backend.{exc}")
        if self.pipeline not in PIPELINE_CHOICES:
            out.append(f"backend.pipeline must be auto, on or off, not {self.pipeline!r}")
        if self.max_batch_size < 1:
            out.append("backend.max_batch_size must be >= 1")
        return out
