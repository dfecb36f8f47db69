"""An independent fake quantization of the KV cache: numpy + ml_dtypes, and a transformers hook.

This is the reference the engine's fp8 cache is judged against, so it does not import
``jfp8kv.kvcache.fp8`` (or anything that does): it re-implements the numerics contract
from its text (docs/architecture.md, "Numerics contract"):

* quantize(x, s) = cast(clip(x * fl(1/s), -fmax, fmax)), round-to-nearest-even (ml_dtypes);
  dequantize(q, s) = float32(q) * s. fl(1/s) is IEEE float32 division, correctly rounded.
* tensor / channel: static float32 scales, one per (layer, KV head, channel); "tensor" is
  the same number for every head and channel of a layer.
* token: one dynamic float32 scale per (token, KV head): max(amax * fl(1/fmax), 1e-12),
  moved one float32 step up where amax * fl(1/s) would still exceed fmax (never saturates).
* block: one dynamic scale per (token, KV head, 32 channels), rounded *up* to float16
  (floored at 2^-24, capped at 65504), one float16 step up where it would still saturate.

NaN/inf inputs are not handled specially (real text has none).

K rotation (``KVQuantizer(..., rotate_k=True)``, issue 14): before K is quantized, every
post-RoPE K row x [D] becomes x @ R with R = diag(s) blockdiag(H_b) / sqrt(b): s the +-1
signs taken from the top bits of successive SplitMix64 outputs seeded with ``ROTATION_SEED``,
H_b the Sylvester Hadamard matrix of the largest power of two b dividing D (b >= 16), applied
as a fast Walsh-Hadamard transform (passes h = 1, 2, 4, ..., b/2, each mapping the pair
(x[i], x[i+h]) with i & h == 0 to (x[i] + x[i+h], x[i] - x[i+h])) and one multiply by
1/sqrt(b) rounded to the compute dtype (float32, or float64 for a float64 model). The
queries are rotated the same way, so q.k is unchanged; V is not rotated.

K smoothing (``KVQuantizer(..., k_mean=M)``): before the rotation (if any), the constant
M[layer] [H, D] (a calibrated per-KV-head, per-channel mean of post-RoPE K, ``MeanRecorder``)
is subtracted from every K row, in the compute dtype, and never added back: a query's scores
all move by the same q.M, so softmax (and attention) is unchanged while the large constant
channels leave the fp8 range. Stored K is ``rotate(k - M)`` (``rotate(k)`` without M).

``install(model)`` registers an attention function with transformers that fake-quantizes
the post-RoPE ``key``/``value`` [B, Hkv, T, D] of every layer before calling the stock sdpa
attention; ``set_quantizer(model, q)`` picks what it does (``None``: no quantization).
Text helpers (``natural_text``) live here too so the test and the benchmark share them.

It lives in bench/ and tests import it as ``bench.fakequant``, so dependencies run one way:
tests -> bench -> jfp8kv (and this module depends on no jfp8kv code at all).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np

F32 = np.float32
FORMATS = {  # user-facing name -> (ml_dtypes type, largest finite value)
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}
BLOCK = 32
ROTATION_SEED = 0x6A667038
SCALE_FLOOR = 1e-12
F16_TINY = 2.0**-24  # smallest positive float16 (subnormal)
F16_MAX = 65504.0


def cast_fp8(y: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating RNE cast of float32 ``y`` to ``fmt``; returns the fp8 array."""
    dt, m = FORMATS[fmt]
    return np.clip(y.astype(F32), -m, m).astype(dt)


def fake_quant(x: np.ndarray, s: np.ndarray, fmt: str) -> np.ndarray:
    """dequantize(quantize(x, s)): x float32, s broadcasts against x (compact shape)."""
    s = np.asarray(s, F32)
    inv = (F32(1) / s).astype(F32)
    return cast_fp8(x.astype(F32) * inv, fmt).astype(F32) * s


def _nudge_up(s: np.ndarray, amax: np.ndarray, fmax: float, step) -> np.ndarray:
    over = amax * (F32(1) / s) > F32(fmax)
    return np.where(over, step(s), s).astype(F32)


