"""GPU benchmark of the FSDP2 optimizer engine on one card (issue 8).

Measures, in one run on one GPU:

- the card's bf16 matmul peak (random operands, several square sizes, median
  of CUDA-event timings, best size) and device-to-device copy bandwidth;
- actor-update throughput of ``FSDPEngine.train_step`` (GRPO loss) on
  random-initialised Qwen2 models of Qwen2.5-0.5B and ~1.5B shape, bf16:
  32 sequences × 2,048 tokens per step, every token but the first trained,
  16k-token micro-batches; trained tokens/s and MFU = (6·params·tokens +
  causal attention FLOPs 6·L·s²·H·Dh per sequence) / time / measured peak;
  peak GPU memory. Variants: the engine's default attention (``sdpa``: a
  packed row gets a block-diagonal mask, so the kernel computes the full
  row × row score matrix) against per-document varlen flash attention
  (``swarmkit_varlen``, registered below with transformers'
  ``AttentionInterface`` and selected through ``model.attn_implementation``);
  Options switch engine features off on the same engine: ``+eager`` (the
  decoder layers' uncompiled forward), ``+nokeep`` (logits recomputed in
  backward), ``+tbN`` (token budget N); ``--check-compile`` compares compiled
  and eager layers on one micro-batch;
- timeline merging on vs off on a synthetic AppWorld-like workload (16
  episodes × 12 turns, prompt 300 tokens, +200 tokens per turn): trained /
  forwarded tokens, the FLOPs the engine runs (LM head on trained tokens
  only) and actor-update wall time per step, same data;
- weight sync: ``HFBackend.update_weights(named_tensors=engine.export_weights())``
  on the GPU against a device-to-device copy of the same tensors (into
  preallocated bf16 tensors: the same conversion) and against one
  contiguous copy of the same bytes.

    python benchmarks/gpu_train.py [--models 0.5b,1.5b] [--json out.json]
    python benchmarks/gpu_train.py --smoke     # tiny model on CPU, seconds

The models are random-initialised from ``Qwen2Config`` and saved (bf16) with
swarmkit's tiny tokenizer to a temporary folder, since nothing can be
downloaded on the GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _repo import (
    QWEN_05B,  # also makes the checkout importable (the GPU machine may not pip-install it)
)

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(QWEN_05B, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512),
}

VARLEN = "swarmkit_varlen"
_STATE: dict[str, Any] = {"path": None, "cache": None}


# --------------------------------------------------------------------------- varlen attention
def _doc_bounds(position_ids: torch.Tensor):
    """(cu_seqlens int32, max_len, lengths list) of the packed row; cached per position_ids tensor."""
    c = _STATE["cache"]
    if c is not None and c[0] is position_ids:
        return c[1:]
    pos = position_ids[0]
    n = pos.numel()
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([n])]).to(torch.int32)
    lens = torch.diff(cu).tolist()
    out = (cu, int(max(lens)), lens)
    _STATE["cache"] = (position_ids, *out)
    return out


def _varlen_call(q, k, v, cu, maxlen, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if "enable_gqa" in params:
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu, cu, maxlen, maxlen, **kw)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     sliding_window=None, **kwargs):
    """transformers attention function: causal attention within each packed document only.

    ``query`` (1, H, N, D), ``key``/``value`` (1, Hkv, N, D); documents start where
    ``position_ids`` is 0. On CUDA it calls ``torch.nn.attention.varlen.varlen_attn``
    (flash attention over cu_seqlens); otherwise (or if that fails) one causal
    sdpa call per document. Returns (1, N, H, D).
    """
    import torch.nn.functional as F

    pos = kwargs.get("position_ids")
    if pos is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=True, **kwargs)
    # (B, N) rows -> one flat sequence: documents start where positions restart (row starts included;
    # a row's tail padding continues its last document's positions, so causal attention hides it)
    b, h, n, d = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(1, b * n, x.shape[1], d)  # noqa: E731
    q, k, v = flat(query), flat(key), flat(value)  # (1, B·N, heads, D)
    cu, maxlen, lens = _doc_bounds(pos.reshape(1, -1) if b > 1 else pos)
    if query.is_cuda and _STATE["path"] in (None, "varlen"):
        try:
            out = _varlen_call(q[0], k[0], v[0], cu, maxlen, scaling)
            _STATE["path"] = "varlen"
            return out.reshape(b, n, h, d), None
        except Exception as exc:  # noqa: BLE001 - older torch: per-document sdpa
            print(f"[gpu_train] varlen_attn unavailable ({type(exc).__name__}: {exc}); per-document sdpa",
                  flush=True)
            _STATE["path"] = "loop"
    elif _STATE["path"] is None:
        _STATE["path"] = "loop"
    gqa = query.shape[1] != key.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    outs, a = [], 0
    for m in lens:
        outs.append(F.scaled_dot_product_attention(qt[:, :, a:a + m], kt[:, :, a:a + m], vt[:, :, a:a + m],
                                                    is_causal=True, scale=scaling, enable_gqa=gqa))
        a += m
    return torch.cat(outs, dim=2).transpose(1, 2).reshape(b, n, h, d), None


def register_varlen() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, lambda *a, **k: None)


def compute_lm(engine):
    """The causal LM that runs forward/backward (the engine's bf16 compute copy when it keeps one)."""
    get = getattr(engine, "_compute_model", None)
    return (get() if callable(get) else engine.policy).causal_lm


def set_attn(engine, name: str) -> None:
    for lm in {id(m): m for m in (engine.policy.causal_lm, compute_lm(engine))}.values():
        _set_attn(lm, name)


def _set_attn(lm, name: str) -> None:
    if hasattr(lm, "set_attn_implementation"):
        lm.set_attn_implementation(name)
    lm.config._attn_implementation = name
    for m in lm.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not lm.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


# --------------------------------------------------------------------------- fused logprob (prototype)
def _lse_eager(logits):
    return torch.logsumexp(logits.float(), -1)


def _grad_eager(logits, lse, go, targets):
    p = torch.exp(logits.float() - lse[:, None])
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return ((onehot.float() - p) * go[:, None]).to(logits.dtype)


_FUSED: dict[str, Any] = {}


def fused_fns():
    if "lse" not in _FUSED:
        if torch.cuda.is_available():
            _FUSED["lse"] = torch.compile(_lse_eager, dynamic=True)
            _FUSED["grad"] = torch.compile(_grad_eager, dynamic=True)
        else:
            _FUSED["lse"], _FUSED["grad"] = _lse_eager, _grad_eager
    return _FUSED["lse"], _FUSED["grad"]


class FusedSelectedLogprob(torch.autograd.Function):
    """Same function as the engine's ``SelectedLogprob`` (bf16 chunk matmuls, fp32 log-sum-exp), but
    the chunk's elementwise work is one compiled pass over the bf16 logits (no fp32 copy of the chunk)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype: torch.dtype):  # type: ignore[override]
        lse_fn, _ = fused_fns()
        m = hidden.shape[0]
        w = weight.to(compute_dtype)
        out = torch.empty(m, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, m, chunk):
                e = min(m, s + chunk)
                logits = hidden[s:e].to(compute_dtype) @ w.T
                lse_c = lse_fn(logits)
                out[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1).float() - lse_c
                lse[s:e] = lse_c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.compute_dtype = chunk, compute_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        _, grad_fn = fused_fns()
        hidden, weight, targets, lse = ctx.saved_tensors
        cd = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(cd)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        m = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, m, ctx.chunk):
                e = min(m, s + ctx.chunk)
                h = hidden[s:e].to(cd)
                g = grad_fn(h @ w.T, lse[s:e], grad_out[s:e].float(), targets[s:e])
                if need_h:
                    grad_h[s:e] = (g @ w).to(hidden.dtype)
                if need_w:
                    grad_w.add_((g.T @ h).float())
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


def set_logprob(fused: bool) -> None:
    from swarmkit.training import logprob as core

    if "orig" not in _FUSED:
        _FUSED["orig"] = core.SelectedLogprob
    core.SelectedLogprob = FusedSelectedLogprob if fused else _FUSED["orig"]


# --------------------------------------------------------------------------- helpers
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def matmul_peak(dev: torch.device, smoke: bool) -> dict[str, Any]:
    sizes = [256] if smoke else [4096, 8192, 12288, 16384]
    res = {}
    for n in sizes:
        # several operand sets so repeated runs are not served from L2
        sets = [(torch.randn(n, n, device=dev, dtype=torch.bfloat16),
                 torch.randn(n, n, device=dev, dtype=torch.bfloat16)) for _ in range(3)]
        out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        k = [0]

        def f(sets=sets, out=out, k=k):
            a, b = sets[k[0] % 3]
            k[0] += 1
            torch.mm(a, b, out=out)
        t = timed(f, dev, 5 if smoke else 30, warmup=3)
        res[n] = 2 * n ** 3 / t / 1e12
        del sets, out
    best = max(res, key=res.get)
    return {"tflops_by_size": res, "peak_tflops": res[best], "best_size": best}


def copy_bandwidth(dev: torch.device, smoke: bool) -> float:
    n = (1 << 20) if smoke else (1 << 30)  # bytes... elements of bf16 -> 2 GiB
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, 10)
    return 2 * src.numel() * 2 / t / 1e9  # GB/s, read + write


def build_model(folder: Path, shape: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from swarmkit.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    heads = shape["num_attention_heads"]
    cfg = Qwen2Config(**shape, head_dim=shape["hidden_size"] // heads, max_position_embeddings=32768,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
            "vocab": shape["vocab_size"]}


def model_flops(info: dict[str, Any], doc_lens: list[int]) -> float:
    """Training FLOPs of one pass over documents: 6·N·T + causal attention 6·L·s²·H·Dh per document."""
    t = sum(doc_lens)
    attn = sum(6 * info["layers"] * s * s * info["hidden"] for s in doc_lens)
    return 6.0 * info["params"] * t + attn


def engine_flops(info: dict[str, Any], samples) -> float:
    """FLOPs the engine actually runs for ``samples``: the decoder on every forwarded token, the
    LM head only on trained tokens (``SelectedLogprob`` skips the rest), causal attention per
    sample. Merging shrinks the first and the last, never the head's share."""
    head = info["vocab"] * info["hidden"]
    body = info["params"] - head  # tied embeddings: the lookup costs no matmul
    fwd = sum(len(s.input_ids) for s in samples)
    trained = sum(sum(1 for m in s.loss_mask[1:] if m) for s in samples)
    attn = sum(6 * info["layers"] * len(s.input_ids) ** 2 * info["hidden"] for s in samples)
    return 6.0 * body * fwd + 6.0 * head * trained + attn


def compute_policy(engine):
    get = getattr(engine, "_compute_model", None)
    return get() if callable(get) else engine.policy


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t`` (DTensor gradients of a fully_shard-ed model are gathered)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def check_compile(engine, samples, dev: torch.device) -> dict[str, float]:
    """Compiled vs eager decoder layers on one micro-batch of 2 samples: max |Δ logprob| and the
    relative difference of the gradient (flattened, all trainable compute params)."""
    from swarmkit.training.packing import micro_batch_tensors, prepare_sample

    if not engine.compiled_layers:
        return {"skipped": 1.0}
    mb = micro_batch_tensors([prepare_sample(s) for s in samples[:2]], [0, 1], dev, engine.pad_id)
    out = {}
    # fp32: the uncompiled fp32 master model itself, the reference both bf16 paths are measured against
    has_fp32 = compute_policy(engine) is not engine.policy
    for mode in ("compiled", "eager") + (("fp32",) if has_fp32 else ()):
        restore = apply_knobs(engine, ["eager"] if mode == "eager" else [])
        engine._zero_grad()
        with engine._autocast():
            lp, _, _ = engine._forward(mb, model=engine.policy if mode == "fp32" else None)
        (lp.float().sum() / lp.numel()).backward()
        # the gradient lands on the fp32 masters (the compute copy hands its grads over in a hook)
        grads = [_full(p.grad).detach().float().flatten() for p in engine.policy.parameters() if p.grad is not None]
        if not grads:
            raise RuntimeError("no gradient reached the master weights")
        out[mode] = (lp.detach().float(), torch.cat(grads))
        restore()
    engine._zero_grad()

    def diff(x: str, y: str) -> dict[str, float]:
        (a, ga), (b, gb) = out[x], out[y]
        return {"max_abs_logprob_diff": float((a - b).abs().max()),
                "mean_abs_logprob_diff": float((a - b).abs().mean()),
                "grad_rel_diff": float((ga - gb).norm() / gb.norm().clamp_min(1e-30))}
    res = diff("compiled", "eager")
    if has_fp32:
        res["compiled_vs_fp32"] = diff("compiled", "fp32")
        res["eager_vs_fp32"] = diff("eager", "fp32")
    return res


def apply_knobs(engine, opts: list[str]):
    """Variant options: ``eager`` (the layers' uncompiled forward), ``nokeep`` (recompute logits in
    backward), ``tbN`` (token budget N, e.g. tb32768). Returns a function that undoes them."""
    pol = compute_policy(engine)
    undo = []
    if "eager" in opts:
        saved = [(layer, layer.__dict__.get("forward")) for layer in pol.decoder_layers()]
        for layer, _ in saved:
            layer.__dict__.pop("forward", None)

        def back(saved=saved):
            for layer, fwd in saved:
                if fwd is not None:
                    layer.forward = fwd
        undo.append(back)
    if "nokeep" in opts:
        keep = pol.keep_logits_bytes
        pol.keep_logits_bytes = 0
        undo.append(lambda keep=keep: setattr(pol, "keep_logits_bytes", keep))
    for o in opts:
        if o.startswith("tb") and o[2:].isdigit():
            tb = engine.token_budget
            engine.token_budget = int(o[2:])
            undo.append(lambda tb=tb: setattr(engine, "token_budget", tb))
    return lambda: [f() for f in reversed(undo)]


def flat_samples(n: int, length: int, vocab: int, seed: int):
    from swarmkit.training import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(length)]
        adv = 1.0 if i % 2 else -1.0
        mask = [0] + [1] * (length - 1)
        out.append(TrainSample(input_ids=ids, loss_mask=mask,
                               old_logprobs=[-float(torch.log(torch.tensor(float(vocab))))] * length,
                               advantages=[adv if m else 0.0 for m in mask], episode_id=str(i), task_id=str(i // 4)))
    return out


def appworld_records(episodes: int, turns: int, prompt: int, per_turn: int, vocab: int, seed: int):
    """Pool-like records: each episode has one timeline per LLM call; call t sees every earlier turn."""
    from swarmkit.timelines import Block, Timeline

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    gen_n = per_turn // 2 - 4  # llm tokens; header 3 + trailer 1 + env the rest
    env_n = per_turn - gen_n - 4
    system = ids(prompt - 50)
    records = []
    for e in range(episodes):
        header = Block("template", "<|im_start|>assistant\n", ids(3))
        trailer = Block("template", "\n", ids(1))
        ctx = [Block("user", "system prompt", list(system)), Block("user", f"task {e}", ids(50))]
        tls = []
        for t in range(turns):
            g = ids(gen_n)
            text = f"episode {e} turn {t}"
            tls.append(Timeline(ctx + [header, Block("llm", text, g, [-11.9] * len(g))]))
            ctx = ctx + [header, Block("history", text, list(g)), trailer, Block("env", f"obs {e} {t}", ids(env_n))]
        records.append(SimpleNamespace(episode_id=f"e{e}", task_id=f"task{e // 4}", reward=rng.random(),
                                       timelines=tls, policy_version=0))
    return records


def unmerged_samples(records, algo):
    """Same records, one TrainSample per LLM call (no merging), same advantages as the merged samples."""
    from swarmkit.training import TrainSample, build_samples
    from swarmkit_plugins.match.strategies import TEXT

    merged = build_samples(records, algo, TEXT)
    adv = {s.episode_id: next(a for a, m in zip(s.advantages, s.loss_mask, strict=True) if m) for s in merged}
    out = []
    for rec in records:
        for t in rec.timelines:
            ids, mask, lps = t.token_ids(), t.loss_mask(), t.logprobs()
            a = adv[str(rec.episode_id)]
            out.append(TrainSample(input_ids=ids, loss_mask=mask, old_logprobs=lps,
                                   advantages=[a if m else 0.0 for m in mask], episode_id=str(rec.episode_id),
                                   task_id=str(rec.task_id), reward=float(rec.reward)))
    return merged, out


def run_steps(engine, samples, steps: int, dev: torch.device) -> dict[str, Any]:
    engine.train_step(samples)  # warm-up (allocator, cuBLAS handles, first-call paths)
    sync(dev)
    ts, m = [], {}
    for _ in range(steps):
        sync(dev)
        t = time.perf_counter()
        m = engine.train_step(samples)
        sync(dev)
        ts.append(time.perf_counter() - t)
    return {"step_s": statistics.median(ts), "step_s_all": ts, "tokens": m.get("tokens"),
            "trained_tokens": m.get("trained_tokens"), "micro_batches": m.get("micro_batches"),
            "loss": m.get("loss"), "grad_norm": m.get("grad_norm")}


def mem_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def mem_peak(dev: torch.device) -> dict[str, float]:
    if dev.type != "cuda":
        return {}
    return {"peak_alloc_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(dev) / 1e9}


def profile_step(engine, samples, dev: torch.device, folder: str, name: str) -> str:
    """One train_step under torch.profiler; the kernel table (by device time) goes to ``folder``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.train_step(samples)
        sync(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    path = Path(folder) / f"profile_{name}.txt"
    path.write_text(text)
    return str(path)


def check_attention(engine, samples, dev: torch.device) -> dict[str, float]:
    """Max |Δ logprob| of one packed micro-batch: varlen vs the engine's default sdpa (block-diagonal mask)."""
    from swarmkit.training.packing import micro_batch_tensors, prepare_sample

    prepared = [prepare_sample(s) for s in samples[:4]]
    for p in prepared:  # short documents keep the dense-mask reference cheap
        p.input_ids = p.input_ids[:512]
        keep = [j for j, q in enumerate(p.select) if q < 511]
        p.select = [p.select[j] for j in keep]
        p.targets = [p.targets[j] for j in keep]
        p.old_logprobs, p.advantages = p.old_logprobs[keep], p.advantages[keep]
    mb = micro_batch_tensors(prepared, list(range(len(prepared))), dev, engine.pad_id)
    out = {}
    with torch.no_grad():
        for name in ("sdpa", VARLEN):
            set_attn(engine, name)
            with engine._autocast():
                out[name] = engine._forward(mb)[0].float()
    d = (out["sdpa"] - out[VARLEN]).abs()
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "path": _STATE["path"]}


async def weight_sync(engine, folder: Path, dev: torch.device, repeats: int) -> dict[str, Any]:
    from swarmkit_plugins.backend_hf.engine import HFBackend

    backend = HFBackend(config={"device": str(dev), "dtype": "bfloat16" if dev.type == "cuda" else "float32"},
                        model={"path": str(folder)})
    await backend.start()
    try:
        ts = []
        for i in range(repeats + 1):
            sync(dev)
            t = time.perf_counter()
            await backend.update_weights(named_tensors=engine.export_weights(), version=i + 1)
            sync(dev)
            ts.append(time.perf_counter() - t)
        sync_s = statistics.median(ts[1:])
        named = list(engine.export_weights())
        dst_dtype = backend.dtype
        dsts = [torch.empty(t.shape, dtype=dst_dtype, device=dev) for _, t in named]

        def copy_all():
            for d, (_, s) in zip(dsts, named, strict=True):
                d.copy_(s)
        copy_s = timed(copy_all, dev, repeats)
        nbytes = sum(d.numel() * d.element_size() for d in dsts)
        flat_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        flat_dst = torch.empty_like(flat_src)
        memcpy_s = timed(lambda: flat_dst.copy_(flat_src), dev, repeats)
        src_bytes = sum(s.numel() * s.element_size() for _, s in named)
        return {"hf_update_weights_s": sync_s, "hf_all_s": ts, "tensors": len(named),
                "src_dtype": str(named[0][1].dtype), "src_device": str(named[0][1].device),
                "dst_dtype": str(dst_dtype), "dst_bytes": nbytes, "src_bytes": src_bytes,
                "copy_same_tensors_s": copy_s, "memcpy_same_bytes_s": memcpy_s,
                "ratio_vs_copy": sync_s / copy_s, "ratio_vs_memcpy": sync_s / memcpy_s}
    finally:
        await backend.close()


# --------------------------------------------------------------------------- main
def bench_model(name: str, args, dev: torch.device, peak: float, results: dict, dump) -> None:
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    smoke = args.smoke
    shape = SHAPES["smoke" if smoke else name]
    r: dict[str, Any] = {}
    results["models"][name] = r
    with tempfile.TemporaryDirectory(prefix=f"swarmkit-gpu-{name}-") as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        info = build_model(folder, shape, dev)
        r["model"] = {**info, "build_s": time.perf_counter() - t}
        algo = GRPO()
        optim = {"lr": 1e-6, "token_budget": args.token_budget, "grad_clip": 1.0,
                 "device": "cuda" if dev.type == "cuda" else "cpu", "mixed_precision": args.mixed_precision,
                 "compile": args.compile}
        mem_reset(dev)
        t = time.perf_counter()
        engine = FSDPEngine(str(folder), {"attn_implementation": "sdpa"}, optim, algo)
        r["model"]["engine_init_s"] = time.perf_counter() - t
        vocab = shape["vocab_size"]
        flat = flat_samples(args.seqs, args.seq_len, vocab, seed=1)
        if any(v.split("+")[0] == "varlen" for v in args.variants.split(",")):
            try:
                r["attention_check"] = check_attention(engine, flat, dev)
            except Exception as exc:  # noqa: BLE001
                r["attention_check"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] attention check {r['attention_check']}", flush=True)
        if args.check_compile:
            try:
                r["compile_check"] = check_compile(engine, flat, dev)
            except Exception as exc:  # noqa: BLE001
                r["compile_check"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"[{name}] compile check {r['compile_check']}", flush=True)
        flops = model_flops(info, [args.seq_len] * args.seqs)
        variants = [v for v in args.variants.split(",") if v]
        r["model"]["compiled_layers"] = engine.compiled_layers
        r["model"]["keep_logits_bytes"] = compute_policy(engine).keep_logits_bytes
        r["throughput"] = {}
        for v in variants:
            attn, *opts = v.split("+")
            ac = "ac" if "ac" in opts else ""
            set_attn(engine, "sdpa" if attn == "sdpa" else VARLEN)
            set_logprob("lpc" in opts)
            restore = apply_knobs(engine, opts)
            lm = compute_lm(engine)
            if ac == "ac":
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mem_reset(dev)
            try:
                res = run_steps(engine, flat, args.steps if attn != "sdpa" else max(1, args.steps - 1), dev)
                res.update(mem_peak(dev))
                res["tokens_per_s"] = res["tokens"] / res["step_s"]
                res["trained_tokens_per_s"] = res["trained_tokens"] / res["step_s"]
                res["model_tflops"] = flops / res["step_s"] / 1e12
                res["mfu"] = res["model_tflops"] / peak
            except Exception as exc:  # noqa: BLE001 - e.g. OOM: record and go on
                res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                mem_reset(dev)
            if ac == "ac":
                lm.gradient_checkpointing_disable()
            restore()
            r["throughput"][v] = res
            if args.profile and v == variants[-1]:
                r["profile"] = profile_step(engine, flat, dev, args.profile, f"{name}{args.tag}")
            print(f"[{name}] {v}: {json.dumps({k: res.get(k) for k in ('step_s', 'tokens_per_s', 'mfu', 'peak_alloc_gb', 'error')})}",
                  flush=True)
            dump()
        # merging on vs off, with the last variant's settings
        set_attn(engine, "sdpa" if variants and variants[-1].split("+")[0] == "sdpa" else VARLEN)
        r["merge"] = {}
        if not args.no_merge:
            recs = appworld_records(args.episodes, args.turns, args.prompt, args.per_turn, vocab, seed=2)
            merged, unmerged = unmerged_samples(recs, algo)
            r["merge"] = {"workload": {"episodes": args.episodes, "turns": args.turns, "prompt": args.prompt,
                                       "per_turn": args.per_turn}}
            for label, samples in (("merge_off", unmerged), ("merge_on", merged)):
                mem_reset(dev)
                try:
                    res = run_steps(engine, samples, args.merge_steps, dev)
                    res.update(mem_peak(dev))
                    res["samples"] = len(samples)
                    res["engine_tflop"] = engine_flops(info, samples) / 1e12
                    res["model_tflops"] = model_flops(info, [len(s.input_ids) for s in samples]) / res["step_s"] / 1e12
                    res["mfu"] = res["model_tflops"] / peak
                except Exception as exc:  # noqa: BLE001
                    res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                r["merge"][label] = res
                print(f"[{name}] {label}: {json.dumps({k: res.get(k) for k in ('step_s', 'tokens', 'trained_tokens', 'samples', 'mfu', 'error')})}",
                      flush=True)
        off, on = r["merge"].get("merge_off", {}), r["merge"].get("merge_on", {})
        if "step_s" in off and "step_s" in on:
            r["merge"]["time_ratio"] = off["step_s"] / on["step_s"]
            r["merge"]["token_ratio"] = off["tokens"] / on["tokens"]
            r["merge"]["trained_token_ratio"] = off["trained_tokens"] / on["trained_tokens"]
            r["merge"]["work_ratio"] = off["engine_tflop"] / on["engine_tflop"]
            print(f"[{name}] merge time ratio {r['merge']['time_ratio']:.2f} vs token ratio "
                  f"{r['merge']['token_ratio']:.2f}, work ratio {r['merge']['work_ratio']:.2f}", flush=True)
        dump()
        if not args.no_sync:
            try:
                r["weight_sync"] = asyncio.run(weight_sync(engine, folder, dev, args.sync_repeats))
            except Exception as exc:  # noqa: BLE001
                r["weight_sync"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"[{name}] weight sync {r['weight_sync']}", flush=True)
        from torch._dynamo.utils import counters

        r["compile"] = {"graphs": dict(counters["stats"]), "failed": getattr(compute_policy(engine), "compile_failed", [])}
        del engine
        mem_reset(dev)
        dump()


def table(results: dict) -> str:
    peak = results["peak"]["peak_tflops"]
    lines = [f"device: {results['device']}  bf16 matmul peak {peak:.0f} TFLOP/s, "
             f"copy {results['copy_gbps']:.0f} GB/s",
             "| model | variant | step s | tokens/s | model TFLOP/s | MFU | peak mem GB |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for v, x in r.get("throughput", {}).items():
            if "error" in x:
                lines.append(f"| {name} | {v} | error: {x['error'][:60]} | | | | |")
                continue
            lines.append(f"| {name} | {v} | {x['step_s']:.3f} | {x['tokens_per_s']:,.0f} | {x['model_tflops']:.0f} | "
                         f"{100 * x['mfu']:.1f}% | {x.get('peak_alloc_gb', 0):.1f} |")
    lines += ["", "| model | merge | samples | tokens | trained | engine TFLOP | step s | peak mem GB |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        m = r.get("merge", {})
        for label in ("merge_off", "merge_on"):
            x = m.get(label, {})
            if "step_s" in x:
                lines.append(f"| {name} | {label} | {x['samples']} | {x['tokens']:,.0f} | {x['trained_tokens']:,.0f} | "
                             f"{x['engine_tflop']:.1f} | {x['step_s']:.3f} | {x.get('peak_alloc_gb', 0):.1f} |")
        if "time_ratio" in m:
            lines.append(f"| {name} | ratio off/on | | {m['token_ratio']:.2f}× | {m['trained_token_ratio']:.2f}× | "
                         f"{m['work_ratio']:.2f}× | {m['time_ratio']:.2f}× | |")
    lines += ["", "| model | hf update_weights s | copy same tensors s | memcpy same bytes s | ratio vs copy |",
              "|---|---|---|---|---|"]
    for name, r in results["models"].items():
        w = r.get("weight_sync", {})
        if "hf_update_weights_s" in w:
            lines.append(f"| {name} | {w['hf_update_weights_s']:.4f} | {w['copy_same_tensors_s']:.4f} | "
                         f"{w['memcpy_same_bytes_s']:.4f} | {w['ratio_vs_copy']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, small workload (CPU test)")
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--variants", default="sdpa,varlen",
                   help="comma list of sdpa|varlen[+ac][+lpc][+eager][+nokeep][+tbN]; lpc = fused logprob "
                        "prototype, eager = uncompiled layers, nokeep = recompute logits in backward, tbN = "
                        "token budget N; the last one is also used for the merge runs")
    p.add_argument("--fsdp1", action="store_true",
                   help="init a 1-rank process group so the engine fully_shard-s (bf16 params, FSDP2 path)")
    p.add_argument("--tag", default="")
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--per-turn", type=int, default=200)
    p.add_argument("--merge-steps", type=int, default=2)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--no-merge", action="store_true", help="skip the timeline-merging runs")
    p.add_argument("--mixed-precision", default="auto", choices=["auto", "autocast"],
                   help="engine optim.mixed_precision: auto = bf16 compute copy (one process), autocast = "
                        "fp32 params under autocast (the engine before 2026-12-03)")
    p.add_argument("--compile", default="auto", choices=["auto", "true", "false"],
                   help="engine optim.compile (auto = compiled decoder layers on CUDA in one process)")
    p.add_argument("--check-compile", action="store_true",
                   help="compare compiled and eager layers on one micro-batch (logprobs and gradient)")
    p.add_argument("--profile", default=None, help="folder: profile one varlen step per model there")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.models = "smoke"
        args.seqs, args.seq_len, args.token_budget, args.steps = 4, 64, 128, 1
        args.episodes, args.turns, args.prompt, args.per_turn, args.merge_steps = 4, 3, 60, 40, 1
        args.sync_repeats = 2
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    register_varlen()
    if args.fsdp1:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    import transformers

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "models": {},
        "engine_mode": "fully_shard, 1-rank group" if args.fsdp1 else "in-process (no process group)",
        "mixed_precision": args.mixed_precision,
    }
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_train.json") if os.environ.get("OUT") else None)

    def dump():
        results["varlen_path"] = _STATE["path"]
        if out:
            Path(out).write_text(json.dumps(results, indent=1, default=str))

    results["peak"] = matmul_peak(dev, args.smoke)
    results["copy_gbps"] = copy_bandwidth(dev, args.smoke)
    print(f"peak {results['peak']}, copy {results['copy_gbps']:.0f} GB/s", flush=True)
    dump()
    for name in args.models.split(","):
        bench_model(name, args, dev, results["peak"]["peak_tflops"], results, dump)
    dump()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
