"""Latency the swarm proxy adds per call of each protocol (Chat, Messages, Responses), and its throughput.

A zero-compute backend (:class:`swarmkit.testing.scripted.ScriptedBackend`, fixed
reply) serves a 10-turn conversation (the full history is resent every
turn, as agents do). For each call we time

- **direct**: ``await backend.generate(prompt_ids)`` in this process, with
  the prompt already tokenized (what an engine call costs by itself);
- **proxy**: the same turn as an HTTP request to a real uvicorn server running
  in this process (thread), through keep-alive ``http.client``, once per
  protocol: ``POST /v1/chat/completions``, ``POST /v1/messages`` (Anthropic:
  ``system`` + messages) and ``POST /v1/responses`` (``instructions`` + the
  whole history as input items): JSON parsing, auth, the protocol's
  translation, chat template + tokenization (only new blocks), generation,
  context tracking, tool-call parsing, the JSON answer.

``added = proxy - direct`` per call; p50/p99 over all calls. Throughput: a
few client processes run chat conversations against the server for a fixed time.

    python benchmarks/proxy_overhead.py [--conversations 50] [--seconds 5] [--json out.json]
    python benchmarks/proxy_overhead.py --smoke      # 2 conversations, a 1 s throughput run, no JSON; seconds
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

TURNS = 10
REPLY = "Sure, the answer to that is 42 and the weather in Paris is sunny."
SYSTEM = "You are a helpful assistant. Answer the question."


def conversation_turns(conv: int):
    """The messages sent at each turn of one conversation (history grows)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for t in range(TURNS):
        msgs.append({"role": "user", "content": f"Question {t} of conversation {conv}: what is {t} + {conv}?"})
        yield list(msgs)
        msgs.append({"role": "assistant", "content": REPLY})


def request_for(endpoint: str, msgs: list[dict]) -> tuple[str, dict]:
    """(path, body) of one turn in ``endpoint``'s protocol (the same conversation in each)."""
    system, rest = msgs[0]["content"], msgs[1:]
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 64}
    if endpoint == "messages":
        return "/v1/messages", {"model": "m", "system": system, "messages": rest, "max_tokens": 64}
    return "/v1/responses", {"model": "m", "instructions": system, "input": rest, "max_output_tokens": 64,
                             "store": False}


ENDPOINTS = ("chat", "messages", "responses")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


class Conn:
    """A keep-alive HTTP/1.1 connection."""

    def __init__(self, url: str):
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle/delayed-ACK stalls

    def post(self, path: str, body: dict, key: str | None = None) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.conn.request("POST", path, body=data, headers=headers)
        resp = self.conn.getresponse()
        out = resp.read()
        if resp.status >= 400:
            raise RuntimeError(f"{path}: {resp.status} {out[:300]!r}")
        return json.loads(out)


