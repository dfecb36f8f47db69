"""DeepSeek-V4 (family ``deepseek_v4``): the model's pure-jnp reference forward, prefill and
decode, over a per-sequence dense state (the twin the paged pools must reproduce).

Params (weights [in, out]; G = o_groups, n = hc_mult, c = 2*hd for CSA else hd)::

    embed [V, D], final_norm [D], lm_head [D, V], hc_head {fn [n*D, n], base [n], scale [1]}
    layers[i]: attn_norm, mlp_norm [D]; wq_a [D, q_lora], q_a_norm [q_lora],
      wq_b [q_lora, H*hd]; wkv [D, hd], kv_norm [hd]; wo_a [G, H*hd/G, o_lora],
      wo_b [G*o_lora, D]; sinks [H]; hc_attn, hc_ffn {fn [n*D, (2+n)*n], base, scale [3]};
      CSA / HCA: compressor {wkv, wgate [D, c], bias [m, c], norm [hd]};
      CSA: indexer {wkv, wgate [D, 2*dI], bias [m, 2*dI], norm [dI], wq_b [q_lora, nI*dI],
                    w_weights [D, nI]};
      MoE: router [D, E], router_bias [E] or (hash layers) tid2eid int32[V, k],
      experts_gate/experts_up [E, D, I], experts_down [E, I, D], shared_gate/shared_up [D, I],
      shared_down [I, D]

``forward(params, state, tokens, cfg)`` runs a chunk of T tokens of B sequences that share
their own positions (prefill: a fresh ``init_state``; decode: T = 1) and returns
(logits [B, T, V], new state). The state per layer is the last W-1 window rows and the
compressor / indexer ``CompressorState``: exactly what the paged pools hold per sequence.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.config import ModelConfig
from jfp8kv.kernels import v4_sparse
from jfp8kv.kvcache import v4_pools
from jfp8kv.models import v4_attention as va
from jfp8kv.models import v4_blocks as vb
from jfp8kv.models.layers import ONE_DEVICE, map_named


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """The state of ``batch`` empty sequences that may grow to ``max_len`` tokens: ``pos``
    int32 [B] zeros (tokens seen per sequence) and per layer the last W-1 window rows
    [B, W-1, hd] (row j holds position pos-W+1+j)
    and (CSA / HCA) the compressor and indexer ``CompressorState``s. Compressor state is
    float32 (or float64): it is an accumulator, not storage."""
    v4, hd = cfg.v4, cfg.head_dim
    sdt = jnp.promote_types(dtype, jnp.float32)
    layers = []
    for i in range(cfg.num_layers):
        kind, m = v4.layer_kind(i), v4.compress_ratios[i]
        ls = {"window": jnp.zeros((batch, v4.sliding_window - 1, hd), dtype)}
        if kind != "window":
            ls["compressor"] = va.empty_compressor(batch, hd, m, kind == "csa", max_len // m,
                                                   sdt)
        if kind == "csa":
            ls["indexer"] = va.empty_compressor(batch, v4.index_head_dim, m, True,
                                                max_len // m, sdt)
        layers.append(ls)
    return {"pos": jnp.zeros((batch,), jnp.int32), "layers": layers}


def _pooled(storage: str | None):
    """Rows as the window / compressed (``storage``) or indexer pools give them back."""
    if storage is None:
        return lambda x: x, lambda x: x
    return ((lambda x: v4_pools.read_rows(*v4_pools.store_rows(x, storage), x.dtype)),
            (lambda x: x.astype(v4_pools.INDEXER_DTYPE).astype(x.dtype)))


def _decode_kernel(q, keys, n_window: int, entries, chosen, pos, sinks, cfg, kind, interpret):
    """Decode (T = 1) attention through ``kernels.v4_sparse.sparse_decode``: the window rows
    keys[:, :n_window] (the last min(pos+1, W) visible) and the entries ``chosen`` marks,
    passed as indices into the flattened entries."""
    b, cap = entries.shape[:2]
    k = cap if kind == "hca" else min(cfg.v4.index_topk, cap)
    if kind == "window":
        entries, idx = jnp.zeros((1, cfg.head_dim), keys.dtype), jnp.full((b, 1), -1)
    else:
        vals, ids = jax.lax.top_k(chosen[:, 0].astype(jnp.int32), k)
        idx = jnp.where(vals > 0, ids + cap * jnp.arange(b)[:, None], -1)
        entries = entries.reshape(b * cap, -1)
    win_len = jnp.minimum(pos + 1, n_window).astype(jnp.int32)
    out = v4_sparse.sparse_decode(q[:, 0], keys[:, :n_window], None, win_len, entries, None,
                                  idx, sinks, cfg.head_dim ** -0.5, interpret=interpret)
    return out[:, None].astype(q.dtype)


def _window_after(keys, n_new, rows: int):
    """The ``rows`` window rows before each row's next position: keys [B, rows + T, hd]
    holds the old rows then the chunk's; row b keeps rows n_new[b] .. n_new[b] + rows - 1."""
    return jax.vmap(lambda k, n: jax.lax.dynamic_slice_in_dim(k, n, rows, 0))(keys, n_new)


