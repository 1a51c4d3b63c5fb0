"""Merging the timelines of an episode into training samples (Algorithm 1).

Later calls of an episode reuse earlier calls as prompt, so timelines share
long block prefixes; :func:`merge_timelines` absorbs each timeline into a
longer one that contains it, so every generated token is trained once, in the
longest context. Every function answers in the form it was given
(:class:`~swarmkit.timelines.block.Timeline` or ``list[Block]``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from operator import attrgetter, itemgetter
from typing import Any

from swarmkit.contract import check_implementation
from swarmkit.contract.match import MatchStrategy
from swarmkit.timelines.block import Block, Timeline, TimelineLike

__all__ = ["MergeResult", "drifted_blocks", "merge", "merge_timelines", "merge_timelines_reference", "resolve_match"]



def _blocks_of(t: TimelineLike) -> list[Block]:
    if isinstance(t, Timeline):
        return t.blocks
    blocks = t if type(t) is list else list(t)
    if blocks and not isinstance(blocks[0], Block):  # a cheap check; the first block only
        raise TypeError(f"a timeline must be a Timeline or a list of Block, found {type(blocks[0]).__name__}")
    return blocks


def _rewrap(original: TimelineLike, blocks: list[Block]) -> TimelineLike:
    if isinstance(original, Timeline):
        return Timeline(blocks, original.role, dict(original.meta))
    return blocks


def resolve_match(match: str | MatchStrategy) -> MatchStrategy:
    """A match strategy from its registered name (plugin kind ``match``) or the object itself.

    :raises TypeError: the object misses the :class:`~swarmkit.contract.match.MatchStrategy` contract.
    """
    if isinstance(match, str):
        from swarmkit.plugins import load_component

        strategy: MatchStrategy = load_component("match", match)  # checked against the contract when loaded
        return strategy
    check_implementation("match", match)
    return match


@dataclass
class MergeResult:
    """Outcome of a merge.

    :param timelines: the surviving timelines in original order (updated copies).
    :param survivors: their indices in the input.
    :param absorbed_into: per input timeline, the index of the timeline that
        absorbed it, or ``None`` for a survivor.
    """

    timelines: list[TimelineLike]
    survivors: list[int]
    absorbed_into: list[int | None] = field(default_factory=list)


def _absorb_block(target: Block, source: Block) -> Block:
    """``target`` after absorbing the generated block ``source`` (a new block).

    Built without re-validation: ``source`` is a valid block, and the result has
    its lengths, author ``llm``, ``source``'s loss mask (ones, except tokens the
    server forced into the turn) and its per-token policy versions. The
    ``token_ids``, ``logprobs``, ``loss_mask`` and ``versions`` lists are
    ``source``'s own: shared, as untouched blocks are (copying ~100 scattered int
    objects per block was most of the merge's time); the merge never mutates a list.
    """
    new = object.__new__(Block)
    new.author = "llm"
    new.text = target.text
    new.token_ids = source.token_ids
    new.logprobs = source.logprobs
    new.loss_mask = source.loss_mask
    new.versions = source.versions
    return new


def merge(timelines: Sequence[TimelineLike], match: str | MatchStrategy = "text", *,
          method: str = "fast") -> MergeResult:
    """Merge timelines (Algorithm 1) and report who absorbed whom.

    ``method="fast"`` (near-linear, hash-consed prefix trie) and
    ``method="reference"`` (the literal O(n^2 * blocks) walk) give identical
    results. Inputs are not mutated: surviving timelines are new containers;
    a block updated by absorption is a new :class:`Block` (the absorbed
    block's text is kept, token ids / logprobs are copied from the generated
    block and its loss mask); untouched blocks are shared with the input.
    """
    strategy = resolve_match(match)
    if method == "fast":
        return _merge_fast(timelines, strategy)
    if method == "reference":
        return _merge_reference(timelines, strategy)
    raise ValueError(f"unknown merge method {method!r}; expected 'fast' or 'reference'")


def drifted_blocks(timelines: Sequence[TimelineLike], result: MergeResult) -> int:
    """How many generated blocks were absorbed over a block of equal key but other tokens.

    Under the ``text`` match, a later call whose history re-tokenized an earlier
    generation (same text, other token ids: a turn the server could not replay)
    still absorbs it; the sample then trains on the generated tokens in a context
    that held other ones. This counts those blocks: what the ``text`` match traded
    away (0 under ``token``, which never absorbs them).
    """
    lists = [_blocks_of(t) for t in timelines]
    drifted = 0
    for j, s in enumerate(result.absorbed_into):
        if s is None:
            continue
        target = lists[s]
        for k, bj in enumerate(lists[j]):
            bs = target[k]
            if bj is not bs and bj.author == "llm" and bs.author != "llm" and bs.token_ids != bj.token_ids:
                drifted += 1
    return drifted


def merge_timelines(timelines: Sequence[TimelineLike], match: str | MatchStrategy = "text") -> list[TimelineLike]:
    """The surviving timelines, in their original order, with absorbed blocks updated.

    :param timelines: T_1..T_n in order of collection; each a :class:`Timeline`
        or a list of :class:`Block` (answers come back in the same form).
    :param match: a registered match-strategy name (``"text"``, ``"token"``, ...)
        or a :class:`~swarmkit.contract.MatchStrategy` object.

    Semantics: walk i from n down to 2, skipping absorbed timelines; for each
    j from i-1 down to 1, not absorbed: T_j is absorbed into T_i when
    ``len(T_i) >= len(T_j)`` and ``key(T_i[k]) == key(T_j[k])`` for every k of
    T_j; then every block k authored ``llm`` in T_j but not in T_i becomes
    ``llm`` in T_i with T_j's token ids, logprobs and loss mask.
    Updates happen in place during the walk (they may change T_i's later keys
    for a strategy whose key depends on author or tokens); the result is
    identical to :func:`merge_timelines_reference`. Runs in about
    O(total blocks + total key cost).
    """
    return _merge_fast(timelines, resolve_match(match)).timelines


def merge_timelines_reference(timelines: Sequence[TimelineLike],
                              match: str | MatchStrategy = "text") -> list[TimelineLike]:
    """The literal Algorithm 1 walk (test oracle, O(n^2 * blocks)); same contract as :func:`merge_timelines`."""
    return _merge_reference(timelines, resolve_match(match)).timelines


# --------------------------------------------------------------------------- reference
def _merge_reference(timelines: Sequence[TimelineLike], strategy: MatchStrategy) -> MergeResult:
    key = strategy.key
    cur = [list(_blocks_of(t)) for t in timelines]
    n = len(cur)
    absorbed_into: list[int | None] = [None] * n
    for i in range(n - 1, 0, -1):
        if absorbed_into[i] is not None:
            continue
        ti = cur[i]
        for j in range(i - 1, -1, -1):
            if absorbed_into[j] is not None:
                continue
            tj = cur[j]
            if len(ti) < len(tj):
                continue
            if all(key(ti[k]) == key(tj[k]) for k in range(len(tj))):
                for k, bj in enumerate(tj):
                    if bj.author == "llm" and ti[k].author != "llm":
                        ti[k] = _absorb_block(ti[k], bj)
                absorbed_into[j] = i
    survivors = [i for i in range(n) if absorbed_into[i] is None]
    return MergeResult([_rewrap(timelines[i], cur[i]) for i in survivors], survivors, absorbed_into)


# --------------------------------------------------------------------------- fast
def _llm_positions(blocks: list[Block]) -> list[int]:
    authors = list(map(_AUTHOR_OF, blocks))
    out = []
    k = -1
    try:
        while True:
            k = authors.index("llm", k + 1)
            out.append(k)
    except ValueError:
        return out


_AUTHOR_OF = attrgetter("author")


def _merge_dynamic(timelines: Sequence[TimelineLike], strategy: MatchStrategy) -> MergeResult:
    """Buckets of timelines by their whole key sequence.

    Keys are interned to ints; ``bucket[ids]`` lists (ascending) the timelines
    whose key sequence is ``ids`` (a tuple: exact dict equality, no hash
    collisions can merge anything). For an
    outer timeline T_i, the timelines mergeable into it are exactly the
    members < i of the buckets of T_i's own key prefixes (one per length that
    occurs); they are absorbed in descending order. If an update changes one of
    T_i's keys, the prefixes from the changed position on are looked up again
    and the remaining candidates re-derived (only candidates below the walk
    position count, as in the literal walk). Cost: one ``key()`` per block plus
    O(#distinct lengths) prefix lookups per surviving timeline.
    """
    key = strategy.key
    cur = [list(_blocks_of(t)) for t in timelines]
    n = len(cur)
    # intern keys to small ints (C-level: defaultdict + count), so prefix tuples hash cheaply
    kid = defaultdict(count().__next__).__getitem__
    keyseqs = [tuple(map(kid, map(key, blocks))) for blocks in cur]
    buckets: dict[tuple[int, ...], list[int]] = {}
    for t, ks in enumerate(keyseqs):
        bucket = buckets.get(ks)
        if bucket is None:
            buckets[ks] = [t]
        else:
            bucket.append(t)
    lengths = sorted({len(ks) for ks in keyseqs})

    absorbed_into: list[int | None] = [None] * n
    for i in range(n - 1, 0, -1):
        if absorbed_into[i] is not None:
            continue
        ks = keyseqs[i]
        m = len(ks)
        touched: list[list[int]] = []
        cands: list[int] = []
        for L in lengths:
            if L > m:
                break
            lst = buckets.get(ks[:L])
            if not lst:
                continue
            while lst and (lst[-1] >= i or absorbed_into[lst[-1]] is not None):
                lst.pop()
            if lst:
                touched.append(lst)
                cands.extend(x for x in lst if absorbed_into[x] is None)
        if not cands:
            continue
        cands.sort(reverse=True)
        ti = cur[i]
        cur_keys: list[int] | None = None
        c = 0
        while c < len(cands):
            j = cands[c]
            c += 1
            if absorbed_into[j] is not None:
                continue
            absorbed_into[j] = i
            tj = cur[j]
            changed_at = -1
            for k in _llm_positions(tj):
                old = ti[k]
                if old.author != "llm":
                    new = _absorb_block(old, tj[k])
                    ti[k] = new
                    if changed_at < 0 and key(new) != key(old):
                        changed_at = k
            if changed_at < 0:
                continue
            # T_i's keys changed from position changed_at on: look its longer prefixes up
            # again; candidates must lie below j, as the literal walk goes on from j.
            cur_keys = [kid(key(b)) for b in ti]
            rest = [x for x in cands[c:] if len(cur[x]) <= changed_at and absorbed_into[x] is None]
            for L in lengths:
                if L <= changed_at:
                    continue
                if L > m:
                    break
                lst = buckets.get(tuple(cur_keys[:L]))
                if lst:
                    touched.append(lst)
                    rest.extend(x for x in lst if x < j and absorbed_into[x] is None)
            cands, c = sorted(set(rest), reverse=True), 0
        if cur_keys is not None:
            for lst in touched:
                lst[:] = [x for x in lst if absorbed_into[x] is None and x < i]
        else:
            for lst in touched:
                lst.clear()  # every member < i was absorbed, members >= i are never needed again
    survivors = [t for t in range(n) if absorbed_into[t] is None]
    return MergeResult([_rewrap(timelines[t], cur[t]) for t in survivors], survivors, absorbed_into)


#: leaf buckets up to this size are resolved by a (identity-accelerated) pairwise walk
_LEAF = 32
_MISS = object()
_GET_TEXT = attrgetter("text")


def _merge_fast(timelines: Sequence[TimelineLike], strategy: MatchStrategy) -> MergeResult:
    """Algorithm 1 without the walk, for keys that absorption does not change.

    With fixed keys, T_j is absorbed into the *largest* i > j whose key
    sequence extends T_j's (the walk meets that i first; any larger extender
    of that i would extend T_j too), and every absorber is a survivor. So:

    1. Bucket the timelines by their keys at depth 0, 1, ... (a trie that stops
       splitting once a bucket holds at most ``_LEAF`` timelines). A timeline
       that ends at a trie node is a prefix of every member of the node's
       subtree: its absorber is the subtree's largest index. Inside a leaf,
       the walk runs over the bucket's members only, and a pair is compared
       first by list equality (identical block objects, C speed; equal blocks
       have equal keys) on all but the last block, then by the last block's
       key; a failed fast check falls back to comparing keys block by block.
    2. Apply the updates survivor by survivor, absorbed timelines in
       descending order, as the walk does. When the fast check showed that
       T_j equals T_i's blocks except the last, only that block can change.

    Keys are computed once per block object (cached by identity; for a
    strategy that declares ``key_field = "text"``, the attribute itself; for
    ``"token_ids"`` the id lists are compared directly). For a strategy that
    does not declare ``stable_keys`` (the built-in ``text`` and ``token`` do:
    an update keeps the text and takes equal tokens), each update checks that
    the key is unchanged; if one changes, the merge is redone by
    :func:`_merge_dynamic`, which follows the walk's in-place semantics.
    """
    key = strategy.key
    field_name = strategy.key_field
    lists = [_blocks_of(t) for t in timelines]
    n = len(lists)
    if field_name == "text":
        kf = _GET_TEXT
    else:
        cache: dict[int, Any] = {}
        cget = cache.get

        def kf(b: Block) -> Any:
            v = cget(id(b), _MISS)
            if v is _MISS:
                v = cache[id(b)] = key(b)
            return v

    text = field_name == "text"
    tok = field_name == "token_ids"  # token keys are equal exactly when the id lists are (no tuples built)

    def same(x: Block, y: Block) -> bool:
        return kf(x) == kf(y)

    absorbed: list[int | None] = [None] * n
    only_last = bytearray(n)  # 1: T_j equals its absorber's blocks except (maybe) the last

    def leaf(bucket: list[int], depth: int) -> None:
        for a in range(len(bucket) - 1, 0, -1):
            i = bucket[a]
            if absorbed[i] is not None:
                continue
            ib = lists[i]
            li = len(ib)
            for b in range(a - 1, -1, -1):
                j = bucket[b]
                if absorbed[j] is not None:
                    continue
                jb = lists[j]
                lj = len(jb)
                if lj > li:
                    continue
                if lj <= depth:  # ended above: a prefix of every bucket member
                    absorbed[j] = i
                    continue
                k = lj - 1
                if (k == 0 or ib[k - 1] is jb[k - 1]) and ib[:k] == jb[:k]:
                    x, y = ib[k], jb[k]
                    if x is y or (x.text == y.text if text else
                                  x.token_ids == y.token_ids if tok else same(x, y)):
                        absorbed[j] = i
                        only_last[j] = 1
                    continue
                for k in range(depth, lj):
                    x, y = ib[k], jb[k]
                    if x is not y and kf(x) != kf(y):
                        break
                else:
                    absorbed[j] = i

    if text:
        def depth_keys(objs: list[Block]) -> list[Any]:
            return list(map(_GET_TEXT, objs))  # C speed; str hashes are cached
    else:
        def depth_keys(objs: list[Block]) -> list[Any]:
            # timelines of one episode share block objects: compute (and hash) each distinct
            # object's key once, and hand out small ints that are equal exactly when keys are
            ids = list(map(id, objs))
            first = dict(zip(ids, objs, strict=True))
            codes: dict[Any, int] = {}
            code_of = {i: codes.setdefault(kf(o), len(codes)) for i, o in first.items()}
            return list(map(code_of.__getitem__, ids))

    stack = [(list(range(n)), 0)]
    while stack:
        idxs, depth = stack.pop()
        if len(idxs) <= _LEAF:
            leaf(idxs, depth)
            continue
        top = idxs[-1]  # ascending: the subtree's largest index, never absorbed
        bls = [lists[t] for t in idxs]
        if min(map(len, bls)) <= depth:  # these end here: prefixes of the whole subtree
            keep = []
            for t, bl in zip(idxs, bls, strict=True):
                if len(bl) > depth:
                    keep.append(t)
                elif t != top:
                    absorbed[t] = top
            idxs = keep
            bls = [lists[t] for t in idxs]
            if not idxs:
                continue
        keys = depth_keys(list(map(itemgetter(depth), bls)))
        if keys.count(keys[0]) == len(keys):  # one key at this depth: descend (C speed)
            stack.append((idxs, depth + 1))
            continue
        groups: dict[Any, list[int]] = {}
        for t, k in zip(idxs, keys, strict=True):
            g = groups.get(k)
            if g is None:
                groups[k] = [t]
            else:
                g.append(t)
        stack.extend((g, depth + 1) for g in groups.values())

    # updates, per survivor in descending order of the absorbed timelines (as the walk)
    cur: dict[int, list[Block]] = {}
    check = not strategy.stable_keys
    for j in range(n - 1, -1, -1):
        s = absorbed[j]
        if s is None:
            continue
        jb = lists[j]
        if only_last[j]:
            k = len(jb) - 1
            bj = jb[k]
            if bj.author != "llm":
                continue
            cs = cur.get(s)
            old = lists[s][k] if cs is None else cs[k]
            if old.author == "llm":
                continue
            if cs is None:
                cs = cur[s] = list(lists[s])
            new = cs[k] = _absorb_block(old, bj)
            if check and key(new) != kf(old):
                return _merge_dynamic(timelines, strategy)
            continue
        sb = lists[s]
        cs = cur.get(s)
        for k, bj in enumerate(jb):
            if bj is sb[k] or bj.author != "llm":
                continue
            old = sb[k] if cs is None else cs[k]
            if old.author == "llm":
                continue
            if cs is None:
                cs = cur[s] = list(sb)
            new = cs[k] = _absorb_block(old, bj)
            if check and key(new) != key(old):
                return _merge_dynamic(timelines, strategy)
    survivors = [t for t in range(n) if absorbed[t] is None]
    out = []
    for t in survivors:
        cs = cur.get(t)
        out.append(_rewrap(timelines[t], list(lists[t]) if cs is None else cs))
    return MergeResult(out, survivors, absorbed)
