"""Config schema of the ``sglang`` backend."""

from dataclasses import dataclass, field


@dataclass
class SGLangBackendConfig:
    name: str = "sglang"
    dtype: str = "auto"
    #: attach to a running SGLang server instead of starting one
    url: str | None = None
    port: int = 30000
    mem_fraction_static: float = 0.5
    startup_timeout_s: float = 600.0
    host: str = "127.0.0.1"
    request_timeout_s: float = 600.0
    enable_lora: bool = False
    max_lora_rank: int = 64
    #: extra command-line flags for sglang.launch_server
    extra_args: list[str] = field(default_factory=list)