def compressors(h, q_res, lp, ls, positions, n_new, cfg: ModelConfig, kind: str, freqs,
                storage, scorer=None):
    """A CSA / HCA layer's compressors over the chunk h [B, T, D] from the states in ``ls``
    ("compressor", CSA also "indexer"): returns (their new states, their pool writes, the
    entries [B, N, hd] after the chunk, the per-query arrays [B, T, ...] that choose among
    them (CSA: the indexer's "iq" [B, T, nI, dI] and "iw" [B, T, nI]), and ``pick``, which
    maps a query block of those to the bool [B, t, N] entries each query attends:
    ``va.blocked_attention``'s contract). A state whose ``entries`` capacity is 0 (the paged
    forward: entries live in the pools) gets none stored."""
    store, store_index = _pooled(storage)
    pos, eps = positions[:, 0], cfg.rms_norm_eps
    cp = lp["compressor"]
    cs, new, ids = va.compress_batch(ls["compressor"], pos, vb.linear(h, cp["wkv"]),
                                     vb.linear(h, cp["wgate"]), cp, eps, freqs, store, n_new)
    states, writes = {"compressor": cs}, {"compressor": (new, ids)}
    if kind == "hca":
        m = cp["bias"].shape[0]
        return (states, writes, cs.entries, {},
                lambda x: va.visible_entries(x["positions"], cs.entries.shape[1], m))
    ip = lp["indexer"]
    ist, new, ids = va.compress_batch(ls["indexer"], pos, vb.linear(h, ip["wkv"]),
                                      vb.linear(h, ip["wgate"]), ip, eps, freqs, store_index,
                                      n_new)
    states["indexer"], writes["indexer"] = ist, (new, ids)
    iq, iw = va.indexer_queries(h, q_res, positions, ip, cfg, freqs)
    return (states, writes, cs.entries, {"iq": iq, "iw": iw},
            lambda x: va.indexer_select(x["iq"], x["iw"], x["positions"], ist.entries, cfg,
                                        scorer))


def project(h, lp, positions, cfg: ModelConfig, kind: str, inv):
    """A layer's projections of h [B, T, D] (normalized): (q_res [B, T, q_lora] the query
    latent, q [B, T, H, hd] with RoPE, kv [B, T, hd] the window rows with RoPE, before
    storage rounding, and the layer's RoPE frequencies)."""
    b, t = h.shape[:2]
    hd = cfg.head_dim
    freqs = inv["main" if kind == "window" else "compress"]
    q_res = vb.rms_norm(vb.linear(h, lp["wq_a"]), lp["q_a_norm"], cfg.rms_norm_eps)
    q = vb.unweighted_rms_norm(vb.linear(q_res, lp["wq_b"]).reshape(b, t, -1, hd),
                               cfg.rms_norm_eps)
    q = vb.rope(q, positions, freqs)
    kv = vb.rope(vb.rms_norm(vb.linear(h, lp["wkv"]), lp["kv_norm"], cfg.rms_norm_eps),
                 positions, freqs)
    return q_res, q, kv, freqs


