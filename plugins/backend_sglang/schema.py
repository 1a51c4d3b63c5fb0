"""Config schema of the ``sglang`` backend."""

from dataclasses import dataclass


@dataclass
class SGLangBackendConfig:
    name: str = "sglang"
    dtype: str = "auto"
    #: attach to a running SGLang server instead of starting one
    url: str | None = None
    port: int = 30000
    mem_fraction_static: float = 0.5
    startup_timeout_s: float = 600.0
