"""Train/inference mismatch benchmark: ``mismatch_kl`` of the ``hf`` engine, and what each correction does
when the engine's logprobs are deliberately perturbed.

Every run is one main job (``python -m swarmkit``: server, task client, GRPO, the ``hf`` engine) on the
tiny model and ``token_rule``, in its own process. A perturbed run patches the ``hf`` engine's sampler
in that process only (this script's code, never a production option):

- ``--perturb logits`` (default): the engine adds Gaussian noise of scale ``--noise`` to the logits of
  every sampled (non-greedy) row, samples from that distribution and records its logprobs: an engine
  whose kernel disagrees with the trainer's, as a low-precision or differently batched one does;
  the recorded logprobs are the true sampling probabilities, so importance weights are exact.
- ``--perturb record``: sampling is untouched and only the recorded logprobs get Gaussian noise: wrong
  bookkeeping, where the best weight is 1.

Greedy rows (the held-out evaluation) are never perturbed, so the held-out reward measures the trained
policy. Arms (``--arms``): ``exact`` (no perturbation, no correction: the ``hf`` engine's own
mismatch), ``none`` (perturbed, uncorrected: the loss's old policy is the engine's logprobs) and
``LEVEL-MODE`` for each ``algo.mismatch`` level × mode, all with ``algo.mismatch.cap`` / ``floor``
from ``--cap`` / ``--floor``. Per arm it prints the held-out reward before and after (mean over seeds
with a 95% t-interval), ``mismatch_kl`` (mean over steps), the share of tokens the correction
truncated or masked, and writes JSON with every run's numbers and per-step curves.

    python benchmarks/mismatch.py                                  # every arm, 3 seeds, 20 steps
    python benchmarks/mismatch.py --arms exact,none,token-truncate --seeds 0,1 --noise 1.5
    python benchmarks/mismatch.py --smoke                          # 2 arms, 1 seed, 2 tiny steps; seconds

Another engine's own mismatch (no perturbation: ``--noise 0``), e.g. vLLM in its venv (docs/backends.md)::

    python benchmarks/mismatch.py --arms exact,geometric-truncate --noise 0 --seeds 0,1 \
        --out benchmarks/results/mismatch_vllm.json +backend=vllm
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
ALL_ARMS = ("exact", "none", *(f"{lv}-{md}" for lv in LEVELS for md in MODES))
#: the main job's recipe: the CI learning test's (tests/test_learning.py), fewer steps
RECIPE = ["model=tiny", "task=token_rule", "task.max_tokens=8", "batching.batch_size=4",
          "batching.rollouts_per_task=8", "optim.lr=1e-2", "trainer.checkpoint_every=0"]
SMOKE = ["model=tiny", "task=token_rule", "task.max_tokens=4", "task.train_size=8", "task.eval_size=4",
         "batching.batch_size=2", "batching.rollouts_per_task=2", "trainer.checkpoint_every=0"]

#: two-sided 95% quantiles of Student's t, by degrees of freedom (1..10); above, the normal 1.96
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95% half-interval of the mean (Student's t; nan with fewer than two values)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, math.nan
    t = _T95[len(vals) - 2] if len(vals) - 1 <= len(_T95) else 1.96
    return mean, t * statistics.stdev(vals) / math.sqrt(len(vals))


def arm_overrides(arm: str, cap: float, floor: float) -> list[str]:
    """The ``algo.mismatch`` overrides of an arm."""
    if arm in ("exact", "none"):
        return ["algo.mismatch.mode=none"]
    level, _, mode = arm.partition("-")
    if level not in LEVELS or mode not in MODES:
        raise SystemExit(f"unknown arm {arm!r}; choose from {', '.join(ALL_ARMS)}")
    return [f"algo.mismatch.mode={mode}", f"algo.mismatch.level={level}", f"algo.mismatch.cap={cap}",
            f"algo.mismatch.floor={floor}"]


# --------------------------------------------------------------------------- the child: one main job
def patch_hf_sampler(kind: str, scale: float, seed: int) -> None:
    """Perturb the ``hf`` engine's sampled (non-greedy) rows in this process (see the module doc)."""
    import torch

    import swarmkit_plugins.backend_hf.engine as hf_engine
    from swarmkit_plugins.backend_hf.sampler import GREEDY_TEMPERATURE

    original = hf_engine.sample
    gen = torch.Generator().manual_seed(10_007 + seed)

    def perturbed(raw, shaped, rows, *args, **kwargs):  # the engine's other arguments pass through as they are
        hot = torch.tensor([float(r.temperature >= GREEDY_TEMPERATURE) for r in rows])
        if kind == "logits":
            noise = (torch.randn(raw.shape, generator=gen) * scale * hot[:, None]).to(raw.device, raw.dtype)
            return original(raw + noise, shaped + noise, rows, *args, **kwargs)
        out = original(raw, shaped, rows, *args, **kwargs)
        noise = (torch.randn(out.logprobs.shape, generator=gen) * scale * hot).to(out.logprobs.device)
        out.logprobs = (out.logprobs + noise).clamp(max=0.0)
        return out

    hf_engine.sample = perturbed


def child(spec: dict[str, Any]) -> None:
    if spec["noise"] > 0:
        patch_hf_sampler(spec["perturb"], spec["noise"], spec["seed"])
    from swarmkit.apps.cli import main

    main(spec["overrides"])


