"""When the scheduler saves and restores state snapshots (``kvcache.snapshots``): plain
Python, no arrays, testable without a device.

Prefix caching of a family whose cache has slot pools needs, beside a matched run of pages,
the state after exactly that run. A state is *saved* by a device copy of a sequence's slot
into a snapshot slot, always where its computed tokens end on a page boundary, and
registered under the key of the page that ends there. Saved:

* **at prefill chunk ends.** With snapshots on, the scheduler ends every chunk on a page
  boundary (``chunk_length``: at most page_size - 1 tokens of a step's budget go unused),
  so each chunk end of a long prompt (every ``max_num_batched_tokens``) is a cacheable
  point; a prompt's last chunk is cut at its last page boundary too, and the rest (fewer
  than page_size tokens) runs in the next step: the state there is the end of the request
  whenever the answer crosses no page boundary (short answers, V4's 128-token pages). The
  copy runs in the prefill dispatch, after the forward.
* **where a shared prefix diverges.** An admission whose cached pages run past the last
  snapshot among them (pages a request computed, without a state at their end: two sessions
  that share a system prompt) ends its first chunk where the run ends, so the state there
  is saved and the next request with that prefix restores it.
* **at the end of every request.** While it decodes, each time a sequence's computed tokens
  reach a page boundary its state is copied, inside the decode dispatch, into a slot it
  holds (``plan_decode``). Its latest checkpoint is registered when it releases its pages
  (finish, abort, preemption): the prompt and output up to the last page boundary, which the
  next turn of a conversation (that prompt + output + new text) matches. Only one per
  request is kept: a snapshot at every page (vLLM's "align" cost) would take a slot per
  page_size tokens.

A decode capture is *unconfirmed* until the host has read the tokens up to its boundary:
with overlap scheduling a dispatch runs past a stop the host has not seen yet, and a capture
past the stop holds tokens the sequence never had. So it goes to a slot of its own, replaces
the sequence's checkpoint once ``len(seq.tokens)`` passes its boundary (``confirm``), and is
dropped if the sequence ends short of it. A sequence has at most one unconfirmed capture (a
crossing meanwhile is skipped; none is when page_size >= 2 x decode_steps, the defaults).

*Restored*: an admission matches the longest run of cached pages its tokens start with, then
the longest part of it that ends at a snapshot (``PrefixCache.restore_point``); it shares
those pages, its first chunk's dispatch copies the snapshot into its slot before the forward,
and only the rest is prefilled. A snapshot restored in a step is pinned for that step (a
capture scheduled in the same step cannot evict it before the copy has read it).

*Evicted* least recently used (``SnapshotPool``), with one hint: when a request ends and
registers its latest state, the states it moved past (the snapshot it restored, unless other
requests restored it too, and its own earlier saves) become the next to go, before other
conversations' last states. Agents take turns: plain LRU would evict the conversation whose
turn comes next, and keep the one that just moved on.
"""

from __future__ import annotations

import dataclasses

from jfp8kv.kvcache.prefix_cache import PrefixCache


@dataclasses.dataclass
class SeqSnapshots:
    """One sequence's snapshot bookkeeping (``Sequence.snap``): ``restore`` the snapshot slot
    its next chunk copies in first (0: none); ``cut_at`` a token count its prefill should end
    a chunk at (0: none); ``saves`` prefill captures (boundary, slot) not registered yet;
    ``ckpt`` its latest confirmed decode capture and ``staging`` an unconfirmed one
    ((boundary, slot) or None); ``keys`` the snapshots it restored or registered, in
    order."""

    restore: int = 0
    cut_at: int = 0
    saves: list = dataclasses.field(default_factory=list)
    keys: list = dataclasses.field(default_factory=list)
    ckpt: tuple[int, int] | None = None
    staging: tuple[int, int] | None = None


