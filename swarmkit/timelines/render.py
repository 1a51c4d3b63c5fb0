"""Render OpenAI chat messages into timeline prompt blocks.

:class:`ChatRenderer` applies the tokenizer's chat template once to the whole
conversation and splits the rendered text per message, using the renders of
message prefixes (``render(messages[:k])``) as the split points. Each block is
tokenized on its own, so the text and tokens of a message's block do not
depend on what follows it, and the concatenated token ids equal
``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)``
(every split point is checked: one where the tokenizer would merge across
the two blocks is removed by joining them).

Blocks per message:

- system / user (and unknown roles) -> one ``"user"`` block;
- tool -> one ``"env"`` block;
- assistant -> ``"template"`` header (equal to the generation prompt),
  ``"history"`` body (content + EOS, what the model generated), ``"template"``
  trailer (e.g. the newline after ``<|im_end|>``);
- the generation prompt -> a final ``"template"`` block.

The text of a history body block is the text the model generated for that
turn: the message content, followed by whatever the template rendered after
the part of the content it kept (for a template that strips ``<think>...``
from earlier turns, the stripped part is restored in ``text`` while
``token_ids`` stay the template's rendering). So ``text`` match merges across
such drift and ``token`` match does not (see docs/timeline_merging.md).

Invariant (ChatML templates): if call 2's messages are call 1's messages, an
assistant message whose content is the text generated in call 1 (without the
EOS), then new user/tool messages, then
``render_prompt(call1) + [completion_block(call1 output incl. EOS)]`` is a
block-wise prefix of ``render_prompt(call2)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmkit.timelines.block import Block
from swarmkit.timelines.reasoning import THINK_CLOSE

__all__ = ["ChatRenderer", "TemplateError"]


class TemplateError(ValueError):
    """The chat template refused a conversation.

    :ivar index: the first message whose prefix fails to render (``None``
        when every prefix renders and only the whole conversation fails).
    :ivar reason: the template's own error (e.g. its ``raise_exception`` text).
    """

    def __init__(self, index: int | None, reason: str):
        where = f"messages[{index}]" if index is not None else "the conversation"
        super().__init__(f"the chat template could not render {where}: {reason}")
        self.index = index
        self.reason = reason

_ROLE_AUTHOR = {"system": "user", "developer": "user", "user": "user", "tool": "env", "ipython": "env"}


@dataclass
class _Piece:
    """A block before tokenization: ``rendered`` is the template's text, ``text`` the block text."""

    author: str
    rendered: str
    text: str


@dataclass
class _State:
    """What one render of a conversation leaves for the next call of the same conversation."""

    mkeys: tuple[str, ...]
    prefix: str  # F[:bounds[-1]], the render without the generation prompt
    bounds: list[int]  # bounds[k] = end of message k-1's segment in F, bounds[0] = 0
    stable: list[bool]  # stable[k]: render(messages[:k]) is exactly F[:bounds[k]]
    pieces: list[list[_Piece]]  # per message


def _content_text(message: dict[str, Any]) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(parts)
    return None


def _generated_text(content: str | None, rendered_body: str) -> str:
    """The text the model generated for an assistant turn, reconstructed.

    ``content`` followed by the rendered body after the longest suffix of
    ``content`` that the body starts with (the template may have dropped a
    prefix of the content, e.g. a ``<think>`` block). Equal to
    ``rendered_body`` when the template kept the content as is.
    """
    if not content or rendered_body.startswith(content):
        return rendered_body
    first = rendered_body[:1]
    j = content.find(first, 1) if first else -1
    while j != -1:
        if rendered_body.startswith(content[j:]):
            return content[:j] + rendered_body
        j = content.find(first, j + 1)
    return content + rendered_body


