"""Where the durable state is: the sample pool and its SQLite journal.

- :mod:`.records`: :class:`EpisodeRecord`, one accepted training episode as stored.
- :mod:`.journal`: :class:`SamplePool`, untrained episodes in memory and every
  episode in the journal (written before the episode's reporter is answered).
"""

from swarmkit.contract.batching import scalar_reward
from swarmkit.pool.journal import JournalReader, SamplePool
from swarmkit.pool.records import FILTERED, TRAINED, UNTRAINED, DuplicateEpisodeError, EpisodeRecord

__all__ = ["FILTERED", "TRAINED", "UNTRAINED", "DuplicateEpisodeError", "EpisodeRecord", "JournalReader", "SamplePool",
           "scalar_reward"]
