"""One generated turn: the capture path every inference protocol shares.

Chat Completions, Anthropic Messages and OpenAI Responses translate their
request into OpenAI-chat messages, function tools and a :class:`ToolChoice`
(:mod:`swarmkit.server.protocols`); from there the path is one and the same:

normalise the messages → replay turns this server generated with their own
tokens → render the chat template → generate from token ids → record the
timeline → parse tool calls → remember the turn for its replay.

So one conversation gives the same token ids and loss masks whichever protocol
carried it, and prefix merging works across turns of any protocol. A streamed
turn and a non-streamed one give the same answer (content, tool calls and their
verbatim arguments, finish reason: one parser, :mod:`swarmkit.timelines.toolcalls`),
and the recorded timeline's ``meta.finish_reason`` is the answer's.

``/v1/completions`` sends a raw prompt (text or token ids, no chat template):
:func:`prepare_raw_turn_async` makes it a :class:`Turn` of one prompt block, and
from there it takes the same path (generate, record with the same meta,
``structured`` included), minus what only a chat turn has: its text comes back
as generated (no reasoning split, no tool calls) and it is not remembered for
replay.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from swarmkit.contract import GenerationOutput, SamplingParams, StreamChunk
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import (
    ToolChoice,
    check_tools_rendered,
    format_violations,
    normalize_messages,
    strict_violations,
    template_error,
)
from swarmkit.timelines.reasoning import ReasoningStreamSplitter, opens_reasoning, split_reasoning
from swarmkit.timelines.render import TemplateError
from swarmkit.timelines.strict_tools import tool_call_tag
from swarmkit.timelines.toolcalls import CLOSE, OPEN, ToolCallStreamParser, parse_tool_parts

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer
    from swarmkit.timelines.block import Block

__all__ = ["CallDelta", "Finished", "Opened", "Piece", "Reply", "Turn", "generate_turn", "prepare_raw_turn_async",
           "prepare_turn", "prepare_turn_async", "stream_turn", "with_internal_stop", "with_tool_constraint"]


@dataclass
class Turn:
    """A checked request, ready to generate.

    :ivar endpoint: the protocol's name in the recorded timelines (``chat``, ``messages``, ``responses``,
        ``completions``).
    :ivar forced_text: a tool-call opening the server prefills (``tool_choice`` required or named).
    :ivar internal_stop: generation stops at the first ``</tool_call>`` (no parallel calls).
    :ivar think_started: the generation prompt opened ``<think>``: the reply starts as reasoning.
    :ivar raw: a raw prompt (``/v1/completions``): the text comes back as generated (no reasoning split,
        no tool calls) and the turn is not remembered for replay.
    :ivar tool_names: the names of the tools offered (in order).
    :ivar call_wrapping: how the template writes a tool call (``ChatRenderer.tool_call_wrapping``), read
        when the request has ``strict`` tools (None otherwise): their calls may be constrained.
    """

    endpoint: str
    blocks: list[Any]
    prompt_ids: list[int]
    choice: ToolChoice
    forced_text: str
    forced_ids: list[int]
    internal_stop: bool
    stops: list[str] = field(default_factory=list)  # the client's stop strings
    think_started: bool = False
    raw: bool = False
    tool_names: tuple[str, ...] = ()
    call_wrapping: tuple[str, str, str] | None = None


def prepare_turn(srv: SwarmServer, ep: Episode, messages: Any, tools: list[dict[str, Any]] | None,
                 choice: ToolChoice, *, endpoint: str, template_kwargs: dict[str, Any] | None = None) -> Turn:
    """Normalise, replay and render a conversation (400 naming the message on a bad one).

    ``template_kwargs``: extra chat-template variables of this request (``enable_thinking``...).
    """
    renderer = srv.inference.renderer_for(template_kwargs) if template_kwargs else srv.inference.renderer
    messages = normalize_messages(messages, developer_role=renderer.has_developer_role)
    check_tools_rendered(renderer, tools)
    messages, generated = ep.turns.substitute(messages)
    try:
        blocks = renderer.render_prompt(messages, tools=tools, generated=generated)
    except TemplateError as exc:
        raise template_error(exc) from None
    forced_text = renderer.tool_call_prefix(choice.name) if choice.forced else ""
    forced_ids = renderer.encode(forced_text) if forced_text else []
    prompt_ids = [t for b in blocks for t in b.token_ids] + forced_ids
    started = not forced_text and bool(blocks) and opens_reasoning(blocks[-1].text)
    names = tuple(t["function"]["name"] for t in tools or ())
    wrapping = renderer.tool_call_wrapping() if choice.strict and choice.parse else None
    return Turn(endpoint, blocks, prompt_ids, choice, forced_text, forced_ids, choice.parse and not choice.parallel,
                think_started=started, tool_names=names, call_wrapping=wrapping)


def with_tool_constraint(turn: Turn, params: SamplingParams, mode: str) -> SamplingParams:
    """``params`` with the structural tag that forces the turn's tool calls into shape, when the request
    has ``strict`` tools and the server constrains them (``mode``: ``constrain`` or ``check``, see
    :mod:`swarmkit.timelines.strict_tools`); a request with ``response_format`` keeps its own constraint
    (its strict calls are checked only)."""
    if mode != "constrain" or turn.call_wrapping is None or params.response_format is not None:
        return params
    strict = turn.choice.strict
    tools = {name: strict.get(name) for name in turn.tool_names}
    opened = (turn.choice.name or "") if turn.forced_text else None
    params.structural_tag = tool_call_tag(turn.call_wrapping, tools, opened=opened, parallel=turn.choice.parallel)
    return params


def _structured(params: SamplingParams) -> dict[str, Any] | None:
    """Timeline meta of a call under constrained decoding: its logprobs are the masked
    distribution's (vLLM), so training rescores them (:mod:`swarmkit.training.samples`)."""
    return {"structured": True} if params.response_format is not None or params.structural_tag is not None else None


