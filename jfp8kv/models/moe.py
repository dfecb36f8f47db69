"""Mixture-of-experts MLP: routing functions and grouped expert matmuls.

Routing functions are pure: router logits ``[N, E]`` -> (weights ``[N, k]`` in the
accumulation dtype, expert ids ``int32[N, k]``).

* ``softmax_topk``: softmax over all experts, top-k, optionally renormalized (Qwen3-MoE).
* ``deepseek_v2_route``: softmax scores; ``greedy`` is plain top-k, ``group_limited_greedy``
  first keeps the ``topk_group`` groups whose best expert scores highest; weights times
  ``routed_scaling_factor``.
* ``deepseek_v3_route``: sigmoid scores; experts are *chosen* on score + correction bias
  inside the ``topk_group`` groups with the largest sum of their two best biased scores, but
  *weighted* by the unbiased score (renormalized when ``norm_topk_prob``), times
  ``routed_scaling_factor``.

Experts (``grouped_experts``): every (token, expert) assignment is kept (no capacity, no
dropping). Assignments are sorted by expert so that each expert's rows are contiguous, the
three SwiGLU matmuls run as grouped matmuls over the sorted rows (``kernels.grouped_matmul``:
``jax.lax.ragged_dot`` on the reference backend, ``pallas_gmm`` on the Pallas ones; one per
projection, no per-expert Python loop), and the rows are un-sorted and summed per token
with their router weights. Shapes are static (N*k rows), so it jits once per batch shape.

MoE layer params (weights [in, out] like the dense layers)::

    router [D, E], experts_gate [E, D, I], experts_up [E, D, I], experts_down [E, I, D]
    DeepSeek adds router_bias [E] (V3) and shared_gate/shared_up [D, Is], shared_down [Is, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfp8kv import kernels


def _acc(dtype):
    """float32, or float64 for the float64 check mode (as transformer.acc_dtype)."""
    return jnp.promote_types(dtype, jnp.float32)


def softmax_topk(logits, top_k: int, norm_topk_prob: bool):
    """Softmax over experts, keep the ``top_k`` largest; renormalize them to sum 1 if asked."""
    probs = jax.nn.softmax(logits.astype(_acc(logits.dtype)), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} must divide the number of experts {num_experts}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group} kept groups of "
                         f"{num_experts // n_group} experts")


def _group_mask(group_scores, topk_group: int, per_group: int):
    """bool[N, E]: True for experts in the ``topk_group`` best groups of ``group_scores``."""
    _, best = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.any(best[..., None] == jnp.arange(group_scores.shape[-1]), axis=-2)  # [N, G]
    return jnp.repeat(keep, per_group, axis=-1)


def deepseek_v2_route(logits, top_k: int, *, topk_method: str = "greedy", n_group: int = 1,
                      topk_group: int = 1, routed_scaling_factor: float = 1.0):
    """DeepSeek-V2 routing (``topk_method`` greedy or group_limited_greedy).

    Weights are not renormalized (transformers' DeepseekV2 ignores ``norm_topk_prob``, and the
    published V2 checkpoints set it false); they are scaled by ``routed_scaling_factor``.
    """
    n, e = logits.shape
    scores = jax.nn.softmax(logits.astype(_acc(logits.dtype)), axis=-1)
    if topk_method == "group_limited_greedy":
        _check_groups(e, top_k, n_group, topk_group)
        per_group = e // n_group
        group_best = jnp.max(scores.reshape(n, n_group, per_group), axis=-1)
        scores = jnp.where(_group_mask(group_best, topk_group, per_group), scores, 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"unknown DeepSeek-V2 topk_method {topk_method!r}; "
                         "supported: greedy, group_limited_greedy")
    weights, ids = jax.lax.top_k(scores, top_k)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)


def deepseek_v3_route(logits, bias, top_k: int, *, n_group: int, topk_group: int,
                      norm_topk_prob: bool, routed_scaling_factor: float):
    """DeepSeek-V3 routing: sigmoid scores, bias-corrected grouped choice, unbiased weights."""
    n, e = logits.shape
    _check_groups(e, top_k, n_group, topk_group)
    acc = _acc(logits.dtype)
    scores = jax.nn.sigmoid(logits.astype(acc))
    choice = scores + bias.astype(acc)
    per_group = e // n_group
    top2 = jax.lax.top_k(choice.reshape(n, n_group, per_group), min(2, per_group))[0]
    mask = _group_mask(jnp.sum(top2, axis=-1), topk_group, per_group)
    _, ids = jax.lax.top_k(jnp.where(mask, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)


def grouped_experts(x, ids, weights, w_gate, w_up, w_down, backend: str = "reference",
                    activation=None):
    """sum_j weights[n, j] * SwiGLU_{ids[n, j]}(x[n]) for every token n, without dropping.

    x [N, D]; ids int32[N, k]; weights [N, k]; w_gate/w_up [E, D, I]; w_down [E, I, D].
    Returns [N, D] in x's dtype. Gate/up outputs are rounded to x's dtype as the dense MLP
    does; the down projection, router weighting and the sum over k stay in the accumulation
    dtype and are rounded once. ``backend``: ``kernels.grouped_matmul``'s (``reference``:
    ``jax.lax.ragged_dot``; the Pallas backends: ``pallas_gmm``). ``activation(gate, up)``
    (both in the accumulation dtype; None: silu(gate) * up) replaces the SwiGLU product.
    """
    n, k = ids.shape
    num_experts = w_gate.shape[0]
    acc = _acc(x.dtype)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment rows grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // k]

    def mm(lhs, w):
        return kernels.grouped_matmul(lhs, w, sizes, acc, backend)

    gate = mm(rows, w_gate).astype(x.dtype)
    up = mm(rows, w_up).astype(x.dtype)
    if activation is None:
        mid = (jax.nn.silu(gate.astype(acc)) * up).astype(x.dtype)
    else:
        mid = activation(gate.astype(acc), up.astype(acc)).astype(x.dtype)
    out = mm(mid, w_down) * weights.reshape(-1)[order][:, None].astype(acc)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    return jnp.sum(out[inverse].reshape(n, k, -1), axis=1).astype(x.dtype)


def router_logits(h, router):
    """h [..., D] @ router [D, E] in the accumulation dtype."""
    return jnp.einsum("...d,de->...e", h, router, preferred_element_type=_acc(h.dtype))


def qwen3_moe_mlp(h, lp, cfg, backend: str = "reference"):
    """Qwen3-MoE sparse block on h [B, T, D] (already normalized); returns [B, T, D].
    ``backend`` picks the grouped matmul (``grouped_experts``)."""
    flat = h.reshape(-1, h.shape[-1])
    weights, ids = softmax_topk(router_logits(flat, lp["router"]), cfg.num_experts_per_tok,
                                cfg.norm_topk_prob)
    out = grouped_experts(flat, ids, weights, lp["experts_gate"], lp["experts_up"],
                          lp["experts_down"], backend)
    return out.reshape(h.shape)


def deepseek_moe_mlp(h, lp, *, version: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                     norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                     topk_method: str = "greedy", backend: str = "reference"):
    """DeepSeek-V2/V3 MoE block on h [B, T, D]: routed experts plus the shared expert(s).

    ``lp`` holds router [D, E], experts_* (as Qwen3-MoE), shared_gate/shared_up [D, Is],
    shared_down [Is, D] (the n_shared_experts fused into one SwiGLU of width Is) and, for V3,
    router_bias [E] (e_score_correction_bias). The router runs in the accumulation dtype.
    ``backend`` picks the grouped matmul (``grouped_experts``).
    """
    flat = h.reshape(-1, h.shape[-1])
    logits = router_logits(flat.astype(_acc(h.dtype)), lp["router"].astype(_acc(h.dtype)))
    if version == 3:
        weights, ids = deepseek_v3_route(logits, lp["router_bias"], top_k, n_group=n_group,
                                         topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                         routed_scaling_factor=routed_scaling_factor)
    elif version == 2:
        weights, ids = deepseek_v2_route(logits, top_k, topk_method=topk_method, n_group=n_group,
                                         topk_group=topk_group,
                                         routed_scaling_factor=routed_scaling_factor)
    else:
        raise ValueError(f"DeepSeek MoE version must be 2 or 3, got {version!r}")
    out = grouped_experts(flat, ids, weights, lp["experts_gate"], lp["experts_up"],
                          lp["experts_down"], backend)
    return out.reshape(h.shape) + swiglu(h, lp["shared_gate"], lp["shared_up"],
                                         lp["shared_down"])


def swiglu(h, w_gate, w_up, w_down):
    """down(silu(h @ w_gate) * (h @ w_up)) with the dense MLP's rounding points."""
    acc = _acc(h.dtype)

    def mm(x, w):
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=acc).astype(h.dtype)

    mid = jax.nn.silu(mm(h, w_gate).astype(acc)) * mm(h, w_up)
    return mm(mid.astype(h.dtype), w_down)


def moe_layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Param shapes of one routed-expert layer's MLP (for random-weight benchmarks)."""
    d, e, i_sz = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return dict(router=(d, e), experts_gate=(e, d, i_sz), experts_up=(e, d, i_sz),
                experts_down=(e, i_sz, d))
