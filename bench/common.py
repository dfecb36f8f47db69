"""Shared benchmark plumbing: the machine record and the copy-bandwidth ceiling."""

from __future__ import annotations

import platform
import statistics
import time

import jax
import jax.numpy as jnp


def machine_info() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "host": platform.node(), "python": platform.python_version(),
            "versions": {"jax": jax.__version__,
                         "jaxlib": getattr(jaxlib, "__version__", "?")}}


def copy_bandwidth_tbps(n_floats: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second, in TB/s), 4 GiB f32."""
    if jax.default_backend() != "gpu":
        n_floats = 1 << 22
    x = jax.random.normal(jax.random.key(0), (n_floats,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    jax.block_until_ready(f(x))
    samples = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        samples.append(time.perf_counter() - t)
    return 2 * n_floats * 4 / statistics.median(samples) / 1e12


def command_line() -> str:
    import sys

    return " ".join(["python"] + sys.argv)


def write_result(path: str, doc: dict) -> None:
    import json
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
