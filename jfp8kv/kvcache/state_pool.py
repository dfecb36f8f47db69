"""Per-sequence state slots of the Gated DeltaNet layers (Qwen3.5/3.6 hybrid models).

Attention layers keep their K/V in the paged pool (``cache.KVCache``, every dtype and scale
mode); the linear-attention layers keep a fixed-size state per sequence instead, one slot
of this pool per running sequence::

    conv[l]       [num_slots, kernel - 1, conv_dim]      the last inputs of the causal conv
    recurrent[l]  [num_slots, v_heads, k_dim, v_dim]     the delta rule's state S

for each linear layer ``l`` (in layer order). Slot 0 is reserved as the padding sink, as
page 0 is: padding rows of a batch read and write it, no sequence owns it. The state dtype is
float32 or bfloat16, never fp8: the recurrent state is a running sum that every later token
reads, so its rounding compounds over the sequence (the issue's point 2).

A sequence's slot needs no clearing when it is (re)allocated: the model starts from zeros
for a chunk that begins at position 0 (``models.qwen3_hybrid``), so a preempted sequence's
state is simply recomputed by its prefill, as its pages are. With prefix caching, slots past
the sequences' hold state snapshots (``snapshots.py``): the conv and recurrent rows after a
page boundary, copied whole; a sequence restored from one continues from it exactly as it
would have from its own slot.

``bytes_per_slot`` is the capacity model of this pool, as ``cache.bytes_per_token`` is the
pages'; ``DeltaState.nbytes`` equals ``num_slots * bytes_per_slot`` exactly.

``hybrid_layout`` declares the hybrid family's cache: the full-attention layers' K/V pages
(``cache.KVPool``, every dtype and scale mode) and this pool (``DeltaNetPool``) of slots.
Under tensor parallelism both split: the K/V pages on the KV-head axis, the states by value
head (conv channels in the order ``models/sharding.py`` stores them: each device's q, k and
v heads; q/k heads the mesh size does not divide stored ``stored_key_heads`` times).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfp8kv.config import KV_SCALE_MODES, ModelConfig
from jfp8kv.kvcache.cache import DEFAULT_FP8_SCALE_MODE, kv_pool
from jfp8kv.kvcache.layout import (CacheLayout, CacheRequest, SlotPool, Supports, array_bytes,
                                   resolve_scale_mode)

STATE_DTYPES = ("float32", "bfloat16", "float64")  # float64: the float64 check mode only


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """Static shape of the state pool (hashable: a jit static argument)."""

    num_layers: int  # linear-attention layers
    num_slots: int  # including the reserved slot 0
    conv_dim: int
    conv_kernel: int
    v_heads: int
    k_dim: int
    v_dim: int
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"DeltaNet state dtype {self.dtype!r} is not supported; choose one "
                             f"of {list(STATE_DTYPES)} (fp8 would compound rounding in the "
                             "recurrence)")
        if self.num_slots < 2:
            raise ValueError(f"num_slots={self.num_slots}: slot 0 is reserved, so at least 2")

    @property
    def max_seqs(self) -> int:
        return self.num_slots - 1


def stored_key_heads(hybrid, devices: int = 1) -> int:
    """The DeltaNet q/k heads the layers keep over ``devices`` (tensor parallelism splits
    the value heads, ``devices`` dividing them): the model's ``Hk``, or when ``devices``
    does not divide it, ``lcm(Hk, devices)``: each q/k head kept ``lcm / Hk`` times, so
    that a device holds whole heads for its value heads (value head ``v`` reads stored
    head ``v // (Hv / stored)``, a copy of its own ``v // (Hv / Hk)``), as attention's
    KV heads are (``models/sharding.py``)."""
    return math.lcm(hybrid.linear_num_key_heads, devices)


def conv_channels(hybrid, devices: int = 1) -> int:
    """Channels of the causal conv as stored over ``devices``: q and k of the stored key
    heads, then v (``HybridFields.conv_dim`` on one device)."""
    return (2 * stored_key_heads(hybrid, devices) * hybrid.linear_key_head_dim
            + hybrid.value_dim)


def state_config(hybrid, num_slots: int, dtype: str | None = None,
                 devices: int = 1) -> StateConfig:
    """The pool for a ``config_fields.HybridFields`` model with ``num_slots`` slots, in
    ``dtype`` (default: the model's ``state_dtype``), split over ``devices`` (the arrays'
    global shapes: ``conv_channels``)."""
    return StateConfig(len(hybrid.linear_layers), num_slots, conv_channels(hybrid, devices),
                       hybrid.linear_conv_kernel_dim, hybrid.linear_num_value_heads,
                       hybrid.linear_key_head_dim, hybrid.linear_value_head_dim,
                       dtype or hybrid.state_dtype)


def bytes_per_slot(cfg: StateConfig) -> int:
    """Bytes one sequence's state takes over all linear layers (conv + recurrent)."""
    item = jnp.dtype(cfg.dtype).itemsize
    per_layer = (cfg.conv_kernel - 1) * cfg.conv_dim + cfg.v_heads * cfg.k_dim * cfg.v_dim
    return cfg.num_layers * per_layer * item


def plan_num_slots(memory: int, cfg: StateConfig) -> int:
    """Usable slots (excluding the reserved slot 0) that fit in ``memory`` bytes."""
    return max(0, memory // bytes_per_slot(cfg) - 1)


@typing.no_type_check
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeltaState:
    """Functional state pool; ``config`` is static."""

    conv: list[jax.Array]
    recurrent: list[jax.Array]
    config: StateConfig = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def init(cls, cfg: StateConfig) -> "DeltaState":
        dt = jnp.dtype(cfg.dtype)
        conv = [jnp.zeros((cfg.num_slots, cfg.conv_kernel - 1, cfg.conv_dim), dt)
                for _ in range(cfg.num_layers)]
        rec = [jnp.zeros((cfg.num_slots, cfg.v_heads, cfg.k_dim, cfg.v_dim), dt)
               for _ in range(cfg.num_layers)]
        return cls(conv, rec, cfg)

    def nbytes(self, per_device: bool = False) -> int:
        """Bytes of the states (``per_device``: one device's share)."""
        return sum(array_bytes(x, per_device) for x in (*self.conv, *self.recurrent))


# Static scale modes run with a float kv_scales only: start-up calibration runs the dense
# forward. Prefix caching restores the state after a cached prefix from a state snapshot
# (``snapshots.py``: a copy of a slot, taken at a page boundary).
HYBRID_SUPPORTS = Supports(
    scale_modes=KV_SCALE_MODES, default_scale_mode=DEFAULT_FP8_SCALE_MODE,
    rotations=("none", "hadamard"), tensor_parallel=True, prefix_caching=True)


@dataclasses.dataclass(frozen=True)
class DeltaNetPool(SlotPool):
    """The DeltaNet layers' conv and recurrent state, one slot per sequence: a
    ``DeltaState`` (``config.num_slots`` is set by ``init``). Split over ``devices`` (tensor
    parallelism): each holds its value heads' recurrent states and its heads' conv
    channels (``models/sharding.py`` orders the channels device by device), and
    ``bytes_per_slot`` is one device's share."""

    config: StateConfig
    devices: int = 1
    name = "deltanet"

    def bytes_per_slot(self) -> int:
        return bytes_per_slot(self.config) // self.devices

    def init(self, num_slots: int) -> DeltaState:
        return DeltaState.init(dataclasses.replace(self.config, num_slots=num_slots))

    @property
    def split(self) -> bool:
        return self.devices > 1

    def partition(self, axis: str):
        """Conv states [S, K-1, C] on the channel axis, recurrent [S, Hv, dk, dv] on the
        value-head axis."""
        if not self.split:
            return P()
        layers = range(self.config.num_layers)
        return DeltaState([P(None, None, axis) for _ in layers], [P(None, axis) for _ in layers],
                          self.config)

    def info(self) -> dict:
        return dict(dtype=self.config.dtype, layers=self.config.num_layers,
                    value_heads_per_device=self.config.v_heads // self.devices)


def hybrid_layout(cfg: ModelConfig, req: CacheRequest) -> CacheLayout:
    """A Qwen3.5/3.6 hybrid's cache: K/V pages of its full-attention layers, DeltaNet state
    slots of its linear-attention layers (state dtype: the model's ``state_dtype``). Over
    ``req.devices`` (tensor parallelism): the K/V pool as the dense one (``req.kv_heads``,
    an equal share per device) and the state split by value heads."""
    mode = resolve_scale_mode(cfg.family, HYBRID_SUPPORTS, req)
    heads = req.kv_heads or cfg.num_kv_heads
    kv = kv_pool(len(cfg.hybrid.attention_layers), heads, cfg.head_dim, req, mode,
                 heads // req.devices)
    state = DeltaNetPool(state_config(cfg.hybrid, 2, devices=req.devices), req.devices)
    return CacheLayout(cfg.family, "kv", (kv,), (state,), storage_dtype=req.storage_dtype,
                       scale_mode=mode, kv_rotation=kv.config.kv_rotation,
                       supports=HYBRID_SUPPORTS)
