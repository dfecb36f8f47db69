"""What a model family keeps between steps, declared once: its cache layout, the one planner
that sizes it, and the one cache pytree that holds it.

A family's cache is made of two kinds of pool:

* **paged pools** (``PagedPool``): rows reached through the engine's one page table, so they
  grow with the tokens cached: dense K/V pages with their scales, the MLA latent rows,
  DeepSeek-V4's compressed and indexer entries. Each says its bytes per page (and any bytes
  allocated once whatever the page count: static scales).
* **slot pools** (``SlotPool``): a fixed-size state per running sequence, reached through
  the sequence's state slot: Gated DeltaNet's conv and recurrent state, V4's window ring and
  compressor state. Each says its bytes per slot.

A ``CacheLayout`` lists a family's pools, the page multiple it needs (V4: a page holds whole
compressed windows) and what the family supports (``Supports``: scale modes, K transforms,
start-up calibration, tensor parallelism, prefix caching), with one wording for a refusal.

Tensor parallelism: a layout is declared for ``CacheRequest.devices`` devices, and each pool
says how it lies on them (``partition``: a ``PartitionSpec`` pytree over the mesh axis;
``split``: whether the devices hold shares or each a whole copy). Bytes per page and per
slot are one device's, so every budget and figure of the planner is per device;
``Cache.init`` / ``abstract_cache`` take the resulting shardings (``models/sharding.py``
builds them) and allocate each device's share in place.
The families' own modules in this package declare their layouts (the dense one in
``cache``, the others beside their pools); ``jfp8kv.models.families`` maps a model config to
its family. Nothing here knows a family.

``plan_cache`` turns (layout, budget, page size, max_num_seqs, max_model_len, snapshot
bytes) into a ``CachePlan``: slots first (slot 0 the padding sink, one per running sequence,
one scratch slot for ``LLM.nll``, then the state snapshots of prefix caching:
``snapshots.py``), then the static bytes, then as many pages as the rest holds, plus page 0
(the padding sink; not counted against the budget). ``cache_tree.Cache`` is the pytree every
family's forward takes, made from a plan.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, ClassVar

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfp8kv.kvcache import fp8

# Slots a slot-pool family allocates beyond max_num_seqs: the padding sink (slot 0) and the
# scratch slot ``LLM.nll`` runs in.
EXTRA_SLOTS = 2


class PagedPool:
    """A pool of rows reached through the page table (subclasses: frozen dataclasses, so a
    layout is hashable and equal across builds: it is part of the jitted steps' static
    cache). ``name`` keys the pool in ``Cache.pools``."""

    name: ClassVar[str]
    kind: ClassVar[str] = "paged"

    def bytes_per_page(self, page_size: int) -> int:
        """Bytes every array of the pool allocates per page of ``page_size`` tokens, on one
        device (its share where the pool is ``split``: budgets are per device)."""
        raise NotImplementedError

    def fixed_bytes(self) -> int:
        """Bytes allocated once, whatever the page count (static scales)."""
        return 0

    def init(self, num_pages: int, page_size: int, **args) -> Any:
        """The pool's zeroed pytree of ``num_pages`` pages (page 0 included); its bytes are
        ``num_pages * bytes_per_page(page_size) + fixed_bytes()`` exactly."""
        raise NotImplementedError

    def info(self) -> dict:
        """What ``cache_info`` lists of the pool besides its bytes (dtypes, layers)."""
        return {}

    def placeholder_args(self) -> dict:
        """``init`` arguments that stand in for values known later (static scales), so
        that the pool's shapes can be traced before they are (``abstract_cache``)."""
        return {}

    @property
    def split(self) -> bool:
        """Whether the pool is split over the devices of a tensor-parallel mesh (each holds
        its share, and ``bytes_per_page`` counts that share); False: every device holds
        all of it (replicated), and the bytes are one copy's."""
        return False

    def partition(self, axis: str) -> Any:
        """Where the pool's arrays live on a 1-D mesh whose axis is ``axis``: a pytree
        prefix of ``PartitionSpec`` matching ``init``'s result. Default: replicated."""
        return P()


class SlotPool:
    """A fixed-size state per sequence slot (frozen dataclass subclasses, as ``PagedPool``).
    Every array of the pool's pytree has the slot axis first, so a slot is copied whole by
    ``Cache.copy_slots`` (a state snapshot) without the engine knowing the pool."""

    name: ClassVar[str]
    kind: ClassVar[str] = "slot"

    def bytes_per_slot(self) -> int:
        raise NotImplementedError

    def init(self, num_slots: int) -> Any:
        """The pool's zeroed pytree of ``num_slots`` slots (slot 0 included); its bytes are
        ``num_slots * bytes_per_slot()`` exactly (per device where the pool is ``split``)."""
        raise NotImplementedError

    def info(self) -> dict:
        return {}

    split = PagedPool.split
    partition = PagedPool.partition


