"""DeepSeek-V4 reference forward against transformers' DeepseekV4ForCausalLM (float32, CPU).

A tiny random V4 (window-only, CSA and HCA layers; hash-routed and score-routed MoE; mHC with
2 streams; grouped output projection; YaRN on the compressed layers; every parameter drawn
at a visible scale, sinks and position biases included) is run by transformers without a
cache; ``jfp8kv.models.deepseek_v4.forward`` on the same weights must give the same logits
for a one-shot prefill, and token-by-token decode / uneven chunks must give the same logits
as the one-shot prefill (the compressor state carried between calls is exact).
The indexer has 16 heads: an entry whose every head score is clipped by the ReLU scores
exactly 0, and torch and XLA break such top-k ties differently (both valid).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import ModelConfig
from jfp8kv.models import deepseek_v4 as dv4

torch = pytest.importorskip("torch")

TINY = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=16,
            num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16,
            index_n_heads=16, index_head_dim=32, index_topk=3, sliding_window=6,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 64})


def tiny_hf_model(seed: int, **overrides):
    """transformers' V4 at TINY shapes, every tensor redrawn (tid2eid: random experts)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("scale", "sinks", "position_bias", "base")):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[
                    :cfg.num_experts_per_tok] for _ in range(cfg.vocab_size)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def ours(model):
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        model.config.save_pretrained(d)
        cfg = ModelConfig.from_hf_dict(json.load(open(f"{d}/config.json")))
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return cfg, dv4.params_from_hf(sd.__getitem__, cfg)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), use_cache=False).logits.numpy()


@pytest.fixture(scope="module")
def tiny():
    model = tiny_hf_model(0)
    cfg, params = ours(model)
    return model, cfg, params


def test_config_parses_schedule(tiny):
    _, cfg, _ = tiny
    assert cfg.family == "deepseek_v4" and cfg.num_kv_heads == 1 and cfg.head_dim == 32
    assert cfg.v4.compress_ratios == (0, 4, 8, 4)
    assert cfg.v4.hash_layers == (True, False, False, False)
    assert cfg.v4.compress_rope.factor == 4.0 and cfg.v4.compress_rope.attention_factor == 1.0


def test_both_config_spellings_agree(tiny, tmp_path):
    """DeepSeek's own config.json spelling (compress_ratios, num_hash_layers, flat YaRN
    rope_scaling; the ``deepseek-v4-tiny`` preset) parses to what transformers' saved config
    gives; the random preset loads."""
    from jfp8kv.models.loader import load_model
    from jfp8kv.models.v4_presets import v4_config

    model, cfg, _ = tiny
    own = v4_config("deepseek-v4-tiny")
    assert own.v4 == cfg.v4
    for field in ("head_dim", "qk_rope_head_dim", "q_lora_rank", "num_experts",
                  "moe_intermediate_size", "routed_scaling_factor", "rope_theta"):
        assert getattr(own, field) == getattr(cfg, field), field
    assert load_model("random:deepseek-v4-tiny", "float32").config.v4 == own.v4
    with pytest.raises(ValueError, match="deepseek-v4-flash-<N>l"):
        load_model("random:deepseek-v4-huge", "float32")


def test_checkpoint_directory_loads(tiny, tmp_path):
    """A ``save_pretrained`` directory (DeepSeek's tensor names under ``model.``, per-expert
    tensors; plus a word-level tokenizer) loads through ``load_model`` to exactly the params
    ``params_from_hf`` makes from the state dict, as does the release spelling; the engine
    builds on it (V4 pools); TP > 1 is refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jfp8kv import LLM
    from jfp8kv.models.loader import load_model

    model, cfg, params = tiny
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "float32")
    assert loaded.config.v4 == cfg.v4
    import jax

    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    llm = LLM(loaded=loaded, dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=64)
    assert llm.cache_info()["kv_layout"] == "v4"
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices"):
        load_model(str(tmp_path), "float32", 2)  # one device here (TP: test_tp_families.py)
    # DeepSeek's release spelling (no "model." prefix, embed / hc_head_* / norm) loads alike
    from safetensors.numpy import load_file, save_file

    release = tmp_path / "release"
    release.mkdir()
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
             **{f"model.hc_head.hc_{x}": f"hc_head_{x}" for x in ("fn", "base", "scale")}}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({names.get(k, k.removeprefix("model.")): v for k, v in tensors.items()},
              str(release / "model.safetensors"))
    for f in tmp_path.glob("*.json"):
        (release / f.name).write_text(f.read_text())
    again = load_model(str(release), "float32")
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_matches_transformers(tiny):
    model, cfg, params = tiny
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (2, 37))
    want = hf_logits(model, ids)
    got, _ = dv4.forward(params, dv4.init_state(cfg, 2, 64), jnp.asarray(ids), cfg)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_decode_matches_prefill(tiny):
    """Chunks of 7, 1 x 6, 7, 1 x 17 (the shapes every test here shares: one compile
    each) give the one-shot prefill's logits."""
    model, cfg, params = tiny
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 37)))
    full, _ = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids, cfg)
    state, outs, at = dv4.init_state(cfg, 2, 64), [], 0
    for c in [7] + [1] * 6 + [7] + [1] * 17:
        out, state = dv4.forward(params, state, ids[:, at:at + c], cfg)
        outs.append(out)
        at += c
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)


