"""Multi-process training worker, started by a torch.distributed launcher.

::

    torchrun --nproc_per_node 2 -m swarmkit.training.worker \\
        --samples steps.json --out metrics.jsonl [--engine fsdp|deepspeed] \\
        [--model builtin:tiny] [--model-cfg '{"lora_rank": 8}'] [--optim-cfg '{"lr": 1e-4}'] \\
        [--algo-cfg '{"name": "grpo"}'] [--save DIR] [--resume DIR] [--export FILE]

``steps.json`` is a list of steps, each a list of ``TrainSample.to_dict()``
dicts; every rank reads the same file and trains on the same data (the engine
deals micro-batches to ranks). Rank 0 appends one JSON line of metrics per
step to ``--out``. ``--export`` writes the final full HF weights (safetensors)
from rank 0; ``--save`` / ``--resume`` write / read an engine checkpoint.
Backend: gloo on CPU, NCCL on CUDA.

``--serve HOST:PORT`` instead of ``--samples``: a long-lived group driven by a
swarm server (:class:`swarmkit.training.group.ProcessGroupEngine`).
Rank 0 connects back to the server (``multiprocessing.connection``, authkey from
``SWARMKIT_GROUP_AUTHKEY``), receives one command at a time, broadcasts it to
every rank, and answers with the result once every rank has run it.
On several hosts (``torchrun --nnodes N`` with a c10d rendezvous; the server's
launcher and ``python -m swarmkit join`` build that command) global rank 0 may
run on any of them; ``--world`` makes a group of another size fail clearly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from swarmkit.contract import TrainSample
from swarmkit.models import resolve_model_path
from swarmkit.plugins import load_component
from swarmkit.training.group import serve
from swarmkit.training.trainer import build_algo
from swarmkit.weights import save_weights


def launch(nproc: int, samples: str | Path, out: str | Path, engine: str = "fsdp",
           model: str = "builtin:tiny", model_cfg: dict[str, Any] | None = None,
           optim_cfg: dict[str, Any] | None = None, algo_cfg: dict[str, Any] | None = None,
           extra: list[str] | None = None, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run this worker under ``torchrun --standalone --nproc_per_node nproc``; rank 0's metrics per step.

    :raises RuntimeError: the launcher failed (the message ends with its stderr).
    """
    out = Path(out)
    if out.exists():
        out.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "swarmkit.training.worker", "--engine", engine, "--model", model,
           "--samples", str(samples), "--out", str(out), "--model-cfg", json.dumps(model_cfg or {}),
           "--optim-cfg", json.dumps(optim_cfg or {}), "--algo-cfg", json.dumps(algo_cfg or {"name": "grpo"}),
           *(extra or [])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"worker failed (rc {res.returncode}): {' '.join(cmd)}\n{res.stderr[-8000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="fsdp")
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--model-cfg", default="{}")
    ap.add_argument("--optim-cfg", default="{}")
    ap.add_argument("--algo-cfg", default='{"name": "grpo"}')
    ap.add_argument("--samples", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--serve", default="", help="HOST:PORT of the driving server (instead of --samples)")
    ap.add_argument("--steps", type=int, default=0, help="train only the first N steps (0 = all)")
    ap.add_argument("--save", default="")
    ap.add_argument("--resume", default="")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N steps of the file (after --resume)")
    ap.add_argument("--export", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--world", type=int, default=0, help="ranks the group must have (0 = any)")
    ap.add_argument("--shm", default="", help="with --serve: the server's /dev/shm folder (weights by file)")
    args = ap.parse_args(argv)
    if not args.serve and not (args.samples and args.out):
        ap.error("give --samples and --out, or --serve HOST:PORT")

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # a served group waits in a collective while the swarm collects rollouts: no 30-minute timeout
    timeout = timedelta(days=7) if args.serve else timedelta(minutes=30)
    if args.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    rank = dist.get_rank()
    if args.world and dist.get_world_size() != args.world:
        print(f"swarmkit worker: world size mismatch: torch.distributed formed {dist.get_world_size()} ranks, "
              f"the group expects {args.world} (nnodes x nprocs); every node must join with the same spec",
              file=sys.stderr, flush=True)
        return 3

    model_cfg = {"path": args.model, **json.loads(args.model_cfg)}
    optim_cfg = {"name": args.engine, **json.loads(args.optim_cfg)}
    algo = build_algo(json.loads(args.algo_cfg))
    engine_cls = load_component("optim", args.engine)
    engine = engine_cls(model_path=str(resolve_model_path(model_cfg["path"])), model_cfg=model_cfg,
                        optim_cfg=optim_cfg, algo=algo)
    if args.resume:
        engine.load_checkpoint(args.resume)
    if args.serve:
        serve(engine, args.serve, args.shm)
        dist.destroy_process_group()
        return 0
    steps = [[TrainSample.from_dict(s) for s in step] for step in json.loads(Path(args.samples).read_text())]
    steps = steps[args.skip:]
    if args.steps:
        steps = steps[: args.steps]
    out = Path(args.out)
    for batch in steps:
        metrics = engine.train_step(batch)
        if rank == 0:
            with out.open("a") as f:
                f.write(json.dumps({**metrics, "world": dist.get_world_size()}) + "\n")
    if args.save:
        engine.save_checkpoint(args.save)
    if args.export:
        weights = dict(engine.export_weights())
        if rank == 0:
            save_weights(weights, args.export)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    code = main()
    # Skip interpreter finalisation: gloo's worker threads can still be torn down while Python
    # shuts down and abort the process ("terminate called without an active exception", SIGABRT)
    # after all the work is written. Outputs are flushed and closed at this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
