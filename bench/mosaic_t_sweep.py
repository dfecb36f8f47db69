"""The transposed Mosaic decode kernel (``lab.mosaic_decode_t``) with K upcast into
registers (``k_regs``): stage counts and programs per SM (``target_programs`` 264 = two
programs an SM, which its ~95 KB of shared memory allows at head_dim 128), beside the Triton
kernel, fp8 e4m3 token and tensor, at bench.kernels' four decode shapes; rows in one run,
``ratio_vs_triton`` per row. Usage (a GPU; ~140 s on the H200):
``OUT=dir python -m bench.mosaic_t_sweep`` -> dir/sweep-t.json (``BUDGET`` seconds, default
200, after which no new rows start). Results: bench/results/kernels-mosaic-t-sweep-h200.json."""
import os
import time

from bench.kernels import Bench
from lab.mosaic_decode_t import MosaicDecodeTTuning as T

SHAPES = [(64, 8192, 32, 8, 128), (8, 32768, 32, 8, 128), (64, 8192, 9, 3, 64),
          (32, 640, 16, 8, 128)]  # (batch, context, query heads, KV heads, head_dim)
SETTINGS = [("c1 st4 kregs", dict(upcast="compute", k_regs=True)),
            ("c1 st2 kregs", dict(upcast="compute", k_regs=True, stages=2)),
            ("c1 st3 kregs", dict(upcast="compute", k_regs=True, stages=3)),
            ("c1 st6 kregs", dict(upcast="compute", k_regs=True, stages=6)),
            ("c1 st4 kregs tp264", dict(upcast="compute", k_regs=True, target_programs=264)),
            ("c1 st2 kregs tp264",
             dict(upcast="compute", k_regs=True, stages=2, target_programs=264)),
            ("c1 st4 kregs tp396", dict(upcast="compute", k_regs=True, target_programs=396)),
            ("c2 st4 kregs tp264",
             dict(upcast="compute", k_regs=True, compute_wgs=2, target_programs=264))]


def main():
    out = os.path.join(os.environ["OUT"], "sweep-t.json")
    b = Bench(out, False)
    b.doc["compare"] = []
    t0 = time.time()
    for shape in SHAPES:
        batch, ctx, hq, hkv, d = shape
        for mode in ("token", "tensor"):
            rows = []
            for label, knobs in [("triton", None)] + SETTINGS:
                if time.time() - t0 > float(os.environ.get("BUDGET", "200")):
                    break
                impl = "jfp8kv" if knobs is None else "mosaic_t"
                try:
                    r = b.decode(impl, "float8_e4m3fn", mode, batch, ctx, hq, hkv, d,
                                 None if knobs is None else T(**knobs), where="compare")
                except Exception as e:  # noqa: BLE001 - a failing row is recorded, the rest run
                    print("ERR", label, e)
                    continue
                if r:
                    r["setting"] = label
                    rows.append(r)
            if rows and "ms" in rows[0]:
                for r in rows[1:]:
                    if "ms" in r:
                        r["ratio_vs_triton"] = round(r["ms"] / rows[0]["ms"], 3)
            b.save()
    print("done", round(time.time() - t0))


if __name__ == "__main__":
    main()
