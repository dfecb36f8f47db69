"""Shared benchmark plumbing: paths, the machine record, and the device's measured ceilings.

Imports no jax at module level, so host-only tools (the serving matrix, merging, plotting)
stay light.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
RESULTS = os.path.join(ROOT, "bench", "results")


def nvidia_smi_gpu() -> str | None:
    """"name, memory.total, driver_version" of the first GPU from nvidia-smi, without
    initialising a JAX backend in this process (a server started next needs the memory);
    None without nvidia-smi or a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return q.stdout.strip().splitlines()[0] if q.stdout.strip() else None


def machine_info() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "host": platform.node(), "python": platform.python_version(),
            "versions": {"jax": jax.__version__,
                         "jaxlib": getattr(jaxlib, "__version__", "?")}}


def _median_seconds(f, *args, reps: int = 10) -> float:
    import jax

    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def copy_bandwidth_tbps(n_floats: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second, in TB/s), 4 GiB f32 on a
    GPU, 16 MiB elsewhere."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        n_floats = 1 << 22
    x = jax.random.normal(jax.random.key(0), (n_floats,), jnp.float32)
    return 2 * n_floats * 4 / _median_seconds(jax.jit(lambda x: x * 1.0001), x) / 1e12


def matmul_tflops(n: int = 8192, dtype: str = "bfloat16") -> float:
    """Dense matmul rate (2 n^3 FLOPs per product, in TFLOP/s) of an n x n x n ``dtype``
    product, f32 accumulation; n is cut to 512 off the GPU."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        n = min(n, 512)
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    return 2 * n**3 / _median_seconds(f, a, b) / 1e12


def command_line(module: str | None = None, argv: list[str] | None = None) -> str:
    """How this benchmark was started, as a shell line (``python -m bench.NAME ...``, after
    ``XLA_FLAGS=...`` when that is set: it changes what XLA compiles); a ``main(argv)``
    called in-process passes its module and argv."""
    env = [f"XLA_FLAGS={os.environ['XLA_FLAGS']}"] if os.environ.get("XLA_FLAGS") else []
    if argv is not None:
        return shlex.join(env + ["python", "-m", module or "bench", *argv])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    name = head[-1]
    if name.endswith(".__main__"):
        head[-1] = name[: -len(".__main__")]
    return shlex.join(env + head + sys.argv[1:])


def write_result(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def override_decode_tuning(variant: str | None = None, one_wave: bool = True) -> None:
    """For this process, make the engine's decode kernel tuning (it asks
    ``pallas_decode.default_tuning`` when it traces its steps) differ from the default:
    ``variant`` (e.g. "pagepf+asm+vmask") for fp8 pages; ``one_wave=False`` turns the
    no-split rule off (``DecodeTuning.unsplit_programs``), for an A/B in one run."""
    import dataclasses

    from jfp8kv.kernels import pallas_decode
    from jfp8kv.kernels.tiles import Variant

    default = pallas_decode.default_tuning
    parsed = Variant.parse(variant) if variant else None

    def tuning(cfg):
        t = default(cfg)
        if parsed is not None and cfg.is_fp8:
            t = dataclasses.replace(t, variant=parsed)
        return t if one_wave else dataclasses.replace(t, unsplit_programs=(0, 0))

    pallas_decode.default_tuning = tuning


def override_split_loop(on: bool | None) -> None:
    """For this process, set ``Variant.split_loop`` (full tiles in an unmasked loop of their
    own) in the decode and prefill kernels' default tunings, for an A/B in one run; None
    keeps the defaults."""
    if on is None:
        return
    import dataclasses

    from jfp8kv.kernels import pallas_decode, pallas_prefill

    for mod in (pallas_decode, pallas_prefill):
        def tuning(cfg, default=mod.default_tuning):
            t = default(cfg)
            return dataclasses.replace(t, variant=dataclasses.replace(t.variant,
                                                                      split_loop=on))

        mod.default_tuning = tuning


def override_gmm_tuning(sweep_path: str | None) -> list[dict]:
    """For this process, make ``pallas_gmm.gmm``'s tuning (it asks ``choose_tuning`` when it
    traces) the fastest one ``bench.gmm_tuning`` measured for the same (M, K, N, E): the
    ``best`` list of its result file at ``sweep_path``; other shapes keep the default. Each
    trace prints what it picked. None changes nothing. Returns the sweep's entries."""
    if not sweep_path:
        return []
    from jfp8kv.kernels import pallas_gmm

    with open(sweep_path) as f:
        best = json.load(f).get("best", [])
    table = {(b["M"], b["K"], b["N"], b["E"]): pallas_gmm.GmmTuning(**b["tuning"])
             for b in best}
    default = pallas_gmm.choose_tuning

    def tuning(m, num_groups, k, n):
        hit = table.get((m, k, n, num_groups))
        print(f"gmm tuning for M={m} K={k} N={n} E={num_groups}: "
              f"{hit or 'default (not in the sweep)'}", flush=True)  # once per trace
        return hit or default(m, num_groups, k, n)

    pallas_gmm.choose_tuning = tuning
    return best


def reserve_check(plan: dict, device: dict) -> dict:
    """The memory plan (``cache_info()["memory_plan"]``: capacity, in_use = the weights,
    peak = the step's measured temporaries, margin, pool_budget) against the device's peak
    bytes in use during the run (``device_peak_bytes_in_use``, ``device_bytes_limit``): the
    bytes held back for temporaries (peak + margin) and what the run used of them (the
    allocator's peak minus the weights and the pools), as fractions of the card's memory
    (the plan's ``total``). Empty without both."""
    need = ("capacity", "in_use", "peak", "margin", "pool_budget")
    if not all(isinstance(plan.get(k), (int, float)) for k in need) or \
            "device_peak_bytes_in_use" not in device:
        return {}
    gib = float(1 << 30)
    reserve = plan["peak"] + plan["margin"]
    used = device["device_peak_bytes_in_use"] - plan["in_use"] - plan["pool_budget"]
    card = plan.get("total") or device["device_bytes_limit"]
    return {"plan_line": (f"memory plan: capacity {plan['capacity'] / gib:.2f} GiB, in use "
                          f"(weights) {plan['in_use'] / gib:.2f} GiB, peak temporaries "
                          f"{plan['peak'] / gib:.2f} GiB, margin {plan['margin'] / gib:.2f} GiB"
                          f" -> pools {plan['pool_budget'] / gib:.2f} GiB"),
            "card_bytes": card, "reserve_bytes": reserve, "used_of_reserve_bytes": used,
            "device_peak_bytes_in_use": device["device_peak_bytes_in_use"],
            "over_reserve_fraction_of_card": (reserve - used) / card,
            "used_beyond_reserve_fraction_of_card": max(0.0, used - reserve) / card}