def output(out, lp, positions, freqs, cfg: ModelConfig):
    """The attention output [B, T, H, hd] (RoPE'd values) -> [B, T, D]: the inverse RoPE at
    the query's angle, then the grouped output projection."""
    return vb.grouped_output(vb.rope(out, positions, freqs, inverse=True), lp, cfg)


def _attention(h, lp, ls, positions, n_new, cfg: ModelConfig, kind: str, inv, storage,
               backend, query_block=None):
    """One layer's attention on h [B, T, D] (normalized), of which the first n_new[b]
    tokens of row b are real (the rest padding: they write nothing); returns (out
    [B, T, D], state, writes). Rows are stored first (rounded as their pools hold them),
    then attended; decode steps take the Pallas kernels unless ``backend`` is "reference".
    Projections and compressors run over all T tokens; the attention itself in blocks of
    ``query_block`` queries (``va.blocked_attention``; None: one block).
    ``writes``: what the pools receive, before storage rounding: "kv" [B, T, hd] (the
    window rows) and per compressor (entries [B, K, d], entry indices [B, K], -1: none)."""
    kernel = backend != "reference" and h.shape[1] == 1
    interpret = backend == "pallas_interpret"
    scorer = (functools.partial(v4_sparse.indexer_scores, interpret=interpret)
              if kernel else None)
    q_res, q, kv_raw, freqs = project(h, lp, positions, cfg, kind, inv)
    kv = _pooled(storage)[0](kv_raw)  # as the window pool gives it back
    rows = ls["window"].shape[1]
    keys = jnp.concatenate([ls["window"], kv.astype(ls["window"].dtype)], 1)
    new_ls, writes = {"window": _window_after(keys, n_new, rows)}, {"kv": kv_raw}
    entries, per_query, pick = None, {}, None
    if kind != "window":
        states, w, entries, per_query, pick = compressors(
            h, q_res, lp, ls, positions, n_new, cfg, kind, freqs, storage, scorer)
        new_ls.update(states)
        writes.update(w)
    if kernel:
        chosen = None if pick is None else pick(dict(per_query, positions=positions))
        out = _decode_kernel(q, keys, keys.shape[1],
                             keys[:, :0] if entries is None else entries.astype(keys.dtype),
                             chosen, positions[:, 0], lp["sinks"], cfg, kind, interpret)
    else:
        out = va.blocked_attention(q, positions, keys, entries, pick, per_query, lp["sinks"],
                                   cfg.v4.sliding_window, query_block)
    return output(out, lp, positions, freqs, cfg), new_ls, writes


