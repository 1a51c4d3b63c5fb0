"""What constraining strict tool calls costs the ``hf`` engine per decode step (xgrammar token masks).

Runs ``B`` concurrent requests on the hf engine twice: plain, and under the structural tag the
server sends for a ``strict`` tool (:func:`swarmkit.timelines.strict_tools.tool_call_tag`, a call
opened by ``tool_choice: required``, then free text with constrained calls). Times every decode step
and, in the constrained run, the grammar's share of it (filling and applying the token bitmasks,
feeding the matchers the sampled tokens), and checks that every constrained call matches the schema.

    python benchmarks/strict_tools.py [--model builtin:smollm2] [--batch 1 32] [--tokens 64]
        [--out benchmarks/results/strict_tools.json]
    python benchmarks/strict_tools.py --smoke      # the tiny model, batch 1 and 4, no JSON; seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from swarmkit.chat_templates import resolve_chat_template
from swarmkit.contract import SamplingParams
from swarmkit.timelines.render import ChatRenderer
from swarmkit.timelines.strict_tools import tool_call_tag
from swarmkit.timelines.toolcalls import parse_tool_calls
from swarmkit_plugins.backend_hf import grammar
from swarmkit_plugins.backend_hf.engine import HFBackend

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "the weather forecast of a city",
                                           "parameters": SCHEMA}}]


class Timer:
    """Wall time of the wrapped calls (a method of a class, replaced in place)."""

    def __init__(self, owner: Any, name: str):
        self.times: list[float] = []
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)
        setattr(owner, name, timed)
        self.restore = lambda: setattr(owner, name, fn)


async def one_run(backend: HFBackend, prompt: list[int], batch: int, tokens: int,
                  tag: dict[str, Any] | None) -> dict[str, Any]:
    steps = Timer(HFBackend, "_decode_step")
    fill = Timer(grammar.Grammars, "mask")
    accept = Timer(grammar.Grammars, "accept")
    try:
        params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, structural_tag=tag) for i in range(batch)]
        outs = await asyncio.gather(*(backend.generate(prompt, p) for p in params))
    finally:
        for t in (steps, fill, accept):
            t.restore()
    n = max(len(steps.times), 1)
    return {"batch": batch, "decode_steps": len(steps.times),
            "step_ms": 1e3 * statistics.fmean(steps.times) if steps.times else None,
            "grammar_ms_per_step": 1e3 * (sum(fill.times) + sum(accept.times)) / n if tag else 0.0,
            "texts": [o[0].text for o in outs]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backend = HFBackend(config={"device": "cpu", "dtype": "float32", "max_batch_size": max(args.batch),
                                "batch_wait_s": 0.05}, model={"path": args.model})
    await backend.start()
    try:
        renderer = ChatRenderer(backend.tokenizer, chat_template=resolve_chat_template("builtin:smollm2_tools"))
        messages = [{"role": "user", "content": "What will the weather be in Rome for the next 3 days?"}]
        prefix = renderer.tool_call_prefix()
        prompt = [t for b in renderer.render_prompt(messages, tools=TOOLS) for t in b.token_ids] + renderer.encode(prefix)
        tag = tool_call_tag(renderer.tool_call_wrapping(), {"forecast": SCHEMA}, opened="")
        await one_run(backend, prompt, 1, 4, tag)  # warm-up: loads xgrammar, builds the token table
        rows = []
        for batch in args.batch:
            plain = await one_run(backend, prompt, batch, args.tokens, None)
            ruled = await one_run(backend, prompt, batch, args.tokens, tag)
            valid = 0
            for text in ruled["texts"]:
                _, calls = parse_tool_calls(prefix + text)
                valid += bool(calls) and calls[0]["function"]["name"] == "forecast" and _valid(
                    calls[0]["function"]["arguments"])
            rows.append({"batch": batch, "plain_step_ms": plain["step_ms"], "constrained_step_ms": ruled["step_ms"],
                         "grammar_ms_per_step": ruled["grammar_ms_per_step"],
                         "valid_calls": f"{valid}/{batch}", "example": ruled["texts"][0][:120]})
            print(f"B={batch:3d}  plain {plain['step_ms']:.1f} ms/step  constrained {ruled['step_ms']:.1f} ms/step  "
                  f"(grammar {ruled['grammar_ms_per_step']:.2f} ms/step)  valid calls {valid}/{batch}")
        return {"model": args.model, "tokens": args.tokens, "rows": rows}
    finally:
        await backend.close()


def _valid(arguments: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/strict_tools.json"))
    p.add_argument("--smoke", action="store_true", help="the tiny model, batch 1 and 4, 96 tokens, no JSON")
    args = p.parse_args()
    if not grammar.available():
        p.error(grammar.HINT)
    if args.smoke:
        args.model, args.batch, args.tokens = "builtin:tiny", [1, 4], 96
    result = asyncio.run(run(args))
    if not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    bad = [r for r in result["rows"] if r["valid_calls"].split("/")[0] != r["valid_calls"].split("/")[1]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