#: requests whose text is longer than this are rendered and tokenized off the event loop (one
#: worker thread): a big prompt never stalls other calls, a small one pays no thread hop
INLINE_CHARS = 32_000
_T = TypeVar("_T")
_render_pool: ThreadPoolExecutor | None = None


#: what one message costs to render, in characters of text (its role markers and the template's work): 20,000
#: empty messages are as much work as 640 kB of text, not nothing
MESSAGE_COST = 32


def _text_size(messages: Any, tools: Any) -> int:
    """Characters of text in a request's messages and tools, plus :data:`MESSAGE_COST` a message (a cheap
    upper bound's input)."""
    if not isinstance(messages, list):
        return 0
    size = (len(repr(tools)) if tools else 0) + MESSAGE_COST * len(messages)
    for m in messages:
        if isinstance(m, dict):
            c = m.get("content")
            size += len(c) if isinstance(c, str) else len(repr(c)) if c is not None else 0
            if m.get("tool_calls"):
                size += len(repr(m["tool_calls"]))
    return size


def max_prompt_chars(srv: SwarmServer) -> int | None:
    """The most characters a prompt that fits the context can hold (see
    :meth:`~swarmkit.swarm.gateway.InferenceGateway.max_prompt_chars`)."""
    return srv.inference.max_prompt_chars()


async def prepare_turn_async(srv: SwarmServer, ep: Episode, messages: Any, tools: list[dict[str, Any]] | None,
                             choice: ToolChoice, *, endpoint: str,
                             template_kwargs: dict[str, Any] | None = None) -> Turn:
    """:func:`prepare_turn` that never stalls the event loop: a request whose text cannot fit the
    context is refused before it is rendered (400 ``context_length_exceeded``), and a large one is
    rendered in a worker thread."""
    size = check_prompt_size(srv, messages, tools)
    if size <= INLINE_CHARS and not srv.inference.renders_in_pool:
        return prepare_turn(srv, ep, messages, tools, choice, endpoint=endpoint, template_kwargs=template_kwargs)
    return await in_render_pool(srv, lambda: prepare_turn(srv, ep, messages, tools, choice, endpoint=endpoint,
                                                          template_kwargs=template_kwargs))