def hidden_states(params, layers, tokens, pos, n_new, cfg: ModelConfig, storage, backend,
                  moe_backend=None, query_block=None, attention=None, mlp=None):
    """The layers on tokens [B, T] after ``pos`` [B] tokens, with per-layer states
    ``layers`` (``init_state``'s "layers"); the first n_new[b] tokens of row b are real.
    Returns (final-normed hidden [B, T, D], new layer states, per-layer pool writes:
    ``_attention``'s). ``moe_backend``: None (the reference MoE, expert weights gathered
    per token) or a ``kernels.grouped_matmul`` backend (grouped by expert). Each layer runs
    once over all T tokens (so the MoE reads each expert's weights once per chunk); only
    its attention runs in blocks of ``query_block`` queries (None: one block), which
    bounds the logits held at once. ``attention``: None (``_attention`` over the dense
    state), or ``attention(i, h, lp, layers[i], positions, n_new, kind, inv) -> (out
    [B, T, D], state, writes)`` for layer i (the paged forward's, which reads and writes
    the pools itself). ``mlp``: the MoE block's per-device hook (``layers.OneDevice.mlp``,
    the default: the block as it is)."""
    mlp = mlp or ONE_DEVICE.mlp
    b, t = tokens.shape
    v4 = cfg.v4
    positions = pos[:, None] + jnp.arange(t)[None]
    inv = {k: vb.rope_inv_freq(cfg, k) for k in ("main", "compress")}
    x = params["embed"][tokens]
    streams = jnp.broadcast_to(x[:, :, None], (b, t, v4.hc_mult, x.shape[-1]))
    new_layers, writes = [], []
    for i, lp in enumerate(params["layers"]):
        kind = v4.layer_kind(i)
        col, post, comb = vb.hc_pre(streams, lp["hc_attn"], cfg)
        x = vb.rms_norm(col, lp["attn_norm"], cfg.rms_norm_eps)
        if attention is None:
            a, ls, w = _attention(x, lp, layers[i], positions, n_new, cfg, kind, inv, storage,
                                  backend, query_block)
        else:
            a, ls, w = attention(i, x, lp, layers[i], positions, n_new, kind, inv)
        new_layers.append(ls)
        writes.append(w)
        streams = vb.hc_post(streams, a, post, comb)
        col, post, comb = vb.hc_pre(streams, lp["hc_ffn"], cfg)
        block = functools.partial(vb.moe, cfg=cfg, is_hash=v4.hash_layers[i],
                                  backend=moe_backend)
        f = mlp(lambda h, lp, tok, block=block: block(h, tok, lp),
                vb.rms_norm(col, lp["mlp_norm"], cfg.rms_norm_eps), lp, tokens)
        streams = vb.hc_post(streams, f, post, comb)
    h = vb.rms_norm(vb.hc_head(streams, params["hc_head"], cfg), params["final_norm"],
                    cfg.rms_norm_eps)
    return h, new_layers, writes


@functools.partial(jax.jit, static_argnames=("cfg", "storage", "backend"))
def forward(params, state, tokens, cfg: ModelConfig, storage: str | None = None,
            backend: str = "reference", n_new=None):
    """tokens int [B, T] continuing ``state`` -> (logits [B, T, V] float32-or-wider, state).
    ``n_new`` int32 [B] (None: all T): row b's first n_new[b] tokens are real, the rest
    padding that neither writes the state nor advances ``pos`` (its logits are garbage).
    ``storage``: None (rows kept in the compute dtype: the exact twin of transformers), or
    the window / compressed pools' dtype ("bfloat16", "float8_e4m3fn": e4m3 with per-32
    float16 scales), the indexer then bf16 (``jfp8kv.kvcache.v4_pools``). ``backend``:
    "reference" (jnp), "pallas" or "pallas_interpret" (decode steps through
    ``kernels.v4_sparse``; chunks of T > 1 stay jnp). Jitted with
    ``cfg`` / ``storage`` static; state shapes are fixed: one compile per chunk length."""
    n_new = jnp.full_like(state["pos"], tokens.shape[1]) if n_new is None else n_new
    h, layers, _ = hidden_states(params, state["layers"], tokens, state["pos"], n_new, cfg,
                                 storage, backend)
    logits = jnp.einsum("btd,dv->btv", h, params["lm_head"],
                        preferred_element_type=jnp.promote_types(h.dtype, jnp.float32))
    return logits, {"pos": state["pos"] + n_new, "layers": layers}


def _compressor_from_hf(get, prefix: str) -> dict[str, np.ndarray]:
    return {"wkv": get(prefix + "kv_proj.weight").T, "wgate": get(prefix + "gate_proj.weight").T,
            "bias": get(prefix + "position_bias"), "norm": get(prefix + "kv_norm.weight")}