def _throughput_worker(url: str, seconds: float, offset: int, queue: mp.Queue) -> None:
    conn = Conn(url)
    done = 0
    end = time.monotonic() + seconds
    conv = offset
    while time.monotonic() < end:
        ep = conn.post("/api/v1/episodes", {"task_id": f"bench-{conv}"})
        for msgs in conversation_turns(conv):
            conn.post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 64}, ep["api_key"])
            done += 1
            if time.monotonic() >= end:
                break
        conn.post(f"/api/v1/episodes/{ep['episode_id']}/report", {"reward": 1.0}, ep["api_key"])
        conv += 1000
    queue.put(done)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=50, help="conversations timed for latency")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of the throughput run")
    ap.add_argument("--clients", type=int, default=2, help="client processes in the throughput run")
    ap.add_argument("--json", default="benchmarks/results/proxy_overhead.json", help="where to write the results")
    ap.add_argument("--smoke", action="store_true", help="2 conversations, 1 client for 1 s, no JSON (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.conversations, args.seconds, args.clients, args.json = 2, 1.0, 1, None

    import logging

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.contract import SamplingParams
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.testing.scripted import ScriptedBackend
    from swarmkit.timelines.render import ChatRenderer

    logging.getLogger("swarmkit").setLevel(logging.WARNING)
    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, replies=[REPLY])
    cfg = validate_config(compose(["model=tiny", "model.max_context=100000"]), get_registry())
    # a fresh run dir and no training: a step (or a journal left by an earlier run) must not answer 503 mid-timing
    import shutil
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="swarmkit-bench-proxy-")
    handle = start_server_thread({"server": {"port": 0, "admin_token": "bench-admin-token",
                                             "run_dir": run_dir,
                                             "episode_timeout_s": 3600}},
                                 config=cfg, backend_factory=lambda c: backend, train=False)
    admin = Conn(handle.url)
    admin.post("/api/v1/admin/start", {}, "bench-admin-token")
    while handle.swarm.state.state != "ROLLING":
        time.sleep(0.01)

    # ---- direct: the engine call alone (prompt already tokenized, as an engine gets it)
    params = SamplingParams(max_tokens=64)
    renderer = ChatRenderer(tok)
    prompts = [[t for b in renderer.render_prompt(m) for t in b.token_ids]
               for c in range(args.conversations) for m in conversation_turns(c)]
    loop = asyncio.new_event_loop()

    async def direct_all() -> list[float]:
        out = []
        for ids in prompts:
            t0 = time.perf_counter()
            await backend.generate(ids, params)
            out.append(time.perf_counter() - t0)
        return out

    direct = loop.run_until_complete(direct_all())

    # ---- proxy: the same calls through HTTP + tracking, once per protocol
    conn = Conn(handle.url)
    proxy: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
    for endpoint in ENDPOINTS:
        for warm in (True, False):
            for c in range(3 if warm else args.conversations):
                ep = conn.post("/api/v1/episodes", {"task_id": f"lat-{endpoint}-{c}-{warm}"})
                for msgs in conversation_turns(c + (10_000 if warm else 0)):
                    path, body = request_for(endpoint, msgs)
                    t0 = time.perf_counter()
                    conn.post(path, body, ep["api_key"])
                    if not warm:
                        proxy[endpoint].append(time.perf_counter() - t0)
                conn.post(f"/api/v1/episodes/{ep['episode_id']}/report", {"reward": 1.0}, ep["api_key"])
    added = {e: [p - d for p, d in zip(proxy[e], direct, strict=True)] for e in ENDPOINTS}

    # ---- throughput: client processes, fixed time
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_throughput_worker, args=(handle.url, args.seconds, i, queue))
             for i in range(args.clients)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    total = sum(queue.get() for _ in procs)
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    # the workers start up (imports) inside the wall time; count their own measured window
    rps = total / args.seconds
    handle.stop()
    shutil.rmtree(run_dir, ignore_errors=True)

    ms = 1000.0

    def summary(xs: list[float]) -> dict[str, float]:
        return {"p50": pct(xs, 50) * ms, "p99": pct(xs, 99) * ms, "mean": statistics.mean(xs) * ms}

    results = {
        "turns_per_conversation": TURNS,
        "calls_timed": len(added["chat"]),
        "direct_ms": summary(direct),
        # the chat endpoint's numbers at the top level (as before); every protocol under "endpoints"
        "proxy_ms": summary(proxy["chat"]),
        "added_ms": summary(added["chat"]),
        "endpoints": {e: {"proxy_ms": summary(proxy[e]), "added_ms": summary(added[e])} for e in ENDPOINTS},
        "throughput_rps": rps,
        "throughput_clients": args.clients,
        "throughput_requests": total,
        "throughput_wall_s": wall,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(f"{'':24}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'direct (engine)':24}{results['direct_ms']['p50']:>10.3f}{results['direct_ms']['p99']:>10.3f}")
    for e in ENDPOINTS:
        for kind in ("proxy_ms", "added_ms"):
            row = results["endpoints"][e][kind]
            print(f"{e + ' ' + kind[:-3]:24}{row['p50']:>10.3f}{row['p99']:>10.3f}")
    print(f"throughput: {rps:.0f} chat calls/s ({args.clients} client processes, {total} calls in "
          f"{args.seconds:g} s; {os.cpu_count()} CPUs)")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
