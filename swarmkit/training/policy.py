"""The scoring model: a Hugging Face causal LM that returns the logprobs of trained tokens.

:class:`PolicyModel` wraps a causal LM (plain or peft) and scores a *packed*
row of samples (see :mod:`swarmkit.training.packing`): the decoder runs once,
the hidden states of the trained positions go through the chunked logprob
kernel (:mod:`swarmkit.training.logprob`, which also gives the policy's entropy
at those positions in the same pass), and an optional value head gives PPO
values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from swarmkit.training.logprob import (
    DEFAULT_LOGIT_CHUNK_ELEMENTS,
    logits_entropy,
    selected_logprobs_and_entropy,
)


def _causal_lm(lm: Any) -> Any:
    """The transformers ``*ForCausalLM`` inside a peft model (or the model itself)."""
    get_base = getattr(lm, "get_base_model", None)
    return get_base() if callable(get_base) else lm


class PolicyModel(nn.Module):
    """A causal LM that scores packed samples: ``forward`` returns trained-token logprobs and entropies.

    ``lm`` is a transformers causal LM or a peft model around one. With
    ``value_head`` a scalar head on the last hidden state gives PPO values.
    """

    def __init__(self, lm: nn.Module, compute_dtype: torch.dtype, value_head: bool = False,
                 chunk_elements: int = DEFAULT_LOGIT_CHUNK_ELEMENTS, keep_logits_bytes: int = 0):
        super().__init__()
        #: the HF causal LM (or peft model around one); typed Any: its attributes are dynamic
        self.lm: Any = lm
        self.compute_dtype = compute_dtype
        self.chunk_elements = chunk_elements
        self.keep_logits_bytes = keep_logits_bytes
        hidden = _causal_lm(lm).config.hidden_size
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def causal_lm(self) -> Any:
        return _causal_lm(self.lm)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, select: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Score one packed row.

        :param input_ids: (R, C) packed token ids.
        :param position_ids: (R, C), restarting at 0 at each sample.
        :param select: (M,) flattened positions whose *next* token is trained.
        :param targets: (M,) the token at ``select + 1``.
        :returns: logprobs (M,) float32, values (M,) float32 or None, and entropies (M,) float32:
            the entropy of the policy's next-token distribution at each selected position
            (differentiable; an unused one costs nothing in backward).
        """
        clm = self.causal_lm
        decoder = getattr(clm, clm.base_model_prefix)
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
        last = out.last_hidden_state
        hidden = last.reshape(-1, last.shape[-1]).index_select(0, select)  # (M, H)
        head = clm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            logits = head(hidden).float()
            lp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
            ent = logits_entropy(logits)
        else:
            lp, ent = selected_logprobs_and_entropy(hidden, head.weight, targets, self.compute_dtype,
                                                    self.chunk_elements, self.keep_logits_bytes)
        values = None
        if self.value_head is not None:
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return lp, values, ent

    def decoder_layers(self) -> list[nn.Module]:
        clm = self.causal_lm
        return list(getattr(getattr(clm, clm.base_model_prefix), "layers", []))

    def compile_layers(self, backend: str = "inductor") -> int:
        """``torch.compile`` every decoder layer's ``forward`` in place; returns how many.

        The layers share one code object, so they share compiled graphs (one per input
        shape kind: static, then dynamic after the first new shape). Only ``forward`` is
        replaced: module hooks (FSDP2's unshard/reshard, gradient checkpointing) stay
        outside the compiled region and parameter names do not change. What it fuses is
        the memory-bound work between the matmuls: RMSNorm, rotary, SiLU gate, residuals.
        """
        layers = self.decoder_layers()
        failed: list[str] = []  # shared by this model's layers: one failure sends them all to eager
        for layer in layers:
            if "forward" not in layer.__dict__:
                layer.forward = _compiled_forward(layer.forward, torch.compile(layer.forward, backend=backend),
                                                  failed)
        self.compile_failed = failed
        return len(layers)


def _compiled_forward(eager: Callable[..., Any], compiled: Callable[..., Any],
                      failed: list[str]) -> Callable[..., Any]:
    """A layer forward that runs ``compiled`` and, if compiling fails (no Triton, no C++ compiler, an
    unsupported op), warns once and runs ``eager`` for good; errors of the model itself still raise."""
    from torch._dynamo.exc import TorchDynamoException

    def forward(*args: Any, **kwargs: Any) -> Any:
        if failed:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            import warnings

            failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            warnings.warn(f"torch.compile of the decoder layers failed ({failed[0]}); running eager. "
                          "Set optim.compile=false to skip compiling.", stacklevel=2)
            return eager(*args, **kwargs)

    forward.__wrapped__ = eager  # type: ignore[attr-defined]
    return forward
