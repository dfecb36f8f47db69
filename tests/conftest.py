"""Session-wide test settings.

XLA compiles on CPU are the slowest part of the suite; a persistent compilation cache
shared by every test process of a run (and by the server subprocesses the serve tests
start) lets identical shapes compile once.

The jaxtyping annotations at the real boundaries (the kernels' contract, the cache pytree,
``transformer.forward``) are checked at run time under pytest only: the import hook below
wraps the functions of these modules with beartype before any test imports them.
"""

import os
import tempfile

import jax
import pytest
from jaxtyping import install_import_hook

install_import_hook(["jfp8kv.kernels", "jfp8kv.kvcache.cache", "jfp8kv.models.transformer"],
                    "beartype.beartype")

_CACHE = os.environ.setdefault(
    "JFP8KV_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "jfp8kv-test-jax-cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)
