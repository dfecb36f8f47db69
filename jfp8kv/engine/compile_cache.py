"""JAX's persistent compilation cache, on by default so compile time is paid once per machine.

Directory: ``$JFP8KV_CACHE/jax-cache`` (default ``~/.cache/jfp8kv/jax-cache``). Off with
``compile_cache=False`` (``LLM``) or ``--no-compile-cache`` (CLI), or ``JFP8KV_COMPILE_CACHE=0``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("JFP8KV_CACHE") or os.path.join(Path.home(), ".cache", "jfp8kv")
    return Path(root) / "jax-cache"


def setup_compile_cache(enabled: bool = True) -> Path | None:
    """Point JAX's persistent compilation cache at ``cache_dir()`` (every executable, however
    fast it compiled). Returns the directory, or None when disabled. A directory set by the
    user (``JAX_COMPILATION_CACHE_DIR`` / jax.config) is kept."""
    if not enabled or os.environ.get("JFP8KV_COMPILE_CACHE", "1") == "0":
        return None
    current = jax.config.jax_compilation_cache_dir
    path = Path(current) if current else cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache disabled: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
