"""Grouped-matmul tunings on a model's exact expert shapes: ``pallas_gmm.gmm`` candidates.

    python -m bench.gmm_tuning --preset v4 --out bench/results/gmm-v4-sweep-h100.json
    python -m bench.gmm_tuning --preset qwen3-moe --out bench/results/gmm-qwen3-moe-sweep-h100.json
    python -m bench.gmm_tuning --preset smoke    # tiny shapes, interpret mode, CPU

``v4``: DeepSeek-V4-Flash's routed experts (E 256, top-6, D 4096, I 2048, bf16 operands,
f32 result as ``moe.grouped_experts`` runs them): the gate/up projection ``[M, 4096] x
[256, 4096, 2048]`` (gate and up share the shape) and the down projection ``[M, 2048] x
[256, 2048, 4096]``, at M = 512 x 6 = 3,072 rows (what a V4 prefill ran per call while
``v4_paged.forward`` split a 2,048-token chunk into four 512-token passes, every expert's
weights read four times per step) and M = 2,048 x 6 = 12,288 (what it runs now: each layer
once over the whole chunk). Rows go to experts by uniform random top-k (k distinct per
token).

Each candidate (a short list, pruned on the CPU by ``bench.ptx_stats --kernels gmm``: no
spills, shared memory within an SM, 16-byte pipelined weight loads) is compiled once and
checked, then a case's candidates are timed round-robin (``--calls`` rounds of ``--reps``
calls dispatched back to back), so a clock drift hits every one alike. Per candidate:
median ms, the weight-read rate (each hit expert's K x N bf16 read once, per second), the
fraction of the byte floor (weights + rows in + f32 rows out at the measured copy rate) and
the max abs error against a padded batched reference (every group's rows padded to the
largest group, one bf16 x bf16 -> f32 batched dot). ``best`` names the fastest candidate
within tolerance per case (``bench.common.override_gmm_tuning`` reads it), and
``step_estimate_ms`` adds up a V4 prefill step's grouped matmuls (layers x (2 gate/up + 1
down) x passes) to set against ``bench.prefill_profile``'s ``jfp8kv_gmm`` time. A candidate
that fails is recorded; those past ``--budget-s`` are skipped and listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jfp8kv.kernels import pallas_gmm

T = pallas_gmm.GmmTuning
# Candidates pruned by bench.ptx_stats --kernels gmm (sm_90, pip Triton 3.6): all keep the
# 16-byte cp.async weight loads pipelined, none spills, each fits >= 3 programs per SM.
# 512 tokens (12 rows per expert, choose_tm -> 16, mma.sync): rows inner (the default until
# 343b321), the column-inner grid (the default since), one row tile per expert (tm 32),
# 512-byte weight rows (tn 256), half the K steps. A record's ``default``: choose_tuning's.
FEW_ROWS = (T(), T(columns_inner=True), T(tm=32), T(tm=32, columns_inner=True),
            T(tn=256, num_warps=8), T(tn=256, num_warps=8, columns_inner=True),
            T(tk=128, num_warps=8))
# 2,048 tokens (48 rows per expert, choose_tm -> 64, wgmma)
WHOLE_CHUNK = (T(), T(columns_inner=True), T(num_warps=8), T(tn=256, num_warps=8))
# Qwen3-30B-A3B's experts (E 128, top-8): each side of choose_tuning's columns-inner range
# (8-64 rows per expert, measured on V4 only) and inside it: decode batches of 64 and 256
# rows (4 and 16 rows per expert), a 1,024-token chunk (64) and a 4,096-token one (256).
EITHER_ORDER = (T(), T(columns_inner=True))
PRESETS = {
    "v4": dict(d=4096, i=2048, e=256, k=6, layers=4, chunk=2048, sub_chunk=512,
               cases={512: FEW_ROWS, 2048: WHOLE_CHUNK}, estimate=(512, 2048)),
    "qwen3-moe": dict(d=2048, i=768, e=128, k=8, layers=48, chunk=4096, sub_chunk=4096,
                      cases={64: EITHER_ORDER, 1024: EITHER_ORDER, 4096: EITHER_ORDER,
                             256: EITHER_ORDER + (T(tm=32, columns_inner=True),)},
                      estimate=(1024, 4096)),
    "smoke": dict(d=64, i=48, e=8, k=2, layers=1, chunk=32, sub_chunk=16,
                  cases={16: (T(), T(tm=16, tn=32, tk=16, columns_inner=True)),
                         32: (T(columns_inner=True), T(tn=16, tk=32))}, estimate=(16, 32)),
}
PROJECTIONS = ("gate_up", "down")  # gate/up: [M, D] x [E, D, I]; down: [M, I] x [E, I, D]


def route(rng, tokens: int, e: int, k: int) -> np.ndarray:
    """int32[E] rows per expert of ``tokens`` tokens each routed to k distinct experts."""
    ids = np.argsort(rng.random((tokens, e)), axis=1)[:, :k].reshape(-1)
    return np.bincount(ids, minlength=e).astype(np.int32)


def normal(key, shape, scale: float = 1.0):
    """bf16 N(0, scale^2) made on the device (V4's 4.3 GB of weights: no host copy)."""
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)


