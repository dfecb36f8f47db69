"""The memory plan: how many bytes the cache pools get, from a measurement of the step.

    pool = capacity - in use (the weights) - peak temporaries - margin

* **capacity** (GPU): ``gpu_memory_utilization`` x the device's memory. JAX's allocator may
  hand out ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of it (0.75 unless set); ``claim_device_memory``
  sets that fraction to the utilization before JAX starts its GPU backend (the CLI and the
  server call it first), and the capacity never exceeds what the allocator allows. CPU:
  the utilization x the host memory available at start.
* **peak temporaries**: the most device memory any of the engine's largest executables needs
  beyond its arguments (XLA's compiled memory analysis: temporaries plus outputs not aliased
  to the donated cache), measured by compiling them: the largest prefill dispatch at
  ``max_num_batched_tokens`` (one row, and the most rows) and the largest decode bucket at
  the widest page table. A first measurement uses a two-page probe pool (temporaries do
  not grow with the pool: the cache is donated and updated in place); the builder then
  compiles the same shapes at the planned pool (the executables warm-up runs) and checks
  them again before anything is allocated (``largest_shapes``, ``peak_bytes``). Measurements
  and the resolved plan are kept beside the compilation cache (``PeakMemo``), so a second
  start with the same settings compiles no probe and plans the same pages.
* **margin**: ``MARGIN_FRACTION`` of the capacity, at least ``MIN_MARGIN``: XLA's autotuning
  of executables compiled after the pool exists (warm-up's other shapes), the allocator's
  fragmentation, the sampler's and scheduler's small arrays.

On the CPU (the tests' and the quick start's device) the default pool is
``CPU_DEFAULT_CACHE_MEMORY`` at most, bounded by the sequences it needs; the measurement runs
only where that pool and the weights come within half of the capacity, where it could matter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

log = logging.getLogger(__name__)

DEFAULT_GPU_UTILIZATION = 0.9
JAX_DEFAULT_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset
MARGIN_FRACTION = 0.03
MIN_MARGIN = 1 << 30
CPU_DEFAULT_CACHE_MEMORY = 1 << 30
CPU_MARGIN = 256 << 20
GiB = float(1 << 30)


def claim_device_memory(utilization: float) -> None:
    """Let JAX's GPU allocator take ``utilization`` of the device (its
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``), unless the environment sets a fraction already.
    Effective only before JAX starts its GPU backend; harmless after (the plan then reads
    the allocator's own limit)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{utilization:.4g}")


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What the plan starts from: ``capacity`` (bytes the engine may use in all),
    ``in_use`` (resident now: the weights) and ``total`` (the device's memory: the GPU's as
    its allocator limit implies, the host's available memory on the CPU)."""

    capacity: int
    in_use: int
    on_gpu: bool
    total: int = 0

    @property
    def margin(self) -> int:
        if not self.on_gpu:
            return CPU_MARGIN
        return max(MIN_MARGIN, int(MARGIN_FRACTION * self.capacity))

    def free_for(self, peak: int) -> int:
        """Bytes left for the pools once ``peak`` temporaries and the margin are held."""
        return self.capacity - self.in_use - peak - self.margin


def device_memory(device, utilization: float, weights_bytes: int) -> DeviceMemory:
    """The capacity of ``device`` at ``utilization`` and the bytes resident on it (on a GPU
    the allocator's count, which includes the weights; on the CPU ``weights_bytes``)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if device.platform == "gpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                            JAX_DEFAULT_MEM_FRACTION))
            total = limit / fraction
            return DeviceMemory(int(min(limit, utilization * total)),
                                int(stats.get("bytes_in_use", weights_bytes)), True, int(total))
    host = _host_available() + weights_bytes
    return DeviceMemory(int(utilization * host), weights_bytes, False, host)


def device_counts(device) -> dict:
    """The allocator's counts (``device_bytes_in_use``, ``device_peak_bytes_in_use``,
    ``device_bytes_limit``) where the device keeps them (a GPU); empty elsewhere."""
    stats = (device.memory_stats() or {}) if device.platform == "gpu" else {}
    return {f"device_{k}": stats[k] for k in ("bytes_in_use", "peak_bytes_in_use",
                                              "bytes_limit") if k in stats}


def executable_peak(compiled) -> int:
    """Device bytes an executable needs beyond its arguments while it runs: temporaries,
    its code, and outputs not aliased to donated inputs."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    return int(m.temp_size_in_bytes + m.generated_code_size_in_bytes
               + max(0, m.output_size_in_bytes - m.alias_size_in_bytes))


