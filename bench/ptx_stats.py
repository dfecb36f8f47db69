"""Static code statistics of the Pallas kernels (prefill, store, decode), without a GPU.

    pip install --no-deps --target /tmp/tritonpkg triton==3.6.0   # once (~170 MB)
    PYTHONPATH=/tmp/tritonpkg python -m bench.ptx_stats --kernels prefill
    PYTHONPATH=/tmp/tritonpkg python -m bench.ptx_stats --kernels store,decode
    PYTHONPATH=/tmp/tritonpkg python -m bench.ptx_stats --kernels gmm   # DeepSeek-V4's experts

Each configuration (storage x scale mode x tile shape x warps x upcast variant) is lowered
by Pallas for CUDA on this machine (``jit(...).trace(...).lower(lowering_platforms=
("cuda",))``, capturing the Triton IR Pallas emits), compiled for sm_90 by the pip Triton
and its ptxas, and measured: instructions in the key loop's PTX body (per thread, per
tile), the same normalized to warp-instructions per 1,000 (query row, key) pairs,
registers, spill bytes and shared memory; and the SASS (``cuobjdump -sass``: instructions
in all and in the key loop, counts of ``SASS_KEY_OPS``), which shows what one PTX line can
hide (a correctly rounded reciprocal's slow path). No timing: these numbers only rank candidates
for the GPU sweep (``python -m bench.kernels --sweep-prefill``); jaxlib's bundled Triton may
generate different code than the pip one.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels import cache_cfg, prologue_inputs
from jfp8kv.kernels import pallas_decode, pallas_gmm, pallas_prefill, pallas_store
from jfp8kv.kvcache.cache import KVCache


def capture_ttir(fn, *args):
    """The Triton IR modules Pallas emits while lowering ``fn`` for CUDA (private API)."""
    from jax._src.pallas.triton import lowering as tl

    captured = []
    orig = tl.lower_jaxpr_to_triton_module

    def cap(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    tl.lower_jaxpr_to_triton_module = cap
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        tl.lower_jaxpr_to_triton_module = orig
    return captured


def compile_ptx(ttir: str, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttir")
        with open(path, "w") as fh:
            fh.write(ttir)
        k = tcompile(path, target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as fh:
            fh.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", p, "-o", p + ".cubin"],
                           capture_output=True, text=True, check=True)
    return k.asm["ptx"], r.stdout + r.stderr, k.metadata.shared, k.asm["cubin"]


# SASS ops that PTX hides or that mark the costs discussed in docs/lab/kernels-notes.md: a PTX
# ``rcp.rn.f32`` is one line but a MUFU.RCP plus a slow-path CALL in SASS; LDS.U8 / PRMT are
# the byte transposes of fp8 B operands
SASS_KEY_OPS = ("MUFU", "CALL", "BRA", "BAR", "LDS.U8", "PRMT", "HMMA", "F2FP", "LDGSTS")


def sass_stats(cubin: bytes):
    """sm_90 SASS of a cubin (the pip Triton's ``cuobjdump -sass``): instructions in all, in
    the longest backward-branching block (a key loop, 0 if none) and counts of the
    ``SASS_KEY_OPS`` families."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", text)]
    loop = (0, -1)
    for addr, txt in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > loop[1] - loop[0]:
            loop = (int(m.group(1), 16), addr)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", txt).split()[0] for _, txt in ins)
    keys = {k: sum(n for op, n in ops.items() if op.startswith(k)) for k in SASS_KEY_OPS}
    return dict(sass_instr=len(ins),
                sass_loop_instr=sum(1 for a, _ in ins if loop[0] <= a <= loop[1]),
                sass_ops={k: n for k, n in keys.items() if n})


