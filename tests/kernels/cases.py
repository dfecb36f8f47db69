"""Random paged-cache cases for the Pallas kernel tests (fresh inputs on every call).

A case holds two copies of one layer: ``clean`` (every slot finite, what the reference
reads) and ``poisoned`` (every slot no sequence may see set to NaN, scales too: what the
kernel reads). Masking strictly by length is then checked by the kernel never returning
NaN, and its values by the reference on the clean copy. Page tables are shuffled; entries
past a sequence's last page point at the NaN-filled sink page 0.

The oracle always runs on the CPU (``on_cpu``), so a GPU run compares the native kernel
against the same numbers as the interpret run (no TF32 or approximate division on it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import KVCache, LayerKV

NAN_BITS = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


_GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")]


def has_hopper() -> bool:
    from jfp8kv.kernels import is_hopper

    return is_hopper()


HOPPER_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not has_hopper(),
                                                    reason="needs a Hopper GPU")]
# what a Mosaic GPU kernel lowered down to NVVM holds: wgmma, mbarrier waits, TMA copies
NVVM_OPS = ("nvvm.wgmma.fence", "nvvm.mbarrier.try_wait.parity", "nvvm.cp.async.bulk.tensor")


def assert_lowers_for_hopper(fn, *args, **kwargs):
    """Lower ``fn(*args, **kwargs)`` (a jitted Pallas Mosaic GPU wrapper) for CUDA on this
    machine, GPU or not (Pallas's lowering, Mosaic's layout inference and its dialect down to
    NVVM run in Python), and check the NVVM operations are there; returns the lowered text."""
    text = fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    for op in NVVM_OPS:
        assert op in text, op
    return text


def sweep(cases, ids, cpu_subset):
    """(case, exec_mode) params: every case natively under ``-m gpu``; the cases whose index
    is in ``cpu_subset`` also in interpret mode (each interpret config costs ~7 s of XLA
    compile on 2 cores, so the CPU sweep is a chosen subset)."""
    params = []
    for i, (case, name) in enumerate(zip(cases, ids)):
        if i in cpu_subset:
            params.append(pytest.param(case, "interpret", id=f"{name}-interpret"))
        params.append(pytest.param(case, "gpu", id=f"{name}-gpu", marks=_GPU_MARKS))
    return params


def _put(tree, device):
    """Move array leaves to ``device``; static arguments (configs, floats) stay as they are."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, device) if isinstance(x, (jax.Array, np.ndarray)) else x,
        tree)


def on_cpu(fn, *args, **kwargs):
    cpu = jax.devices("cpu")[0]
    args, kwargs = _put((args, kwargs), cpu)
    with jax.default_device(cpu):
        return jax.block_until_ready(fn(*args, **kwargs))


def on_exec(exec_mode: str, fn, *args, **kwargs):
    if exec_mode == "interpret":
        return on_cpu(fn, *args, interpret=True, **kwargs)
    gpu = jax.devices("gpu")[0]
    args, kwargs = _put((args, kwargs), gpu)
    with jax.default_device(gpu):
        return jax.block_until_ready(fn(*args, interpret=False, **kwargs))


