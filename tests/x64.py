"""``x64()``: 64-bit JAX inside a block (the float64 check mode), restored afterwards."""

import contextlib

import jax


@contextlib.contextmanager
def x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)