def padded_reference(lhs, rhs, sizes: np.ndarray):
    """f32 [M, N]: each group's rows padded to the largest group, one batched bf16 x bf16 ->
    f32 dot over [E, cap, K] x [E, K, N], scattered back (rows past the sum stay 0)."""
    m, e = lhs.shape[0], sizes.shape[0]
    cap = max(1, int(sizes.max()))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    slot = np.arange(cap)[None, :]
    valid = slot < sizes[:, None]  # [E, cap]
    src = np.where(valid, starts[:, None] + slot, 0)
    x = jnp.where(jnp.asarray(valid)[..., None], lhs[jnp.asarray(src)], 0)
    y = jnp.einsum("eck,ekn->ecn", x, rhs, preferred_element_type=jnp.float32)
    flat = np.flatnonzero(valid.reshape(-1))
    out = jnp.zeros((m, rhs.shape[2]), jnp.float32)
    return out.at[jnp.asarray(src.reshape(-1)[flat])].set(y.reshape(e * cap, -1)[flat])


def time_round_robin(fns: dict, reps: int, calls: int) -> dict:
    """{key: median ms per call}: ``calls`` rounds, each dispatching ``reps`` calls of every
    (compiled, warmed) fn in turn and waiting for them; separate dispatches cannot be
    merged, and the host queues them ahead of the device."""
    samples = {key: [] for key in fns}
    for _ in range(calls):
        for key, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready([f() for _ in range(reps)])
            samples[key].append((time.perf_counter() - t) * 1e3 / reps)
    return {key: statistics.median(s) for key, s in samples.items()}


def run_case(doc, base: dict, operands, tunings, args, deadline, interpret: bool):
    """Compile, check and time ``tunings`` on one (projection, tokens) case."""
    lhs, rhs, sizes = operands
    ref = jax.block_until_ready(padded_reference(lhs, rhs, np.asarray(sizes)))
    ref_max = float(jnp.max(jnp.abs(ref)))
    recs, fns = {}, {}
    default = pallas_gmm.choose_tuning(base["M"], base["E"], base["K"], base["N"])
    for i, tuning in enumerate(tunings):
        filled = dataclasses.replace(
            tuning, tm=tuning.tm or pallas_gmm.choose_tm(base["M"], base["E"]))
        rec = dict(base, tuning=dataclasses.asdict(filled), default=(filled == default))
        if time.monotonic() > deadline:
            doc["skipped"].append(dict(base, tuning=rec["tuning"]))
            continue
        f = functools.partial(pallas_gmm.gmm, lhs, rhs, sizes, tuning=filled,
                              preferred_element_type=jnp.float32, interpret=interpret)
        try:
            out = jax.block_until_ready(f())  # compile; the check; a warm-up
            err = float(jnp.max(jnp.abs(out - ref)))
            finite = bool(jnp.isfinite(out).all())
            rec.update(max_abs_err=err, ref_max_abs=ref_max, finite=finite,
                       ok=finite and err <= args.tol * ref_max)
            fns[i] = f
        except Exception as exc:  # noqa: BLE001 - a failed config is a result too
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        recs[i] = rec
    for i, ms in time_round_robin(fns, args.reps, args.calls).items():
        r = recs[i]
        r.update(ms=round(ms, 4), weight_tbps=round(r["weight_bytes"] / ms / 1e9, 3),
                 floor_fraction=round(r["floor_ms"] / ms, 3))
    for r in recs.values():
        tun = " ".join(f"{k}={v}" for k, v in r["tuning"].items())
        print(f"{r['projection']} M={r['M']} {tun}: " + (
            f"ERROR {r['error'][:200]}" if "error" in r else
            f"{r['ms']:.4f} ms {r['weight_tbps']:.3f} TB/s weights, "
            f"floor {r['floor_fraction']:.3f}, max_abs_err {r['max_abs_err']:.3g}"
            + ("" if r["ok"] else " (NOT OK)")), flush=True)
    doc["records"].extend(recs.values())


