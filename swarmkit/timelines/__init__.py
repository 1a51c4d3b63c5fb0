"""How a call becomes a sample: blocks and timelines, rendering, tracking, matching, merging.

- :mod:`.block`: :class:`Block` and :class:`Timeline`, the recorded data.
- :mod:`.render`: chat messages → prompt blocks (the tokenizer's chat template).
- :mod:`.toolcalls`: tool calls in generated text → OpenAI ``tool_calls``.
- :mod:`.track`: one model call → one timeline per choice, on its episode.
- :mod:`.merging`: timelines that are prefixes of later ones are absorbed (Algorithm 1).

Pure Python: nothing here imports torch.
"""

from swarmkit.timelines.block import AUTHORS, Block, Timeline, TimelineLike
from swarmkit.timelines.merging import (
    MergeResult,
    merge,
    merge_timelines,
    merge_timelines_reference,
    resolve_match,
)

__all__ = [
    "AUTHORS",
    "Block",
    "MergeResult",
    "Timeline",
    "TimelineLike",
    "merge",
    "merge_timelines",
    "merge_timelines_reference",
    "resolve_match",
]