# --------------------------------------------------------------------------- the parent
def run_one(arm: str, seed: int, args: argparse.Namespace, base: list[str]) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmkit-mismatch-{arm}-{seed}-"))
    noise = 0.0 if arm == "exact" else args.noise
    overrides = [*base, f"trainer.total_steps={args.steps}", f"seed={seed}", "server.port=0",
                 f"hydra.run.dir={run_dir}", *arm_overrides(arm, args.cap, args.floor), *args.overrides]
    spec = {"noise": noise, "perturb": args.perturb, "seed": seed, "overrides": overrides}
    env = dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    wall = time.time() - t0
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"run {arm} seed {seed} failed (exit {proc.returncode}); run dir {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
            for r in [json.loads(line)] if r.get("kind", "train") == "train"]

    def curve(key: str) -> list[float | None]:  # 6 significant digits (not decimals): a KL of 1e-9 is not 0
        return [float(f"{r[key]:.6g}") if isinstance(r.get(key), int | float) else None for r in rows]

    def mean(key: str) -> float:
        vals = [v for v in curve(key) if v is not None]
        return statistics.fmean(vals) if vals else math.nan

    out = {
        "arm": arm, "seed": seed, "noise": noise, "perturb": args.perturb if noise else None,
        "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
        "steps": summary["global_step"], "mismatch_kl_mean": mean("mismatch_kl"),
        "truncated_frac_mean": mean("mismatch_truncated_frac"), "masked_frac_mean": mean("mismatch_masked_frac"),
        "mismatch_kl": curve("mismatch_kl"), "reward_mean": curve("reward_mean"),
        "clip_frac": curve("clip_frac"), "wall_s": round(wall, 1), "command": overrides,
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def fmt(mean: float, half: float, digits: int = 3) -> str:
    if math.isnan(mean):
        return "—"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def table(runs: list[dict[str, Any]], arms: list[str]) -> list[str]:
    lines = ["| arm | held-out before | held-out after | mismatch_kl | truncated / masked | seeds | s/run |",
             "|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        before = t_interval([r["eval_before"]["mean"] for r in rs])
        after = t_interval([r["eval_after"]["mean"] for r in rs])
        kl = statistics.fmean(r["mismatch_kl_mean"] for r in rs)
        acted = [r["truncated_frac_mean"] if arm.endswith("truncate") else r["masked_frac_mean"] for r in rs]
        acted_s = f"{statistics.fmean(acted):.3f}" if arm not in ("exact", "none") else "—"
        kl_s = f"{kl:.2e}" if kl < 1e-3 else f"{kl:.4f}"
        lines.append(f"| {arm} | {fmt(*before)} | {fmt(*after)} | {kl_s} | {acted_s} | {len(rs)} | "
                     f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ALL_ARMS), help=f"comma-separated, from {', '.join(ALL_ARMS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--perturb", choices=("logits", "record"), default="logits")
    p.add_argument("--noise", type=float, default=1.0, help="std of the Gaussian perturbation")
    p.add_argument("--cap", type=float, default=2.0, help="algo.mismatch.cap of the corrected arms")
    p.add_argument("--floor", type=float, default=0.5, help="algo.mismatch.floor of the corrected arms")
    p.add_argument("--out", default="benchmarks/results/mismatch.json")
    p.add_argument("--smoke", action="store_true", help="arms exact and geometric-mask, seed 0, 2 tiny steps")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    base = RECIPE
    if args.smoke:
        args.arms, args.seeds, args.steps, base = "exact,geometric-mask", "0", 2, SMOKE
        args.out = str(Path(tempfile.mkdtemp(prefix="swarmkit-mismatch-smoke-")) / "mismatch.json")
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        arm_overrides(a, args.cap, args.floor)  # unknown arms fail before any run
    seeds = [int(s) for s in args.seeds.split(",") if s]
    other_engine = [o for o in args.overrides if o.lstrip("+").startswith("backend=") and o.split("=", 1)[1] != "hf"]
    if other_engine and args.noise > 0 and any(a != "exact" for a in arms):
        raise SystemExit(f"the perturbation patches the hf engine only: with {other_engine[0]} pass --noise 0 "
                         "(the engine's own mismatch, uncorrected and corrected)")
    runs: list[dict[str, Any]] = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write() -> list[str]:  # after every run, so a stopped benchmark keeps what it measured
        lines = table(runs, arms)
        result = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "steps": args.steps,
                  "perturb": args.perturb, "noise": args.noise, "cap": args.cap, "floor": args.floor,
                  "seeds": seeds, "table": lines, "runs": runs}
        Path(args.out).write_text(json.dumps(result, indent=2))
        return lines

    for seed in seeds:
        for arm in arms:
            r = run_one(arm, seed, args, base)
            runs.append(r)
            write()
            print(f"{arm:>20} seed {seed}: held-out {r['eval_before']['mean']:.3f} -> {r['eval_after']['mean']:.3f}"
                  f"  mismatch_kl {r['mismatch_kl_mean']:.3g}  ({r['wall_s']:.0f} s)", flush=True)
    print(f"\ntiny model, token_rule, {args.steps} steps, perturbation {args.perturb} σ={args.noise} "
          f"(arm exact: none), cap {args.cap}, floor {args.floor}; mean over seeds ± 95% t-interval")
    print("\n".join(write()))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