def check_prompt_size(srv: SwarmServer, messages: Any, tools: Any) -> int:
    """400 ``context_length_exceeded`` for messages that cannot fit the context (too much text, or more
    messages than it has tokens), checked before rendering; returns the size estimate."""
    size = _text_size(messages, tools)
    bound = max_prompt_chars(srv)
    if isinstance(messages, list) and srv.inference.max_context and len(messages) > int(srv.inference.max_context):
        raise ApiError(400, f"{len(messages)} messages: more than any prompt of this model's context "
                       f"({srv.inference.max_context} tokens; every message renders to at least one) can hold",
                       "context_length_exceeded", param="messages")
    if bound is not None and size > bound:
        raise ApiError(400, f"the messages hold {size} characters, more than any prompt of this model's context "
                       f"({srv.inference.max_context} tokens) can (model.max_context)", "context_length_exceeded",
                       param="messages")
    return size


async def in_render_pool(srv: SwarmServer, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` (rendering or tokenizing) on the render worker thread, off the event loop. While one
    runs there, this server's others queue behind it: the renderer's caches are never used from two
    threads at once (so every render runs there while one is under way)."""
    global _render_pool
    if _render_pool is None:
        _render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmkit-render")
    with srv.inference.rendering():
        return await asyncio.get_running_loop().run_in_executor(_render_pool, fn)


def check_text_fits(srv: SwarmServer, text: str, param: str) -> None:
    """400 ``context_length_exceeded`` for a text longer than any prompt of the model's context can be
    (checked before tokenizing: a 6 MB prompt is refused at once)."""
    bound = max_prompt_chars(srv)
    if bound is not None and len(text) > bound:
        raise ApiError(400, f"'{param}' holds {len(text)} characters, more than any prompt of this model's "
                       f"context ({srv.inference.max_context} tokens) can (model.max_context)", "context_length_exceeded",
                       param=param)


async def encode_async(srv: SwarmServer, text: str, encode: Callable[[str], list[int]], param: str) -> list[int]:
    """``encode(text)`` that never stalls the event loop: refused when it cannot fit the context, run in the
    render worker when long (or while another render runs there)."""
    check_text_fits(srv, text, param)
    if len(text) <= INLINE_CHARS and not srv.inference.renders_in_pool:
        return encode(text)
    return await in_render_pool(srv, lambda: encode(text))


#: token-id prompts longer than this are decoded off the event loop
INLINE_IDS = 4096


async def prepare_raw_turn_async(srv: SwarmServer, prompt: str | list[int], *, endpoint: str,
                                 param: str = "prompt") -> Turn:
    """The turn of a raw prompt (no chat template): its one block is the prompt (author ``user``, loss
    mask 0). Text is tokenized as it is (refused before tokenizing when it cannot fit the context, long text
    tokenized off the event loop); token ids are checked against the context and the vocabulary (400
    naming ``param``) and decoded for the block's text."""
    tok = srv.inference.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, f"'{param}' must not be empty", "invalid_value", param=param)
        ids = await encode_async(srv, prompt, lambda t: list(tok.encode(t, add_special_tokens=False)), param)
        text = prompt
    else:
        if srv.inference.max_context and len(prompt) > int(srv.inference.max_context):
            raise ApiError(400, f"a prompt of {len(prompt)} token ids is longer than the model's context "
                           f"({srv.inference.max_context} tokens)", "context_length_exceeded", param=param)
        vocab = len(tok)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"token-id prompts must be non-empty lists of ids in [0, {vocab})",
                           "invalid_value", param=param)
        ids = list(prompt)
        text = await in_render_pool(srv, lambda: tok.decode(ids)) if len(ids) > INLINE_IDS else tok.decode(ids)
    return Turn(endpoint, [srv.inference.tracker.prompt_block(text, ids)], ids, ToolChoice(), "", [], False, raw=True)


def with_internal_stop(turn: Turn, params: SamplingParams) -> SamplingParams:
    """``params`` with the turn's internal ``</tool_call>`` stop added (kept on ``turn``)."""
    turn.stops = list(params.stop)
    if turn.internal_stop and CLOSE not in params.stop:
        params.stop = [*params.stop, CLOSE]
    else:
        turn.internal_stop = False
    return params


def _reply_text(turn: Turn, text: str, finish_reason: str | None) -> str:
    """What tool calls are parsed from: the forced opening, the text, and the ``</tool_call>``
    that the internal stop (``parallel_tool_calls: false``) cut off."""
    full = turn.forced_text + text
    if turn.internal_stop and finish_reason == "stop" and full.rfind(OPEN) > full.rfind(CLOSE):
        full += CLOSE
    return full


def answer_finish(engine_reason: str, calls: list[dict[str, Any]]) -> str:
    """The answer's ``finish_reason`` (also the recorded one): ``tool_calls`` when calls were parsed, but
    ``length`` whenever the token limit cut the turn (a call it cut may be incomplete; training's overlong
    handling reads ``length``)."""
    return "tool_calls" if calls and engine_reason != "length" else engine_reason


def _annotate(timeline: Any, reply_reason: str, violations: list[str]) -> None:
    """The recorded timeline's meta says what the answer said: its finish reason, its strict violations."""
    timeline.meta["finish_reason"] = reply_reason
    if violations:
        timeline.meta["strict_violations"] = violations


def _remember(srv: SwarmServer, ep: Episode, completion: Block, content: str | None,
              calls: list[dict[str, Any]]) -> None:
    """Keep the turn (its recorded completion block: forced + generated tokens, decoded) for
    token-exact replay when the client sends it back."""
    rendered = completion.text
    eos = srv.inference.renderer.eos_text
    text = rendered[: -len(eos)] if eos and rendered.endswith(eos) else rendered
    ep.turns.remember(text, completion.token_ids, rendered, content, calls)


def matched_stop(srv: SwarmServer, turn: Turn, token_ids: list[int], text: str, finish_reason: str) -> str | None:
    """The client stop string that ended a choice (None: EOS, length, or no stop strings)."""
    if finish_reason != "stop" or not turn.stops:
        return None
    tail = srv.inference.renderer.decode(token_ids)[len(text):]
    found = [(tail.find(s), s) for s in turn.stops if s and s in tail]
    return min(found)[1] if found else None


async def choice_streams(
    srv: SwarmServer, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) from ``params.n`` concurrent backend streams."""
    one = SamplingParams(**{**params.__dict__, "n": 1})
    if params.n == 1:
        agen = srv.inference.backend.stream(prompt_ids, one)
        try:
            async for chunk in agen:
                yield 0, chunk
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        return
    send, receive = anyio.create_memory_object_stream[tuple[int, StreamChunk | None]](64)

    async def pump(i: int) -> None:
        params_i = SamplingParams(**{**one.__dict__, "seed": None if one.seed is None else one.seed + i})
        agen = srv.inference.backend.stream(prompt_ids, params_i)
        try:
            async for chunk in agen:
                await send.send((i, chunk))
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            with anyio.CancelScope(shield=True):
                await send.send((i, None))

    async with anyio.create_task_group() as tg:
        for i in range(params.n):
            tg.start_soon(pump, i)
        done = 0
        async with receive:
            while done < params.n:
                i, chunk = await receive.receive()
                if chunk is None:
                    done += 1
                    continue
                yield i, chunk


def _call_deltas(index: int, parser: ToolCallStreamParser) -> list[CallDelta]:
    out = []
    for ev in parser.take_events():
        if ev[0] == "start":
            out.append(CallDelta(index, ev[1], ev[2], name=ev[3]))
        else:
            out.append(CallDelta(index, ev[1], "", args=ev[2]))
    return out


@dataclass
class Reply:
    """One finished choice.

    :ivar content: the text around the tool calls (None when only calls were generated and
        tools were offered; the text as generated otherwise).
    :ivar finish_reason: ``stop``, ``length`` or ``tool_calls`` (:func:`answer_finish`).
    :ivar stop_sequence: the client stop string that ended it, if one did.
    :ivar reasoning: a thinking model's ``<think>`` text (None when it did not reason).
    :ivar parts: the content's text pieces and the calls in the order generated (protocols that
        interleave text and calls: Messages, Responses).
    :ivar strict_violations: how calls of ``strict`` tools break their schema (:func:`strict_violations`),
        and the answer the ``response_format`` it was asked for (:func:`format_violations`).
    """

    index: int
    content: str | None
    calls: list[dict[str, Any]]
    finish_reason: str
    output: GenerationOutput
    stop_sequence: str | None = None
    reasoning: str | None = None
    parts: list[str | dict[str, Any]] | None = None
    strict_violations: list[str] = field(default_factory=list)


async def generate_turn(srv: SwarmServer, ep: Episode, role: str | None, turn: Turn,
                        params: SamplingParams) -> list[Reply]:
    """Generate every choice, record the call, parse and remember each turn (a raw turn: its text as generated)."""
    outputs = await srv.generate(ep, turn.prompt_ids, params)
    replies = []
    for i, out in enumerate(outputs):
        stop = matched_stop(srv, turn, out.token_ids, out.text, out.finish_reason)
        if turn.raw:
            replies.append(Reply(i, out.text, [], out.finish_reason, out, stop,
                                 strict_violations=format_violations(out.text, params.response_format)))
            continue
        reasoning, answer = split_reasoning(out.text, started=turn.think_started)
        if turn.choice.parse:  # tool calls are read from the answer, never from the reasoning
            content, calls, parts = parse_tool_parts(_reply_text(turn, answer, out.finish_reason))
        else:
            content, calls, parts = answer, [], [answer] if answer else []
        replies.append(Reply(i, content, calls, answer_finish(out.finish_reason, calls), out, stop, reasoning, parts,
                             strict_violations(calls, turn.choice.strict)
                             + format_violations(content, params.response_format)))
    recorded = srv.inference.tracker.record(ep, role, turn.blocks, outputs, endpoint=turn.endpoint, forced=turn.forced_ids,
                                            meta={**(_structured(params) or {}), "max_tokens": params.max_tokens})
    for reply, timeline in zip(replies, recorded, strict=True):
        _annotate(timeline, reply.finish_reason, reply.strict_violations)
        if not turn.raw:
            _remember(srv, ep, timeline.blocks[-1], reply.content, reply.calls)
    return replies


@dataclass
class Opened:
    """The server serves the episode: the protocol's opening events may go out."""


@dataclass
class Piece:
    """Streamed content of choice ``index``: ``text`` is answer text safe to send (never part of a
    tool call), ``reasoning`` the thinking text; ``chunk`` is the engine's chunk they came from
    (token ids, logprobs)."""

    index: int
    text: str
    chunk: StreamChunk
    reasoning: str = ""


@dataclass
class CallDelta:
    """A tool call of choice ``index`` streamed as it is generated: its start (``name`` set, the
    call's ``call_id``) or a piece of its arguments (``args``). ``call`` counts the choice's calls."""

    index: int
    call: int
    call_id: str
    name: str | None = None
    args: str = ""


@dataclass
class Finished:
    """The end of choice ``index``: held-back text, the parsed calls, the reason."""

    index: int
    rest: str
    calls: list[dict[str, Any]]
    finish_reason: str
    stop_sequence: str | None = None
    completion_tokens: int = 0
    reasoning: str | None = None  # the whole reasoning (None: the choice did not reason)
    streamed: frozenset[str] = frozenset()  # ids of the calls already sent as CallDelta events
    strict_violations: list[str] = field(default_factory=list)  # see Reply


async def stream_turn(srv: SwarmServer, ep: Episode, role: str | None, turn: Turn,
                      params: SamplingParams) -> AsyncIterator[Opened | Piece | CallDelta | Finished]:
    """:class:`Opened` once the server serves the episode, the turn's pieces as the engine makes
    them (and :class:`CallDelta` events of tool calls streamed as generated), then one
    :class:`Finished` per choice.

    The call is recorded after the last :class:`Finished` (before the caller sends its closing
    event: a client that saw the end finds the call recorded), and also when the stream is cut
    (the tokens generated so far). A raw turn's pieces are the text as generated.
    """
    n = params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    vers: list[list[int]] = [[] for _ in range(n)]
    tops: list[list[dict[int, float]]] = [[] for _ in range(n)]
    texts: list[list[str]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    parsers = [ToolCallStreamParser() if turn.choice.parse else None for _ in range(n)]
    thinkers = [None if turn.raw else ReasoningStreamSplitter(started=turn.think_started) for _ in range(n)]
    reasonings: list[list[str]] = [[] for _ in range(n)]
    contents: list[list[str]] = [[] for _ in range(n)]
    calls_of: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n  # the answers' finish reasons, once sent
    violations: list[list[str]] = [[] for _ in range(n)]
    version = srv.policy_version
    completed = False
    recorded = False

    def record() -> None:
        nonlocal recorded
        if recorded:
            return
        recorded = True
        srv.end_call(ep)
        outputs = [
            GenerationOutput(token_ids=ids[i], logprobs=lps[i], text="", finish_reason=finish[i] or "abort",
                             top_logprobs=tops[i] or None, policy_version=version, token_versions=vers[i])
            for i in range(n)
        ]
        if ep.running and any(ids):
            made = srv.inference.tracker.record(ep, role, turn.blocks, outputs, endpoint=turn.endpoint,
                                      forced=turn.forced_ids,
                                      meta={"stream": True, "complete": completed, **(_structured(params) or {}),
                                            "max_tokens": params.max_tokens})
            for i in range(n):
                _annotate(made[i], reasons[i] or outputs[i].finish_reason, violations[i])
            if completed and not turn.raw:
                for i in range(n):
                    _remember(srv, ep, made[i].blocks[-1], "".join(contents[i]) or None, calls_of[i])

    srv.begin_call(ep)
    try:
        await srv.wait_serving(ep)
        yield Opened()
        for i in range(n):
            parser = parsers[i]
            if parser is not None and turn.forced_text:
                parser.feed(turn.forced_text)  # an open tool call: held until it closes
        async for i, ch in choice_streams(srv, turn.prompt_ids, params):
            ids[i].extend(ch.token_ids)
            lps[i].extend(ch.logprobs)
            vers[i].extend(ch.versions(version))
            texts[i].append(ch.text)
            if ch.top_logprobs:
                tops[i].extend(ch.top_logprobs)
            thinker = thinkers[i]
            thought, text = thinker.feed(ch.text) if thinker is not None else ("", ch.text)
            if thought:
                reasonings[i].append(thought)
            parser = parsers[i]
            if parser is not None:
                text = parser.feed(text)
            if ch.finish_reason:
                finish[i] = ch.finish_reason
            if text:
                contents[i].append(text)
            yield Piece(i, text, ch, thought)
            if parser is not None:
                for ev in _call_deltas(i, parser):
                    yield ev
        for i in range(n):
            reason = finish[i] or "stop"
            thinker = thinkers[i]
            thought, rest = thinker.finish() if thinker is not None else ("", "")
            if thought:
                reasonings[i].append(thought)
            parser = parsers[i]
            if parser is not None:
                rest = parser.feed(rest) if rest else ""
                if turn.internal_stop and finish[i] == "stop" and parser.in_call:
                    parser.feed(CLOSE)
                tail, calls = parser.finish()
                for ev in _call_deltas(i, parser):
                    yield ev
                rest += tail
                calls_of[i] = calls
                reason = answer_finish(reason, calls)
                violations[i] = strict_violations(calls, turn.choice.strict)
            reasons[i] = reason
            if rest:
                contents[i].append(rest)
            violations[i] += format_violations("".join(contents[i]), params.response_format)
            stop = matched_stop(srv, turn, ids[i], "".join(texts[i]), reason)
            reasoning = "".join(reasonings[i]) if thinker is not None and thinker.reasoned else None
            yield Finished(i, rest, calls_of[i], reason, stop, len(ids[i]), reasoning,
                           frozenset(parser.streamed) if parser is not None else frozenset(), violations[i])
        completed = True
        record()
    finally:
        record()
