"""Where a test run's time goes: a pytest plugin that charges JAX's compile events to tests.

    pytest -q -n 2 -p tests.compile_profile --compile-profile=DIR
    python -m tests.compile_profile DIR          # the summary: per file, per function

Each process (every xdist worker) writes ``DIR/<worker>.jsonl``, one line per test: its
wall seconds (setup + call + teardown) and, from ``jax.monitoring`` duration events, the
seconds and count of tracing, lowering to MLIR and XLA backend compiles, and persistent
cache hits, with the backend compile seconds per compiled function name. Subprocesses
the tests start (servers, the tensor-parallel child) are charged only as their test's wall.
Nothing here changes what a test does; without the option the plugin does nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load"}


class _Recorder:
    def __init__(self, out: Path):
        self.out = out
        self.current: dict | None = None  # the running test's record

    def on_duration(self, event: str, duration: float, **kwargs) -> None:
        kind = EVENTS.get(event)
        if kind is None or self.current is None:
            return
        rec = self.current
        rec[kind] = rec.get(kind, 0.0) + duration
        rec[kind + "_n"] = rec.get(kind + "_n", 0) + 1
        if kind == "compile":
            name = str(kwargs.get("fun_name", "?"))
            rec["funs"][name] = rec["funs"].get(name, 0.0) + duration


def pytest_addoption(parser):
    parser.addoption("--compile-profile", default=None,
                     help="directory for per-test JAX compile times (tests/compile_profile.py)")


def pytest_configure(config):
    out = config.getoption("--compile-profile")
    if not out:
        return
    import jax

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(out).mkdir(parents=True, exist_ok=True)
    rec = _Recorder(Path(out) / f"{worker}.jsonl")
    jax.monitoring.register_event_duration_secs_listener(rec.on_duration)
    config._compile_profile = rec


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    rec = getattr(item.config, "_compile_profile", None)
    if rec is None:
        yield
        return
    rec.current, start = {"test": item.nodeid, "funs": {}}, time.perf_counter()
    yield
    rec.current["wall"] = time.perf_counter() - start
    with open(rec.out, "a") as f:
        f.write(json.dumps(rec.current) + "\n")
    rec.current = None


def summarize(directory: str, top: int = 40) -> None:
    rows = [json.loads(line) for p in sorted(Path(directory).glob("*.jsonl"))
            for line in p.read_text().splitlines() if line]
    keys = ("wall", "trace", "lower", "compile", "cache_load")
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    funs: collections.Counter = collections.Counter()
    fun_n: collections.Counter = collections.Counter()
    for r in rows:
        c = per_file[r["test"].split("::")[0]]
        for k in keys:
            c[k] += r.get(k, 0.0)
        c["compile_n"] += r.get("compile_n", 0)
        c["tests"] += 1
        for name, s in r["funs"].items():
            funs[name] += s
            fun_n[name] += 1
    total = collections.Counter()
    for c in per_file.values():
        total.update(c)
    print(f"{len(rows)} tests; " + ", ".join(f"{k} {total[k]:.0f} s" for k in keys)
          + f", {total['compile_n']} backend compiles")
    print(f"\n{'file':60s} {'tests':>5s} " + " ".join(f"{k:>9s}" for k in keys) + "   n_comp")
    for path, c in sorted(per_file.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        print(f"{path:60s} {c['tests']:5d} " + " ".join(f"{c[k]:9.1f}" for k in keys)
              + f" {c['compile_n']:8d}")
    print("\nbackend compile seconds by function (tests compiling it)")
    for name, s in funs.most_common(top):
        print(f"{s:8.1f} s {fun_n[name]:5d}  {name}")
    print("\nslowest tests")
    for r in sorted(rows, key=lambda r: -r.get("wall", 0))[:top]:
        print(f"{r.get('wall', 0):7.1f} s compile {r.get('compile', 0):6.1f} s "
              f"({r.get('compile_n', 0)})  {r['test']}")


if __name__ == "__main__":
    summarize(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
