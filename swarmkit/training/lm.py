"""Loading the trainable model, and where it runs: device, dtype, process group."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def dist_info() -> tuple[bool, int, int]:
    """(initialized, rank, world size) of torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def default_device() -> torch.device:
    """This rank's GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA, float32 elsewhere."""
    if name in ("auto", None, ""):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
            "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}[name]


def adapter_seed(seed: int, index: int) -> int:
    """The seed of the initial LoRA of the adapter at ``index`` of ``model.adapters`` (0: ``seed`` itself), so an
    adapter added at run time starts as it would have had the list named it from the start."""
    return seed + 7919 * index


def load_lm(model_path: str | Path, model: Any, seed: int) -> Any:
    """The HF causal LM in float32 (master weights), with LoRA adapters when ``model.lora_rank > 0``.

    :param model: the ``model`` group (:class:`swarmkit.config.schema.ModelConfig`).
    :param seed: seeds the adapter init, so every rank starts from the same adapter.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": model.trust_remote_code}
    if model.attn_implementation:
        kwargs["attn_implementation"] = model.attn_implementation
    lm: Any = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    if model.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        cfg = LoraConfig(
            r=model.lora_rank, lora_alpha=model.lora_alpha, lora_dropout=model.lora_dropout,
            target_modules=list(model.lora_target_modules), task_type="CAUSAL_LM",
        )
        specs = model.adapter_specs()
        if not specs:
            return get_peft_model(lm, cfg)
        # several named adapters of one shape over the one base (model.adapters); each seeded on its own
        lm = get_peft_model(lm, cfg, adapter_name=specs[0].name)
        for k, spec in enumerate(specs[1:], 1):
            torch.manual_seed(adapter_seed(seed, k))
            lm.add_adapter(spec.name, cfg)
        lm.set_adapter(specs[0].name)
    return lm