def token_scale(x: np.ndarray, fmt: str) -> np.ndarray:
    """x [..., D] -> float32 scales [..., 1]: one per row (token, head)."""
    fmax = FORMATS[fmt][1]
    amax = np.abs(x.astype(F32)).max(axis=-1, keepdims=True)
    s = np.maximum(amax * (F32(1) / F32(fmax)), F32(SCALE_FLOOR)).astype(F32)
    return _nudge_up(s, amax, fmax, lambda a: np.nextafter(a, F32(np.inf)))


def _f16_ceil(s: np.ndarray) -> np.ndarray:
    """Smallest float16 >= s (s float32, 2^-24 <= s <= 65504), as float32."""
    h = s.astype(np.float16)  # round to nearest
    h = np.where(h.astype(F32) < s, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(F32)


def block_scale(x: np.ndarray, fmt: str) -> np.ndarray:
    """x [..., D] -> float32 values of the float16 scales [..., D/32, 1]."""
    fmax = FORMATS[fmt][1]
    xb = x.astype(F32).reshape(*x.shape[:-1], -1, BLOCK)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    s = np.maximum(amax * (F32(1) / F32(fmax)), F32(SCALE_FLOOR))
    s = _f16_ceil(np.clip(s, F16_TINY, F16_MAX).astype(F32))
    up16 = lambda a: _f16_ceil(np.nextafter(a, F32(np.inf)))  # noqa: E731  next float16 up
    return np.minimum(_nudge_up(s, amax, fmax, up16), F32(F16_MAX))


def fake_quant_rows(x: np.ndarray, fmt: str, mode: str, static_scale=None) -> np.ndarray:
    """Fake-quantize K or V rows of one layer as the cache would store them.

    x: [B, H, T, D] float32 (transformers' layout). static_scale (tensor/channel): [H, D].
    """
    x = np.asarray(x, F32)
    if mode in ("tensor", "channel"):
        return fake_quant(x, np.asarray(static_scale, F32)[None, :, None, :], fmt)
    if mode == "token":
        return fake_quant(x, token_scale(x, fmt), fmt)
    if mode == "block":
        xb = x.reshape(*x.shape[:-1], -1, BLOCK)
        return fake_quant(xb, block_scale(x, fmt), fmt).reshape(x.shape)
    raise ValueError(f"unknown scale mode {mode!r}")


# -- K rotation ------------------------------------------------------------------------------
def rotation_signs(d: int, seed: int = ROTATION_SEED) -> np.ndarray:
    """+-1 [d]: sign i is + when the top bit of the i-th SplitMix64 output is set."""
    m = (1 << 64) - 1
    out, state = [], seed & m
    for _ in range(d):
        state = (state + 0x9E3779B97F4A7C15) & m
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(1.0 if (z ^ (z >> 31)) >> 63 else -1.0)
    return np.array(out)


def hadamard_rotate(x: np.ndarray, seed: int = ROTATION_SEED) -> np.ndarray:
    """x [..., D] -> x @ R (see the module docstring), in float32 (float64 stays float64)."""
    x = np.asarray(x)
    dt = np.promote_types(x.dtype, F32)
    d = x.shape[-1]
    b = d & -d
    if b < 16:
        raise ValueError(f"head_dim {d}: the rotation needs a multiple of 16")
    y = x.astype(dt) * rotation_signs(d, seed).astype(dt)
    idx = np.arange(d)
    h = 1
    while h < b:
        lo = idx[(idx & h) == 0]
        a, c = y[..., lo], y[..., lo + h]
        y = y.copy()
        y[..., lo], y[..., lo + h] = a + c, a - c
        h *= 2
    return y * dt.type(1.0 / np.sqrt(float(b)))


class KVQuantizer:
    """What the attention hook does to each layer's K and V (and the queries).

    static_k/static_v: [layers, H, D] float32 scales for tensor/channel modes (static K
    scales must be measured in the basis K is stored in: rotated when ``rotate_k``).
    rotate_k: rotate K (and the queries) by ``hadamard_rotate`` before quantizing.
    k_mean: [layers, H, D] float32 subtracted from K before the rotation (K smoothing).
    """

    def __init__(self, fmt: str, mode: str, static_k=None, static_v=None,
                 rotate_k: bool = False, k_mean=None, sink_tokens: int = 0):
        if mode in ("tensor", "channel") and (static_k is None or static_v is None):
            raise ValueError(f"mode {mode!r} needs static scales")
        self.fmt, self.mode = fmt, mode
        self.static_k, self.static_v = static_k, static_v
        self.rotate_k, self.k_mean = rotate_k, k_mean
        self.sink_tokens = sink_tokens  # an experiment: the first tokens left unquantized

    def __call__(self, layer: int, k: np.ndarray, v: np.ndarray):
        sk = None if self.static_k is None else self.static_k[layer]
        sv = None if self.static_v is None else self.static_v[layer]
        kq = fake_quant_rows(k, self.fmt, self.mode, sk)
        vq = fake_quant_rows(v, self.fmt, self.mode, sv)
        if self.sink_tokens:  # [B, H, T, D]: positions < sink_tokens keep their values
            n = self.sink_tokens
            kq = np.concatenate([np.asarray(k)[:, :, :n], np.asarray(kq)[:, :, n:]], axis=2)
            vq = np.concatenate([np.asarray(v)[:, :, :n], np.asarray(vq)[:, :, n:]], axis=2)
        return kq, vq


class AmaxRecorder:
    """A hook quantizer that quantizes nothing and records max |K| and |V| per layer, KV head
    and channel (K in the stored basis: smoothed by ``k_mean`` and rotated when asked):
    calibration for static scales."""

    def __init__(self, rotate_k: bool = False, k_mean=None):
        self.rotate_k, self.k_mean, self.k, self.v = rotate_k, k_mean, {}, {}

    def __call__(self, layer: int, k: np.ndarray, v: np.ndarray):
        for store, x in ((self.k, k), (self.v, v)):
            a = np.abs(np.asarray(x, F32)).max(axis=(0, 2))  # [B, H, T, D] -> [H, D]
            store[layer] = np.maximum(store.get(layer, a), a)
        return k, v

    def amax(self) -> dict:
        """{"k_amax": [layers, H, D], "v_amax": ...} as in a jfp8kv scales JSON."""
        return {f"{n}_amax": np.stack([d[i] for i in sorted(d)])
                for n, d in (("k", self.k), ("v", self.v))}


def static_scales(fmt: str, mode: str, num_layers: int, heads: int, head_dim: int,
                  constant: float | None = None, scales_json: str | None = None,
                  amax: dict | None = None):
    """[layers, H, D] K and V scales: a constant, or amax / fmax from a jfp8kv scales JSON
    or an ``AmaxRecorder.amax()`` dict (k_amax / v_amax per layer, head, channel; "tensor"
    takes the layer's maximum)."""
    shape = (num_layers, heads, head_dim)
    if constant is not None:
        s = np.full(shape, constant, F32)
        return s, s
    if amax is not None:
        doc = amax
    else:
        with open(scales_json) as f:
            doc = json.load(f)
    fmax = F32(FORMATS[fmt][1])

    def conv(amax):
        a = np.asarray(amax, F32)
        if mode == "tensor":
            a = np.broadcast_to(a.max(axis=(1, 2), keepdims=True), a.shape)
        return np.maximum(a / fmax, F32(SCALE_FLOOR)).astype(F32)

    return conv(doc["k_amax"]), conv(doc["v_amax"])


class MeanRecorder:
    """A hook quantizer that quantizes nothing and records the mean of post-RoPE K per layer,
    KV head and channel over every token it sees (float64 sums): K smoothing's calibration."""

    rotate_k, k_mean = False, None

    def __init__(self):
        self.sum, self.count = {}, {}

    def __call__(self, layer: int, k: np.ndarray, v: np.ndarray):
        x = np.asarray(k, np.float64)
        self.sum[layer] = self.sum.get(layer, 0.0) + x.sum(axis=(0, 2))  # [B,H,T,D] -> [H,D]
        self.count[layer] = self.count.get(layer, 0) + x.shape[0] * x.shape[2]
        return k, v

    def mean(self) -> np.ndarray:
        """[layers, H, D] float32."""
        return np.stack([self.sum[i] / self.count[i] for i in sorted(self.sum)]).astype(F32)


# -- transformers hook --------------------------------------------------------------------
ATTN_NAME = "jfp8kv_fakequant"


def _attention(module, query, key, value, attention_mask, **kwargs):
    """key/value: [B, Hkv, T, D] post-RoPE torch tensors; fake-quantized (K smoothed, then K
    and the query rotated, first when the quantizer says so), then stock sdpa."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = getattr(module, "jfp8kv_kv_quantizer", None)
    kdt, vdt = key.dtype, value.dtype
    mean = getattr(q, "k_mean", None)
    if mean is not None:  # in float32 (float64 stays float64), as the rotation
        ct = torch.float64 if key.dtype == torch.float64 else torch.float32
        m = torch.from_numpy(np.asarray(mean[module.layer_idx], F32)).to(ct)
        key = key.detach().cpu().to(ct) - m[None, :, None, :]
    if q is not None and getattr(q, "rotate_k", False):
        def rot(t):  # float32/float64 keep their dtype; others compute in float32
            a = t.detach().cpu()
            a = a if a.dtype in (torch.float32, torch.float64) else a.float()
            return torch.from_numpy(hadamard_rotate(a.numpy()))
        # K is quantized from the rotation's float32 result (never re-rounded to bf16 first);
        # the query goes back to its dtype for attention.
        query, key = rot(query).to(query.dtype), rot(key)
    if q is not None:
        k, v = q(module.layer_idx, key.detach().float().cpu().numpy(),
                 value.detach().float().cpu().numpy())
        key = torch.from_numpy(k).to(kdt)
        value = torch.from_numpy(v).to(vdt)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def install(model) -> None:
    """Route ``model``'s attention through the fake-quant hook (no quantizer set yet)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    model.set_attn_implementation(ATTN_NAME)
    set_quantizer(model, None)


def set_quantizer(model, quantizer) -> None:
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj"):
            m.jfp8kv_kv_quantizer = quantizer


def hf_nll(model, ids) -> np.ndarray:
    """Per-position next-token NLL [len(ids) - 1] from one full forward pass (float32)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, torch.tensor(list(ids[1:])),
                                                 reduction="none").numpy()


def exact_float64(model) -> None:
    """Make a float64 transformers Llama compute in float64 end to end.

    transformers' RMSNorm upcasts to float32 (a downcast for a float64 model) and its rotary
    embedding computes inverse frequencies and angles in float32. Both are replaced by the same
    formulas in float64 (inverse frequencies as ``1 / theta ** (arange(0, d, 2) / d)`` in numpy
    float64; default RoPE only), so the model has no float32 rounding step left and another
    float64 implementation of the same model agrees with it to ~1e-13.
    """
    import types

    import torch

    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError("exact_float64 supports the default RoPE only")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv = torch.from_numpy(1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d)))

    def rms_norm(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm"):
            m.forward = types.MethodType(rms_norm, m)
        elif name.endswith("RotaryEmbedding"):
            m.forward = types.MethodType(rotary, m)


# -- text ----------------------------------------------------------------------------------
def natural_text() -> str:
    """Python's own documentation topics: natural English prose shipped with CPython."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def paragraph_offset(chars: int) -> int:
    """The first paragraph start at or after character ``chars`` of ``natural_text()``."""
    text = natural_text()
    return 0 if chars == 0 else text.index("\n\n", chars) + 2


def natural_text_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """``n_tokens`` token ids of ``natural_text()`` from character ``offset`` on."""
    ids = tokenizer.encode(natural_text()[offset:offset + 12 * n_tokens])
    if len(ids) < n_tokens:
        raise ValueError(f"only {len(ids)} tokens from offset {offset}")
    return ids[:n_tokens]
