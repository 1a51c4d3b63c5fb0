"""Constrained decoding for the ``hf`` engine: xgrammar's token masks over the shaped logits.

A request with ``SamplingParams.structural_tag`` (the server sets it for calls of
``strict`` tools: :mod:`swarmkit.timelines.strict_tools`) gets a grammar matcher per
sequence. At every step each constrained row's next-token bitmask is filled on the
host and applied to its shaped logits (disallowed tokens at ``-inf``) before the
sampler draws, and the drawn token is then fed to the matcher. Logprobs stay those
of the raw distribution (the sampler's contract); the server marks such a call
``structured`` so training rescores it.

xgrammar is an optional dependency (the ``grammar`` extra): :func:`available`
says whether it is installed without importing it; it is imported, and the
tokenizer's token table built, when the first constrained request reaches the
engine (a few seconds on a CPU, once).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

#: what to install when the engine cannot constrain decoding
HINT = "the hf engine constrains decoding with xgrammar: pip install 'swarmkit[grammar]'"

#: compiled grammars kept (a request's tools are the same from one turn to the next)
CACHE_SIZE = 64


def available() -> bool:
    """Whether xgrammar is installed (not imported: importing it takes seconds)."""
    return importlib.util.find_spec("xgrammar") is not None


class Grammars:
    """The matchers of one engine's constrained sequences (used from the engine's worker thread only).

    :param tokenizer: the served model's Hugging Face tokenizer.
    :param vocab_size: the width of the logits (the model's vocabulary, which may exceed the tokenizer's).
    :param stop_ids: the ids that end a sequence (allowed once a grammar is complete).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]):
        try:
            import xgrammar
        except ImportError as exc:  # pragma: no cover - available() was checked by the engine
            raise RuntimeError(HINT) from exc
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=int(vocab_size),
                                                       stop_token_ids=sorted(int(t) for t in stop_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: dict[str, Any] = {}
        self.vocab_size = int(vocab_size)
        self._bitmask: Any = None

    def matcher(self, tag: dict[str, Any]) -> Any:
        """A fresh matcher of the structural tag ``tag`` (compiled once per distinct tag).

        :raises ValueError: the tag (a tool's schema) cannot be compiled.
        """
        key = json.dumps(tag, sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compiler.compile_structural_tag(key)
            except Exception as exc:  # noqa: BLE001 - xgrammar's errors: the request's schema, not the engine
                raise ValueError(f"the tool-call constraint cannot be compiled: {exc}") from exc
            if len(self._compiled) >= CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, shaped: Any, rows: list[int], matchers: list[Any]) -> None:
        """Set the logits of ``shaped [B, V]`` that the matcher of each row in ``rows`` forbids to ``-inf``
        (in place)."""
        import torch

        b = shaped.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < b:
            self._bitmask = self._xgr.allocate_token_bitmask(max(b, 8), self.vocab_size)
        bitmask = self._bitmask[:b]
        for r, m in zip(rows, matchers, strict=True):
            m.fill_next_token_bitmask(bitmask, r)
        if shaped.device.type == "cpu":
            self._xgr.apply_token_bitmask_inplace(shaped, bitmask, indices=rows)
            return
        # on an accelerator: the rows' masks, unpacked to booleans there (one copy of the bitmask)
        words = bitmask[rows].to(shaped.device, non_blocking=True)
        bits = (words[:, :, None] >> torch.arange(32, device=shaped.device, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(rows), -1)[:, : shaped.shape[1]].bool()
        idx = torch.tensor(rows, device=shaped.device)
        shaped.index_copy_(0, idx, shaped.index_select(0, idx).masked_fill(~allowed, float("-inf")))

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> None:
        """Feed each matcher its sequence's sampled token (a stop token ends a complete grammar)."""
        for m, t in zip(matchers, tokens, strict=True):
            if not m.is_terminated():
                m.accept_token(int(t))
