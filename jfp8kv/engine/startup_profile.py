"""Where start-up goes: one row per executable the engine obtains, and a summary.

Every executable the runner obtains ahead of use (``ModelRunner.compile_variant``: the
memory plan's probes, the warm-up's parallel precompile) is recorded with the phase it
belongs to (``phase("sizing")``, ``phase("warmup")``; anything later is "serving", which a
server should never see), its step and shape, where it came from ("store": jfp8kv's
executable store, no tracing; "jax-cache": traced and lowered, then found in JAX's
compilation caches, persistent or in this process's memory; "compiled": XLA compiled it) and the seconds spent tracing and
lowering, and in XLA (or loading). Threads overlap, so per-phase sums exceed the phase's
wall time, which is recorded too.

``summary()`` is what ``LLM.warmup`` logs and what ``JFP8KV_STARTUP_PROFILE=<path>`` writes
as JSON at the end of the warm-up (the benchmarks set it to keep the breakdown of a GPU
start beside their results). Plain Python, thread-safe; one profile at a time, begun
again by each ``build_engine`` (so a second engine in a process reports its own start-up).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

_lock = threading.Lock()
_rows: list[dict] = []
_phases: dict[str, list[float]] = {}  # phase -> [start, end] (perf_counter)
_current = ["serving"]


@contextlib.contextmanager
def phase(name: str):
    """Attribute the executables obtained inside to ``name`` (start-up phases nest only
    by replacing each other; the previous one is restored after)."""
    prev, t0 = _current[0], time.perf_counter()
    _current[0] = name
    try:
        yield
    finally:
        _current[0] = prev
        with _lock:
            span = _phases.setdefault(name, [t0, t0])
            span[0], span[1] = min(span[0], t0), max(span[1], time.perf_counter())


def record(step: str, shape: tuple, greedy: bool, switched, source: str, lower_s: float,
           compile_s: float) -> None:
    row = {"phase": _current[0], "step": step, "shape": list(shape), "greedy": bool(greedy),
           "switched": repr(switched), "source": source, "lower_s": round(lower_s, 4),
           "compile_s": round(compile_s, 4)}
    with _lock:
        _rows.append(row)


class Clock:
    """Times one executable from its creation: ``lowered(x)`` marks the end of tracing and
    lowering (returns ``x``), ``done(source)`` records the row (XLA or loading time since
    the mark, or since the start when nothing was lowered)."""

    def __init__(self, step: str, shape: tuple, greedy: bool, switched):
        self.what = (step, shape, greedy, switched)
        self.t0 = self.t1 = time.perf_counter()

    def lowered(self, x):
        self.t1 = time.perf_counter()
        return x

    def done(self, source: str) -> None:
        record(*self.what, source, self.t1 - self.t0, time.perf_counter() - self.t1)


def rows() -> list[dict]:
    with _lock:
        return list(_rows)


def reset() -> None:
    with _lock:
        _rows.clear()
        _phases.clear()


def summary(slowest: int = 5) -> dict:
    """Per phase: wall seconds, executables by source, summed trace+lower and XLA seconds
    (over threads), per step; and the ``slowest`` executables overall."""
    with _lock:
        rows_, spans = list(_rows), {k: list(v) for k, v in _phases.items()}
    out = {}
    for name in dict.fromkeys([r["phase"] for r in rows_] + list(spans)):
        mine = [r for r in rows_ if r["phase"] == name]
        by_source, by_step = {}, {}
        for r in mine:
            by_source[r["source"]] = by_source.get(r["source"], 0) + 1
            s = by_step.setdefault(r["step"], {"n": 0, "lower_s": 0.0, "compile_s": 0.0})
            s["n"] += 1
            s["lower_s"] = round(s["lower_s"] + r["lower_s"], 3)
            s["compile_s"] = round(s["compile_s"] + r["compile_s"], 3)
        span = spans.get(name)
        out[name] = {"wall_s": round(span[1] - span[0], 3) if span else None,
                     "executables": len(mine), "by_source": by_source,
                     "lower_s": round(sum(r["lower_s"] for r in mine), 3),
                     "compile_s": round(sum(r["compile_s"] for r in mine), 3),
                     "by_step": by_step}
    top = sorted(rows_, key=lambda r: -(r["lower_s"] + r["compile_s"]))[:slowest]
    return {"phases": out, "slowest": top}


def log_line(s: dict) -> str:
    parts = []
    for name, p in s["phases"].items():
        src = ", ".join(f"{n} {k}" for k, n in sorted(p["by_source"].items()))
        wall = f"{p['wall_s']:.1f} s" if p["wall_s"] is not None else "-"
        parts.append(f"{name}: {p['executables']} executables ({src or 'none'}) in {wall} "
                     f"(trace+lower {p['lower_s']:.1f} s, XLA {p['compile_s']:.1f} s over "
                     "threads)")
    return "start-up: " + "; ".join(parts)


def write_if_asked() -> str | None:
    """Write ``summary()`` and every row to ``$JFP8KV_STARTUP_PROFILE`` when it is set;
    returns the path written (None when not asked)."""
    path = os.environ.get("JFP8KV_STARTUP_PROFILE")
    if not path:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**summary(), "rows": rows()}, f, indent=1)
    return path
