"""DeepSeek-V4 reference forward with per-row real token counts (``n_new``): a chunk padded
to a bucket gives the unpadded chunk's logits on its real rows and exactly its state (window
rows, compressor buffers, overlap halves, entries, ``pos``); rows with n_new = 0 (the
engine's padding and finished decode rows) leave their state untouched. Random tiny preset,
float32, fp8 pools (the rounding the engine stores)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.models import deepseek_v4 as dv4
from jfp8kv.models.v4_presets import init_random_params, v4_config

F8 = "float8_e4m3fn"


@pytest.fixture(scope="module")
def tiny():
    cfg = v4_config("deepseek-v4-tiny")
    return cfg, init_random_params(cfg, jax.random.PRNGKey(0), "float32")


def assert_same_state(a, b, tol=0.0):
    """Equal leaves (``tol``: float32 rounding of differently shaped computations)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_padded_chunk_equals_unpadded(tiny):
    """Rows of 11 and 5 real tokens in a chunk of 16, after a 9-token prefix: both rows'
    real logits and their states equal those of the same tokens unpadded (one row alone), up
    to float32 rounding (XLA fuses the two shapes differently)."""
    cfg, params = tiny
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9 + 16)))
    state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids[:, :9], cfg, storage=F8)[1]
    n_new = jnp.asarray([11, 5], jnp.int32)
    logits, padded = dv4.forward(params, state, ids[:, 9:], cfg, storage=F8, n_new=n_new)
    np.testing.assert_array_equal(np.asarray(padded["pos"]), [20, 14])
    for row, n in enumerate([11, 5]):
        one = jax.tree.map(lambda a: a[row:row + 1], state)
        want, want_state = dv4.forward(params, one, ids[row:row + 1, 9:9 + n], cfg, storage=F8)
        np.testing.assert_allclose(logits[row, :n], want[0], rtol=1e-5, atol=1e-5)
        assert_same_state(jax.tree.map(lambda a: a[row:row + 1], padded), want_state, 1e-5)


def test_rows_without_tokens_keep_their_state(tiny):
    """A decode step with n_new = [1, 0]: row 0 advances, row 1's state is bit-identical."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 13)))
    state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids[:, :12], cfg, storage=F8)[1]
    _, after = dv4.forward(params, state, ids[:, 12:], cfg, storage=F8,
                           n_new=jnp.asarray([1, 0], jnp.int32))
    assert_same_state(jax.tree.map(lambda a: a[1:], after), jax.tree.map(lambda a: a[1:], state))
    _, full = dv4.forward(params, state, ids[:, 12:], cfg, storage=F8)
    assert_same_state(jax.tree.map(lambda a: a[:1], after), jax.tree.map(lambda a: a[:1], full))