class SnapshotPolicy:
    """The module docstring's policy over ``cache``'s snapshot pool."""

    def __init__(self, cache: PrefixCache, page_size: int):
        if cache.snapshots is None:
            raise ValueError("the prefix cache has no snapshot pool")
        self.cache, self.pool, self.ps = cache, cache.snapshots, page_size
        self._pinned: set[int] = set()

    @staticmethod
    def of(seq) -> SeqSnapshots:
        if seq.snap is None:
            seq.snap = SeqSnapshots()
        return seq.snap

    def begin_step(self) -> None:
        self._pinned.clear()

    # -- restore -------------------------------------------------------------------------
    def match(self, seq, hit: list[int]) -> tuple[list[int], int]:
        """(pages, snapshot slot): the part of the matched ``hit`` pages that ends at a
        snapshot, and that snapshot's slot ([], 0: start from scratch). Changes nothing."""
        j, slot = self.cache.restore_point(seq.page_keys, len(hit))
        return hit[:j], slot

    def admitted(self, seq, slot: int, run: int) -> None:
        """``seq`` starts after the pages ``match`` kept, restoring ``slot`` (0: none);
        ``run``: the matched run of pages (its end, past the restore point, is a
        divergence point: a chunk ends there)."""
        st = self.of(seq)
        st.restore = slot
        start = seq.num_cached
        st.cut_at = run * self.ps if run * self.ps > start else 0
        if slot:
            self.pool.use(slot)
            self._pinned.add(slot)
            st.keys.append(self.pool.key_of(slot))

    # -- saves -------------------------------------------------------------------------
    def chunk_length(self, seq, n: int) -> int:
        """The length of ``seq``'s next chunk of at most ``n`` tokens: up to its divergence
        point when it lies inside, else up to the last page boundary it crosses (the whole
        chunk when it crosses none)."""
        start, end = seq.num_cached, seq.num_cached + n
        cut = self.of(seq).cut_at
        if start < cut < end:
            return cut - start
        if end % self.ps and end - end % self.ps > start:
            return end - end % self.ps - start
        return n

    def on_chunk(self, chunk) -> None:
        """Attach the restore a chunk's dispatch copies in first, and the capture after it
        when the chunk ends on a page boundary."""
        st = self.of(chunk.seq)
        chunk.restore, st.restore = st.restore, 0
        end = chunk.start + chunk.length
        if end == st.cut_at:
            st.cut_at = 0
        if end % self.ps == 0:
            slot = self.pool.acquire(self._pinned)
            if slot is not None:
                chunk.capture = slot
                st.saves.append((end, slot))
                if st.ckpt is not None:  # older than this save: no longer the latest state
                    self.pool.release(st.ckpt[1])
                    st.ckpt = None

    def plan_decode(self, rows) -> None:
        """Give each decode row whose scan crosses a page boundary a capture (step, slot):
        the state after the step whose computed tokens reach the boundary."""
        for r in rows:
            st = self.of(r.seq)
            step = self.ps - 1 - r.seq.num_cached % self.ps
            if st.staging is not None or step >= r.steps:
                continue
            slot = self.pool.acquire(self._pinned)
            if slot is None:
                continue
            r.capture = (step, slot)
            st.staging = (r.seq.num_cached + step + 1, slot)

    # -- validity and registration --------------------------------------------------------
    def confirm(self, seq) -> None:
        """An unconfirmed capture whose tokens the host knows replaces the checkpoint: those
        before its boundary and one more (a sequence ending right at the boundary registers
        the pages before it only: its last token's K/V is not computed)."""
        st = self.of(seq)
        if st.staging is not None and st.staging[0] < len(seq.tokens):
            if st.ckpt is not None:
                self.pool.release(st.ckpt[1])
            st.ckpt, st.staging = st.staging, None

    def register(self, seq) -> None:
        """After ``seq``'s pages were offered to the prefix cache: register its prefill
        captures whose page is registered (the rest wait)."""
        st = self.of(seq)
        self.confirm(seq)
        wait = []
        for at, slot in st.saves:
            if at // self.ps <= seq.num_registered:
                self._save(seq, at, slot)
            else:
                wait.append((at, slot))
        st.saves = wait

    def release(self, seq) -> None:
        """``seq`` gives its pages back (after offering them): register what is valid (its
        prefill captures, its latest checkpoint), give back every other slot it holds."""
        self.register(seq)
        st = self.of(seq)
        for at, slot in st.saves:
            self.pool.release(slot)
        if st.ckpt is not None:
            at, slot = st.ckpt
            if at // self.ps <= seq.num_registered:
                self._save(seq, at, slot)
            else:
                self.pool.release(slot)
        if st.staging is not None:
            self.pool.release(st.staging[1])
        for key in st.keys[:-1]:  # moved past: the next to go (the module docstring)
            if key != st.keys[-1] and (key not in st.keys[:1] or self.pool.uses(key) < 2):
                self.pool.demote(key)
        seq.snap = None

    def _save(self, seq, at: int, slot: int) -> None:
        key = seq.page_keys[at // self.ps - 1]
        if self.cache.is_registered(key):
            if self.pool.register(key, slot):
                self.of(seq).keys.append(key)
        else:
            self.pool.release(slot)