def _hc_from_hf(get, prefix: str, names=("fn", "base", "scale")) -> dict[str, np.ndarray]:
    fn, base, scale = (get(prefix + n) for n in names)
    return {"fn": fn.T, "base": base, "scale": scale}


def layer_from_hf(get, i: int, cfg: ModelConfig) -> dict[str, Any]:
    """Layer ``i``'s params from transformers' DeepseekV4 tensor names; ``get(name)`` returns
    a numpy array (HF orientation, [out, in])."""
    p, v4 = f"model.layers.{i}.", cfg.v4
    a, mlp = p + "self_attn.", p + "mlp."
    g = v4.o_groups
    wo_a = get(a + "o_a_proj.weight")  # [G*o_lora, H*hd/G]
    lp = {"attn_norm": get(p + "input_layernorm.weight"),
          "mlp_norm": get(p + "post_attention_layernorm.weight"),
          "wq_a": get(a + "q_a_proj.weight").T, "q_a_norm": get(a + "q_a_norm.weight"),
          "wq_b": get(a + "q_b_proj.weight").T, "wkv": get(a + "kv_proj.weight").T,
          "kv_norm": get(a + "kv_norm.weight"), "sinks": get(a + "sinks"),
          "wo_a": wo_a.reshape(g, -1, wo_a.shape[-1]).transpose(0, 2, 1),
          "wo_b": get(a + "o_b_proj.weight").T,
          "hc_attn": _hc_from_hf(get, p + "attn_hc."), "hc_ffn": _hc_from_hf(get, p + "ffn_hc."),
          "router": get(mlp + "gate.weight").T}
    if v4.layer_kind(i) != "window":
        lp["compressor"] = _compressor_from_hf(get, a + "compressor.")
    if v4.layer_kind(i) == "csa":
        ix = a + "compressor.indexer."
        lp["indexer"] = dict(_compressor_from_hf(get, ix), wq_b=get(ix + "q_b_proj.weight").T,
                             w_weights=get(ix + "scorer.weights_proj.weight").T)
    if v4.hash_layers[i]:
        lp["tid2eid"] = get(mlp + "gate.tid2eid").astype(np.int32)
    else:
        lp["router_bias"] = get(mlp + "gate.e_score_correction_bias")
    gate_up = get(mlp + "experts.gate_up_proj")  # [E, 2I, D]
    inter = gate_up.shape[1] // 2
    lp.update(experts_gate=gate_up[:, :inter].transpose(0, 2, 1),
              experts_up=gate_up[:, inter:].transpose(0, 2, 1),
              experts_down=get(mlp + "experts.down_proj").transpose(0, 2, 1),
              shared_gate=get(mlp + "shared_experts.gate_proj.weight").T,
              shared_up=get(mlp + "shared_experts.up_proj.weight").T,
              shared_down=get(mlp + "shared_experts.down_proj.weight").T)
    return lp


def params_from_hf(get, cfg: ModelConfig, dtype=jnp.float32, put=None) -> dict[str, Any]:
    """The params pytree from transformers' DeepseekV4ForCausalLM tensor names (``get(name)``
    -> numpy, e.g. a state_dict or safetensors reader); float weights cast to ``dtype``,
    the hash tables stay int32. ``put(name, host)``: where each leaf goes (by its
    ``layers.map_named`` name; tensor parallelism's placer), else the default device."""
    tree = {"embed": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"),
            "lm_head": get("lm_head.weight").T,
            "hc_head": _hc_from_hf(get, "model.hc_head.", ("hc_fn", "hc_base", "hc_scale")),
            "layers": [layer_from_hf(get, i, cfg) for i in range(cfg.num_layers)]}
    put = put or (lambda name, x: jnp.asarray(x))
    return map_named(lambda name, x: put(name, np.ascontiguousarray(
        x, x.dtype if np.issubdtype(x.dtype, np.integer) else dtype)), tree)
