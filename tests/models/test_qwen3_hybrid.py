"""Qwen3.5/3.6 hybrid MoE (qwen3_5_moe): the gated delta rule against a float64 reference
written from its equations and against transformers' torch functions; chunked == recurrent
token by token; config parsing (the multimodal text_config nesting); and the whole model
over the paged cache plus DeltaNet state slots against transformers' logits (one-shot,
chunked and token-by-token decode, unequal batch with padding rows)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import CacheConfig, ModelConfig
from jfp8kv.kernels import delta_rule
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.kvcache.state_pool import DeltaState, bytes_per_slot, state_config
from jfp8kv.models import qwen3_hybrid, transformer
from jfp8kv.models.loader import load_model
from tests.models.test_parity import LENGTHS, PAGE, assert_paged_paths_match
from tests.tiny_checkpoints import randomize, save_with_tokenizer


def _inputs(rng, b=2, t=21, hk=2, hv=4, dk=8, dv=6):
    q = rng.standard_normal((b, t, hk, dk))
    k = rng.standard_normal((b, t, hk, dk))
    v = rng.standard_normal((b, t, hv, dv))
    g = -rng.uniform(0.0, 1.5, (b, t, hv))
    beta = rng.uniform(0.0, 1.0, (b, t, hv))
    s0 = rng.standard_normal((b, hv, dk, dv)) * 0.3
    return q, k, v, g, beta, s0


def _reference(q, k, v, g, beta, s0):
    """float64, one token at a time, written from the equations (delta_rule's docstring)."""
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    out = np.zeros(v.shape)
    s = s0.copy()
    for bi in range(b):
        for h in range(hv):
            st = s[bi, h]
            for i in range(t):
                qi, ki = q[bi, i, h * hk // hv], k[bi, i, h * hk // hv]
                qi = qi / np.sqrt(qi @ qi + 1e-6) / np.sqrt(dk)
                ki = ki / np.sqrt(ki @ ki + 1e-6)
                st = np.exp(g[bi, i, h]) * st
                u = beta[bi, i, h] * (v[bi, i, h] - st.T @ ki)
                st = st + np.outer(ki, u)
                out[bi, i, h] = st.T @ qi
            s[bi, h] = st
    return out, s


def test_delta_rule_forms_equal_a_float64_reference():
    rng = np.random.default_rng()
    args = _inputs(rng)
    want, want_s = _reference(*args)
    f32 = [jnp.asarray(a, jnp.float32) for a in args]
    for name, fn in (("recurrent", delta_rule.recurrent),
                     ("chunked", functools.partial(delta_rule.chunked, chunk=8))):
        out, s = jax.jit(fn)(*f32)
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-4, atol=2e-4, err_msg=name)
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=2e-4, atol=2e-4, err_msg=name)
    # chunked prefill of 13 tokens, then the recurrent decode step token by token
    head = [a[:, :13] for a in f32[:5]]
    out, s = jax.jit(functools.partial(delta_rule.chunked, chunk=4))(*head, f32[5])
    outs = [np.asarray(out)]
    step = jax.jit(delta_rule.recurrent)
    for i in range(13, 21):
        o, s = step(*[a[:, i:i + 1] for a in f32[:5]], s)
        outs.append(np.asarray(o))
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=2e-4, atol=2e-4)


def test_unit_lower_solve_without_lapack_on_the_cpu():
    """The chunk system's solve: forward substitution on the CPU (jaxlib's LAPACK solve can
    deadlock two concurrent callers on a 2-thread pool) equals the triangular solve, and the
    compiled chunked rule calls no LAPACK."""
    rng = np.random.default_rng()
    a = np.tril(rng.uniform(-1, 1, (3, 16, 16)), -1) + np.eye(16)
    rhs = rng.standard_normal((3, 16, 5))
    got = jax.jit(jax.vmap(delta_rule._unit_lower_solve))(jnp.asarray(a), jnp.asarray(rhs))
    want = np.linalg.solve(a, rhs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    args = [jnp.asarray(x, jnp.float32) for x in _inputs(rng)]
    hlo = jax.jit(functools.partial(delta_rule.chunked, chunk=8)).lower(*args).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]*)"', hlo)
    assert not [t for t in targets if "lapack" in t.lower()], targets


def test_delta_rule_matches_transformers_torch_functions():
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    rng = np.random.default_rng()
    args = [a.astype(np.float32) for a in _inputs(rng, t=70)]
    tq = [torch.from_numpy(a) for a in args]
    out, s = jax.jit(delta_rule.chunked)(*[jnp.asarray(a) for a in args])
    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        ref, ref_s = fn(*tq[:3], g=tq[3], beta=tq[4], initial_state=tq[5],
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), rtol=1e-4, atol=1e-4)


