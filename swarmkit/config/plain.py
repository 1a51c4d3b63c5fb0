"""One way to turn any config object into a plain dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def as_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict from ``None`` (empty), a mapping, a dataclass or an OmegaConf node (resolved)."""
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping) and not _is_omegaconf(cfg):
        return dict(cfg)
    if _is_omegaconf(cfg):
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    raise TypeError(f"expected a mapping, dataclass or OmegaConf config, got {type(cfg).__name__}")


def _is_omegaconf(cfg: Any) -> bool:
    return type(cfg).__module__.startswith("omegaconf")


def with_adapters(cfg: Any, entries: list[Any]) -> Any:
    """A copy of ``cfg`` whose ``model.adapters`` is ``entries`` (an OmegaConf config stays one, unresolved)."""
    if _is_omegaconf(cfg):
        from omegaconf import OmegaConf

        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        out.model.adapters = entries
        return out
    out_dict = as_dict(cfg)
    out_dict["model"] = {**as_dict(out_dict.get("model")), "adapters": list(entries)}
    return out_dict
