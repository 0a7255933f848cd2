"""The readable reference of a dynamic vocabulary (raw ids -> rows): plain Python dicts, the oracle.

The rules below are the contract of the raw-id tables to come (``TableConfig(dynamic=...)``);
tests/test_reference_vocab.py pins them down on hand-made cases. One map holds the ids resident in
one shard of ``capacity`` rows:

- Training steps are counted (``t`` = 1, 2, ...). At the start of a training step, with
  ``ttl_steps = k``, every resident id whose last use is more than ``k`` training steps ago is
  evicted (its row freed).
- A distinct id of a training step that is resident is used: its last use becomes ``t`` and its
  frequency (training steps that used it) grows by one.
- A distinct id that is not resident is counted (once per step). When it has been seen in
  ``admit_after`` training steps while not resident, it is admitted; before that it looks up a
  zero vector and its gradient is dropped.
- Ids admitted in one step are placed in ascending id order: each takes the lowest free row;
  when none is free, the resident id with the lowest score is evicted first (``"lru"``: its last
  use; ``"lfu"``: its frequency; ties: the smaller id), never an id used in the current step.
  A new row starts with last use ``t`` and frequency 1; an evicted id starts counting again.
- When a step admits more distinct ids than can be placed (free rows plus evictable ids), it is
  a ``ValueError`` naming the count and the capacity, and nothing changes (not even the counts).
- Evaluation (``training=False``) changes nothing: resident ids give their rows, others None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class ReferenceVocabulary:
    """One shard's id -> row map, by the rules of the module docstring."""

    capacity: int
    eviction: str = "lru"                 # "lru" or "lfu"
    admit_after: int = 1
    ttl_steps: int | None = None
    step: int = 0                          # training steps so far
    rows: dict[int, int] = field(default_factory=dict)       # resident id -> row
    last_use: dict[int, int] = field(default_factory=dict)   # resident id -> training step
    frequency: dict[int, int] = field(default_factory=dict)  # resident id -> steps that used it
    counts: dict[int, int] = field(default_factory=dict)     # non-resident id -> steps seen

    def __post_init__(self) -> None:
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if self.capacity < 1 or self.admit_after < 1:
            raise ValueError("capacity and admit_after must be >= 1")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            raise ValueError("ttl_steps must be None or >= 1")

    def lookup(self, ids: Iterable[int], training: bool) -> list[int | None]:
        """Each id's row after this step (None: not resident, a zero vector)."""
        ids = [int(i) for i in ids]
        if not training:
            return [self.rows.get(i) for i in ids]
        state = self._apply(sorted(set(ids)))  # raises before any change
        (self.step, self.rows, self.last_use, self.frequency, self.counts) = state
        return [self.rows.get(i) for i in ids]

    def _apply(self, distinct: list[int]) -> tuple:
        t = self.step + 1
        rows, last, freq = dict(self.rows), dict(self.last_use), dict(self.frequency)
        counts = dict(self.counts)
        if self.ttl_steps is not None:  # expiry at the start of the step
            for i in [i for i, u in last.items() if t - u > self.ttl_steps]:
                del rows[i], last[i], freq[i]
        admitted = []
        for i in distinct:
            if i in rows:
                last[i], freq[i] = t, freq[i] + 1
                continue
            counts[i] = counts.get(i, 0) + 1
            if counts[i] >= self.admit_after:
                admitted.append(i)
        free = sorted(set(range(self.capacity)) - set(rows.values()))
        current = set(distinct)

        def score(i: int) -> tuple[int, int]:
            return (last[i] if self.eviction == "lru" else freq[i], i)

        evictable = sorted((i for i in rows if i not in current), key=score)
        if len(admitted) > len(free) + len(evictable):
            raise ValueError(f"this step admits {len(admitted)} new ids but the shard holds "
                             f"{self.capacity} rows, {len(free)} free and {len(evictable)} "
                             f"evictable (the others are used by this step)")
        for i in admitted:
            if free:
                row = free.pop(0)
            else:
                victim = evictable.pop(0)
                row = rows.pop(victim)
                del last[victim], freq[victim]
            rows[i], last[i], freq[i] = row, t, 1
            del counts[i]
        return t, rows, last, freq, counts

    def resident(self) -> tuple[list[int], list[int]]:
        """(ids ascending, their rows): what ``emb.vocabulary(table)`` returns for this shard."""
        ids = sorted(self.rows)
        return ids, [self.rows[i] for i in ids]