def test_fp8_pools_round_like_fakequant(tiny):
    """fp8 storage: layer 0's window rows are the exact rows fake-quantized by the
    independent ``bench.fakequant`` (e4m3, per-32 float16 scales); every closed compressed
    entry likewise; and decode over fp8 pools equals one-shot prefill over fp8 pools."""
    from bench import fakequant
    from jfp8kv.models import v4_attention as va
    from jfp8kv.models.deepseek_v4 import _pooled

    _, cfg, params = tiny
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)))  # shapes of the test above
    exact_state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids, cfg)[1]
    f8 = "float8_e4m3fn"
    full, f8_state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids, cfg, storage=f8)
    want = fakequant.fake_quant_rows(np.asarray(exact_state["layers"][0]["window"])[:, None],
                                     "fp8_e4m3", "block")[:, 0]
    np.testing.assert_array_equal(np.asarray(f8_state["layers"][0]["window"]), want)

    cp = params["layers"][2]["compressor"]  # HCA, m = 8: 3 windows close
    kv, gate = (jnp.asarray(rng.standard_normal((1, 27, 32)), jnp.float32) for _ in range(2))
    inv = np.asarray([0.5 ** i for i in range(8)])
    empty = va.empty_compressor(1, 32, 8, False, 8, jnp.float32)
    exact = va.compress(empty, jnp.int32(0), kv, gate, cp, 1e-6, inv).entries
    stored = va.compress(empty, jnp.int32(0), kv, gate, cp, 1e-6, inv, _pooled(f8)[0]).entries
    np.testing.assert_array_equal(
        np.asarray(stored[:, :3]),
        fakequant.fake_quant_rows(np.asarray(exact[:, None, :3]), "fp8_e4m3", "block")[:, 0])

    state, outs = dv4.init_state(cfg, 2, 64), []
    for at in range(7):
        out, state = dv4.forward(params, state, ids[:, at:at + 1], cfg, storage=f8)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-4, atol=1e-4)


def test_decode_through_kernels(tiny):
    """Decode steps through the Pallas kernels (interpret mode: sparse attention over window
    + chosen entries, indexer scores) equal the jnp path, past the point where the indexer's
    top-3 drops entries (position 15: 4 closed CSA entries)."""
    _, cfg, params = tiny
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 18)))
    _, state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids[:, :7], cfg)
    for at in range(7, 14):
        _, state = dv4.forward(params, state, ids[:, at:at + 1], cfg)
    ref_state = state
    for at in range(14, 18):
        want, ref_state = dv4.forward(params, ref_state, ids[:, at:at + 1], cfg)
        got, state = dv4.forward(params, state, ids[:, at:at + 1], cfg,
                                 backend="pallas_interpret")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_batch_at_unequal_positions(tiny):
    """Two sequences decoded together at positions 10 and 7 (their states merged row-wise)
    give each one's logits when decoded alone: the window, compressor and indexer states
    and the masks follow each sequence's own position."""
    import jax

    _, cfg, params = tiny
    rng = np.random.default_rng(5)
    a, b = (jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 14))) for _ in range(2))

    def run(ids, steps, state=None):
        out, state = dv4.forward(params, dv4.init_state(cfg, 2, 64), ids[:, :7], cfg)
        outs = []
        for at in range(7, 7 + steps):
            out, state = dv4.forward(params, state, ids[:, at:at + 1], cfg)
            outs.append(out)
        return outs, state

    _, sa = run(a, 3)  # both rows at position 10
    _, sb = run(b, 0)  # position 7
    merged = jax.tree.map(lambda x, y: jnp.stack([x[0], y[0]]), sa, sb)
    want_a = run(a, 7)[0][3:]
    want_b = run(b, 4)[0]
    for i in range(4):
        tok = jnp.stack([a[0, 10 + i], b[0, 7 + i]])[:, None]
        got, merged = dv4.forward(params, merged, tok, cfg)
        np.testing.assert_allclose(got[0], want_a[i][0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[1], want_b[i][0], rtol=1e-4, atol=1e-4)