def test_causal_conv_continues_across_chunks_and_ignores_padding():
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 11, 5)).astype(np.float32)
    w = rng.standard_normal((5, 4)).astype(np.float32)
    full, _ = delta_rule.causal_conv(x, np.zeros((1, 3, 5), np.float32), w, np.array([11]))
    padded = np.concatenate([x[:, :6], rng.standard_normal((1, 3, 5))], 1).astype(np.float32)
    a, st = delta_rule.causal_conv(padded, np.zeros((1, 3, 5), np.float32), w, np.array([6]))
    b, _ = delta_rule.causal_conv(x[:, 6:], st, w, np.array([5]))
    np.testing.assert_allclose(np.concatenate([a[:, :6], b], 1), full, rtol=1e-6, atol=1e-6)
    xp = np.pad(x[0], ((3, 0), (0, 0)))
    want = np.stack([(xp[i:i + 4] * w.T).sum(0) for i in range(11)])
    np.testing.assert_allclose(np.asarray(full[0]), want / (1 + np.exp(-want)), rtol=1e-5,
                               atol=1e-6)


TEXT = dict(vocab_size=384, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                 partial_rotary_factor=0.25))


def test_config_from_multimodal_and_text_checkpoints():
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
              "text_config": dict(TEXT, model_type="qwen3_5_moe_text"),
              "vision_config": {"depth": 2}}
    flat = dict(TEXT, architectures=["Qwen3_5MoeForCausalLM"])
    a, b = ModelConfig.from_hf_dict(nested), ModelConfig.from_hf_dict(flat)
    assert a == b and a.family == "qwen3_5_moe" and a.hybrid.attention_layers == (1, 3)
    assert (a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, a.rope_theta) == (
        8, 2, True, 1e6)
    assert a.hybrid.conv_dim == 2 * 2 * 16 + 4 * 16 and qwen3_hybrid.rotary_dim(a) == 8
    interval = dict(flat, layer_types=None, full_attention_interval=2)
    assert ModelConfig.from_hf_dict(interval).hybrid.layer_types == a.hybrid.layer_types
    with pytest.raises(ValueError, match="linear_attention or full_attention"):
        ModelConfig.from_hf_dict(dict(flat, layer_types=["sliding_attention"] * 4))
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_hf_dict(dict(flat, linear_num_key_heads=3))
    st = state_config(a.hybrid, num_slots=5)
    assert DeltaState.init(st).nbytes() == 5 * bytes_per_slot(st)
    with pytest.raises(ValueError, match="float32"):
        state_config(a.hybrid, 5, "float8_e4m3fn")


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TEXT))
    randomize(model, seed=3)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("tiny-qwen3.5-moe"),
                               tiny_tokenizer_dir)


@functools.partial(jax.jit, static_argnames="cfg")
def _logits(params, cache, state, tok, pos, slots, pt, lens, state_slots, *, cfg):
    h, cache, state = qwen3_hybrid.forward(params, cache, state, tok, pos, slots, pt, lens,
                                           state_slots, cfg=cfg)
    return transformer.logits(params, h), cache, state


class HybridPagedModel:
    """The hybrid forward with shuffled page tables and one state slot per sequence."""

    def __init__(self, loaded, rng, num_pages=40):
        self.loaded = loaded
        cfg = loaded.config
        attn = len(cfg.hybrid.attention_layers)
        self.cache = KVCache.init(CacheConfig(attn, cfg.num_kv_heads, cfg.head_dim, num_pages,
                                              PAGE, "float32"))
        self.state = DeltaState.init(state_config(cfg.hybrid, len(LENGTHS) + 2))
        perm = rng.permutation(np.arange(1, num_pages))
        self.pages = [perm[i * 8:(i + 1) * 8] for i in range(len(LENGTHS))]
        self.pt = np.stack(self.pages).astype(np.int32)
        self.slot_of = rng.permutation(np.arange(1, len(LENGTHS) + 2))[:len(LENGTHS)]

    def run(self, chunks):
        b, t = len(chunks), max(len(c[0]) for c in chunks if c)
        tok, pos, slots = (np.zeros((b, t), np.int32) for _ in range(3))
        lens, state_slots = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, c in enumerate(chunks):
            if c:
                ids, start = c
                p = np.arange(start, start + len(ids))
                tok[i, :len(ids)], pos[i, :len(ids)] = ids, p
                slots[i, :len(ids)] = self.pages[i][p // PAGE] * PAGE + p % PAGE
                lens[i], state_slots[i] = start + len(ids), self.slot_of[i]
        lg, self.cache, self.state = _logits(self.loaded.params, self.cache, self.state, tok,
                                             pos, slots, self.pt, lens, state_slots,
                                             cfg=self.loaded.config)
        return np.asarray(lg)


def test_paged_logits_match_transformers(hybrid_checkpoint):
    loaded = load_model(str(hybrid_checkpoint), "float32")
    assert loaded.config.family == "qwen3_5_moe"
    assert_paged_paths_match(hybrid_checkpoint, HybridPagedModel, "qwen3_5_moe")
