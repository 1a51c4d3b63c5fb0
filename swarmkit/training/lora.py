"""The one LoRA merge: ``W + scale · B @ A`` with peft's exact scaling.

Every place that turns an adapter into full weights uses these functions: the
trainer's weight export (:func:`merge_lora_state`, scalings read from the live
peft layers) and the inference backends' ``update_weights(path=adapter)``
(:func:`adapter_deltas`, scalings from ``adapter_config.json`` by
:func:`lora_scale`, which picks ``alpha_pattern`` / ``rank_pattern`` entries
the way peft does). So a model served from an exported adapter equals the
trainer's merged weights, whatever the adapter's patterns.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
_AB = re.compile(r"(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def pattern_key(patterns: Sequence[str], module: str) -> str | None:
    """The first pattern that matches the end of ``module`` (peft's rule: ``(.*\\.)?(pattern)$``)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def lora_scale(adapter_cfg: Mapping[str, Any], module: str) -> float:
    """The scaling peft gives ``module`` (HF name, e.g. ``model.layers.0.self_attn.q_proj``).

    ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), where ``r`` and
    ``alpha`` come from the first matching ``rank_pattern`` / ``alpha_pattern``
    entry, else ``r`` / ``lora_alpha``.
    """
    rank_pattern = adapter_cfg.get("rank_pattern") or {}
    alpha_pattern = adapter_cfg.get("alpha_pattern") or {}
    rk = pattern_key(list(rank_pattern), module)
    ak = pattern_key(list(alpha_pattern), module)
    r = float(rank_pattern[rk] if rk is not None else adapter_cfg.get("r", 8))
    alpha = float(alpha_pattern[ak] if ak is not None else adapter_cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if adapter_cfg.get("use_rslora") else alpha / r


def strip_peft_prefix(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def _delta(a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """(out, in) float32 ``scale · B @ A`` of A (r, in) and B (out, r)."""
    delta = (b.float() @ a.float()) * scale
    return delta.T if fan_in_fan_out else delta


def merge_lora_state(sd: Mapping[str, torch.Tensor], scalings: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """peft-named state dict → base-model HF names with ``W + scaling · B @ A`` merged in.

    ``sd`` keys are relative to the peft model (``base_model.model.…``);
    ``scalings`` maps HF module names (``model.layers.0.self_attn.q_proj``) to
    the adapter's scaling (peft's ``LoraLayer.scaling["default"]``).
    """
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        name = strip_peft_prefix(key)
        m = _AB.match(name)
        if m:
            lora.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        if ".lora_" in name:  # embedding / magnitude variants are not supported for export
            continue
        out[name.replace(".base_layer.", ".")] = t
    for mod, ab in lora.items():
        w = out[mod + ".weight"]
        out[mod + ".weight"] = (w.float() + _delta(ab["A"], ab["B"], scalings.get(mod, 1.0))).to(w.dtype)
    return out


def adapter_deltas(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A peft adapter folder as ``(deltas, replaced)``.

    ``deltas``: HF module name → float32 ``scale · B @ A`` (shaped like the module's
    weight); ``replaced``: full tensors the adapter carries (``modules_to_save``), by
    HF name. DoRA and non-linear LoRA tensors are refused with a ValueError.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    if cfg.get("use_dora"):
        raise ValueError("DoRA adapters are not supported; merge them first")
    files = sorted(folder.glob("adapter_model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no adapter_model*.safetensors in {folder}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            m = _AB.match(name)
            if m:
                pairs.setdefault(strip_peft_prefix(m.group(1)), {})[m.group(2)] = t
            elif "lora_" in name:
                raise ValueError(f"unsupported LoRA tensor '{name}' (only lora_A/lora_B of linear layers)")
            else:
                replaced[strip_peft_prefix(name).replace(".modules_to_save.default", "")] = t
    deltas = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA module '{module}' lacks lora_A or lora_B")
        deltas[module] = _delta(ab["A"], ab["B"], lora_scale(cfg, module), bool(cfg.get("fan_in_fan_out")))
    return deltas, replaced
