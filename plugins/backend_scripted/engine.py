"""The ``scripted`` backend: :class:`swarmkit.testing.ScriptedBackend` driven by a script file.

Each call decodes its prompt, finds the messages since the model last spoke and how many
assistant turns came before (by rendering probe conversations with the served chat template
once, at start), and answers with :meth:`Script.answer`. The tokenizer and chat template are
the model's (``model.path``; no weights are loaded), so prompts, tool calls and token counts
are those of a real server. ``trainable`` is False: the training cycle runs its steps without
a trainer (docs/backends.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from swarmkit.chat_templates import resolve_chat_template
from swarmkit.config.schema import ModelConfig
from swarmkit.models import resolve_model_path
from swarmkit.testing.scripted import ScriptedBackend
from swarmkit_plugins.backend_scripted.schema import ScriptedBackendConfig
from swarmkit_plugins.backend_scripted.script import Script, load_script, since_model_spoke

_S1, _S2, _S3 = "SCRIPTPROBEONE", "SCRIPTPROBETWO", "SCRIPTPROBETHREE"


def _between(text: str, a: str, b: str | None) -> str:
    start = text.find(a) + len(a)
    return text[start:] if b is None else text[start: text.find(b, start)]


def template_markers(tokenizer: Any, template: str | None) -> tuple[str, str, str]:
    """(assistant header, end of an assistant turn, user header) of a chat template, read from
    probe renderings; empty strings where the template does not show them."""
    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        kw: dict[str, Any] = {"chat_template": template} if template else {}
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw))

    try:
        one = render([{"role": "user", "content": _S1}], False)
        header = render([{"role": "user", "content": _S1}], True)[len(one):]
        two = render([{"role": "user", "content": _S1}, {"role": "assistant", "content": _S2}], False)
        end = _between(two, _S2, None)
        three = render([{"role": "user", "content": _S1}, {"role": "assistant", "content": _S2},
                        {"role": "user", "content": _S3}], False)
        gap = _between(three, _S2, _S3)
        user = gap[len(end):] if gap.startswith(end) else ""
    except Exception:  # noqa: BLE001 - a template the probes cannot render: match on the whole prompt
        return "", "", ""
    return header, end.strip(), user


class ScriptFileBackend(ScriptedBackend):
    """Replies from ``backend.script``; the served model's tokenizer and template, no weights."""

    replicable = True
    trainable = False

    def __init__(self, config: dict[str, Any] | None = None, model: dict[str, Any] | None = None):
        cfg = ScriptedBackendConfig(**(config or {}))
        self.script: Script = load_script(cfg.script)
        self.model_cfg = ModelConfig.of(model)
        self.markers = ("", "", "")
        super().__init__(None, replies=self._answer, delay_s=cfg.delay_s, model=model)

    async def start(self) -> None:
        self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        template = resolve_chat_template(self.model_cfg.chat_template, self.model_cfg.path)
        self.markers = template_markers(self._tokenizer, template)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        folder = resolve_model_path(self.model_cfg.path)
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=self.model_cfg.trust_remote_code)

    def _answer(self, prompt_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        new, turn = since_model_spoke(text, *self.markers)
        try:
            return self.script.answer(new, turn)
        except LookupError as exc:
            raise ValueError(str(exc)) from None