@dataclasses.dataclass(frozen=True)
class Supports:
    """What a family's cache can do. Settings it cannot take are refused (``refuse``) or,
    for prefix caching (on by default, so an explicit request cannot be told from the
    default), turned off with a warning by the builder."""

    scale_modes: tuple[str, ...]  # fp8 scale modes the family stores
    default_scale_mode: str | None  # the mode when the user names none (fp8 storage)
    fp8_dtypes: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
    rotations: tuple[str, ...] = ("none",)  # K transforms (``k_transform``)
    static_calibration: bool = False  # static scales / K shift measured at start-up
    tensor_parallel: bool = False
    prefix_caching: bool = False
    why_no_prefix_caching: str = ""  # said in the warning when prefix caching is off


def refuse(family: str, setting: str, value, works: str) -> ValueError:
    """The one wording of a cache setting a family does not support."""
    return ValueError(f"{setting}={value!r} is not supported for {family}'s cache; {works}")


def choices(names) -> str:
    """'a', 'b' or 'c'."""
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """What the builder asks a family's layout for: the resolved storage dtype, the user's
    fp8 scale mode (None: the family's default) and K transform, the fp8 prefill products,
    integer page arrays (``CacheConfig.bitcast_pool``), the mesh size the pools are split
    over (their byte model is per device) and, under tensor parallelism, the KV heads the
    pool holds (replicated heads included; None: the model's)."""

    storage_dtype: str
    scale_mode: str | None = None
    kv_rotation: str = "none"
    attention_compute: str = "dequant"
    bitcast_pool: bool = False
    devices: int = 1
    kv_heads: int | None = None

    @property
    def is_fp8(self) -> bool:
        return fp8.is_fp8(self.storage_dtype)