def best_per_case(records: list[dict]) -> list[dict]:
    """The fastest correct record per (projection, M), with its speed-up over the default."""
    out = []
    for key in sorted({(r["projection"], r["M"]) for r in records}):
        rs = [r for r in records if (r["projection"], r["M"]) == key and r.get("ok")
              and "ms" in r]
        if not rs:
            continue
        win = min(rs, key=lambda r: r["ms"])
        default = next((r for r in rs if r["default"]), None)
        out.append(dict(projection=key[0], M=win["M"], K=win["K"], N=win["N"], E=win["E"],
                        tuning=win["tuning"], ms=win["ms"],
                        default_ms=None if default is None else default["ms"],
                        speedup=None if default is None else round(default["ms"] / win["ms"], 3)))
    return out


def step_estimate(best: list[dict], preset: dict) -> dict:
    """ms of a prefill step's grouped matmuls: layers x (2 gate/up + down) x passes, with
    the default (``choose_tuning``'s) and with the best tuning, by tokens per pass (the
    preset's ``estimate`` cases)."""
    est = {}
    for tokens in preset["estimate"]:
        rows = {b["projection"]: b for b in best if b["M"] == tokens * preset["k"]}
        if set(rows) != set(PROJECTIONS):
            continue
        passes = preset["chunk"] // tokens
        for which in ("default_ms", "ms"):
            if any(rows[p][which] is None for p in PROJECTIONS):
                continue
            per_layer = 2 * rows["gate_up"][which] + rows["down"][which]
            name = f"{tokens}_tokens_per_pass_{'default' if which == 'default_ms' else 'best'}"
            est[name] = round(preset["layers"] * passes * per_layer, 3)
    return est


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="v4")
    ap.add_argument("--out", default=None,
                    help="default bench/results/gmm-<preset>-sweep.json (smoke: /tmp)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="candidates not started by then are skipped and listed")
    ap.add_argument("--reps", type=int, default=5, help="gmm calls per timed sample")
    ap.add_argument("--calls", type=int, default=15, help="timed rounds")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="max abs error allowed, as a fraction of the reference's max abs")
    args = ap.parse_args(argv)
    smoke = args.preset == "smoke"
    if smoke:  # interpret mode on the CPU: a plumbing run, its times mean nothing
        args.reps, args.calls = 1, 2
    out = args.out or (f"/tmp/gmm-{args.preset}-sweep.json" if smoke
                       else f"bench/results/gmm-{args.preset}-sweep.json")
    preset = PRESETS[args.preset]
    deadline = time.monotonic() + args.budget_s
    doc = {"machine": common.machine_info(), "command": common.command_line(
        "bench.gmm_tuning", argv) if argv is not None else common.command_line(),
        "preset": args.preset, "records": [], "skipped": []}
    doc["versions"] = doc["machine"].pop("versions")
    tbps = common.copy_bandwidth_tbps()
    doc["copy_tbps"] = round(tbps, 3)
    d, i, e, k = (preset[x] for x in "diek")
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 3)
    rhs = normal(keys[0], (e, d, i), d ** -0.5)  # gate/up [E, D, I]; down: the same bytes
    weights = {"gate_up": rhs, "down": rhs.reshape(e, i, d)}
    for tokens, tunings in preset["cases"].items():
        sizes_np = route(rng, tokens, e, k)
        sizes, hit, m = jnp.asarray(sizes_np), int((sizes_np > 0).sum()), tokens * k
        for proj, key in zip(PROJECTIONS, keys[1:]):
            w = weights[proj]
            kk, n = w.shape[1:]
            a = normal(jax.random.fold_in(key, tokens), (m, kk))
            nbytes = hit * kk * n * 2 + m * kk * 2 + m * n * 4
            base = dict(projection=proj, tokens=tokens, M=m, K=kk, N=n, E=e, top_k=k,
                        experts_hit=hit, max_group=int(sizes_np.max()),
                        weight_bytes=hit * kk * n * 2, bytes=nbytes,
                        floor_ms=round(nbytes / (tbps * 1e12) * 1e3, 4))
            run_case(doc, base, (a, w, sizes), tunings, args, deadline, interpret=smoke)
            common.write_result(out, doc)  # partial results survive a kill
    doc["best"] = best_per_case(doc["records"])
    doc["step_estimate_ms"] = step_estimate(doc["best"], preset)
    common.write_result(out, doc)
    for b in doc["best"]:
        print(f"best {b['projection']} M={b['M']}: {b['tuning']} {b['ms']} ms "
              f"(default {b['default_ms']} ms, x{b['speedup']})")
    print(f"step estimate (ms of grouped matmuls per {preset['chunk']}-token step, "
          f"{preset['layers']} layers): {doc['step_estimate_ms']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
