"""Property: the fast merge equals the literal Algorithm 1 walk on random timelines."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmkit.timelines import AUTHORS, Block, merge

TEXTS = ["", "a", "b", "ab", "ba"]


class FlipKey:
    """Adversarial strategy: a block's key changes when absorption makes it 'llm'."""

    stable_keys = False  # the key reads the author, which absorption changes
    key_field = None

    def key(self, block):
        return block.text if block.author != "llm" else block.text[::-1]


@st.composite
def blocks(draw):
    author = draw(st.sampled_from(AUTHORS))
    text = draw(st.sampled_from(TEXTS))
    # tokens: usually the 'canonical' tokens of the text, sometimes a drifted variant
    if text == "":
        ids = [] if draw(st.booleans()) else [99]
    else:
        variant = draw(st.integers(0, 2))
        ids = [ord(c) for c in text] if variant == 0 else [ord(text[0]) + 100 * variant]
    lp = draw(st.sampled_from([-0.1, -0.7, -2.0]))
    return Block(author, text, ids, [lp] * len(ids) if author == "llm" else None)


@st.composite
def timeline_sets(draw):
    """Timelines that often extend (a truncation of) an earlier one, as calls of episodes do."""
    n = draw(st.integers(0, 14))
    out: list[list[Block]] = []
    for _ in range(n):
        if out and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(out))
            cut = draw(st.integers(0, len(base)))
            prefix = list(base[:cut])
            # sometimes re-author a copied block (history vs llm) to create absorption updates
            if prefix and draw(st.booleans()):
                k = draw(st.integers(0, len(prefix) - 1))
                b = prefix[k]
                new_author = draw(st.sampled_from(AUTHORS))
                text = b.text[::-1] if draw(st.booleans()) else b.text  # FlipKey matches across
                prefix[k] = Block(new_author, text, b.token_ids,
                                  b.logprobs if new_author == "llm" else None)
        else:
            prefix = []
        tail = draw(st.lists(blocks(), max_size=3))
        out.append(prefix + tail)
    return out


def _check(ts, strategy):
    fast = merge(ts, strategy)
    ref = merge(ts, strategy, method="reference")
    assert fast.absorbed_into == ref.absorbed_into
    assert fast.survivors == ref.survivors
    assert fast.timelines == ref.timelines


_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(timeline_sets())
def test_fast_equals_reference_text(ts):
    _check(ts, "text")


@_SETTINGS
@given(timeline_sets())
def test_fast_equals_reference_token(ts):
    _check(ts, "token")


@_SETTINGS
@given(timeline_sets())
def test_fast_equals_reference_key_changing_strategy(ts):
    _check(ts, FlipKey())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.randoms(use_true_random=False))
def test_fast_equals_reference_interleaved_episodes(n_episodes, turns, rnd):
    """Many concurrent episodes, their calls interleaved in collection order."""
    calls = []
    for e in range(n_episodes):
        prompt = [Block("user", "sys", [1]), Block("user", f"task{e % 3}", [2, e % 3])]
        for t in range(rnd.randint(1, turns)):
            gen = f"g{e % 2}{t}{rnd.randint(0, 1)}"
            ids = [3, t, rnd.randint(0, 1)]
            calls.append((e, t, prompt + [Block("template", "<a>", [9]), Block("llm", gen, ids, [-0.5] * 3)]))
            hist_ids = ids if rnd.random() < 0.7 else [4, t]
            prompt = prompt + [Block("template", "<a>", [9]), Block("history", gen, hist_ids),
                               Block("env", f"obs{t % 2}", [5, t % 2])]
    rnd.shuffle(calls)
    calls.sort(key=lambda c: (c[1], rnd.random()))  # turns of an episode stay in order
    ts = [c[2] for c in calls]
    for strategy in ("text", "token"):
        _check(ts, strategy)


@_SETTINGS
@given(timeline_sets())
def test_fast_equals_reference_small_leaves(ts):
    """The trie levels (buckets split by key per depth, timelines ending at a node) and not
    only the leaf walk: with leaves of at most 1 timeline every bucket is split."""
    import swarmkit.timelines.merging as tl

    old = tl._LEAF
    tl._LEAF = 1
    try:
        for strategy in ("text", "token", FlipKey()):
            _check(ts, strategy)
    finally:
        tl._LEAF = old


def test_updated_block_shares_generated_lists():
    """An absorbed llm block's token ids / logprobs are the generated block's lists (not copied)."""
    gen = Block("llm", "g", [5, 6], [-0.5, -0.25])
    t1 = [Block("user", "u", [1]), gen]
    t2 = [Block("user", "u", [1]), Block("history", "g", [5, 6]), Block("env", "o", [7])]
    for method in ("fast", "reference"):
        res = merge([t1, t2], "text", method=method)
        assert res.absorbed_into == [1, None]
        b = res.timelines[0][1]
        assert b.author == "llm" and b.text == "g" and b.loss_mask == [1, 1]
        assert b.token_ids is gen.token_ids and b.logprobs is gen.logprobs
        assert t2[1].author == "history"  # the input is not mutated
