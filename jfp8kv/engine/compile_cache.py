"""JAX's persistent compilation cache, on by default so compile time is paid once per machine.

Directory: ``$JFP8KV_CACHE/jax-cache`` (default ``~/.cache/jfp8kv/jax-cache``). Off with
``compile_cache=False`` (``LLM``) or ``--no-compile-cache`` (CLI), or ``JFP8KV_COMPILE_CACHE=0``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import threading
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


# Names in jax.config / the environment that say where (or whether) things are cached, not
# what a traced program is: left out of the fingerprint so a moved cache still hits.
_NOT_PROGRAM = ("cache", "log", "debug_infs", "traceback", "explain")
# The same for the environment: where things are cached or reported (a start-up profile's
# path differs between a cold and a warm start and must not make the warm one miss).
_NOT_PROGRAM_ENV = ("CACHE", "STARTUP_PROFILE")


@functools.cache
def fingerprint() -> str:
    """What a step's traced program depends on besides its arguments: jfp8kv's source, the
    versions of Python, jax, jaxlib, numpy and ml_dtypes, the device and host CPU (model and
    feature flags: XLA:CPU compiles for the host), jax.config's values and the JAX_*, XLA_*
    and JFP8KV_* environment (cache locations aside)."""
    import platform

    import jaxlib
    import ml_dtypes
    import numpy as np

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    dev = jax.devices()[0]
    cpu = ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(dict.fromkeys(ln for ln in info if ln.startswith(("model name", "flags"))))
    except OSError:
        cpu = platform.processor()
    cfg = {k: v for k, v in jax.config.values.items()
           if not any(w in k for w in _NOT_PROGRAM)}
    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_", "JFP8KV_"))
           and not any(w in k for w in _NOT_PROGRAM_ENV)}
    for part in (sys.version, jax.__version__, jaxlib.__version__, np.__version__,
                 ml_dtypes.__version__, dev.platform, dev.device_kind, len(jax.devices()),
                 getattr(dev.client, "platform_version", ""), cpu, sorted(cfg.items(), key=str),
                 sorted(env.items())):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def _aval(x) -> str:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        sharding = None  # one device: the sizer's abstract pools and the live ones compile alike
    return f"{getattr(x, 'shape', None)}:{getattr(x, 'dtype', type(x).__name__)}:" + (
        "" if sharding is None else repr(sharding))


_REQUEST, _HIT = ("/jax/compilation_cache/compile_requests_use_cache",
                  "/jax/compilation_cache/cache_hits")
_events = threading.local()  # this thread's persistent-cache requests and hits


def _on_event(event: str, **kwargs) -> None:
    if event in (_REQUEST, _HIT):
        setattr(_events, event, getattr(_events, event, 0) + 1)


@functools.cache
def _listen() -> None:
    jax.monitoring.register_event_listener(_on_event)


def compile_fresh(lowered):
    """(``lowered.compile()``, whether XLA compiled it here): False when JAX's persistent
    cache or its in-memory cache had the executable. Only a fresh one is stored by an
    ``ExecutableStore``: XLA:CPU (jaxlib 0.10.2) serializes an executable that was itself
    deserialized without some of its kernels ("Function bitcast_gather_fusion.4 not
    found" when the reloaded one runs)."""
    _listen()
    before = [getattr(_events, e, 0) for e in (_REQUEST, _HIT)]
    compiled = lowered.compile()
    requests, hits = (getattr(_events, e, 0) - b for e, b in zip((_REQUEST, _HIT), before))
    return compiled, requests > 0 and hits == 0


class ExecutableStore:
    """Step executables on disk, loaded without tracing or lowering (issue 38: on the 2-core
    CPU those took ~1.5 s per bucket, a third of a warm start; JAX's own persistent cache
    is keyed by the lowered program, so it can only be read after both).

    An entry's key hashes ``fingerprint()`` (jfp8kv's source, library versions, device, host
    CPU, JAX/XLA settings), the step's name, its static arguments (``repr``: the model
    config, backend, sampler mode, scan length) and every argument's tree, shape, dtype and
    sharding. Anything else a trace could depend on is a bug to report. A missing,
    unreadable or stale-format entry is a miss: the caller traces and compiles as before
    (through JAX's persistent cache) and stores the result. Entries live next to JAX's,
    in ``<compilation cache dir>/jfp8kv-executables``, so clearing that directory (or
    ``--no-compile-cache``) clears both. Like JAX's cache, the directory is trusted:
    loading an entry unpickles it."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def default(cls, enabled: bool = True) -> "ExecutableStore | None":
        """The store beside JAX's persistent cache, or None when that cache is off (or not
        ``enabled``: ``compile_cache=False``, ``JFP8KV_COMPILE_CACHE=0``)."""
        if not enabled or os.environ.get("JFP8KV_COMPILE_CACHE", "1") == "0":
            return None
        d = jax.config.jax_compilation_cache_dir
        if not d or not jax.config.jax_enable_compilation_cache:
            return None
        return cls(Path(d) / "jfp8kv-executables")

    def key(self, label: str, args, static: dict) -> str:
        leaves, tree = jax.tree.flatten(args)
        h = hashlib.sha256(fingerprint().encode())
        h.update(f"{label}\0{sorted(static.items(), key=str)!r}\0{tree!r}\0".encode())
        for x in leaves:
            h.update(_aval(x).encode() + b"\0")
        return h.hexdigest()

    def load(self, key: str):
        """The ``jax.stages.Compiled`` stored under ``key``, or None."""
        from jax.experimental import serialize_executable

        f = self.path / key
        if not f.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(f.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a bad entry is a miss
            log.warning("ignoring unreadable executable %s (%s: %s)", f, type(e).__name__, e)
            return None

    def save(self, key: str, compiled) -> None:
        """Store ``compiled`` (atomically: a reader sees the whole entry or none); an
        executable that cannot be serialized is not stored."""
        from jax.experimental import serialize_executable

        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, delete=False) as tmp:
                tmp.write(blob)
            os.replace(tmp.name, self.path / key)
        except Exception as e:  # noqa: BLE001 - storing is an optimisation
            log.info("executable not stored (%s: %s)", type(e).__name__, e)
