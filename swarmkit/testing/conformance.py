"""Test helpers that ship with swarmkit, for its own tests and for third-party plugins.

Backend conformance suite
-------------------------
Every inference backend (``hf``, ``vllm``, a third-party one) must pass the same
checks against a reference transformers forward pass of the same weights::

    import pytest
    from swarmkit.testing import CONFORMANCE_CHECKS, BackendConformance, build_test_model

    @pytest.fixture(scope="module")
    def conformance(tmp_path_factory):
        folder = build_test_model(tmp_path_factory.mktemp("model"))
        with BackendConformance.started(MyBackend, config={...}, model={"path": str(folder)},
                                        reference_dir=folder) as suite:
            yield suite

    @pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
    def test_backend_conformance(conformance, check):
        conformance.run(check)

The backend runs on an event loop of its own (a background thread), so the
checks are plain synchronous pytest tests and one started backend serves them
all. Checks that change weights put the original weights back before they end.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from swarmkit.contract import GenerationOutput, InferenceBackend, SamplingParams

#: names of the checks of :class:`BackendConformance`, for ``pytest.mark.parametrize``
CONFORMANCE_CHECKS: tuple[str, ...] = (
    "decode_consistency",
    "logprobs_match_reference",
    "greedy_determinism",
    "stop_strings",
    "stop_token_ids",
    "max_tokens",
    "n_samples",
    "seeded_sampling",
    "top_logprobs",
    "prompt_scores",
    "sampling_fields",
    "special_tokens",
    "concurrent_requests",
    "streaming",
    "weight_update",
    "partial_rollout",
    "lora_adapter",
)

PROMPTS: tuple[str, ...] = (
    "What is 12 + 7?",
    "The weather in Paris is",
    "Call the tool get_weather",
    "hello world apple banana",
    "0 1 2 3 4 5",
    "You are a helpful assistant.",
    "yes no yes no",
    "system user assistant tool",
)


def build_test_model(folder: str | Path, *, std: float = 0.1, seed: int = 1, arch: str = "qwen2") -> Path:
    """Save the built-in tiny model with larger random weights into ``folder``.

    ``arch="llama"`` gives the same model as a Llama (SmolLM2's architecture, whose mask
    handling differs from Qwen2's): the Qwen2 weights in ``LlamaForCausalLM`` with attention
    biases (a zero ``o_proj`` bias).

    The default init (std 0.02) makes greedy decoding repeat one token whatever
    the prompt; std 0.1 gives prompt-dependent, varied continuations, which
    makes contamination and weight-update checks meaningful. Cheap (~1 s).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmkit.models import tiny_model_dir

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    src = tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        c = model.config
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, attention_bias=True,
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=True, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id))
    elif arch != "qwen2":
        raise ValueError(f"arch must be qwen2 or llama, got {arch!r}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        if arch == "llama":  # the Qwen2 model's weights (a Qwen2 is a Llama with q/k/v biases); o_proj bias 0
            qwen = AutoModelForCausalLM.from_pretrained(build_test_model(folder.parent / f"{folder.name}-qwen2",
                                                                         std=std, seed=seed), dtype=torch.float32)
            missing, unexpected = model.load_state_dict(qwen.state_dict(), strict=False)
            if unexpected or any("o_proj.bias" not in k for k in missing):
                raise RuntimeError(f"llama test model: missing {missing}, unexpected {unexpected}")
            for layer in model.model.layers:
                layer.self_attn.o_proj.bias.zero_()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return folder


class BackendHarness:
    """Runs coroutines of one backend on a dedicated event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="backend-harness",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        """Run ``coro`` on the harness loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class BackendConformance:
    """The checks every :class:`~swarmkit.contract.InferenceBackend` must pass.

    :param backend: a *started* backend serving the weights of ``reference_dir``
        (use :meth:`started` to build, start and close one).
    :param reference_dir: a Hugging Face model folder; the suite loads it in
        fp32 on CPU and teacher-forces the backend's outputs through it.
    :param tol: absolute tolerance on logprobs (1e-3 by the conformance spec).
    :param harness: the event-loop harness the backend was started on.
    """

    def __init__(self, backend: InferenceBackend, reference_dir: str | Path, *, tol: float = 1e-3,
                 harness: BackendHarness | None = None, max_tokens: int = 12) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.backend = backend
        self.reference_dir = Path(reference_dir)
        self.tol = tol
        self.max_tokens = max_tokens
        self._own_harness = harness is None
        self.harness = harness or BackendHarness()
        self.ref = AutoModelForCausalLM.from_pretrained(self.reference_dir, dtype=torch.float32).eval()
        self.tok = backend.tokenizer
        self.prompts = [self._encode(p) for p in PROMPTS]
        self._version = int(getattr(backend, "policy_version", 0))

    # ------------------------------------------------------------------ set-up
    @classmethod
    @contextlib.contextmanager
    def started(cls, backend_cls: Callable[..., InferenceBackend], *, config: dict[str, Any],
                model: dict[str, Any], reference_dir: str | Path,
                **kwargs: Any) -> Iterator[BackendConformance]:
        """Build ``backend_cls(config=..., model=...)``, start it, yield the suite, close it."""
        harness = BackendHarness()
        backend = backend_cls(config=config, model=model)
        try:
            harness.run(backend.start())
            yield cls(backend, reference_dir, harness=harness, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                harness.run(backend.close(), timeout=60)
            harness.close()

    def run(self, name: str) -> None:
        """Run the check ``name`` (one of :data:`CONFORMANCE_CHECKS`)."""
        if name not in CONFORMANCE_CHECKS:
            raise KeyError(f"unknown conformance check '{name}'")
        getattr(self, "check_" + name)()

    def run_all(self) -> None:
        for name in CONFORMANCE_CHECKS:
            self.run(name)

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompt: Sequence[int], **params: Any) -> list[GenerationOutput]:
        params.setdefault("max_tokens", self.max_tokens)
        params.setdefault("temperature", 0.0)
        return self.harness.run(self.backend.generate(list(prompt), SamplingParams(**params)))

    def stream(self, prompt: Sequence[int], **params: Any) -> list[Any]:
        params.setdefault("max_tokens", self.max_tokens)
        params.setdefault("temperature", 0.0)

        async def collect() -> list[Any]:
            return [c async for c in self.backend.stream(list(prompt), SamplingParams(**params))]
        return self.harness.run(collect())

    def update(self, named_tensors: Any = None, path: str | None = None) -> int:
        self._version += 1
        self.harness.run(self.backend.update_weights(named_tensors, path=path, version=self._version))
        return self._version

    def ref_logprobs(self, prompt: Sequence[int], ids: Sequence[int], model: Any = None) -> Any:
        """Log-softmax rows of the reference model at the positions that predicted ``ids``."""
        import torch

        model = model if model is not None else self.ref
        with torch.no_grad():
            full = torch.tensor([list(prompt) + list(ids)])
            logits = model(full).logits[0, len(prompt) - 1: len(prompt) + len(ids) - 1]
        return torch.log_softmax(logits.float(), dim=-1)

    def assert_matches_reference(self, prompt: Sequence[int], out: GenerationOutput, *,
                                 greedy: bool, model: Any = None, what: str = "") -> None:
        """Logprobs equal the reference (within ``tol``); greedy picks are argmaxes."""
        assert len(out.token_ids) == len(out.logprobs), f"{what}: one logprob per token"
        if not out.token_ids:
            return
        rows = self.ref_logprobs(prompt, out.token_ids, model)
        for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            ref = float(rows[i, t])
            assert abs(ref - lp) <= self.tol, (
                f"{what}: token {i} ({t}) logprob {lp:.6f} != reference {ref:.6f}")
            if greedy:
                best = float(rows[i].max())
                assert best - ref <= self.tol, f"{what}: greedy token {i} is not the argmax"

    def assert_same_greedy(self, a: GenerationOutput, b: GenerationOutput, what: str) -> None:
        """Two greedy outputs agree (a near-tie may flip the pick; then they may diverge)."""
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
            if x != y:
                assert abs(a.logprobs[i] - b.logprobs[i]) <= self.tol, (
                    f"{what}: outputs differ at token {i} ({x} vs {y}) without a tie")
                return
            assert abs(a.logprobs[i] - b.logprobs[i]) <= self.tol, f"{what}: logprob {i} differs"
        assert len(a.token_ids) == len(b.token_ids), f"{what}: lengths differ"
        assert a.text == b.text and a.finish_reason == b.finish_reason, f"{what}: text differs"

    def _visible_ids(self, out: GenerationOutput, stop_ids: Sequence[int] = ()) -> list[int]:
        ids = list(out.token_ids)
        eos = {self.tok.eos_token_id, *stop_ids}
        if out.finish_reason == "stop" and ids and ids[-1] in eos:
            ids = ids[:-1]
        return ids

    def _state(self) -> list[tuple[str, Any]]:
        return [(k, v.detach().clone()) for k, v in self.ref.state_dict().items()]

    # ------------------------------------------------------------------ checks
    def check_decode_consistency(self) -> None:
        """Generated ids decode to the returned text (stop token excluded)."""
        for p in self.prompts[:4]:
            out = self.generate(p)[0]
            assert out.finish_reason in ("stop", "length")
            assert out.text == self.tok.decode(self._visible_ids(out), clean_up_tokenization_spaces=False)

    def check_logprobs_match_reference(self) -> None:
        """Per-token logprobs (greedy and sampled) equal a transformers forward pass."""
        for p in self.prompts[:3]:
            self.assert_matches_reference(p, self.generate(p)[0], greedy=True, what="greedy")
            out = self.generate(p, temperature=0.8, top_p=0.9, seed=3)[0]
            self.assert_matches_reference(p, out, greedy=False, what="sampled")

    def check_greedy_determinism(self) -> None:
        p = self.prompts[1]
        a, b = self.generate(p)[0], self.generate(p)[0]
        assert a.token_ids == b.token_ids and a.text == b.text

    def check_stop_strings(self) -> None:
        """Text is cut before the stop string; ids end at the token that completed it."""
        tried = 0
        for p in self.prompts:
            full = self.generate(p, max_tokens=24)[0]
            text = full.text
            if len(text) < 6 or "\ufffd" in text:
                continue
            tried += 1
            stop = text[len(text) // 2: len(text) // 2 + 2]
            cut = text.find(stop)
            out = self.generate(p, max_tokens=24, stop=[stop, "\x00never\x00"])[0]
            assert out.finish_reason == "stop", "stop string did not stop generation"
            assert out.text == text[:cut]
            assert stop not in out.text
            assert out.token_ids == full.token_ids[: len(out.token_ids)], "ids are not a prefix"
            assert stop not in self.tok.decode(out.token_ids[:-1]), "ids run past the stop string"
            assert stop in self.tok.decode(out.token_ids), "ids stop before the stop string"
            if tried >= 2:
                break
        assert tried, "no prompt produced text long enough to test stop strings"

    def check_stop_token_ids(self) -> None:
        """A stop token id ends generation; it is returned in token_ids but not in text."""
        p = self.prompts[0]
        full = self.generate(p, max_tokens=16)[0]
        stop_id = full.token_ids[min(3, len(full.token_ids) - 1)]
        out = self.generate(p, max_tokens=16, stop_token_ids=[stop_id])[0]
        k = full.token_ids.index(stop_id)
        assert out.token_ids == full.token_ids[: k + 1]
        assert out.finish_reason == "stop"
        assert out.text == self.tok.decode(out.token_ids[:-1], clean_up_tokenization_spaces=False)

    def check_max_tokens(self) -> None:
        for m in (1, 5):
            out = self.generate(self.prompts[2], max_tokens=m)[0]
            assert len(out.token_ids) <= m
            assert out.finish_reason == "stop" or (len(out.token_ids) == m and out.finish_reason == "length")

    def check_n_samples(self) -> None:
        """n continuations, each with correct logprobs; sampling makes them differ."""
        p = self.prompts[3]
        outs = self.generate(p, n=4, temperature=1.0, seed=11, max_tokens=10)
        assert len(outs) == 4
        for o in outs:
            self.assert_matches_reference(p, o, greedy=False, what="n>1")
        assert len({tuple(o.token_ids) for o in outs}) > 1, "n samples are all identical"
        greedy = self.generate(p, n=2)
        assert greedy[0].token_ids == greedy[1].token_ids

    def check_seeded_sampling(self) -> None:
        p = self.prompts[4]
        a = self.generate(p, temperature=1.0, seed=123, max_tokens=10)[0]
        b = self.generate(p, temperature=1.0, seed=123, max_tokens=10)[0]
        assert a.token_ids == b.token_ids, "same seed gave different samples"

    def check_top_logprobs(self) -> None:
        p = self.prompts[5]
        out = self.generate(p, top_logprobs=3, max_tokens=6)[0]
        assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
        rows = self.ref_logprobs(p, out.token_ids)
        for i, top in enumerate(out.top_logprobs):
            assert len(top) == 3
            ref_v, _ = rows[i].topk(3)
            got = sorted(top.values(), reverse=True)
            for g, r in zip(got, ref_v.tolist(), strict=True):
                assert abs(g - r) <= self.tol
            for t, v in top.items():
                assert abs(float(rows[i, int(t)]) - v) <= self.tol
            assert out.token_ids[i] in top  # greedy pick is the best alternative

    def check_prompt_scores(self) -> None:
        """``score_prompt`` (``echo``): every prompt token's logprob and top alternatives equal a full forward
        of the reference over the prompt (the first token None); skipped without ``scores_prompts``."""
        if not self.backend.scores_prompts:
            return
        import torch

        p = list(self.prompts[1]) + list(self.prompts[3])
        got = self.harness.run(self.backend.score_prompt(p, 2))
        assert len(got.logprobs) == len(p) and got.logprobs[0] is None
        assert got.top_logprobs is not None and len(got.top_logprobs) == len(p) and got.top_logprobs[0] is None
        with torch.no_grad():
            rows = torch.log_softmax(self.ref(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
        for i in range(1, len(p)):
            lp, top = got.logprobs[i], got.top_logprobs[i]
            assert lp is not None and abs(float(rows[i - 1, p[i]]) - lp) <= self.tol, f"prompt token {i}"
            assert top is not None and len(top) == 2
            for t, v in top.items():
                assert abs(float(rows[i - 1, int(t)]) - v) <= self.tol
        plain = self.harness.run(self.backend.score_prompt(p))
        assert plain.top_logprobs is None
        assert all(abs(a - b) <= self.tol for a, b in zip(plain.logprobs[1:], got.logprobs[1:], strict=True))  # type: ignore[operator]
        one = self.harness.run(self.backend.score_prompt(p[:1], 2))
        assert one.logprobs == [None] and one.top_logprobs == [None]
        limit = self.backend.max_context
        if limit:  # a prompt that fills the context is scored (nothing is generated); one token more is refused
            full = (p * (int(limit) // len(p) + 1))[:int(limit)]
            got = self.harness.run(self.backend.score_prompt(full, 1))
            assert len(got.logprobs) == len(full)
            with torch.no_grad():
                rows = torch.log_softmax(self.ref(torch.tensor([full])).logits[0, :-1].float(), dim=-1)
            want = rows.gather(1, torch.tensor(full[1:])[:, None])[:, 0].tolist()
            worst = max(abs(w - g) for w, g in zip(want, got.logprobs[1:], strict=True))  # type: ignore[operator]
            assert worst <= self.tol, f"a {limit}-token prompt: logprobs off by {worst}"
            assert got.top_logprobs is not None and got.top_logprobs[-1] is not None
            (t, v), = got.top_logprobs[-1].items()
            assert t == int(rows[-1].argmax()) and abs(v - float(rows[-1].max())) <= self.tol
            try:
                self.harness.run(self.backend.score_prompt(full + full[:1]))
            except ValueError:
                pass
            else:
                raise AssertionError(f"a prompt of {limit + 1} tokens was scored (max_context {limit})")

    def check_sampling_fields(self) -> None:
        """Each distribution-shaping field the backend lists in ``sampling_fields`` does what it
        says, and logprobs stay those of the raw distribution."""
        fields = set(getattr(self.backend, "sampling_fields", ()))
        p = self.prompts[2]
        greedy = self.generate(p)[0]
        if "logit_bias" in fields:
            eos = {self.tok.eos_token_id}
            target = next(t for t in range(5, len(self.tok)) if t not in eos and t != greedy.token_ids[0])
            out = self.generate(p, logit_bias={target: 100.0}, max_tokens=6)[0]
            assert out.token_ids == [target] * len(out.token_ids) and len(out.token_ids) == 6, "logit_bias +100"
            self.assert_matches_reference(p, out, greedy=False, what="logit_bias")
            out = self.generate(p, logit_bias={greedy.token_ids[0]: -100.0}, max_tokens=2)[0]
            assert out.token_ids[0] != greedy.token_ids[0], "logit_bias -100 left the greedy token"
        for name, value in (("top_k", 1), ("min_p", 1.0)):
            if name in fields:  # only the most likely token is left: sampling becomes greedy
                out = self.generate(p, temperature=1.5, seed=0, **{name: value})[0]
                assert out.token_ids == greedy.token_ids, f"{name}={value} is not greedy"
                self.assert_matches_reference(p, out, greedy=True, what=name)
        if "response_format" in fields:  # guided decoding: the text is JSON valid for the schema
            schema = {"type": "string", "enum": ["yes", "no"]}
            out = self.generate(p, response_format={"type": "json_schema", "schema": schema}, max_tokens=12,
                                temperature=1.0, seed=0)[0]
            assert json.loads(out.text) in ("yes", "no"), f"response_format json_schema gave {out.text!r}"
            # (logprobs under a grammar may be the masked distribution's: training rescores them)
        if "structural_tag" in fields:
            self.check_structural_tag(p)
        repeats = len(set(greedy.token_ids)) < len(greedy.token_ids)
        for name, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 10.0)):
            if name in fields:
                out = self.generate(p, **{name: value})[0]
                self.assert_matches_reference(p, out, greedy=False, what=name)
                if repeats:  # greedy repeats a token: a strong penalty changes the continuation
                    assert out.token_ids != greedy.token_ids, f"{name}={value} changed nothing"

    def check_structural_tag(self, prompt: Sequence[int]) -> None:
        """A call of a strict tool constrained by its structural tag (:mod:`swarmkit.timelines.strict_tools`)
        is a well-formed call whose arguments match the schema (an enum, an integer range: what a random
        model breaks unconstrained), sampled or greedy, generated whole or streamed."""
        import jsonschema

        from swarmkit.timelines.strict_tools import tool_call_tag
        from swarmkit.timelines.toolcalls import parse_tool_calls

        wrapping = ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>")
        schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["unit", "days"], "additionalProperties": False}
        tag = tool_call_tag(wrapping, {"weather": schema}, opened="", parallel=False)
        texts = [self.generate(prompt, structural_tag=tag, max_tokens=96, temperature=1.0, seed=s, n=2)[k].text
                 for s in range(2) for k in range(2)]
        texts.append(self.generate(prompt, structural_tag=tag, max_tokens=96)[0].text)
        texts.append("".join(c.text for c in self.stream(prompt, structural_tag=tag, max_tokens=96, temperature=1.0,
                                                         seed=7)))
        for text in texts:
            _, calls = parse_tool_calls(wrapping[0] + text)
            assert len(calls) == 1 and calls[0]["function"]["name"] == "weather", f"structural_tag gave {text!r}"
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)

    def check_special_tokens(self) -> None:
        """A special token generated mid-answer stays in the text (a client that sends the text
        back replays it), unless ``skip_special_tokens``. Forced with ``logit_bias``: a backend
        without it has nothing to check."""
        if "logit_bias" not in set(getattr(self.backend, "sampling_fields", ())):
            return
        ends = {self.tok.eos_token_id, *getattr(self.backend, "_eos_ids", ())}
        special = next((t for t in self.tok.all_special_ids if t not in ends), None)
        if special is None:
            return
        p = self.prompts[0]
        name = self.tok.convert_ids_to_tokens(special)
        out = self.generate(p, logit_bias={special: 100.0}, max_tokens=3)[0]
        assert out.token_ids == [special] * 3, "logit_bias +100 did not force the special token"
        assert out.text == name * 3, f"special token {name!r} dropped from the text: {out.text!r}"
        assert "".join(c.text for c in self.stream(p, logit_bias={special: 100.0}, max_tokens=3)) == out.text
        out = self.generate(p, logit_bias={special: 100.0}, max_tokens=3, skip_special_tokens=True)[0]
        assert out.token_ids == [special] * 3 and out.text == "", "skip_special_tokens kept them"

    def check_concurrent_requests(self) -> None:
        """16 concurrent requests give exactly their solo results (no cross-talk)."""
        prompts = [self.prompts[i % len(self.prompts)][: 2 + i] for i in range(16)]
        solo = [self.generate(p)[0] for p in prompts]
        sampled_solo = [self.generate(p, temperature=1.0, seed=i)[0] for i, p in enumerate(prompts)]

        async def together() -> list[Any]:
            greedy = [self.backend.generate(p, SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
                      for p in prompts]
            sampled = [self.backend.generate(p, SamplingParams(max_tokens=self.max_tokens, temperature=1.0,
                                                               seed=i))
                       for i, p in enumerate(prompts)]
            return await asyncio.gather(*greedy, *sampled)

        res = self.harness.run(together())
        for i, (a, b) in enumerate(zip(solo, res[:16], strict=True)):
            self.assert_same_greedy(a, b[0], f"concurrent request {i}")
        for i, (a, b) in enumerate(zip(sampled_solo, res[16:], strict=True)):
            if a.token_ids != b[0].token_ids:  # only a near-tie may change a seeded sample
                self.assert_same_greedy(a, b[0], f"concurrent seeded request {i}")
        for p, b in zip(prompts, res[:16], strict=True):
            self.assert_matches_reference(p, b[0], greedy=True, what="concurrent")

    def check_streaming(self) -> None:
        """Stream chunks concatenate to the non-streamed result; the last one has the finish reason."""
        for p, stop in ((self.prompts[1], []), (self.prompts[6], [" "])):
            full = self.generate(p, max_tokens=16, stop=stop)[0]
            chunks = self.stream(p, max_tokens=16, stop=stop)
            assert chunks and chunks[-1].finish_reason == full.finish_reason
            assert all(c.finish_reason is None for c in chunks[:-1])
            assert [t for c in chunks for t in c.token_ids] == full.token_ids
            assert [x for c in chunks for x in c.logprobs] == full.logprobs
            assert "".join(c.text for c in chunks) == full.text

    def check_weight_update(self) -> None:
        """Pushed weights are served at once (outputs follow them); policy_version follows."""
        import torch

        p = self.prompts[0]
        before = self.generate(p)[0]
        original = self._state()
        gen = torch.Generator().manual_seed(5)
        new = copy.deepcopy(self.ref)
        with torch.no_grad():
            for _, t in new.named_parameters():
                if t.dim() == 2:
                    t.copy_(torch.randn(t.shape, generator=gen) * t.std())
        try:
            v = self.update([(k, t.detach().clone()) for k, t in new.state_dict().items()])
            assert self.backend.policy_version == v
            after = self.generate(p)[0]
            assert after.policy_version == v
            self.assert_matches_reference(p, after, greedy=True, model=new, what="after update")
            assert after.token_ids != before.token_ids or any(
                abs(a - b) > 10 * self.tol for a, b in zip(after.logprobs, before.logprobs, strict=False)
            ), "outputs did not change with the new weights"
        finally:
            self.update(original)
        restored = self.generate(p)[0]
        self.assert_same_greedy(before, restored, "after restoring the weights")

    def check_partial_rollout(self) -> None:
        """Weights pushed while a continuation is being generated (asynchronous training): it goes
        on, and every token reports the version that sampled it (old ones first, then the new); a
        backend without ``reports_token_versions`` reports none.

        The swap is requested after the third token; a fast engine may finish a short
        continuation before it lands, so longer ones are tried (48, 256, then 768 tokens).
        """
        p = self.prompts[1]
        ends = {self.tok.eos_token_id, *getattr(self.backend, "_eos_ids", ())}
        bias = {int(t): -100.0 for t in ends if t is not None}  # keep generating past the swap
        weights = self._state()  # the same weights under a new version: outputs stay comparable
        reports = getattr(self.backend, "reports_token_versions", False)
        seen: list[list[int]] = []
        for max_tokens in (48, 256, 768):
            old = self.backend.policy_version
            new = old + 1

            async def run(new: int = new, max_tokens: int = max_tokens) -> list[Any]:
                chunks: list[Any] = []
                swapped = False
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=bias)
                async for chunk in self.backend.stream(list(p), params):
                    chunks.append(chunk)
                    if not swapped and sum(len(c.token_ids) for c in chunks) >= 3:
                        await self.backend.update_weights(weights, version=new)
                        swapped = True
                return chunks

            chunks = self.harness.run(run())
            self._version = new
            if not reports:
                # labelled by the caller with the version the request started with (over-stated staleness)
                assert all(c.token_versions is None for c in chunks), "token_versions without reports_token_versions"
                return
            ids = [t for c in chunks for t in c.token_ids]
            versions = [v for c in chunks for v in c.versions(-1)]
            assert len(versions) == len(ids) == max_tokens, (len(versions), len(ids))
            assert versions[0] == old, versions[:8]
            assert versions == sorted(versions), f"versions must never go back: {versions}"
            assert set(versions) <= {old, new}, set(versions)
            if versions[-1] == new:
                return  # the swap landed mid-generation: old tokens first, then the new version
            seen.append(versions)
        raise AssertionError(f"no weight swap landed during a {max_tokens}-token generation "
                             f"(every token had version {seen[-1][0]})")

    def random_adapter(self, folder: str | Path, seed: int) -> Any:
        """Save a peft LoRA adapter (rank 4 on q/v, ``B`` random so that it changes the outputs) of the
        reference model into ``folder``; returns the peft model (the adapter's own reference)."""
        import torch
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(self.ref), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():
            for name, t in peft_model.named_parameters():
                if "lora_B" in name:
                    t.copy_(torch.randn(t.shape) * 0.5)
        peft_model.eval()
        peft_model.save_pretrained(str(folder))
        return peft_model

    def check_lora_adapter(self) -> None:
        """A peft LoRA adapter folder passed as ``path`` is served (merged or applied)."""
        import tempfile

        p = self.prompts[2]
        before = self.generate(p)[0]
        original = self._state()
        with tempfile.TemporaryDirectory() as tmp:
            peft_model = self.random_adapter(tmp, seed=7)
            try:
                v = self.update(path=tmp)
                after = self.generate(p)[0]
                assert after.policy_version == v
                self.assert_matches_reference(p, after, greedy=True, model=peft_model, what="LoRA")
                assert after.token_ids != before.token_ids or any(
                    abs(a - b) > 10 * self.tol for a, b in zip(after.logprobs, before.logprobs, strict=False)
                ), "the adapter did not change the outputs"
            finally:
                self.update(original)
        self.assert_same_greedy(before, self.generate(p)[0], "after removing the adapter")

    def close(self) -> None:
        if self._own_harness:
            self.harness.close()
