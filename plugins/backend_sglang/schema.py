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
    #: modules LoRA adapters may target (sglang --lora-target-modules); empty = all
    lora_target_modules: list[str] = field(default_factory=list)
    #: events of /generate streams carry only new tokens (sglang --incremental-streaming-output)
    incremental_streaming_output: bool = False
    #: extra command-line flags for sglang.launch_server
    extra_args: list[str] = field(default_factory=list)
    #: the interpreter that has sglang installed (null = this one)
    python: str | None = None
    #: the launched server's log (null = a temporary file)
    log_path: str | None = None
    #: tokenizer folder when it differs from the model's
    tokenizer_path: str | None = None