MAX_COMPILE_THREADS = min(8, os.cpu_count() or 1)


def largest_shapes(runner, max_num_seqs: int, max_num_batched_tokens: int,
                   decode_steps: int) -> list[tuple]:
    """The runner's ``warmup_shapes`` whose executables need the most memory beside the
    cache: the largest decode bucket at the widest page table, and the largest prefill
    dispatches (one row of the largest chunk, and the most rows that share the area)."""
    shapes = runner.warmup_shapes(max_num_seqs, max_num_batched_tokens, (decode_steps,))
    decode = max((s for s in shapes if s[0] == "decode"), key=lambda s: (s[1], s[3]))
    prefill = [s for s in shapes if s[0] == "prefill"]
    one = max((s for s in prefill if s[1] == 1), key=lambda s: s[2])
    rows = max(prefill, key=lambda s: (s[1], s[2]))
    return [decode, one] + ([rows] if rows != one else [])


def peak_bytes(runner, shapes, abstract, every_variant: bool = False,
               register: bool = False) -> dict[tuple, int]:
    """Per shape, the most device memory (``memory.executable_peak``) its executables need
    beside their arguments, compiled by ``runner`` against ``abstract`` (the cache's shapes)
    on parallel threads (XLA compiles outside the GIL): every variant, or only the one with
    every feature (switched, else sampled); ``register``: the runner dispatches those
    shapes through these executables."""
    jobs = [(shape, greedy, switched) for shape in shapes
            for greedy, switched in (runner.variants.of(shape[0]) if every_variant
                                     else runner.variants.of(shape[0])[-1:])]

    def one(job):
        shape, greedy, switched = job
        return executable_peak(runner.compile_variant(shape, greedy, switched, abstract,
                                                      register=register))

    with ThreadPoolExecutor(max(1, min(MAX_COMPILE_THREADS, len(jobs)))) as pool:
        peaks = list(pool.map(one, jobs))
    out: dict[tuple, int] = {}
    for (shape, _, _), peak in zip(jobs, peaks):
        out[shape] = max(out.get(shape, 0), peak)
    return out


class PeakMemo:
    """Measured peaks and resolved plans, in memory and kept beside the compilation cache
    (one small JSON per key), so a second start with the same program skips the probe
    compiles and plans the same pools. ``None`` dir: this process only."""

    def __init__(self, directory: Path | None):
        self.dir = directory
        self.seen: dict[str, dict] = {}

    @staticmethod
    def key(*parts) -> str:
        from jfp8kv.engine.compile_cache import fingerprint

        return hashlib.sha256(repr((fingerprint(),) + parts).encode()).hexdigest()[:32]

    def get(self, key: str) -> int | None:
        record = self.get_record(key)
        try:
            return int(record["peak_bytes"]) if record is not None else None
        except (ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, peak: int) -> None:
        self.put_record(key, {"peak_bytes": peak})

    def get_record(self, key: str) -> dict | None:
        """The JSON object kept under ``key`` (this process's, else the directory's)."""
        if key in self.seen or self.dir is None:
            return self.seen.get(key)
        try:
            record = json.loads((self.dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def put_record(self, key: str, record: dict) -> None:
        self.seen[key] = record
        if self.dir is None:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"{key}.json").write_text(json.dumps(record))
        except OSError as e:
            log.warning("memory plan not kept (%s)", e)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The resolved plan, as ``cache_info`` reports it and start-up logs it."""

    capacity: int
    in_use: int
    peak: int | None  # measured peak temporaries (None: not measured)
    margin: int
    pool_budget: int
    source: str  # "measured", "kv_cache_memory", "cpu default"
    measured: str = ""  # which executables were measured
    total: int = 0  # the device's memory (DeviceMemory.total)

    def info(self) -> dict:
        return dataclasses.asdict(self)

    def line(self, tokens: int, slots: int) -> str:
        peak = "not measured" if self.peak is None else f"{self.peak / GiB:.2f} GiB"
        return (f"memory plan: capacity {self.capacity / GiB:.2f} GiB, in use (weights) "
                f"{self.in_use / GiB:.2f} GiB, peak temporaries {peak}"
                + (f" ({self.measured})" if self.measured else "")
                + f", margin {self.margin / GiB:.2f} GiB -> pools {self.pool_budget / GiB:.2f} "
                f"GiB ({self.source}): {tokens} tokens, {slots} sequence slots")


def params_bytes(params) -> int:
    """Bytes of a params pytree on one device (a sharded leaf counts its shard)."""
    total = 0
    for x in jax.tree.leaves(params):
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else x.size * x.dtype.itemsize
    return total
