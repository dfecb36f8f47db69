"""DeepSeek-V2/V3 MoE routing and blocks against transformers' modules (float32, isolated).

The whole block (router, routed experts, shared experts) runs on fresh random inputs and
weights; router biases and group limits are drawn so that they change some tokens' choice
(asserted), so a routing that ignores them fails.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.models import moe

D, I_SZ, E = 32, 16, 16


def _randomize(module, rng):
    import torch

    with torch.no_grad():
        for _, p in module.named_parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)
                                     / np.sqrt(p.shape[-1])))


def _params(block):
    """transformers' DeepSeek MoE module -> jfp8kv's layer params (weights [in, out])."""
    t = {k: v.detach().numpy() for k, v in block.named_parameters()}
    gate_up = t["experts.gate_up_proj"]  # [E, 2I, D]: gate rows first, then up
    lp = dict(router=t["gate.weight"].T,
              experts_gate=gate_up[:, :I_SZ].transpose(0, 2, 1),
              experts_up=gate_up[:, I_SZ:].transpose(0, 2, 1),
              experts_down=t["experts.down_proj"].transpose(0, 2, 1),
              shared_gate=t["shared_experts.gate_proj.weight"].T,
              shared_up=t["shared_experts.up_proj.weight"].T,
              shared_down=t["shared_experts.down_proj.weight"].T)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        lp["router_bias"] = bias.detach().numpy()
    return {k: jnp.asarray(np.ascontiguousarray(v)) for k, v in lp.items()}


def _compare(block, route, h, **kw):
    """Routed ids (as sets) and weights, then the block output, against transformers."""
    import torch

    lp = _params(block)
    with torch.no_grad():
        _, ref_w, ref_i = (x.numpy() for x in block.gate(torch.from_numpy(h)))
        ref_out = block(torch.from_numpy(h)).numpy()
    w, i = route(moe.router_logits(jnp.asarray(h.reshape(-1, D)), lp["router"]))
    w, i = np.asarray(w), np.asarray(i)
    o_ref, o = np.argsort(ref_i, -1), np.argsort(i, -1)
    np.testing.assert_array_equal(np.take_along_axis(i, o, -1),
                                  np.take_along_axis(ref_i, o_ref, -1))
    np.testing.assert_allclose(np.take_along_axis(w, o, -1),
                               np.take_along_axis(ref_w, o_ref, -1), rtol=1e-6, atol=1e-6)
    out = np.asarray(moe.deepseek_moe_mlp(jnp.asarray(h), lp, **kw))
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    return i


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_block_matches_transformers(norm):
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    rng = np.random.default_rng()
    kw = dict(top_k=4, n_group=4, topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=I_SZ, n_routed_experts=E,
                           num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                           norm_topk_prob=norm, routed_scaling_factor=2.5)
    block = DeepseekV3MoE(cfg).eval()
    _randomize(block, rng)
    bias = rng.standard_normal(E).astype(np.float32) * 0.3
    block.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    h = rng.standard_normal((3, 11, D)).astype(np.float32)
    ids = _compare(block, lambda lg: moe.deepseek_v3_route(lg, jnp.asarray(bias), **kw), h,
                   version=3, **kw)
    # The bias and the group limit both matter for these inputs.
    logits = moe.router_logits(jnp.asarray(h.reshape(-1, D)), _params(block)["router"])
    no_bias = np.asarray(moe.deepseek_v3_route(logits, jnp.zeros(E), **kw)[1])
    no_groups = np.asarray(moe.deepseek_v3_route(logits, jnp.asarray(bias), **{
        **kw, "topk_group": 4})[1])
    assert (np.sort(no_bias, -1) != np.sort(ids, -1)).any()
    assert (np.sort(no_groups, -1) != np.sort(ids, -1)).any()


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_block_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    rng = np.random.default_rng()
    kw = dict(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=1.5, topk_method=method)
    cfg = DeepseekV2Config(hidden_size=D, moe_intermediate_size=I_SZ, n_routed_experts=E,
                           num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                           routed_scaling_factor=1.5, topk_method=method)
    block = DeepseekV2Moe(cfg).eval()
    _randomize(block, rng)
    h = rng.standard_normal((3, 11, D)).astype(np.float32)
    ids = _compare(block, lambda lg: moe.deepseek_v2_route(lg, **kw), h, version=2, **kw)
    if method == "group_limited_greedy":
        logits = moe.router_logits(jnp.asarray(h.reshape(-1, D)), _params(block)["router"])
        greedy = np.asarray(moe.deepseek_v2_route(logits, **{**kw, "topk_method": "greedy"})[1])
        assert (np.sort(greedy, -1) != np.sort(ids, -1)).any()


def test_bad_group_settings_are_clear():
    logits = jnp.zeros((2, E))
    with pytest.raises(ValueError, match="n_group"):
        moe.deepseek_v3_route(logits, jnp.zeros(E), 2, n_group=5, topk_group=1,
                              norm_topk_prob=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="exceeds"):
        moe.deepseek_v2_route(logits, 9, topk_method="group_limited_greedy", n_group=4,
                              topk_group=2)
    with pytest.raises(ValueError, match="topk_method"):
        moe.deepseek_v2_route(logits, 2, topk_method="noaux_tc")