def loop_stats(ptx: str, ptxas_info: str):
    """The longest backward-branching block of the PTX (the key loop): its instructions."""
    lines = ptx.split("\n")
    labels = {ln.strip().split(":")[0]: i for i, ln in enumerate(lines)
              if re.match(r"^\$L__BB\d+_\d+:", ln)}
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"bra(\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            st = labels[m.group(2)]
            if best is None or i - st > best[1] - best[0]:
                best = (st, i)
    body = [ln.strip() for ln in lines[best[0]:best[1]]
            if ln.strip() and not ln.strip().startswith((".loc", "//", "$L", "{", "}"))]
    ops = collections.Counter(re.sub(r"^@!?%p\d+\s+", "", ln).split()[0] for ln in body)
    return dict(loop_instr=len(body),
                regs=int(re.search(r"Used (\d+) registers", ptxas_info).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", ptxas_info).group(1)),
                top_ops=ops.most_common(10))


def prefill_record(storage, mode, bm, bk, nw, ns, variant, hkv=8, d=128, hq=32):
    tun = pallas_prefill.PrefillTuning(bm, bk, nw, ns, variant=variant)
    cfg = cache_cfg(storage, mode, hkv, d, num_pages=64)
    static = np.ones((hkv, d), np.float32) if mode in ("tensor", "channel") else None
    layer = KVCache.init(cfg, static, static).layer(0)
    b, t = 2, 64
    args = (jnp.zeros((b, t, hq, d), jnp.bfloat16), layer, jnp.zeros((b, 8), jnp.int32),
            jnp.zeros((b,), jnp.int32), jnp.zeros((b, t), jnp.int32))
    f = functools.partial(pallas_prefill.prefill_attention, cfg=cfg, sm_scale=0.1, tuning=tun)
    rec = dict(kernel="prefill_attention", storage=storage, kv_scale_mode=mode, block_m=bm,
               block_k=bk, num_warps=nw, num_stages=ns, variant=variant,
               num_heads=hq, num_kv_heads=hkv, head_dim=d)
    try:
        (ttir,) = capture_ttir(lambda *a: f(*a), *args)
        ptx, info, shared, cubin = compile_ptx(ttir, nw, ns)
        rec.update(loop_stats(ptx, info), shared_bytes=shared, **sass_stats(cubin))
        rec["warp_instr_per_1k_pairs"] = round(rec["loop_instr"] * nw / (bm * bk) * 1000, 1)
    except Exception as e:  # noqa: BLE001 - a failed config is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def kernel_stats(ptx: str, ptxas_info: str):
    """Instructions of the whole kernel body (for loop-free kernels such as the store)."""
    body = [ln.strip() for ln in ptx.split("\n")]
    start = next(i for i, ln in enumerate(body) if ".entry" in ln) + 1
    body = [ln for ln in body[start:] if ln and not ln.startswith(
        (".loc", "//", "$L", "{", "}", ".reg", ".param", ".shared", ".file", ".section", "(",
         ")", ".maxntid", ".reqntid")) and not ln.startswith(".b8") and ln != "ret;"]
    ops = collections.Counter(re.sub(r"^@!?%p\d+\s+", "", ln).split()[0] for ln in body)
    return dict(kernel_instr=len(body), ops=dict(ops),
                regs=int(re.search(r"Used (\d+) registers", ptxas_info).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", ptxas_info).group(1)),
                top_ops=ops.most_common(12))


def store_record(storage, mode, fp8_cast, block_n=32, nw=4, hkv=8, d=128, prologue=False):
    """Static statistics of one store program (block_n tokens x one KV head, K and V);
    ``prologue``: the engine's fused store (``prologue_store``, 32 query heads, block_n 8)."""
    cfg = cache_cfg(storage, mode, hkv, d, num_pages=64)
    static = np.ones((hkv, d), np.float32) if mode in ("tensor", "channel") else None
    layer = KVCache.init(cfg, static, static).layer(0)
    n = 4 * block_n
    slots = jnp.arange(16, 16 + n, dtype=jnp.int32)
    if prologue:
        qkv = jnp.zeros((n, 4 * hkv + 2 * hkv, d), jnp.bfloat16)
        args = (qkv, prologue_inputs(n, d), layer, slots)
        f = functools.partial(pallas_store.prologue_store, cfg=cfg, block_n=block_n,
                              num_warps=nw, fp8_cast=fp8_cast)
    else:
        args = (layer, jnp.zeros((n, hkv, d), jnp.bfloat16),
                jnp.zeros((n, hkv, d), jnp.bfloat16), slots)
        f = functools.partial(pallas_store.store_kv, cfg=cfg, block_n=block_n, num_warps=nw,
                              fp8_cast=fp8_cast)
    rec = dict(kernel="prologue_store_kv" if prologue else "store_kv", storage=storage,
               kv_scale_mode=mode, fp8_cast=fp8_cast, block_n=block_n, num_warps=nw,
               num_kv_heads=hkv, head_dim=d)
    try:
        (ttir,) = capture_ttir(lambda *a: f(*a), *args)
        ptx, info, shared, cubin = compile_ptx(ttir, nw, 1)
        st = kernel_stats(ptx, info)
        ops = st.pop("ops")
        rec.update(st, shared_bytes=shared, **sass_stats(cubin),
                   cvt_satfinite=sum(v for k, v in ops.items() if "satfinite" in k))
        # K and V: 2 * block_n * d elements per program
        rec["warp_instr_per_1k_elems"] = round(st["kernel_instr"] * nw / (2 * block_n * d)
                                               * 1000, 1)
    except Exception as e:  # noqa: BLE001 - a failed config is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def decode_record(storage, mode, variant, bk=128, nw=4, ns=3, hq=32, hkv=8, d=128):
    """Static statistics of the decode key loop: per-thread instructions per tile, and bytes
    of K+V (+ token scales) per warp-instruction."""
    tun = pallas_decode.DecodeTuning(block_k=bk, num_warps=nw, num_stages=ns,
                                     variant=variant)
    cfg = cache_cfg(storage, mode, hkv, d, num_pages=64)
    static = np.ones((hkv, d), np.float32) if mode in ("tensor", "channel") else None
    layer = KVCache.init(cfg, static, static).layer(0)
    b = 2
    args = (jnp.zeros((b, hq, d), jnp.bfloat16), layer, jnp.zeros((b, 16), jnp.int32),
            jnp.zeros((b,), jnp.int32))
    f = functools.partial(pallas_decode.decode_attention, cfg=cfg, sm_scale=0.1, tuning=tun)
    rec = dict(kernel="decode_attention", storage=storage, kv_scale_mode=mode, block_k=bk,
               num_warps=nw, num_stages=ns, variant=variant, num_heads=hq, num_kv_heads=hkv,
               head_dim=d)
    try:
        (ttir,) = capture_ttir(lambda *a: f(*a), *args)
        ptx, info, shared, cubin = compile_ptx(ttir, nw, ns)
        rec.update(loop_stats(ptx, info), shared_bytes=shared, **sass_stats(cubin))
        item = jnp.dtype(storage).itemsize
        tile_bytes = 2 * bk * (d * item + (4 if mode == "token" else 0))
        rec["bytes_per_warp_instr"] = round(tile_bytes / (rec["loop_instr"] * nw), 2)
    except Exception as e:  # noqa: BLE001 - a failed config is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def prefill_jobs(quick: bool):
    shapes = [(64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8), (128, 32, 4)]
    # "asm" is left out: for prefill it compiles to the same PTX as "" (Triton already emits
    # the packed cvt.rn.f16x2.e4m3x2 for an e4m3 -> f16 astype on sm_90).
    configs = [("bfloat16", None, "")] + [
        ("float8_e4m3fn", "token", v) for v in ("", "vmask", "rowscale", "rowscale+vmask")] + [
        ("float8_e4m3fn", "tensor", v) for v in ("", "vmask")]
    if quick:
        shapes, configs = shapes[:1], [configs[0], configs[1]]
    return [functools.partial(prefill_record, st, mode, bm, bk, nw, 2, v)
            for st, mode, v in configs for bm, bk, nw in shapes]


def store_jobs(quick: bool):
    """bf16 vs each fp8 cast path (fp8.KERNEL_CASTS), every scale mode, e4m3 and e5m2."""
    jobs = [functools.partial(store_record, "bfloat16", None, "auto")]
    for st in ("float8_e4m3fn",) if quick else ("float8_e4m3fn", "float8_e5m2"):
        for mode in ("token",) if quick else ("token", "tensor", "block", "channel"):
            for cast in ("software", "hardware", "satfinite"):
                jobs.append(functools.partial(store_record, st, mode, cast))
    # the fused prologue store the engine runs, with the cast sm_90 takes ("satfinite")
    jobs.append(functools.partial(store_record, "bfloat16", None, "auto", block_n=8,
                                  prologue=True))
    for mode in ("token",) if quick else ("token", "tensor", "block", "channel"):
        jobs.append(functools.partial(store_record, "float8_e4m3fn", mode, "satfinite",
                                      block_n=8, prologue=True))
    return jobs


def decode_jobs(quick: bool):
    """Decode key loop at 32/8/128 (GQA 4) and 9/3/64 (GQA 3): bf16, fp8 token/tensor with
    the upcast / P.V variants, at 128-token tiles (and 32/64 for the multiply-reduce one)."""
    heads = [(32, 8, 128)] if quick else [(32, 8, 128), (9, 3, 64)]
    fp8_vars = [("pagepf", 128, 3), ("pagepf+asm", 128, 3), ("pagepf+asm+vmask", 128, 3),
                ("pagepf+asm+vmask", 128, 2), ("pagepf+asm+vmask", 64, 3),
                ("pagepf+asm+nomma", 32, 3), ("pagepf+asm+nomma", 128, 3)]
    if quick:
        fp8_vars = fp8_vars[1:3]
    jobs = []
    for hq, hkv, d in heads:
        hd = dict(hq=hq, hkv=hkv, d=d)
        jobs += [functools.partial(decode_record, "bfloat16", None, "pagepf", bk=bk, **hd)
                 for bk in (64, 128)]
        for mode in ("token", "tensor"):
            jobs += [functools.partial(decode_record, "float8_e4m3fn", mode, v, bk=bk, ns=ns,
                                       **hd) for v, bk, ns in fp8_vars]
    return jobs


SM90_SMEM = 227 * 1024  # shared memory one sm_90 SM gives its programs
SM90_REGS = 65536


def occupancy(regs: int, smem: int, num_warps: int) -> int:
    """Programs resident per sm_90 SM, from registers (allocated per warp in units of 256),
    shared memory (+1 KiB the runtime reserves per program), threads (2,048) and the 32-block
    cap."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(SM90_REGS // (per_warp * num_warps), SM90_SMEM // (smem + 1024),
               2048 // (32 * num_warps), 32)


def gmm_record(m, k, n, e, tuning: "pallas_gmm.GmmTuning"):
    """Static statistics of the grouped matmul's K loop for bf16 lhs [m, k] x rhs [e, k, n]
    (f32 out): registers, spills, shared memory, the pipelined loads (16-byte cp.async vs
    plain ld.global), the matrix instruction (wgmma or mma.sync), programs per SM and the
    weight bytes each SM has in flight (programs x prefetched stages x the rhs tile)."""
    t = tuning
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32))
    f = functools.partial(pallas_gmm.gmm, preferred_element_type=jnp.float32, tuning=t)
    rec = dict(kernel="gmm", M=m, K=k, N=n, E=e, tm=t.tm or pallas_gmm.choose_tm(m, e),
               tn=t.tn, tk=t.tk, num_warps=t.num_warps, num_stages=t.num_stages,
               columns_inner=t.columns_inner)
    try:
        (ttir,) = capture_ttir(lambda *a: f(*a), *args)
        ptx, info, shared, cubin = compile_ptx(ttir, t.num_warps, t.num_stages)
        rec.update(loop_stats(ptx, info), shared_bytes=shared, **sass_stats(cubin))
        rec.update({name: len(re.findall(pat, ptx)) for name, pat in (
            ("cp_async_16B", r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10"),
            ("cp_async_all", r"cp\.async\.c[ag]\.shared"), ("ld_global", r"ld\.global"),
            ("wgmma", r"wgmma\.mma_async"), ("mma_sync", r"mma\.sync"),
            ("wait_group", r"cp\.async\.wait_group"))})
        rec["programs_per_sm"] = occupancy(rec["regs"], shared, t.num_warps)
        rec["rhs_tile_bytes"] = t.tk * t.tn * 2
        rec["rhs_bytes_in_flight_per_sm"] = (rec["programs_per_sm"]
                                             * max(1, t.num_stages - 1) * t.tk * t.tn * 2)
    except Exception as e:  # noqa: BLE001 - a failed config is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


# DeepSeek-V4-Flash's routed experts as its prefill ran them in 512-token passes (512 tokens
# x 6 routes = 3,072 rows per call; 12,288 for a whole 2,048-token chunk, as it runs now).
GMM_SHAPES = {"gate_up": (3072, 4096, 2048, 256), "down": (3072, 2048, 4096, 256)}


def gmm_jobs(quick: bool):
    """On the gate/up shape: tm 16/32 x tn 128/256 x tk 64/128 plus a tn 64, a tk 32 and
    three tm 64 tiles (those at the whole-chunk M), each x warps 4/8 x stages 3/4/5; three
    on the down shape, one with the column-inner grid."""
    tiles = [(tm, tn, tk) for tm in (16, 32) for tn in (128, 256) for tk in (64, 128)]
    tiles += [(16, 64, 64), (16, 128, 32), (64, 128, 64), (64, 256, 64), (64, 128, 128)]
    grid = [(tm, tn, tk, nw, ns) for tm, tn, tk in tiles for nw in (4, 8) for ns in (3, 4, 5)]
    if quick:
        grid = [(16, 128, 64, 4, 3), (16, 256, 64, 8, 4)]
    m, k, n, e = GMM_SHAPES["gate_up"]
    jobs = [functools.partial(gmm_record, m if tm < 64 else 4 * m, k, n, e,
                              pallas_gmm.GmmTuning(tm=tm, tn=tn, tk=tk, num_warps=nw,
                                                   num_stages=ns))
            for tm, tn, tk, nw, ns in grid]
    m, k, n, e = GMM_SHAPES["down"]
    jobs += [functools.partial(gmm_record, m, k, n, e,
                               pallas_gmm.GmmTuning(tm=16, tn=tn, tk=64, num_warps=nw, num_stages=3,
                                                    columns_inner=ci))
             for tn, nw, ci in ((128, 4, False), (128, 4, True), (256, 8, False))]
    return jobs


JOBS = {"prefill": prefill_jobs, "store": store_jobs, "decode": decode_jobs, "gmm": gmm_jobs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="prefill",
                    help=f"comma list of {list(JOBS)} (default prefill)")
    ap.add_argument("--out", default=None, help="default bench/results/<kernels>-ptx-stats.json")
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    args = ap.parse_args()
    import triton

    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - set(JOBS)
    if unknown:
        raise SystemExit(f"unknown --kernels {sorted(unknown)}; choose from {list(JOBS)}")
    out = args.out or f"bench/results/{'-'.join(kernels)}-ptx-stats.json"
    doc = {"machine": f"{platform.node()} (no GPU: static compile for sm_90)",
           "versions": {"jax": jax.__version__, "triton": triton.__version__,
                        "python": platform.python_version()},
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "records": []}
    for job in [j for k in kernels for j in JOBS[k](args.quick)]:
        rec = job()
        doc["records"].append(rec)
        print({k: v for k, v in rec.items() if k != "top_ops"}, flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