class ChatRenderer:
    """Turns chat messages into prompt :class:`~swarmkit.timelines.Block` lists.

    :param tokenizer: a Hugging Face tokenizer with a chat template.
    :param chat_template: override the tokenizer's template.
    :param template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
    :param eos_text: the string that ends an assistant turn (default ``tokenizer.eos_token``).
    :param cache_size: conversations (and, times 64, token-cache entries) remembered.

    Thread-compatible, not thread-safe: use one renderer per event loop / thread.
    Returned blocks are fresh objects (safe to mutate).
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, eos_text: str | None = None,
                 cache_size: int = 4096):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_text: str = eos_text if eos_text is not None else (tokenizer.eos_token or "")
        self.cache_size = cache_size
        self._states: OrderedDict[int, _State] = OrderedDict()
        self._tok_cache: dict[str, list[int]] = {}
        self._pair_cache: dict[tuple[str, str], bool] = {}
        self._compiled: dict[bool, Any] = {}
        #: with tools or not -> the generation prompt when the template provably writes it last from
        #: its options alone (one render then serves with and without it), else None
        self._gen_prompt: dict[bool, str | None] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and hasattr(backend, "encode") else None
        specials = []
        for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
            content = getattr(tok, "content", str(tok))
            if content and not getattr(tok, "lstrip", False) and not getattr(tok, "rstrip", False):
                specials.append(content)
        #: added tokens that are split out before BPE: a split next to one is always safe
        self._specials: tuple[str, ...] = tuple(sorted(set(specials), key=len, reverse=True))
        self.stats = {"calls": 0, "renders": 0, "encodes": 0, "reused_messages": 0}
        self._tools_ignored: dict[str, bool] = {}
        self._wrapping: tuple[str, str, str] | None = None  # tool_call_wrapping(), once found
        self._last_error: str = ""

    # ------------------------------------------------------------------ public
    def render_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      generated: Sequence[tuple[str, Sequence[int]]] = ()) -> list[Block]:
        """Prompt blocks (with the generation prompt) of ``messages``.

        Concatenated ``token_ids`` equal ``apply_chat_template(messages, tools=tools,
        add_generation_prompt=True, tokenize=True)``; loss masks are 0 and logprobs 0.0.

        ``generated`` replays earlier model turns: ``(text, token_ids)`` pairs, ``text``
        the decoded generation. An assistant body that renders as ``text`` (optionally
        followed by more template text, e.g. an EOS the generation stopped before) takes
        those ``token_ids`` instead of a re-tokenization, so the prompt holds the tokens
        the model produced.

        :raises TemplateError: the template refused the messages (names the message).
        """
        if not messages:
            raise ValueError("render_prompt needs at least one message")
        self.stats["calls"] += 1
        pieces, replay = self._pieces(messages, tools, generated)
        return [self._block(p, replay.get(id(p))) for p in pieces]

    def render_demonstration(self, messages: list[dict[str, Any]],
                             tools: list[dict[str, Any]] | None = None) -> list[Block]:
        """Blocks of a whole demonstrated conversation (no generation prompt).

        Every assistant body (content, tool calls as the template writes them, and the
        EOS) becomes an ``llm`` block with loss mask 1 and logprob 0.0: the tokens a
        supervised warm start trains; everything else keeps mask 0.

        :raises ValueError: the conversation does not end with an assistant message.
        :raises TemplateError: the template refused the messages.
        """
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("a demonstration must end with an assistant message")
        pieces, _ = self._pieces(messages, tools)
        end = self._render(messages, tools, False)
        if end is None:
            raise self._diagnose(messages, tools)
        kept: list[_Piece] = []
        size = 0
        for p in pieces:
            if size >= len(end):
                break
            kept.append(p)
            size += len(p.rendered)
        if size != len(end):
            raise ValueError("the demonstration's last turn could not be told apart from the generation prompt")
        out = []
        for p in kept:
            b = self._block(p)
            if p.author == "history":
                n = len(b.token_ids)
                b = Block("llm", b.text, b.token_ids, [0.0] * n, [1] * n)
            out.append(b)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; cached)."""
        return list(self._encode(text))

    @property
    def template_source(self) -> str:
        """The Jinja source the renderer uses (the override, or the tokenizer's)."""
        return str(self.tokenizer.get_chat_template(self.chat_template, None))

    @property
    def has_developer_role(self) -> bool:
        """Whether the template mentions a ``developer`` role (else callers map it to ``system``)."""
        return "developer" in self.template_source

    def ignores_tools(self, tools: list[dict[str, Any]]) -> bool:
        """Whether the template renders a conversation the same with and without ``tools``."""
        key = repr(tools)
        hit = self._tools_ignored.get(key)
        if hit is None:
            probe = [{"role": "user", "content": "?"}]
            with_tools = self._render(probe, tools, True)
            hit = with_tools is not None and with_tools == self._render(probe, None, True)
            self._tools_ignored[key] = hit
        return hit

    def tool_call_prefix(self, name: str | None = None) -> str:
        """The text an assistant turn starts with to call a tool, as this template writes it.

        Without ``name``: up to the function name's opening quote (e.g. ``<tool_call>\\n{"name": "``);
        with ``name``: up to the arguments (``...{"name": "add", "arguments": ``). See
        :meth:`tool_call_wrapping`.
        """
        prefix, between, _ = self.tool_call_wrapping()
        return prefix if name is None else prefix + name + between

    def tool_call_wrapping(self) -> tuple[str, str, str]:
        """How this template writes one tool call around its name and its arguments object:
        ``(prefix, between, suffix)``, so a call is ``prefix + name + between + arguments + suffix``
        (e.g. ``<tool_call>\\n{"name": "``, ``", "arguments": ``, ``}\\n</tool_call>``). Found by
        rendering a probe tool call (cached); templates that write no ``<tool_call>`` get the
        Hermes form the parser reads."""
        if self._wrapping is not None:
            return self._wrapping
        marker = "swarmkit_probe_fn"
        probe = [{"role": "user", "content": "?"}]
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": marker, "arguments": "{}"}}]}
        head = self._render(probe, None, True)
        whole = self._render([*probe, call], None, False)
        prefix, between, suffix = '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"
        if head is not None and whole is not None and whole.startswith(head) and marker in whole:
            tail = whole[len(head):]
            cut = tail.index(marker)
            after = tail[cut + len(marker):]
            brace = after.find("{}")
            close = after.find("</tool_call>", brace)
            if "<tool_call>" in tail[:cut] and brace >= 0:
                prefix, between = tail[:cut], after[:brace]
                if close >= 0:
                    suffix = after[brace + 2:close + len("</tool_call>")]
        self._wrapping = (prefix, between, suffix)
        return self._wrapping

    def completion_block(self, token_ids: Sequence[int], logprobs: Sequence[float],
                         forced: Sequence[int] = (), versions: Sequence[int] | None = None) -> Block:
        """The generated tokens (including the EOS, if any) as an ``llm`` block.

        ``forced`` are tokens the server put at the start of the model's turn (e.g. the
        opening of a tool call that ``tool_choice`` requires): part of the turn's text
        and tokens, logprob 0.0 and loss mask 0, so they are never trained.
        ``versions``: the policy version of each token of the block (forced ones included).
        """
        ids = [*forced, *token_ids]
        return Block("llm", self.decode(ids), ids, [0.0] * len(forced) + list(logprobs),
                     [0] * len(forced) + [1] * len(token_ids), None if versions is None else list(versions))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Decode keeping special tokens and spaces as generated (the text of an ``llm`` block)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (same as ``apply_chat_template(tokenize=False)``)."""
        out = self._render(messages, tools, add_generation_prompt)
        if out is None:
            raise self._diagnose(messages, tools)
        return out

    def clear_cache(self) -> None:
        """Forget remembered conversations and tokenizations."""
        self._states.clear()
        self._tok_cache.clear()
        self._pair_cache.clear()

    # ------------------------------------------------------------------ rendering
    def _template(self, with_tools: bool) -> Any:
        compiled = self._compiled.get(with_tools)
        if compiled is None:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            source = self.tokenizer.get_chat_template(self.chat_template, [{}] if with_tools else None)
            compiled = _compile_jinja_template(source)
            self._compiled[with_tools] = compiled
        return compiled

    def _without_generation_prompt(self, full: str, messages: list[dict[str, Any]],
                                   tools: list[dict[str, Any]] | None) -> str | None:
        """``render(messages, add_generation_prompt=False)``: cut from ``full`` when the template
        provably writes the generation prompt last and from its options alone, else rendered."""
        gp = self._fixed_generation_prompt(tools)
        if gp is not None and full.endswith(gp):
            return full[: len(full) - len(gp)]
        return self._render(messages, tools, False)

    def _fixed_generation_prompt(self, tools: list[dict[str, Any]] | None) -> str | None:
        with_tools = tools is not None
        if with_tools in self._gen_prompt:
            return self._gen_prompt[with_tools]
        found = None
        if tools is None or all(isinstance(t, dict) for t in tools):  # the compiled template renders it
            try:
                source = self.tokenizer.get_chat_template(self.chat_template, [{}] if with_tools else None)
                constants = {*self.template_kwargs, *self.tokenizer.special_tokens_map}
                if generation_prompt_is_last(self._template(with_tools).environment.parse(source), constants):
                    probe = [{"role": "user", "content": "x"}]
                    with_gp, without = self._render(probe, tools, True), self._render(probe, tools, False)
                    if with_gp is not None and without is not None and with_gp.startswith(without):
                        found = with_gp[len(without):]
            except Exception:  # noqa: BLE001 - a template this cannot analyse is simply rendered twice
                found = None
        self._gen_prompt[with_tools] = found
        return found

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str | None:
        """The template's text, or None when the template refuses these messages."""
        self.stats["renders"] += 1
        try:
            if tools is not None and not all(isinstance(t, dict) for t in tools):
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=self.chat_template, tokenize=False,
                    add_generation_prompt=add_generation_prompt, **self.template_kwargs)
            kwargs = {**self.tokenizer.special_tokens_map, **self.template_kwargs}
            return self._template(tools is not None).render(
                messages=messages, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a template that requires alternating roles
            self._last_error = f"{type(exc).__name__}: {exc}"
            return None

    def _diagnose(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> TemplateError:
        """Which message the template refuses, and its error."""
        reason = self._last_error or "unknown error"
        for k in range(1, len(messages) + 1):
            if self._render(messages[:k], tools, False) is None:
                return TemplateError(k - 1, self._last_error or reason)
        return TemplateError(None, reason)

    def _pieces(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                generated: Sequence[tuple[str, Sequence[int]]] = ()) -> tuple[list[_Piece], dict[int, list[int]]]:
        """The conversation's pieces after split fixing, and the token ids of the replayed ones (by ``id``)."""
        n = len(messages)
        tkey = repr(tools)
        mkeys = tuple(repr(m) for m in messages)
        hashes = []
        h = hash(tkey)
        for mk in mkeys:
            h = hash((h, mk))
            hashes.append(h)
        full = self._render(messages, tools, True)
        if full is None:
            raise self._diagnose(messages, tools)
        # the longest earlier render of a prefix of this conversation
        prev: _State | None = None
        for d in range(n, 0, -1):
            st = self._states.get(hashes[d - 1])
            if st is not None and st.mkeys == mkeys[:d]:
                prev = st
                self._states.move_to_end(hashes[d - 1])
                break
        bounds = [0]
        stable = [True]
        pieces: list[list[_Piece]] = []
        if prev is not None:
            d = len(prev.pieces)
            if full.startswith(prev.prefix):
                keep = d
            else:  # the template re-rendered history: keep what is still a prefix
                lo, hi = 0, d
                while lo < hi:  # largest run of stable bounds that is still a prefix of `full`
                    mid = (lo + hi + 1) // 2
                    if all(prev.stable[1: mid + 1]) and full.startswith(prev.prefix[: prev.bounds[mid]]):
                        lo = mid
                    else:
                        hi = mid - 1
                keep = lo
            bounds = prev.bounds[: keep + 1]
            stable = prev.stable[: keep + 1]
            pieces = prev.pieces[:keep]
            self.stats["reused_messages"] += keep
        start = len(pieces)
        # split points of the new messages: ends of prefix renders that `full` starts with
        no_gp = self._without_generation_prompt(full, messages, tools) if start < n else None
        for k in range(start + 1, n + 1):
            pk = no_gp if k == n else self._render(messages[:k], tools, False)
            if pk is not None and len(pk) >= bounds[-1] and full.startswith(pk):
                bounds.append(len(pk))
                stable.append(True)
            else:
                bounds.append(-1)
                stable.append(False)
        self._resolve_unstable(full, bounds, start)
        gp_start = bounds[n]
        gen_prompt = full[gp_start:]
        for k in range(start, n):
            seg = full[bounds[k]: bounds[k + 1]]
            pieces.append(self._message_pieces(messages[k], seg, gen_prompt))
        state = _State(mkeys, full[:gp_start], bounds, stable, pieces)
        self._states[hashes[-1]] = state
        self._states.move_to_end(hashes[-1])
        while len(self._states) > self.cache_size:
            self._states.popitem(last=False)
        flat = [p for ps in pieces for p in ps if p.rendered]
        if gen_prompt:
            flat.append(_Piece("template", gen_prompt, gen_prompt))
        replay: dict[int, list[int]] = {}
        if generated:
            flat = self._split_replayed(flat, generated, replay)
        return self._fix_splits(flat, replay), replay

    def _split_replayed(self, flat: list[_Piece], generated: Sequence[tuple[str, Sequence[int]]],
                        replay: dict[int, list[int]]) -> list[_Piece]:
        """``flat`` with each history piece that replays a generation (its ids put in ``replay``)
        split from the template text after it (e.g. the end-of-turn token of a turn cut at
        ``max_tokens``), so its block has the text of the ``llm`` block it repeats and merges."""
        out: list[_Piece] = []
        for p in flat:
            hit = self._replayed(p, generated)
            if hit is None:
                out.append(p)
                continue
            ids, rest = hit
            if rest:  # p.text ends with p.rendered (see _generated_text), so with rest
                out.append(p := _Piece("history", p.rendered[: -len(rest)], p.text[: -len(rest)]))
                replay[id(p)] = ids
                out.append(_Piece("template", rest, rest))
            else:
                out.append(p)
                replay[id(p)] = ids
        return out

    def _resolve_unstable(self, full: str, bounds: list[int], start: int) -> None:
        """Split points whose prefix render is not a prefix of ``full`` (history re-rendered):
        the next message-start marker (the generation prompt's first special token)."""
        n = len(bounds) - 1
        if all(b >= 0 for b in bounds[start + 1:]):
            return
        marker = self._marker(full, bounds)
        for k in range(start + 1, n + 1):
            if bounds[k] >= 0:
                continue
            nxt = next((b for b in bounds[k + 1:] if b >= 0), len(full))
            pos = full.find(marker, bounds[k - 1] + 1) if marker else -1
            if k == n:  # generation prompt starts at the last marker
                pos = full.rfind(marker, bounds[k - 1]) if marker else -1
                bounds[k] = pos if pos > bounds[k - 1] else bounds[k - 1]
            elif 0 <= pos <= nxt:
                bounds[k] = pos
            else:
                bounds[k] = bounds[k - 1]  # unresolvable: message k-1 joins the next segment

    def _marker(self, full: str, bounds: list[int]) -> str:
        tail = full[bounds[-1]:] if bounds[-1] >= 0 else ""
        best, pos = "", len(tail) + 1
        for s in self._specials:
            p = tail.find(s)
            if 0 <= p < pos:
                best, pos = s, p
        return best

    def _message_pieces(self, message: dict[str, Any], seg: str, gen_prompt: str) -> list[_Piece]:
        role = message.get("role", "user")
        if not seg:
            return []
        if role != "assistant":
            author = _ROLE_AUTHOR.get(role, "user")
            return [_Piece(author, seg, seg)]
        if gen_prompt and seg.startswith(gen_prompt):
            header = gen_prompt
        else:
            i = 0
            while i < min(len(seg), len(gen_prompt)) and seg[i] == gen_prompt[i]:
                i += 1
            header = seg[:i]
        rest = seg[len(header):]
        e = rest.rfind(self.eos_text) if self.eos_text else -1
        if e >= 0:
            body, trailer = rest[: e + len(self.eos_text)], rest[e + len(self.eos_text):]
        else:
            body, trailer = rest, ""
        out = []
        if header:
            out.append(_Piece("template", header, header))
        if body:
            out.append(_Piece("history", body, _generated_text(_content_text(message), body)))
        if trailer:
            out.append(_Piece("template", trailer, trailer))
        return out

    # ------------------------------------------------------------------ tokenizing
    def _encode(self, text: str) -> list[int]:
        ids = self._tok_cache.get(text)
        if ids is None:
            self.stats["encodes"] += 1
            if self._backend is not None:
                ids = self._backend.encode(text, add_special_tokens=False).ids
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(self._tok_cache) >= self.cache_size * 64:
                self._tok_cache.clear()
            self._tok_cache[text] = ids
        return ids

    def _safe_split(self, left: str, right: str) -> bool:
        """Whether tokenizing ``left`` and ``right`` apart gives the tokens of ``left + right``."""
        if left.endswith(self._specials) or right.startswith(self._specials):
            return True
        key = (left, right)
        ok = self._pair_cache.get(key)
        if ok is None:
            ok = self._encode(left) + self._encode(right) == self._encode(left + right)
            if len(self._pair_cache) >= self.cache_size * 16:
                self._pair_cache.clear()
            self._pair_cache[key] = ok
        return ok

    def _replayed(self, p: _Piece, generated: Sequence[tuple[str, Sequence[int]]]
                  ) -> tuple[list[int], str] | None:
        """The generated token ids a history piece replays (see ``render_prompt``) and the rendered
        text after them, or None.

        A thinking model's turn that the template renders without its ``<think>`` part
        (Qwen3 drops reasoning before the last user query) replays the tokens generated
        after ``</think>``, when they decode to exactly what the template kept.
        """
        if p.author != "history" or not generated:
            return None
        for text, ids in generated:
            if not text:
                continue
            if not p.rendered.startswith(text):
                tail = self._answer_tail(text, ids)
                if tail is None or not p.rendered.startswith(tail[0]):
                    continue
                text, ids = tail
            rest = p.rendered[len(text):]
            if not rest or self._safe_split(text, rest):
                return list(ids), rest
        return None

    def _answer_tail(self, text: str, ids: Sequence[int]) -> tuple[str, list[int]] | None:
        """``(answer text, its token ids)`` of a generation ``<think>…</think>answer``: the shortest
        token suffix that decodes to the answer (leading newlines dropped), or None."""
        end = text.find(THINK_CLOSE)
        if end < 0:
            return None
        answer = text[end + len(THINK_CLOSE):].lstrip("\n")
        if not answer:
            return None
        # decoded suffix lengths grow as the suffix does: binary search the start
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.decode(ids[mid:])) >= len(answer):
                lo = mid
            else:
                hi = mid - 1
        if self.decode(ids[lo:]) != answer:
            return None
        return answer, list(ids[lo:])

    def _fix_splits(self, pieces: list[_Piece], replay: dict[int, list[int]]) -> list[_Piece]:
        """Join neighbours whose separate tokenization differs from the joint one.

        A replayed generation is never joined: its tokens are what the model produced
        after the prompt before it, which is exactly this split.
        """
        out: list[_Piece] = []
        for p in pieces:
            if replay and (id(p) in replay or (out and id(out[-1]) in replay)):
                out.append(p)
                continue
            while out and not self._safe_split(out[-1].rendered, p.rendered):
                q = out.pop()
                author = "history" if "history" in (q.author, p.author) else q.author
                p = _Piece(author, q.rendered + p.rendered, q.text + p.text)
            out.append(p)
        return out

    def _block(self, p: _Piece, replayed: list[int] | None = None) -> Block:
        return Block.prompt(p.author, p.text, replayed if replayed is not None else list(self._encode(p.rendered)))


def generation_prompt_is_last(template: Any, constants: set[str]) -> bool:
    """Whether a parsed chat template (``jinja2.nodes.Template``) writes the generation prompt
    last and from constants alone: its last top-level node is the only ``if`` that reads
    ``add_generation_prompt``, and that ``if`` reads no variable but ``constants`` (the template's
    options and special tokens) that the template never assigns. Then the render without the
    generation prompt is the render with it, less the prompt's (fixed) text."""
    from jinja2 import nodes

    if not template.body or not isinstance(template.body[-1], nodes.If):
        return False
    last = template.body[-1]
    reads = list(last.find_all(nodes.Name))
    if not any(n.name == "add_generation_prompt" for n in reads):
        return False
    everywhere = [n for n in template.find_all(nodes.Name) if n.name == "add_generation_prompt"]
    if len(everywhere) != sum(n.name == "add_generation_prompt" for n in reads):
        return False  # read elsewhere too: the rest of the render may depend on it
    allowed = constants | {"add_generation_prompt"}
    assigned = {n.name for n in template.find_all(nodes.Name) if n.ctx in ("store", "param")}
    return all(n.name in allowed and n.name not in assigned for n in reads)


class TokenText:
    """Cached per-token strings and bytes for logprob answers."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = (text, list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit
