"""Automatic prefix caching at page granularity: plain Python, no arrays.

A full page whose K/V has been computed is registered under a key that fixes every number
stored in it: the key of page ``j`` is a hash of (key of page ``j-1``, the page's tokens), and
the key of the page before page 0 is a hash of the caller's ``namespace`` (model, cache dtype,
scale mode, static-scale version, rotation: whatever changes stored numbers). K/V at a position
depends on every earlier token, so equal keys mean equal contents. Keys are 128-bit BLAKE2b
digests; the chance that two different prefixes collide is about n^2 / 2^129 for n cached
pages, far below the chance of a hardware error.

A request maps the longest run of registered pages that its tokens start with into its page
table (taking a reference to each through the allocator) and computes only the rest. Pages
stay registered after their users finish; the allocator evicts them least-recently-freed
first when it runs out of clean pages and calls back here to forget them.

With ``snapshots`` (a ``snapshots.SnapshotPool``: families whose cache has slot pools) a
state saved at a page boundary is registered under the key of the page that ends there, and
forgotten with that page; ``restore_point`` finds the longest matched run of pages that ends
at one.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
from typing import Sequence

from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.snapshots import SnapshotPool

DIGEST_BYTES = 16


def _digest(parent: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(parent + payload, digest_size=DIGEST_BYTES).digest()


def namespace_root(namespace) -> bytes:
    """The chain's starting key for a namespace (any value with a deterministic ``repr``)."""
    return _digest(b"jfp8kv-prefix-cache", repr(namespace).encode())


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start-up. ``queried_tokens``: tokens of admitted requests looked up;
    ``hit_tokens``: of those, tokens whose K/V was reused; ``cached_pages``: pages registered
    now (in use or evictable); ``evictions``: registered pages handed out again."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    cached_pages: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, namespace="",
                 snapshots: SnapshotPool | None = None):
        if allocator.on_evict is not None:
            raise ValueError("the allocator already serves a prefix cache")
        self.allocator = allocator
        self.snapshots = snapshots
        self.page_size = page_size
        self.root = namespace_root(namespace)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._queried = 0
        self._hits = 0
        allocator.on_evict = self._forget

    # -- keys -------------------------------------------------------------------------
    def extend_keys(self, tokens: Sequence[int], keys: list[bytes], num_pages: int) -> list[bytes]:
        """Extend ``keys`` (the keys of the first ``len(keys)`` pages of ``tokens``, kept by the
        caller so each page is hashed once) to ``num_pages`` full pages; return it."""
        ps = self.page_size
        if num_pages * ps > len(tokens):
            raise ValueError(f"{num_pages} full pages need {num_pages * ps} tokens, "
                             f"got {len(tokens)}")
        for j in range(len(keys), num_pages):
            page = array.array("q", tokens[j * ps:(j + 1) * ps]).tobytes()
            keys.append(_digest(keys[j - 1] if j else self.root, page))
        return keys

    # -- lookup and registration --------------------------------------------------------
    def match(self, tokens: Sequence[int], keys: list[bytes]) -> list[int]:
        """Registered pages holding the longest page-aligned prefix of ``tokens`` that leaves
        at least the last token to compute (so the model yields logits to sample from).
        The caller takes the references (``share``) and reports the lookup (``record``)."""
        keys = self.extend_keys(tokens, keys, (len(tokens) - 1) // self.page_size)
        pages = []
        for k in keys:
            page = self._page_of.get(k)
            if page is None:
                break
            pages.append(page)
        return pages

    def restore_point(self, keys: list[bytes], num_pages: int) -> tuple[int, int]:
        """(j, slot): the longest j <= ``num_pages`` matched pages whose last one (key
        ``keys[j - 1]``) has a snapshot registered, and that snapshot's slot; (0, 0) when
        none has (or there is no snapshot pool)."""
        if self.snapshots is not None:
            for j in range(num_pages, 0, -1):
                slot = self.snapshots.lookup(keys[j - 1])
                if slot is not None:
                    return j, slot
        return 0, 0

    def is_registered(self, key: bytes) -> bool:
        """Whether a page is registered under ``key`` now."""
        return key in self._page_of

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup in the stats."""
        self._queried += queried_tokens
        self._hits += hit_tokens

    def register(self, tokens: Sequence[int], keys: list[bytes], pages: Sequence[int],
                 start: int, num_computed: int) -> int:
        """Register pages ``start..`` of a sequence that are full and computed (``num_computed``
        tokens have K/V). A page whose key is already registered (computed twice by requests
        admitted together) stays private. Returns the number of pages now considered."""
        end = min(num_computed // self.page_size, len(pages))
        keys = self.extend_keys(tokens, keys, end)
        for j in range(start, end):
            if keys[j] not in self._page_of and pages[j] not in self._key_of:
                self._page_of[keys[j]] = pages[j]
                self._key_of[pages[j]] = keys[j]
                self.allocator.mark_cached(pages[j])
        return max(start, end)

    def reset(self, namespace=None) -> None:
        """Forget every registered page (static scales changed, weights reloaded...); pages in
        use stay with their users and become clean when freed. A new ``namespace`` also
        changes every key computed from now on (keys callers kept are then stale)."""
        for page in list(self._key_of):
            self.allocator.uncache(page)
        self._page_of.clear()
        self._key_of.clear()
        if self.snapshots is not None:
            self.snapshots.reset()
        if namespace is not None:
            self.root = namespace_root(namespace)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        if self.snapshots is not None:
            self.snapshots.drop(key)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queried, self._hits, len(self._key_of),
                                self.allocator.num_evictions)
