"""The LLM leader: an OpenAI-compatible chat model plans each stage.

The protocol: one ``POST {url}/chat/completions`` per stage, whose prompt holds
the goal, the constraints, the blueprint schema and every earlier stage's
analysis; the reply is one JSON (or YAML) object:

.. code-block:: json

    {"done": false, "rationale": "why this stage", "blueprints": [{...}, ...]}
    {"done": true, "conclusion": "what the campaign found"}

A reply that does not parse or whose blueprints break the schema (or whose
overrides the config rejects) is sent back with the problems, at most
``max_attempts`` times in all; then :class:`LeaderError` names every problem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from swarmkit.research.blueprint import (
    DEFAULT_COMMAND,
    SCHEMA_TEXT,
    BlueprintError,
    parse_blueprints,
)
from swarmkit.research.planner import StagePlan

SYSTEM_PROMPT = """\
You are the leader (chief scientist) of an automated research campaign on swarmkit, an RL
framework for LLM agents. Each stage you design a list of experiment blueprints; workers run
every blueprint once per seed (`python -m swarmkit <overrides>`), and you get back the
analysis (each configuration's metric, mean and 95% confidence half-width over seeds, failed
runs). Use what earlier stages found to design the next one; stop when the goal is answered or
the stage limit is near. Keep stages within the constraints' budget.

{schema}
Reply with ONE JSON object and nothing else, either
  {{"done": false, "rationale": "<why this stage>", "blueprints": [<blueprint>, ...]}}
or, when the goal is answered,
  {{"done": true, "conclusion": "<what the campaign found, with numbers>"}}
"""


class LeaderError(BlueprintError):
    """The LLM leader failed: the endpoint could not be reached or kept replying with a malformed plan."""


def extract_object(text: str) -> Any:
    """The JSON (or YAML) object in a model's reply, with code fences and prose around it dropped."""
    import yaml

    fenced = re.search(r"```(?:json|yaml|yml)?\s*\n(.*?)```", text, re.S)
    body = fenced.group(1) if fenced else text
    start, end = body.find("{"), body.rfind("}")
    if start != -1 and end > start:
        try:
            return json.loads(body[start:end + 1])
        except json.JSONDecodeError:
            pass
    try:
        return yaml.safe_load(body)
    except yaml.YAMLError as exc:
        raise BlueprintError(f"the reply is neither JSON nor YAML: {str(exc).splitlines()[0]}") from exc


def parse_plan(text: str, check_overrides: Callable[[list[str]], list[str]] | None = None) -> StagePlan | None:
    """A stage plan from the reply text (None: the leader says the goal is answered).

    :raises BlueprintError: every problem of the reply, each naming its field.
    """
    data = extract_object(text)
    if not isinstance(data, dict):
        raise BlueprintError(f"plan: expected a JSON object with done/rationale/blueprints, got {type(data).__name__}")
    problems = [f"plan.{k}: unknown field (known: done, rationale, blueprints, conclusion)"
                for k in data if k not in ("done", "rationale", "blueprints", "conclusion")]
    done = data.get("done", False)
    if not isinstance(done, bool):
        problems.append(f"plan.done: expected true or false, got {done!r}")
    if done is True:
        if problems:
            raise BlueprintError(f"{len(problems)} problem(s) in the plan:\n  " + "\n  ".join(problems))
        return None
    if not isinstance(data.get("rationale"), str) or not data["rationale"].strip():
        problems.append("plan.rationale: missing (required: why this stage)")
    try:
        blueprints = parse_blueprints(data.get("blueprints"), "plan.blueprints")
    except BlueprintError as exc:
        problems += [line.strip() for line in str(exc).splitlines()[1:]] or [str(exc)]
        blueprints = []
    if check_overrides is not None:  # the overrides of a swarmkit run (another command has its own arguments)
        for i, bp in enumerate(blueprints):
            if bp.command == DEFAULT_COMMAND:
                problems += [f"plan.blueprints[{i}].overrides: {p}" for p in check_overrides(bp.override_args())]
    if problems:
        raise BlueprintError(f"{len(problems)} problem(s) in the plan:\n  " + "\n  ".join(problems))
    return StagePlan(blueprints, str(data["rationale"]))


class LLMLeader:
    """Plans stages by asking an OpenAI-compatible chat endpoint (``url`` ends in ``/v1``)."""

    name = "llm"

    def __init__(self, url: str, model: str, key: str = "", *, max_attempts: int = 2, timeout_s: float = 300.0,
                 check_overrides: Callable[[list[str]], list[str]] | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not url:
            raise LeaderError("planner=llm needs llm.url (an OpenAI-compatible endpoint, e.g. http://host:8000/v1)")
        self.url = url.rstrip("/")
        self.model = model
        self.key = key
        self.max_attempts = max(1, int(max_attempts))
        self.timeout_s = timeout_s
        self.check_overrides = check_overrides
        self.transport = transport
        self.conclusion = ""
        self.transcript: list[dict[str, Any]] = []

    def messages(self, goal: str, constraints: dict[str, Any], stages: Sequence[dict[str, Any]],
                 max_stages: int) -> list[dict[str, str]]:
        """The prompt: the role and schema, then the goal, constraints and what every stage found."""
        history = [{"stage": s.get("index"), "rationale": s.get("rationale"),
                    "results": [{k: r.get(k) for k in ("blueprint", "overrides", "metric", "mean", "ci95", "n",
                                                       "failed")} for r in s.get("results", [])]}
                   for s in stages]
        user = (f"Goal: {goal}\n\nConstraints:\n{json.dumps(constraints, indent=1, default=str)}\n\n"
                f"Stages so far ({len(stages)} of at most {max_stages}):\n{json.dumps(history, indent=1, default=str)}"
                f"\n\nDesign stage {len(stages) + 1}, or reply done with the conclusion.")
        return [{"role": "system", "content": SYSTEM_PROMPT.format(schema=SCHEMA_TEXT)},
                {"role": "user", "content": user}]

    def _ask(self, messages: list[dict[str, str]]) -> str:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            with httpx.Client(timeout=self.timeout_s, transport=self.transport) as http:
                resp = http.post(f"{self.url}/chat/completions", headers=headers,
                                 json={"model": self.model, "messages": messages, "temperature": 0})
        except httpx.HTTPError as exc:
            raise LeaderError(f"the LLM leader at {self.url} could not be reached: {exc}") from exc
        if resp.status_code != 200:
            raise LeaderError(f"the LLM leader at {self.url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return str(resp.json()["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise LeaderError(f"the LLM leader at {self.url} sent no chat completion: {resp.text[:300]}") from exc

    def next_stage(self, goal: str, constraints: dict[str, Any], stages: Sequence[dict[str, Any]],
                   max_stages: int) -> StagePlan | None:
        if len(stages) >= max_stages:
            return None
        messages = self.messages(goal, constraints, stages, max_stages)
        errors = ""
        for attempt in range(1, self.max_attempts + 1):
            reply = self._ask(messages)
            self.transcript.append({"stage": len(stages) + 1, "attempt": attempt, "reply": reply})
            try:
                plan = parse_plan(reply, self.check_overrides)
            except BlueprintError as exc:
                errors = str(exc)
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": f"Your reply was rejected:\n{errors}\n"
                                                        "Reply again with one corrected JSON object only."}]
                continue
            if plan is None:
                data = extract_object(reply)
                self.conclusion = str(data.get("conclusion") or "")
            return plan
        raise LeaderError(f"the LLM leader's plan for stage {len(stages) + 1} was malformed "
                          f"{self.max_attempts} time(s); the last reply's {errors}")
