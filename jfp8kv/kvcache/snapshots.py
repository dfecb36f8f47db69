"""State snapshots keyed like pages: plain Python, no arrays, testable without a device.

A family whose cache has slot pools (``layout.SlotPool``: a Gated DeltaNet state, a
sliding-window ring and compressor state) keeps one fixed-size state per running
sequence, so a cached run of pages is reusable only together with the state after exactly
that run. A *snapshot* is a copy of a sequence's slot, every slot pool's rows as the pool
keeps them (float32 state stays float32), taken when the sequence's computed tokens end on
a page boundary. It lives in a snapshot slot of the same slot pools (slots ``first ..
first + count - 1``, after the sequences' and the scratch slot: ``layout.CachePlan``) and is
registered under the prefix cache's key of the page that ends there
(``prefix_cache.PrefixCache``): equal keys mean equal tokens before the boundary, hence an
equal state.

``SnapshotPool`` hands out snapshot slot ids and keeps the registered ones:

* **held**: acquired by a running sequence (a capture in flight, or its latest checkpoint),
  in no index, never evicted;
* **registered**: under one page key, least recently used first (``use`` on a restore
  refreshes one, ``demote`` makes one the next to go: a state its conversation has moved
  past); ``acquire`` evicts the oldest when no slot is free;
* **free**.

A snapshot never outlives its page: when the prefix cache forgets a page (evicted, reset) it
calls ``drop`` with the page's key. A page may outlive its snapshot; then a match that needs
a state stops at an earlier snapshot. Where a state is saved and restored, and when it is
valid, is the scheduler's (``engine.snapshot_policy``); the copies are the device's
(``cache_tree.Cache.copy_slots``).
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class SnapshotStats:
    """Counters since start-up: ``hits`` admissions restored from a snapshot, ``saves``
    snapshots registered, ``evictions`` registered snapshots dropped (for a free slot or
    with their page); ``cached`` registered now, ``held`` held by running sequences,
    ``slots`` the pool's size."""

    hits: int = 0
    saves: int = 0
    evictions: int = 0
    cached: int = 0
    held: int = 0
    slots: int = 0


class SnapshotPool:
    """Snapshot slots ``first .. first + count - 1`` (see the module docstring)."""

    def __init__(self, first: int, count: int):
        if first < 1 or count < 1:
            raise ValueError(f"snapshot slots need first >= 1 and count >= 1, got {first}, "
                             f"{count}")
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))  # low ids first
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._uses: dict[int, int] = {}  # restores of each registered slot
        self.hits = self.saves = self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_registered(self) -> int:
        return len(self._key_of)

    @property
    def num_held(self) -> int:
        return self.count - self.num_free - self.num_registered

    def owns(self, slot: int) -> bool:
        return self.first <= slot < self.first + self.count

    def acquire(self, pinned=()) -> int | None:
        """A slot to write: a free one, else the least recently used registered one that is
        not ``pinned`` (evicted), else None (every slot is held or pinned)."""
        if self._free:
            return self._free.pop()
        victim = next((s for s in self._lru if s not in pinned), None)
        if victim is None:
            return None
        self._unregister(victim)
        self.evictions += 1
        return victim

    def release(self, slot: int) -> None:
        """Give back a held slot (its contents are forgotten)."""
        if not self.owns(slot) or slot in self._key_of or slot in self._free:
            raise ValueError(f"slot {slot} is not a held snapshot slot")
        self._free.append(slot)

    def register(self, key: bytes, slot: int) -> bool:
        """Register held ``slot`` under ``key``; when ``key`` has a snapshot already (the same
        state, computed twice) ``slot`` is released instead. Returns whether it was kept."""
        if key in self._slot_of:
            self.release(slot)
            return False
        if not self.owns(slot) or slot in self._key_of or slot in self._free:
            raise ValueError(f"slot {slot} is not a held snapshot slot")
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._lru[slot] = None
        self._uses[slot] = 0
        self.saves += 1
        return True

    def lookup(self, key: bytes) -> int | None:
        """The registered slot under ``key``, or None (nothing is refreshed)."""
        return self._slot_of.get(key)

    def use(self, slot: int) -> None:
        """Count a restore from registered ``slot`` and make it the most recently used."""
        self._lru.move_to_end(slot)
        self._uses[slot] += 1
        self.hits += 1

    def key_of(self, slot: int) -> bytes | None:
        return self._key_of.get(slot)

    def uses(self, key: bytes) -> int:
        """Restores of the snapshot under ``key`` since it was registered (0: none, or no
        snapshot)."""
        slot = self._slot_of.get(key)
        return 0 if slot is None else self._uses[slot]

    def demote(self, key: bytes) -> None:
        """Make the snapshot under ``key`` (if any) the next one ``acquire`` evicts."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._lru.move_to_end(slot, last=False)

    def drop(self, key: bytes) -> None:
        """Forget the snapshot under ``key`` (its page was forgotten), if there is one."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._unregister(slot)
            self._free.append(slot)
            self.evictions += 1

    def reset(self) -> None:
        """Forget every registered snapshot (held slots stay with their holders)."""
        for slot in list(self._key_of):
            self._unregister(slot)
            self._free.append(slot)

    def _unregister(self, slot: int) -> None:
        key = self._key_of.pop(slot)
        del self._slot_of[key]
        del self._lru[slot]
        del self._uses[slot]

    def stats(self) -> SnapshotStats:
        return SnapshotStats(self.hits, self.saves, self.evictions, self.num_registered,
                             self.num_held, self.count)
