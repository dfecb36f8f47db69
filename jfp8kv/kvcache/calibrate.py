"""Static fp8 scales: the K/V amax record, its scales JSON file, and amax -> scales.

Calibration (the forward pass lives in ``jfp8kv.engine.calibrate``) runs the model over
text with an unquantized (float32) paged cache; ``fold_amax`` then reads the pages back and
takes the absolute maximum of post-RoPE K and V per layer, KV head and channel. The JSON
file stores those amax values (format-independent); a scale for a given fp8 format is
``amax * headroom / fmax``. Tensor mode reduces over heads and channels.

With a K transform (``kv_rotation``, ``kvcache.k_transform``) the K amax is measured in the
basis K is stored in, and a smoothing transform also records ``k_mean`` (the mean of
post-RoPE K per layer, KV head and channel: the shift subtracted before storage); the file
says which transform its numbers belong to (``"kv_rotation"``, absent for "none").

    python -m jfp8kv.calibrate --model M --text FILE... --out scales.json [--headroom 1.0]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

from jfp8kv.kvcache import scale_modes
from jfp8kv.kvcache.cache import as_storage

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

# A short built-in text for automatic start-up calibration (written for this project).
BUILTIN_TEXT = """\
The old lighthouse stood at the end of a narrow spit of land, where the river met the sea.
For a hundred and twelve years its keepers had climbed the ninety-one steps each evening to
light the lamp, and each morning they wrote in a ledger what the weather had done during
the night: the direction of the wind, the height of the swell, the ships that passed.
When the station was automated in 1987, the last keeper, a retired schoolteacher named Ada
Lindqvist, carried the ledgers down the stairs in a wheelbarrow and donated them to the
county archive. Historians later used them to reconstruct the storms of the nineteenth
century, and a climate scientist counted how often the harbour froze: forty-three winters
before 1900, nine after 1950. Questions people ask about the place are simple. How far can
the light be seen? About eighteen nautical miles on a clear night. Why is the tower painted
in red and white bands? So that sailors can tell it apart from the church spire by day.
def keeper_log(date, wind, swell):
    entry = {"date": date, "wind": wind, "swell_m": round(swell, 1)}
    return json.dumps(entry, sort_keys=True)
Today the lighthouse is a small museum. Visitors may climb the stairs between May and
September, and on the first Saturday of each month the volunteers light the original
paraffin lamp, which burns with a warm, slightly flickering yellow flame.
"""


@dataclasses.dataclass(frozen=True)
class KVAmax:
    """Per-layer, per-KV-head, per-channel absolute maxima of post-RoPE K and V."""

    k: np.ndarray  # float32 [layers, kv_heads, head_dim]
    v: np.ndarray
    model_fingerprint: dict
    source: str = "calibration"
    k_mean: np.ndarray | None = None  # float32 [layers, kv_heads, head_dim] (smoothing)
    kv_rotation: str = "none"  # the K transform ``k`` was measured after

    def scales(self, storage_dtype: str, mode: str, headroom: float = 1.0):
        """Static scales [layers, kv_heads, head_dim] for a static ``mode``."""
        m = scale_modes.get(mode, storage_dtype)
        return (m.static_from_amax(self.k, headroom, storage_dtype),
                m.static_from_amax(self.v, headroom, storage_dtype))

    def to_json(self, path: str, headroom: float = 1.0) -> None:
        doc = {"format_version": FORMAT_VERSION, "model": self.model_fingerprint,
               "headroom": headroom, "source": self.source,
               "k_amax": np.round(self.k * headroom, 6).tolist(),
               "v_amax": np.round(self.v * headroom, 6).tolist()}
        if self.kv_rotation != "none":
            doc["kv_rotation"] = self.kv_rotation
        if self.k_mean is not None:
            doc["k_mean"] = np.asarray(self.k_mean, np.float32).tolist()
        with open(path, "w") as f:
            json.dump(doc, f)

    @classmethod
    def from_json(cls, path: str, expect_fingerprint: dict) -> "KVAmax":
        if not os.path.exists(path):
            raise FileNotFoundError(f"kv_scales file {path!r} does not exist")
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: not a jfp8kv scales file (format_version "
                             f"{doc.get('format_version')!r}, expected {FORMAT_VERSION})")
        fp = doc.get("model", {})
        if fp != expect_fingerprint:
            diff = {k: (fp.get(k), v) for k, v in expect_fingerprint.items() if fp.get(k) != v}
            raise ValueError(
                f"{path} was made for another model (file vs this model: {diff}); run "
                f"`python -m jfp8kv.calibrate --model <this model> --out scales.json`")
        mean = doc.get("k_mean")
        return cls(np.asarray(doc["k_amax"], np.float32), np.asarray(doc["v_amax"], np.float32),
                   fp, source=path, k_mean=None if mean is None else np.asarray(mean, np.float32),
                   kv_rotation=doc.get("kv_rotation", "none"))


def fingerprint(cfg) -> dict:
    return {"name": cfg.name, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size}


def fold_amax(cache, num_tokens: int, k_amax: np.ndarray, v_amax: np.ndarray) -> None:
    """Fold max |K| and |V| of the first ``num_tokens`` tokens of an unquantized cache into
    ``k_amax`` / ``v_amax`` (float32 [layers, kv_heads, head_dim]), in place.

    The tokens must sit in pages 1, 2, ... in order (page 0 is the padding sink); pages are
    laid out ``[kv_heads, num_pages, page_size, head_dim]`` (see ``cache.py``)."""
    cfg = cache.config
    for layer in range(cfg.num_layers):
        for pool, acc in ((cache.k[layer], k_amax), (cache.v[layer], v_amax)):
            x = np.asarray(as_storage(pool[:, 1:], cfg)).reshape(cfg.num_kv_heads, -1,
                                                                  cfg.head_dim)
            np.maximum(acc[layer], np.abs(x[:, :num_tokens]).max(axis=1), out=acc[layer])


def fold_k_sum(cache, num_tokens: int, k_sum: np.ndarray) -> None:
    """Add the sum over the first ``num_tokens`` tokens of an unquantized cache's K to
    ``k_sum`` (float64 [layers, kv_heads, head_dim]), in place; pages as ``fold_amax``."""
    cfg = cache.config
    for layer in range(cfg.num_layers):
        x = np.asarray(as_storage(cache.k[layer][:, 1:], cfg)).reshape(cfg.num_kv_heads, -1,
                                                                        cfg.head_dim)
        k_sum[layer] += x[:, :num_tokens].astype(np.float64).sum(axis=1)