def resolve_scale_mode(family: str, supports: Supports, req: CacheRequest) -> str | None:
    """The scale mode a family stores for ``req`` (None for 16/32-bit pages), after the
    checks every family shares: its fp8 formats, scale modes and K transforms (ValueError
    naming what works)."""
    if not req.is_fp8:
        return None
    if req.storage_dtype not in supports.fp8_dtypes:
        user = [fp8.user_dtype_name(d) for d in supports.fp8_dtypes]
        raise refuse(family, "kv_cache_dtype", fp8.user_dtype_name(req.storage_dtype),
                     f"use {choices(user + ['auto'])}")
    if req.scale_mode is not None and req.scale_mode not in supports.scale_modes:
        raise refuse(family, "kv_scale_mode", req.scale_mode,
                     f"use {choices(supports.scale_modes)}, or leave kv_scale_mode unset "
                     f"({supports.default_scale_mode!r})")
    if req.kv_rotation not in supports.rotations:
        raise refuse(family, "kv_rotation", req.kv_rotation,
                     f"use {choices(supports.rotations)}")
    return req.scale_mode or supports.default_scale_mode


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """A family's cache: its pools, the page multiple it needs and what it supports.
    ``kind`` is the name ``cache_info`` gives it (``kv_layout``); ``storage_dtype`` and
    ``scale_mode`` are those of its paged rows (the main fp8 choice)."""

    family: str
    kind: str
    paged: tuple[PagedPool, ...]
    slots: tuple[SlotPool, ...] = ()
    storage_dtype: str = "bfloat16"
    scale_mode: str | None = None
    kv_rotation: str = "none"
    page_multiple: int = 1
    supports: Supports = Supports((), None)

    @property
    def pools(self) -> tuple:
        return self.paged + self.slots

    def pool(self, name: str):
        """The pool named ``name``, or None."""
        return next((p for p in self.pools if p.name == name), None)

    def bytes_per_page(self, page_size: int) -> int:
        return sum(p.bytes_per_page(page_size) for p in self.paged)

    def bytes_per_slot(self) -> int:
        return sum(p.bytes_per_slot() for p in self.slots)

    def fixed_bytes(self) -> int:
        return sum(p.fixed_bytes() for p in self.paged)

    def bytes_per_token(self, page_size: int) -> Fraction:
        """Bytes each cached token adds (the paged pools' bytes per page / page size)."""
        return Fraction(self.bytes_per_page(page_size), page_size)

    def page_size(self, requested: int) -> int:
        """``requested`` doubled until it is a multiple of ``page_multiple`` (both powers of
        two in the engine); ValueError past 128 tokens, the engine's largest page."""
        ps = requested
        while ps % self.page_multiple:
            ps *= 2
        if ps > 128:
            raise ValueError(f"{self.family} needs pages of a multiple of "
                             f"{self.page_multiple} tokens, more than the largest page size "
                             "(128)")
        return ps


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """A layout sized: pages of ``page_size`` tokens (``num_pages`` with the sink page 0) and
    ``num_slots`` state slots (with the sink slot 0, the scratch slot and the last
    ``num_snapshots``: state snapshots; 0 when the layout has no slot pools). Hashable: the
    cache pytree's static part."""

    layout: CacheLayout
    page_size: int
    num_pages: int
    num_slots: int = 0
    num_snapshots: int = 0

    @property
    def max_tokens(self) -> int:
        """Tokens the pages hold for sequences (page 0 is the padding sink)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def sequence_slots(self) -> int:
        """Slots the scheduler hands to sequences (0: the layout has no slot pools)."""
        return max(0, self.num_slots - EXTRA_SLOTS - self.num_snapshots)

    @property
    def first_snapshot(self) -> int:
        """The first snapshot slot (the snapshots are the plan's last ``num_snapshots``)."""
        return self.num_slots - self.num_snapshots

    def snapshot_bytes(self) -> int:
        """Bytes the snapshot slots take of the slot pools."""
        return self.num_snapshots * self.layout.bytes_per_slot()

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool allocates (what ``Cache.init`` allocates, exactly)."""
        out = {p.name: self.num_pages * p.bytes_per_page(self.page_size) + p.fixed_bytes()
               for p in self.layout.paged}
        out.update({p.name: self.num_slots * p.bytes_per_slot() for p in self.layout.slots})
        return out

    def nbytes(self) -> int:
        return sum(self.pool_bytes().values())

    def info(self) -> dict:
        """Every pool the same way: kind, bytes, bytes per page or slot (one device's: its
        share where ``split``, else a whole copy), and its own facts."""
        out = {}
        for p, n in zip(self.layout.pools, self.pool_bytes().values()):
            unit = ({"bytes_per_page": p.bytes_per_page(self.page_size)} if p.kind == "paged"
                    else {"bytes_per_slot": p.bytes_per_slot()})
            out[p.name] = {"kind": p.kind, "bytes": n, **unit, "split": p.split, **p.info()}
        return out


def array_bytes(x, per_device: bool = False) -> int:
    """Bytes of an array (or ``jax.ShapeDtypeStruct``): all of it, or with ``per_device``
    the share one device holds under its sharding (all of it when replicated or unsharded)."""
    shape = x.shape
    where = getattr(x, "sharding", None) if per_device else None
    if where is not None:
        shape = where.shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def plan_cache(layout: CacheLayout, budget: int, page_size: int, max_num_seqs: int,
               max_model_len: int, snapshot_bytes: int = 0) -> CachePlan:
    """The pages and slots ``budget`` bytes (``kv_cache_memory``: the user's, or the memory
    plan's) hold: ``max_num_seqs + EXTRA_SLOTS`` slots first (layouts with slot pools), then
    as many snapshot slots as ``snapshot_bytes`` hold, the fixed bytes, then whole pages,
    plus the sink page. ValueError, naming what would fit, when one ``max_model_len``
    sequence does not."""
    snapshots = snapshot_bytes // layout.bytes_per_slot() if layout.slots else 0
    slots = max_num_seqs + EXTRA_SLOTS + snapshots if layout.slots else 0
    per_page = layout.bytes_per_page(page_size)
    left = budget - slots * layout.bytes_per_slot() - layout.fixed_bytes()
    usable = max(0, left // per_page) if per_page else 0
    need = math.ceil(max_model_len / page_size)
    if usable < need:
        least = slots * layout.bytes_per_slot() + layout.fixed_bytes() + need * per_page
        fits = usable * page_size
        raise ValueError(
            f"kv_cache_memory={budget} bytes holds {fits} tokens of {layout.family} "
            f"({float(layout.bytes_per_token(page_size)):g} bytes/token"
            + (f", after {slots} state slots of {layout.bytes_per_slot()} bytes" if slots
               else "") + (f" ({snapshots} of them snapshots)" if snapshots else "")
            + f"), fewer than one sequence of max_model_len={max_model_len}; give at least "
            f"{least} bytes, or lower max_model_len" + (" or max_num_seqs" if slots else ""))
    return CachePlan(layout, page_size, usable + 1, slots, snapshots)
