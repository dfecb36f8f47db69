"""Outside peer: Hugging Face transformers ``generate`` with a static KV cache, on the shapes
the server benchmark uses (random weights, built from a local ``Qwen3Config``; no network).

For each model shape, batch and input length: random prompt ids (``--token-id-range``), greedy,
exactly ``--output-len`` new tokens (``min_new_tokens = max_new_tokens``, ``ignore_eos``-like),
``cache_implementation="static"``, bf16 weights instantiated directly on the device. One
warm-up ``generate`` runs first (same shapes with compile; without, the same batch and input
with ``--warmup-new-tokens`` new tokens, enough to warm the kernels), then ``--reps`` timed
ones (the median is reported).
``output_throughput`` = batch x output_len / generate wall time (prefill included, as the
server benchmark's output throughput includes prefill); ``tpot_ms`` = wall time / output_len.

``--compile off`` (default) sets ``generation_config.disable_compile`` so transformers does not
torch.compile the static-cache decode (its default for static caches in recent versions, which
costs minutes of compilation per new shape); ``--compile auto`` leaves transformers' default.
Each record says which setting (``compile_setting``) and whether torch.compile really ran
(``torch_compile``, from dynamo's graph counter; transformers auto-compiles only on
accelerators). ``--compile-last`` appends one ``auto`` config
(the first shape's batch and input) that runs only if ``--compile-min-s`` seconds of the
deadline remain.

Records go to the ``peer`` list of ``--out`` (rewritten after every config), with
``versions`` (torch, transformers, CUDA) and the device.

    python -m bench.peer_hf --shapes qwen3-8b,qwen3-0.6b --configs 8x512,1x512,8x2048 \\
        --output-len 128 --deadline-s 100 --out /tmp/peer-hf.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time


# The same shapes as jfp8kv's random:<preset> models (jfp8kv/models/presets.py); Qwen3's
# published configs. "tiny" is for CPU smoke tests only.
SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                 max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6),
}
EOS = 151645


def versions(torch) -> dict:
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__,
         "python": platform.python_version()}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
    return v


def build(shape: str, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(SHAPES[shape])
    eos = EOS if kw["vocab_size"] > EOS else kw["vocab_size"] - 1
    cfg = Qwen3Config(**kw, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                      use_cache=True, attn_implementation="sdpa")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=device).eval()
    bad = {str(p.dtype) for p in model.parameters()} - {str(dtype)}
    if bad:
        raise RuntimeError(f"parameters in {bad}, not {dtype}")
    model.generation_config.pad_token_id = eos
    model.generation_config.eos_token_id = eos
    return model


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_generate(model, torch, device, batch, input_len, output_len, compile_mode, reps,
                  token_range, seed, warm_new):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = token_range
    ids = torch.randint(lo, hi, (batch, input_len), generator=g).to(device)
    mask = torch.ones_like(ids)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
              min_new_tokens=output_len, do_sample=False, cache_implementation="static",
              num_beams=1)
    # transformers compiles static-cache decoding by default (recent versions); this switch is
    # a GenerationConfig field, set on the model's config so older versions just ignore it.
    model.generation_config.disable_compile = compile_mode == "off"

    def once(new=output_len):
        sync(torch, device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**{**kw, "max_new_tokens": new, "min_new_tokens": new})
        sync(torch, device)
        return time.perf_counter() - t, out.shape[1] - input_len

    graphs0 = _dynamo_graphs()
    warm_s, _ = once(warm_new)
    times, n_new = [], 0
    for _ in range(reps):
        t, n_new = once()
        times.append(t)
    return warm_s, times, n_new, _dynamo_graphs() - graphs0


def _dynamo_graphs() -> int:
    """torch.compile graphs built so far in this process: > 0 after a generate means that
    transformers really compiled (it auto-compiles only where it supports it)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    p.add_argument("--configs", default="8x512,1x512,8x2048,1x2048",
                   help="BATCHxINPUT list, run in this order for each shape")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--warmup-new-tokens", type=int, default=16,
                   help="new tokens of the warm-up generate without compile (with compile it "
                        "is --output-len: same shapes)")
    p.add_argument("--compile", default="off", choices=("off", "auto"))
    p.add_argument("--compile-last", action="store_true")
    p.add_argument("--compile-min-s", type=float, default=60.0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 30000))
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no new config after this many seconds")
    p.add_argument("--out", default="/tmp/peer-hf.json")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    ver = versions(torch)
    dev_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    doc = {"machine": {"device": dev_name, "host": platform.node()}, "versions": ver,
           "command": " ".join(["python", *sys.argv]), "peer": [], "errors": [], "skipped": []}

    def save():
        doc["elapsed_s"] = time.monotonic() - t0
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    def left():
        return (args.deadline_s or 1e9) - (time.monotonic() - t0)

    shapes = args.shapes.split(",")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    plan = [(s, [(b, i, args.compile) for b, i in configs]) for s in shapes]
    if args.compile_last and args.compile == "off":  # on the last shape: no rebuild
        plan[-1][1].append((configs[0][0], configs[0][1], "auto"))
    save()
    for shape, configs in plan:
        if left() <= 0:
            doc["skipped"].append(f"{shape}: deadline")
            continue
        try:
            tb = time.monotonic()
            model = build(shape, device, dtype)
            sync(torch, device)
            build_s = time.monotonic() - tb
            print(f"[{shape}] built on {device} in {build_s:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            doc["errors"].append(f"{shape} build: {type(e).__name__}: {e}")
            print(doc["errors"][-1], flush=True)
            save()
            continue
        for batch, inp, mode in configs:
            tag = f"{shape} B={batch} in={inp} out={args.output_len} compile={mode}"
            need = args.compile_min_s if mode == "auto" else 0.0
            if left() <= need:
                doc["skipped"].append(f"{tag}: deadline")
                print(doc["skipped"][-1], flush=True)
                continue
            try:
                if device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                warm_s, times, n_new, graphs = time_generate(
                    model, torch, device, batch, inp, args.output_len, mode, args.reps,
                    args.token_id_range, seed=batch * 100003 + inp,
                    warm_new=args.output_len if mode == "auto" else args.warmup_new_tokens)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
                print(doc["errors"][-1], flush=True)
                save()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                continue
            wall = statistics.median(times)
            rec = dict(
                impl=f"transformers {ver['transformers']} generate (torch {ver['torch']}, "
                     f"{args.dtype}), static cache" + (", torch.compile" if graphs > 0 else ""),
                model_shape=f"random:{shape}", batch=batch, input_len=inp,
                output_len=args.output_len, new_tokens=int(n_new),
                output_throughput=batch * args.output_len / wall,
                tpot_ms=wall / args.output_len * 1e3, e2e_s=wall, e2e_s_all=times,
                warmup_s=warm_s, warmup_new_tokens=args.output_len if mode == "auto"
                else args.warmup_new_tokens, reps=args.reps, dtype=args.dtype,
                cache_implementation="static", torch_compile=graphs > 0,
                compile_setting=mode, dynamo_graphs=graphs, attn_implementation="sdpa", greedy=True,
                model_build_s=build_s, device=dev_name,
                peak_memory_gb=(torch.cuda.max_memory_allocated() / 1e9
                                if device.startswith("cuda") else None),
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), versions=ver)
            if n_new != args.output_len:
                rec["note"] = f"generated {n_new} tokens, not {args.output_len}"
            doc["peer"].append(rec)
            print(f"{tag}: {rec['output_throughput']:.1f} tok/s ({wall:.2f} s; warm-up "
                  f"{warm_s:.1f} s; t={time.monotonic() - t0:.0f} s)", flush=True)
            save()
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
