"""K smoothing through both measurement paths on CPU: why they disagree (issue 36, point 2).

The two ways this project measures ``kv_rotation=smooth`` (docs/lab/quality-smooth.md):

* ``fake32``: transformers in float32 with the independent fake quantization
  (``bench.fakequant``; what ``bench.rotation_cpu`` runs), against its own float32 model;
* ``engine32`` / ``engine16``: ``jfp8kv.LLM`` with float32 / bfloat16 compute on the reference
  attention backend (what ``bench.quality`` runs on the GPU, there with Pallas kernels), against
  the same engine with an unquantized cache in the compute dtype.

Every path scores the same token windows, so their numbers differ only by the path, the
compute dtype and the smoothing means, which can be crossed: ``--means`` names where the means
come from (``fake32:N``: ``fakequant.MeanRecorder`` in float32 transformers over N held-out
tokens; ``engine32:N`` / ``engine16:N``: ``engine.calibrate.measure_amax`` with float32 /
bfloat16 weights; ``N``x``K``: N * K held-out tokens as K sequences of N, so positions
0..N-1 only), and every path runs every (mode, means) pair. Per run: mean-NLL increase
over the path's own baseline (pooled and per window), mean KL(baseline || run) per position,
greedy agreement. With means, the JSON also gets ``rope_pairs``: per RoPE channel pair,
its wavelength and the size of each source's mean and of their differences
(``rope_pair_stats``); ``--means-only`` stops there.

    python -m bench.smooth_cpu --windows cpu:3 --paths fake32,engine32,engine16 \\
        --means fake32:1024,engine16:2048 --configs fp8_e4m3:token,fp8_e4m3:block

Windows: ``cpu:N`` are ``bench.rotation_cpu``'s (paragraph starts 60k characters apart),
``gpu:N`` the first N of ``bench.quality``'s 1k-context windows (consecutive from the start
of the text); calibration text is both scripts' held-out slice (character 400,000 on). The
text is the running Python's ``pydoc_data.topics``, which differs between Python versions;
``--topics`` takes another version's ``topics.py`` (the GPU run of ``bench.quality`` ran
Python 3.12). Writes ``--out`` (default ``bench/results/smooth-cpu.json``; an existing file's runs of other
settings are kept) with the machine, versions and command.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np

from bench import fakequant as fq
from bench.common import RESULTS, command_line, write_result

WINDOW_STRIDE_CPU = 60_000  # bench.rotation_cpu's window spacing (characters)
CALIB_CHARS = 400_000  # both scripts' held-out calibration slice starts near here
PATHS = ("fake32", "engine32", "engine16")
ENGINE_DTYPES = {"engine32": "float32", "engine16": "bfloat16"}


# -- text ----------------------------------------------------------------------------------
def use_topics_file(path: str) -> None:
    """Make ``pydoc_data.topics`` (the text both benches read) the one in ``path``: another
    Python version's ``Lib/pydoc_data/topics.py`` (each version ships different text)."""
    import importlib.util
    import sys

    import pydoc_data

    spec = importlib.util.spec_from_file_location("pydoc_data.topics", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["pydoc_data.topics"] = mod
    pydoc_data.topics = mod
    from bench import quality

    quality.natural_text.cache_clear()


def text_id() -> dict:
    """The text's size and sha256 (which pydoc topics the windows were cut from)."""
    import hashlib

    t = fq.natural_text()
    return {"chars": len(t), "sha256": hashlib.sha256(t.encode()).hexdigest()}


def windows_of(spec: str, tok, tokens: int) -> tuple[list[list[int]], list[int]]:
    """``cpu:N`` / ``gpu:N`` -> (N windows of ``tokens`` ids, their character offsets)."""
    kind, _, n = spec.partition(":")
    n = int(n or 1)
    if kind == "cpu":
        offsets = [fq.paragraph_offset(i * WINDOW_STRIDE_CPU) for i in range(n)]
        return [fq.natural_text_ids(tok, tokens, o) for o in offsets], offsets
    if kind == "gpu":
        from bench.quality import text_windows

        return text_windows(tok, tokens, n, 0), [0] * n
    raise SystemExit(f"--windows wants cpu:N or gpu:N, got {spec!r}")


def calib_lists(tok, size: str) -> list[list[int]]:
    """``N`` -> [the first N ids of the held-out slice, as ``bench.quality`` cuts them];
    ``NxK`` -> its first N * K ids as K sequences of N (positions 0..N-1 in each)."""
    from bench.quality import text_windows

    n, _, k = size.partition("x")
    n, k = int(n), int(k or 1)
    ids = text_windows(tok, n * k, 1, CALIB_CHARS)[0]
    return [ids[i * n:(i + 1) * n] for i in range(k)]


# -- metrics -------------------------------------------------------------------------------
def log_softmax(logits) -> np.ndarray:
    """[T, V] -> log-probabilities, computed in float64, kept as float32 (memory)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def compare(base_lp: np.ndarray, lp: np.ndarray, ids: list[int]) -> dict:
    """One window: NLL [T-1] of ``ids[1:]`` under ``lp``, mean KL(base || lp), agreement."""
    nxt = np.asarray(ids[1:])
    rows = np.arange(len(nxt))
    b, q = np.asarray(base_lp, np.float64), np.asarray(lp, np.float64)
    kl = float((np.exp(b) * (b - q)).sum(-1).mean())
    agree = float((base_lp.argmax(-1) == lp.argmax(-1)).mean())
    return {"nll": -q[rows, nxt], "kl": kl, "agree": agree}


def summarize(base: list[dict], res: list[dict]) -> dict:
    pooled = lambda rs: float(np.concatenate([r["nll"] for r in rs]).mean())  # noqa: E731
    inc = lambda q, b: 100 * (pooled(q) / pooled(b) - 1)  # noqa: E731
    per = [round(inc([r], [b]), 4) for b, r in zip(base, res)]
    return {"mean_nll": pooled(res), "nll_increase_pct": round(inc(res, base), 4),
            "nll_increase_window_sem_pp": (round(float(np.std(per, ddof=1) / np.sqrt(len(per))),
                                                 4) if len(per) > 1 else None),
            "kl": round(float(np.mean([r["kl"] for r in res])), 6),
            "greedy_agreement": round(float(np.mean([r["agree"] for r in res])), 4),
            "windows": [{"nll_increase_pct": p, "kl": round(r["kl"], 6)}
                        for p, r in zip(per, res)]}


# -- the fake quantization (transformers, float32) --------------------------------------------
class FakePath:
    """transformers float32 + ``bench.fakequant``: log-probs of windows under a quantizer."""

    def __init__(self):
        from bench.rotation_cpu import load, resolve_gguf

        self.hf, _ = load(resolve_gguf("smollm2"))

    def logprobs(self, windows, quantizer):
        """Yields each window's log-probabilities [T-1, V] (one window in memory at a time)."""
        from bench.rotation_cpu import forward_lp

        for ids in windows:
            fq.set_quantizer(self.hf, quantizer)
            try:
                lp = forward_lp(self.hf, ids).numpy()
            finally:
                fq.set_quantizer(self.hf, None)
            yield lp

    def mean(self, lists) -> np.ndarray:
        """Post-RoPE K's mean over every token of the token lists (``MeanRecorder``)."""
        rec = fq.MeanRecorder()
        list(self.logprobs(lists, rec))
        return rec.mean()

    def run(self, windows, fmt, mode, k_mean):
        if mode in ("tensor", "channel"):
            raise SystemExit("smooth_cpu runs the dynamic modes (token, block) only")
        return self.logprobs(windows, fq.KVQuantizer(fmt, mode, k_mean=k_mean))


# -- the engine (jfp8kv.LLM, reference backend) ------------------------------------------------
class EnginePath:
    """``jfp8kv.LLM`` with ``dtype`` compute on the reference backend."""

    def __init__(self, dtype: str):
        from jfp8kv.models.loader import load_model

        self.dtype = dtype
        self.loaded = load_model(None, dtype)
        self.tmp = tempfile.mkdtemp(prefix="jfp8kv-smooth-")

    def mean(self, lists) -> np.ndarray:
        """The engine's smoothing shift over the token lists (``measure_amax``)."""
        from jfp8kv.engine.calibrate import measure_amax

        return measure_amax(self.loaded.config, self.loaded.params, lists,
                            kv_rotation="smooth").k_mean

    def _scales_file(self, k_mean) -> str:
        """A scales JSON carrying ``k_mean`` (the amax fields are not read by dynamic modes)."""
        from jfp8kv.kvcache.calibrate import KVAmax, fingerprint

        zeros = np.zeros_like(k_mean)
        path = os.path.join(self.tmp, f"mean-{abs(hash(k_mean.tobytes()))}.json")
        KVAmax(zeros, zeros, fingerprint(self.loaded.config), k_mean=k_mean,
               kv_rotation="smooth").to_json(path)
        return path

    def run(self, windows, cache_dtype, mode, k_mean):
        """Yields each window's log-probabilities [T-1, V] under one ``jfp8kv.LLM``."""
        import jfp8kv

        t = max(len(w) for w in windows)
        kw = {}
        if k_mean is not None:
            kw = dict(kv_rotation="smooth", kv_scales=self._scales_file(k_mean))
        llm = jfp8kv.LLM(loaded=self.loaded, dtype=self.dtype, kv_cache_dtype=cache_dtype,
                         kv_scale_mode=mode, max_model_len=t, kv_cache_memory=256 << 20,
                         page_size=16, max_num_seqs=1, max_num_batched_tokens=t,
                         attention_backend="reference", **kw)
        if k_mean is not None:
            got = np.stack([np.asarray(s) for s in llm.engine.runner.cache["kv"].k_shift])
            assert np.array_equal(got, k_mean), "the engine did not take the given means"
        for ids in windows:
            yield log_softmax(llm.nll(ids, chunk_size=t, return_logits=True)[1])


def mean_stats(means: dict) -> dict:
    """Per means source: the largest |mean| and its RMS; per pair: the largest difference."""
    sig = lambda x: float(f"{x:.4g}")  # noqa: E731
    out = {n: {"max_abs": sig(np.abs(m).max()), "rms": sig(np.sqrt((m.astype(np.float64) ** 2)
                                                                    .mean()))}
           for n, m in means.items()}
    names = list(means)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d = np.abs(means[a].astype(np.float64) - means[b])
            out[f"{a} vs {b}"] = {"max_abs_diff": sig(d.max()),
                                  "rms_diff": sig(np.sqrt((d ** 2).mean()))}
    return out


def rope_pair_stats(means: dict, rope_theta: float) -> list[dict]:
    """Per RoPE pair (channels i and i + D/2, rotated together at frequency
    theta^(-2i/D)): its wavelength in tokens, each source's RMS over layers and heads of the
    pair's mean vector, and the RMS of each two sources' difference. A pre-RoPE constant in a
    pair turns by 2 pi per wavelength, so its post-RoPE mean depends on the positions
    averaged over where the wavelength is not far longer than the calibration text."""
    m = {n: x.astype(np.float64) for n, x in means.items()}
    d = next(iter(m.values())).shape[-1]
    h = d // 2
    norm = lambda x: np.sqrt((x[..., :h] ** 2 + x[..., h:] ** 2).mean(axis=(0, 1)))  # noqa: E731
    names = list(m)
    cols = {n: norm(x) for n, x in m.items()}
    cols.update({f"{a} - {b}": norm(m[a] - m[b]) for i, a in enumerate(names)
                 for b in names[i + 1:]})
    wave = 2 * np.pi * rope_theta ** (np.arange(0, d, 2) / d)
    return [{"pair": i, "wavelength_tokens": round(float(wave[i]), 1),
             **{n: round(float(c[i]), 4) for n, c in cols.items()}} for i in range(h)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default="cpu:3", help="cpu:N or gpu:N (see the docstring)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per window")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--means", default="fake32:1024",
                    help="comma-separated SOURCE:N[xK], SOURCE one of fake32, engine32, "
                         "engine16 (where the smoothing means are measured), on N held-out "
                         "tokens (xK: N * K tokens cut into K sequences of N)")
    ap.add_argument("--configs", default="fp8_e4m3:token,fp8_e4m3:block")
    ap.add_argument("--means-only", action="store_true",
                    help="measure the means, write their statistics (with rope_pairs), stop")
    ap.add_argument("--no-unsmoothed", action="store_true",
                    help="skip the runs without smoothing (kv_rotation none)")
    ap.add_argument("--topics", default=None,
                    help="a pydoc_data/topics.py to take the text from (default: this "
                         "Python's; the GPU run of bench.quality used Python 3.12's)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "smooth-cpu.json"))
    args = ap.parse_args(argv)
    if args.topics:
        use_topics_file(args.topics)
    import jax
    import torch
    import transformers

    t0 = time.time()
    paths = args.paths.split(",")
    for p in paths:
        if p not in PATHS:
            raise SystemExit(f"--paths: {p!r} is not one of {list(PATHS)}")
    mean_specs = [m for m in args.means.split(",") if m]
    engines, fake = {}, None

    def engine(dtype):
        if dtype not in engines:
            engines[dtype] = EnginePath(dtype)
        return engines[dtype]

    if "fake32" in paths or any(m.startswith("fake32") for m in mean_specs):
        fake = FakePath()
    tok = engine("float32" if "engine32" in paths else "bfloat16").loaded.tokenizer
    windows, offsets = windows_of(args.windows, tok, args.tokens)
    means = {}
    for spec in mean_specs:
        src, _, n = spec.partition(":")
        lists = calib_lists(tok, n)
        if src == "fake32":
            means[spec] = fake.mean(lists)
        elif src in ENGINE_DTYPES:
            means[spec] = engine(ENGINE_DTYPES[src]).mean(lists)
        else:
            raise SystemExit(f"--means: unknown source {src!r}")
        print(f"means {spec}: max |mean| {np.abs(means[spec]).max():.3f} "
              f"({time.time() - t0:.0f}s)", flush=True)
    doc = {"description": __doc__.split("\n\n")[0], "runs": []}
    if os.path.exists(args.out):
        import json

        with open(args.out) as f:
            doc = json.load(f)
    doc["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    doc["versions"] = {"python": platform.python_version(), "jax": jax.__version__,
                       "torch": torch.__version__,
                       "transformers": transformers.__version__, "numpy": np.__version__}
    setting = {"windows": args.windows, "tokens": args.tokens, "offsets": offsets,
               "text": {"topics": args.topics or "this Python's pydoc_data.topics",
                        **text_id()},
               "calibration_from_chars": CALIB_CHARS, "command": command_line(),
               "means": mean_stats(means), "runs": []}
    if means:
        setting["rope_pairs"] = rope_pair_stats(
            means, float(next(iter(engines.values())).loaded.config.rope_theta))
    doc.setdefault("settings", []).append(setting)
    doc.pop("runs", None)
    if args.means_only:
        write_result(args.out, doc)
        for row in setting.get("rope_pairs", []):
            print(row, flush=True)
        return
    variants = ([] if args.no_unsmoothed else [None]) + mean_specs
    for path in paths:
        t = time.time()
        if path == "fake32":
            base = list(fake.logprobs(windows, None))
            runner = lambda fmt, mode, m: fake.run(windows, fmt, mode, m)  # noqa: E731
        else:
            eng = engine(ENGINE_DTYPES[path])
            base = list(eng.run(windows, "auto", None, None))
            runner = lambda fmt, mode, m: eng.run(windows, fmt, mode, m)  # noqa: E731
        base_s = [compare(b, b, ids) for b, ids in zip(base, windows)]
        setting[f"{path}_baseline_mean_nll"] = float(np.concatenate(
            [b["nll"] for b in base_s]).mean())
        print(f"{path}: baseline NLL {setting[f'{path}_baseline_mean_nll']:.5f} "
              f"({time.time() - t:.0f}s)", flush=True)
        jobs = [(spec, m) for spec in args.configs.split(",") for m in variants]
        for spec, m in jobs:
            t = time.time()
            fmt, _, mode = spec.partition(":")
            lp = runner(fmt, mode or None, None if m is None else means[m])
            res = [compare(b, x, ids) for b, x, ids in zip(base, lp, windows)]
            rec = {"path": path, "kv_cache_dtype": fmt, "kv_scale_mode": mode or None,
                   "kv_rotation": "none" if m is None else "smooth", "means": m,
                   **summarize(base_s, res)}
            setting["runs"].append(rec)
            write_result(args.out, doc)
            print(f"{path} {spec} {rec['kv_rotation']} {m or ''}: NLL "
                  f"{rec['nll_increase_pct']:+.3f}% (sem {rec['nll_increase_window_sem_pp']}) "
                  f"KL {rec['kl']:.5f} agree {rec['greedy_agreement']:.4f} "
                  f"({time.time() - t:.0f}s)", flush=True)
    setting["wall_s"] = round(time.time() - t0, 1)
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
