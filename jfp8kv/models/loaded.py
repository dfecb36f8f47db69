"""What every loader returns (``loader.load_model``, the HF / GGUF loaders, the random
presets): a model ready to run."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jfp8kv.config import ModelConfig


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """Everything needed to run a checkpoint.

    ``params``: the transformer pytree (weights [in, out], jnp arrays in the compute dtype,
    ``lm_head`` absent when embeddings are tied). ``tokenizer``: a transformers tokenizer
    (with the checkpoint's chat template when it has one). ``kv_scales``: checkpoint fp8
    scales ``{"k": float32[num_layers], "v": float32[num_layers]}`` or None when absent.
    ``tensor_parallel_size``: the mesh the params were loaded onto (``models/sharding.py``:
    a few leaves are stored in an order of that size).
    """

    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Any
    kv_scales: dict[str, np.ndarray] | None
    name: str
    tensor_parallel_size: int = 1