def decode_lengths(rng, page_size: int, span: int):
    """A decode batch's lengths over a page table of at least ``span`` tokens: an empty
    slot, a length-1 sequence, one off the page grid, a full table and a short one, shuffled.
    -> (lens, max_pages, num_pages: the pages they need + the null page + 3 spare)."""
    s = page_size
    max_pages = max(2, -(-span // s))
    cap = max_pages * s
    lens = np.array([0, 1, int(rng.integers(2, cap)), cap, int(rng.integers(2, s + 3))])
    rng.shuffle(lens)
    return lens, max_pages, 1 + sum(-(-int(n) // s) for n in lens) + 3


def make_cfg(storage: str, mode: str | None, *, heads_kv: int, head_dim: int, page_size: int,
             num_pages: int) -> CacheConfig:
    return CacheConfig(num_layers=1, num_kv_heads=heads_kv, head_dim=head_dim,
                       num_pages=num_pages, page_size=page_size, storage_dtype=storage,
                       scale_mode=mode if storage.startswith("float8") else None)


def poisoned_store_case(rng, storage: str, mode: str | None, *, heads_kv: int,
                        head_dim: int, page_size: int, new_tokens: int):
    """(cfg, layer, slots) for a store test: pages and dynamic scales NaN (static scales
    random), room for twice the new tokens, the tokens' slots shuffled past page 0."""
    n, s = new_tokens, page_size
    num_pages = 2 + -(-n // s) * 2
    cfg = make_cfg(storage, mode, heads_kv=heads_kv, head_dim=head_dim, page_size=s,
                   num_pages=num_pages)
    static = None
    if mode in ("tensor", "channel"):
        static = (rng.uniform(0.002, 0.05, (heads_kv, 1 if mode == "tensor" else head_dim))
                  * np.ones((heads_kv, head_dim)))
    layer = KVCache.init(cfg, static, static).layer(0)
    nan_like = lambda a: jnp.full(a.shape, jnp.nan, a.dtype)  # noqa: E731
    layer.k, layer.v = nan_like(layer.k), nan_like(layer.v)
    if mode in ("token", "block"):
        layer.k_scale, layer.v_scale = nan_like(layer.k_scale), nan_like(layer.v_scale)
    slots = (rng.permutation((num_pages - 1) * s)[:n] + s).astype(np.int32)
    return cfg, layer, slots


def _nan_fill(x: np.ndarray, dtype_name: str) -> np.ndarray:
    if dtype_name in NAN_BITS:
        return np.full(x.shape, NAN_BITS[dtype_name], np.uint8)
    return np.full(x.shape, np.nan, x.dtype)


def _as_bits(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.itemsize == 1:
        return x.view(np.uint8)
    return x


def _from_bits(b: np.ndarray, dtype) -> jax.Array:
    if jnp.dtype(dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.uint8), dtype)
    return jnp.asarray(b, dtype)


def random_pages(rng, cfg: CacheConfig) -> np.ndarray:
    """[Hkv, P, S, D] random values in the storage dtype, as a numpy bit/float array."""
    shape = (cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim)
    x = rng.standard_normal(shape).astype(np.float32)
    if cfg.is_fp8:
        fmax = 448.0 if cfg.storage_dtype == "float8_e4m3fn" else 57344.0
        x = np.clip(x * fmax / 4, -fmax, fmax)  # a raw cast past fmax would give NaN
        return _as_bits(jnp.asarray(x).astype(cfg.storage_dtype))
    return np.asarray(jnp.asarray(x, cfg.storage_dtype))


def random_scales(rng, cfg: CacheConfig) -> np.ndarray | None:
    h, p, s, d = cfg.num_kv_heads, cfg.num_pages, cfg.page_size, cfg.head_dim
    lo, hi = (0.003, 0.03) if cfg.storage_dtype == "float8_e4m3fn" else (3e-4, 3e-3)
    if not cfg.is_fp8:
        return None
    if cfg.scale_mode in ("tensor", "channel"):
        shape = (h, 1) if cfg.scale_mode == "tensor" else (h, d)
        return np.broadcast_to(rng.uniform(lo, hi, shape), (h, d)).astype(np.float32)
    if cfg.scale_mode == "token":
        return rng.uniform(lo, hi, (h, p, s)).astype(np.float32)
    return rng.uniform(lo, hi, (h, p, s, d // cfg.scale_block)).astype(np.float16)


@dataclasses.dataclass
class AttnCase:
    cfg: CacheConfig
    clean: LayerKV
    poisoned: LayerKV
    page_tables: jax.Array  # int32[B, MP]
    seq_lens: jax.Array  # int32[B]


def attention_case(rng, cfg: CacheConfig, seq_lens, max_pages: int) -> AttnCase:
    """A layer whose pages hold random data where some sequence can see it, NaN elsewhere."""
    b = len(seq_lens)
    s = cfg.page_size
    need = [-(-int(n) // s) for n in seq_lens]
    assert max(need) <= max_pages and sum(need) < cfg.num_pages
    free = rng.permutation(np.arange(1, cfg.num_pages))
    pt = np.zeros((b, max_pages), np.int32)  # unused entries -> the NaN sink page 0
    visible = np.zeros((cfg.num_pages, s), bool)
    at = 0
    for i, n in enumerate(seq_lens):
        pages = free[at:at + need[i]]
        at += need[i]
        pt[i, :need[i]] = pages
        for j, pg in enumerate(pages):
            visible[pg, : min(s, int(n) - j * s)] = True
    layer = {}
    for name in ("k", "v"):
        clean = random_pages(rng, cfg)
        vis = visible[None, :, :, None]
        poisoned = np.where(vis, clean, _nan_fill(clean, cfg.storage_dtype))
        layer[name] = (_from_bits(clean, cfg.storage_dtype),
                       _from_bits(poisoned, cfg.storage_dtype))
        sc = random_scales(rng, cfg)
        if sc is None:
            layer[name + "_scale"] = (jnp.ones((0,), jnp.float32),) * 2
        elif cfg.scale_mode in ("token", "block"):
            vis_s = visible[None] if sc.ndim == 3 else visible[None, :, :, None]
            layer[name + "_scale"] = (jnp.asarray(sc), jnp.asarray(np.where(vis_s, sc, np.nan)))
        else:
            layer[name + "_scale"] = (jnp.asarray(sc),) * 2
    clean = LayerKV(*(layer[n][0] for n in ("k", "v", "k_scale", "v_scale")))
    poisoned = LayerKV(*(layer[n][1] for n in ("k", "v", "k_scale", "v_scale")))
    return AttnCase(cfg, clean, poisoned, jnp.asarray(pt), jnp.asarray(seq_lens, jnp.int32))


def prefill_layout(rng, lens, page: int, num_pages: int, max_pages: int):
    """A batch's prefill over shuffled pages: (page tables int32[B, max_pages], positions
    int32[B, T], slots int32[B, T]) for sequence lengths ``lens``; T = max(lens), positions
    past a length repeat its last one and their slots point at the null page 0."""
    b, t, mp = len(lens), int(lens.max()), max_pages
    pt = rng.permutation(np.arange(1, num_pages))[:b * mp].reshape(b, mp).astype(np.int32)
    pos = np.minimum(np.arange(t)[None, :], lens[:, None] - 1).astype(np.int32)
    slots = np.take_along_axis(pt, pos // page, 1) * page + pos % page
    slots = np.where(np.arange(t)[None, :] < lens[:, None], slots, 0).astype(np.int32)
    return pt, pos, slots


def assert_close(out, ref, *, exact_f32: bool = False):
    """No NaN/inf anywhere, then closeness to the oracle (relative to the oracle's scale)."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), f"{(~np.isfinite(out)).sum()} non-finite outputs"
    scale = max(1.0, float(np.abs(ref).max()))
    err = np.abs(out - ref)
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    if exact_f32:
        assert err.max() <= 2e-5 * scale, (err.max(), rel)
    else:
        assert err.max() <= 3e-2 * scale and rel <= 1e-2, (err.max(), rel)
