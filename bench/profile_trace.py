"""Where a jitted step's device time goes: run it under ``jax.profiler.trace`` and summarize
the device's kernel events (the Perfetto trace JSON the profiler writes).

The summary answers what a launch-bound step needs answered: how many kernels ran, how long
the device was busy (the union of kernel intervals) against the span from the first kernel's
start to the last one's end (the difference is launch gaps and idle device), the time by
kind of kernel, and the kernels that cost most. Names are kept as the trace gives them
(XLA fusions, cuBLAS/cuDNN or Triton GEMMs, the Pallas kernels by their ``name=``).

Used by ``bench.decode_floor --profile``; on a CPU the device events are absent and the
summary says so (``kernels`` = 0), so the code path still runs in CI.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

DEVICE_PREFIX = "/device:"

_KINDS = (  # (kind, substrings of a lower-cased kernel name), first match wins
    ("pallas", ("jfp8kv_",)),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "dot")),
    ("copy", ("memcpy", "memset", "copy")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "scatter", "gather", "transpose")),
)


def kind_of(name: str) -> str:
    """The kind of a device kernel by its name: pallas, gemm, copy, fusion or other."""
    low = name.lower()
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def device_events(trace: dict) -> list[dict]:
    """The complete ("X") events of the trace's device processes (names starting with
    ``/device:``), with ts/dur in microseconds."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if n.startswith(DEVICE_PREFIX)}
    return [e for e in events
            if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def summarize(events: list[dict], per: int = 1, top: int = 25) -> dict:
    """Kernel count, busy/span/idle microseconds, time by kind and the ``top`` costliest
    names; ``per``: divide counts and times by this (e.g. the decode steps traced)."""
    if not events:
        return {"kernels": 0, "note": "no device kernel events in the trace"}
    iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    span = max(e for _, e in iv) - min(s for s, _ in iv)
    busy = _busy_us(iv)
    kinds = collections.defaultdict(lambda: [0, 0.0])
    names = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        for table, key in ((kinds, kind_of(e["name"])), (names, e["name"])):
            table[key][0] += 1
            table[key][1] += float(e["dur"])
    costly = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "per": per, "kernels": len(events) / per, "span_us": span / per, "busy_us": busy / per,
        "idle_us": (span - busy) / per, "mean_kernel_us": busy / len(events),
        "by_kind": {k: {"kernels": c / per, "us": t / per} for k, (c, t) in sorted(kinds.items())},
        "top": [{"name": n, "kernels": c / per, "us": t / per, "kind": kind_of(n)}
                for n, (c, t) in costly],
    }


def load_trace(log_dir: str) -> dict:
    """The newest Perfetto trace JSON under ``log_dir`` (what ``jax.profiler.trace`` wrote
    with ``create_perfetto_trace=True``)."""
    paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


def profile(fn, per: int = 1, log_dir: str | None = None, top: int = 25) -> dict:
    """Run ``fn()`` (which must wait for its own results) once under the profiler and
    summarize its device kernels (``summarize``); the trace stays in ``log_dir`` when given."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        where = log_dir or tmp
        with jax.profiler.trace(where, create_perfetto_trace=True):
            fn()
        return summarize(device_events(load_trace(where)), per=per, top=top)
