"""DeepSeek-V4's paged forward reading the pools in place (issue 57; ``models.v4_paged``,
``v4_paged_attention``), random tiny preset (window 6, CSA m = 4 top-3, HCA m = 8, pages of
16 tokens), float32 weights, CPU:

* a prefill chunk then decode steps at a context that fills many HCA entries and exceeds
  the top-k many times over, with index blocks of 16 entries (so the CSA top-k merges
  several blocks and the jnp HCA walk takes several), through the kernels in interpret mode
  and through the jnp twins ("reference"), give the logits of the dense reference forward
  (``deepseek_v4.forward`` with the pools' storage), fp8 and bf16 pools;
* pools whose every row and scale that the sequences never wrote is NaN (other pages and
  slots, the padding page and slot, the rest of the last page, the ring's unwritten rows)
  give the same hidden states as zeroed pools;
* the decode step's compiled temporaries do not grow with the page table's width (XLA's
  memory analysis, no timing): a 64x wider table costs nothing but its own bytes;
* flash-4l's decode step and a 2,048-token chunk lower for CUDA through Triton.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.kvcache import v4_pools
from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models import v4_paged
from jfp8kv.models.v4_presets import init_random_params, v4_config
from tests.models.test_v4_paged import v4_cache

STORAGE = {"fp8_e4m3": "float8_e4m3fn", "bfloat16": "bfloat16"}
PROMPT = 150  # 37 CSA entries (top-3, 3 blocks of 16), 18 HCA entries (2 blocks of 16)
STEPS = 3
# Row 0: pages spread over the pool; row 1: a shorter sequence; row 2: padding.
PAGES = np.zeros((3, 12), np.int32)
PAGES[0, :11] = [7, 3, 12, 1, 9, 14, 4, 11, 2, 16, 5]
PAGES[1, :6] = [6, 10, 13, 8, 15, 17]
SLOTS = jnp.asarray([2, 1, 0], jnp.int32)
LENS = np.asarray([PROMPT, 81, 0])
STEP = jax.jit(v4_paged.forward, static_argnames=("cfg", "backend", "query_block",
                                                  "index_block"))


@pytest.fixture(scope="module")
def tiny():
    cfg = v4_config("deepseek-v4-tiny")
    params = init_random_params(cfg, jax.random.PRNGKey(3), "float32")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, PROMPT + STEPS))
    return cfg, params, ids


def run_paged(cfg, params, ids, storage, backend, cache):
    """Prefill (one chunk per row) then STEPS decode steps; the hidden states of the real
    tokens: [row 0 prompt..., decode...], [row 1 ...]."""
    pt = jnp.asarray(PAGES)
    pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (3, PROMPT))
    kw = dict(cfg=cfg, backend=backend, query_block=None, index_block=16)
    h, cache = STEP(params, cache, jnp.asarray(ids[:, :PROMPT]), pos, pt,
                    jnp.asarray(LENS, jnp.int32), SLOTS, **kw)
    outs = [h[:, :PROMPT]]
    for s in range(STEPS):
        at = LENS + s
        tok = jnp.asarray(ids[np.arange(3), np.minimum(at, PROMPT + STEPS - 1)][:, None])
        lens = jnp.asarray(np.where(LENS > 0, at + 1, 0), jnp.int32)
        hs, cache = STEP(params, cache, tok, jnp.asarray(at[:, None], jnp.int32), pt, lens,
                         SLOTS, **kw)
        outs.append(hs)
    return outs, cache


def reference_logits(cfg, params, ids, storage):
    """The dense reference forward of rows 0 and 1: prompt, then the same decode tokens."""
    got = []
    for row in (0, 1):
        n = int(LENS[row])
        state = dv4.init_state(cfg, 1, 256)
        lg, state = dv4.forward(params, state, jnp.asarray(ids[row:row + 1, :n]), cfg,
                                storage=storage)
        steps = [lg[0]]
        for s in range(STEPS):
            tok = ids[row, min(n + s, PROMPT + STEPS - 1)]
            lg, state = dv4.forward(params, state, jnp.asarray([[tok]]), cfg, storage=storage)
            steps.append(lg[0])
        got.append(steps)
    return got


def logits(params, h):
    return jnp.einsum("...d,dv->...v", h, params["lm_head"])


# The two sum in other orders: a float32 last-bit difference may round a stored row's value
# to the neighbouring fp8 / bf16 step, which moves later logits by up to ~5e-4; a wrong
# entry chosen or missed moves them by ~1e-2 and more.
TOL = 2e-3


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_in_place_equals_the_dense_reference_forward(tiny, kv, backend):
    """Prefill logits of every real position and each decode step's, rows of 150 and 81
    tokens, against ``deepseek_v4.forward`` one row at a time."""
    cfg, params, ids = tiny
    spec = v4_pools.V4PoolSpec.from_model(cfg, kv, 16)
    outs, _ = run_paged(cfg, params, ids, kv, backend, v4_cache(cfg, spec, 18, 4))
    want = reference_logits(cfg, params, ids, STORAGE[kv])
    for row in (0, 1):
        n = int(LENS[row])
        np.testing.assert_allclose(logits(params, outs[0][row, :n]), want[row][0],
                                   rtol=TOL, atol=TOL)
        for s in range(STEPS):
            np.testing.assert_allclose(logits(params, outs[1 + s][row, 0]), want[row][1 + s][0],
                                       rtol=TOL, atol=TOL)


def poisoned(cache):
    """Every pool leaf NaN (the compressor state too): what the sequences write replaces
    it, the rest must never be read."""
    return jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), cache)


@pytest.mark.parametrize("kv,backend", [("fp8_e4m3", "pallas_interpret"),
                                        ("fp8_e4m3", "reference"),
                                        ("bfloat16", "pallas_interpret")])
def test_nan_in_unread_rows_and_scales_changes_nothing(tiny, kv, backend):
    cfg, params, ids = tiny
    spec = v4_pools.V4PoolSpec.from_model(cfg, kv, 16)
    clean = v4_cache(cfg, spec, 18, 4)
    want, _ = run_paged(cfg, params, ids, kv, backend, clean)
    got, _ = run_paged(cfg, params, ids, kv, backend, poisoned(clean))
    for a, b in zip(got, want):  # the prefill chunk, then each decode step
        for row in (0, 1):
            n = int(LENS[row]) if a.shape[1] > 1 else 1
            assert np.isfinite(np.asarray(a[row, :n])).all()
            np.testing.assert_array_equal(np.asarray(a[row, :n]), np.asarray(b[row, :n]))


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_decode_temporaries_do_not_follow_the_table_width(tiny, backend):
    cfg, params, _ = tiny
    spec = v4_pools.V4PoolSpec.from_model(cfg, "fp8_e4m3", 16)
    cache = v4_cache(cfg, spec, 18, 4)
    temp = {}
    for width in (16, 1024):
        z = jnp.zeros((4, 1), jnp.int32)
        compiled = STEP.lower(params, cache, z, z, jnp.zeros((4, width), jnp.int32), z[:, 0],
                              z[:, 0], cfg=cfg, backend=backend).compile()
        temp[width] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[1024] == temp[16], temp


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_flash_step_lowers_for_cuda(kv):
    """flash-4l's decode step (32 rows) and a 2,048-token chunk through the Pallas kernels
    lower for a GPU through Triton on this machine (abstract weights and pools; interpret
    mode cannot see Triton's refusals at these shapes: 64 heads x 512, top-512, a page
    table of 1,048,576 tokens)."""
    cfg = v4_config("deepseek-v4-flash-4l")
    params = jax.eval_shape(lambda k: init_random_params(cfg, k, "bfloat16"),
                            jax.random.PRNGKey(0))
    spec = v4_pools.V4PoolSpec.from_model(cfg, kv, 128)
    cache = jax.eval_shape(lambda: v4_cache(cfg, spec, 1490, 34))
    fwd = jax.jit(v4_paged.forward, static_argnames=("cfg", "backend"))
    for b, t in ((32, 1), (1, 2048)):
        z = jax.ShapeDtypeStruct((b, t), jnp.int32)
        rows = jax.ShapeDtypeStruct((b,), jnp.int32)
        text = fwd.trace(params, cache, z, z, jax.ShapeDtypeStruct((b, 8192), jnp.int32),
                         rows, rows, cfg=cfg, backend="pallas").lower(
            lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
