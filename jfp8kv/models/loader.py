"""Model resolution: turn a ``--model`` string into config, params, tokenizer and KV scales.

``load_model`` accepts

- ``None`` or ``"smollm2-135m-instruct"``: the embedded default model (see ``hub.py``);
- a directory holding ``config.json`` and ``*.safetensors``: a Hugging Face checkpoint;
- a path ending in ``.gguf``: a llama.cpp GGUF file (dequantized to the compute dtype);
- ``random:<preset>``: a real architecture's shapes with random weights (``presets.py``).

Checkpoint naming lives in the loaders alone; the forward pass only sees the params pytree
documented in ``jfp8kv/models/transformer.py``. Nothing is downloaded from the hub. What
every loader returns is a ``loaded.LoadedModel`` (re-exported here).
"""

from __future__ import annotations

from pathlib import Path

from jfp8kv.config import check_compute_dtype
from jfp8kv.models import gguf_loader, hf_loader, hub
from jfp8kv.models.hub import DEFAULT_MODEL_NAME
from jfp8kv.models.loaded import LoadedModel
from jfp8kv.models.presets import load_random


__all__ = ["LoadedModel", "load_model"]


def load_model(model: str | None = None, dtype: str = "bfloat16",
               tensor_parallel_size: int = 1) -> LoadedModel:
    """Resolve ``model`` (see module docstring) and load it with weights in ``dtype``, each
    tensor placed straight onto its shards of a ``tensor_parallel_size`` mesh
    (``models/sharding.py``; ValueError naming the valid sizes when it does not fit)."""
    tp = dict(tensor_parallel_size=tensor_parallel_size)
    check_compute_dtype(dtype)
    if model is None or model.lower() == DEFAULT_MODEL_NAME:
        return gguf_loader.load_gguf(hub.default_gguf_path(), dtype, name=DEFAULT_MODEL_NAME,
                                     **tp)
    if model.lower().startswith("random:"):
        return load_random(model.split(":", 1)[1], dtype, **tp)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return gguf_loader.load_gguf(path, dtype, **tp)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is a directory without config.json; a Hugging Face checkpoint "
                "directory needs config.json and *.safetensors")
        return hf_loader.load_hf_dir(path, dtype, **tp)
    raise FileNotFoundError(
        f"cannot resolve model {model!r}: pass a Hugging Face checkpoint directory (with "
        f"config.json and *.safetensors), a path to a .gguf file, or the name "
        f"{DEFAULT_MODEL_NAME!r} (the embedded default)")
