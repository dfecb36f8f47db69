"""The model over the paged cache matches Hugging Face transformers (PyTorch, fp32).

Every path that produces logits is checked: one-shot prefill, chunked prefill and
token-by-token decode across page boundaries, for a batch of unequal lengths whose pages are
shuffled (non-contiguous) in the pool.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache.cache import KVCache
from jfp8kv.models import mla, transformer
from jfp8kv import SamplingParams
from jfp8kv.models.loader import load_model

from tests.tiny_checkpoints import FAMILIES

PAGE = 8
LENGTHS = (5, 23, 41)  # unequal, not multiples of the page size, several page boundaries


def hf_logits(path, seqs):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in seqs]


class PagedModel:
    """Drives transformer.forward directly with hand-made, shuffled page tables."""

    def __init__(self, loaded, rng, num_pages=40):
        self.loaded = loaded
        cfg = loaded.config
        self.cache = KVCache.init(CacheConfig(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                              num_pages, PAGE, "float32"))
        perm = rng.permutation(np.arange(1, num_pages))
        self.pages = [perm[i * 8:(i + 1) * 8] for i in range(len(LENGTHS))]
        self.pt = np.stack(self.pages).astype(np.int32)

    def run(self, chunks):
        """chunks: per sequence (token_ids, start) or None; returns logits [B, T, V]."""
        b = len(chunks)
        t = max(len(c[0]) for c in chunks if c)
        tok = np.zeros((b, t), np.int32)
        pos = np.zeros((b, t), np.int32)
        slots = np.zeros((b, t), np.int32)  # padding -> the sink page 0
        lens = np.zeros(b, np.int32)
        for i, c in enumerate(chunks):
            if not c:
                continue
            ids, start = c
            p = np.arange(start, start + len(ids))
            tok[i, :len(ids)] = ids
            pos[i, :len(ids)] = p
            slots[i, :len(ids)] = self.pages[i][p // PAGE] * PAGE + p % PAGE
            lens[i] = start + len(ids)
        lg, self.cache = _forward_logits(self.loaded.params, self.cache, tok, pos, slots,
                                         self.pt, lens, cfg=self.loaded.config)
        return np.asarray(lg)


def assert_paged_paths_match(path, make_model, label: str) -> dict:
    """``path``'s float32 checkpoint through ``make_model(loaded, rng)`` (a PagedModel) equals
    transformers' logits within 1e-4 of their scale, all finite, on random sequences of
    LENGTHS: one-shot prefill, chunked prefill (chunks of 7; finished sequences leave gaps)
    and token-by-token decode after a 3-token prefill (crossing page boundaries). Returns
    each path's logits per sequence and the tolerance used."""
    loaded = load_model(str(path), "float32")
    rng = np.random.default_rng()
    seqs = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in LENGTHS]
    ref = hf_logits(path, seqs)
    tol = 1e-4 * max(np.abs(r).max() for r in ref)

    def check(got, what):
        for i, n in enumerate(LENGTHS):
            assert np.isfinite(got[i][:n]).all(), f"{label} {what}"
            err = np.abs(got[i][:n] - ref[i]).max()
            assert err < tol, f"{label} {what}: seq {i} max |diff| {err:.3g} >= {tol:.3g}"

    one_shot = make_model(loaded, rng).run([(s, 0) for s in seqs])
    check(one_shot, "one-shot prefill")
    m, chunked = make_model(loaded, rng), [np.zeros_like(r) for r in ref]
    for start in range(0, max(LENGTHS), 7):
        chunks = [(s[start:start + 7], start) if start < len(s) else None for s in seqs]
        lg = m.run(chunks)
        for i, c in enumerate(chunks):
            if c:
                chunked[i][start:start + len(c[0])] = lg[i, :len(c[0])]
    check(chunked, "chunked prefill")
    m, out = make_model(loaded, rng), [np.zeros_like(r) for r in ref]
    lg = m.run([(s[:3], 0) for s in seqs])
    for i in range(len(seqs)):
        out[i][:3] = lg[i, :3]
    for p in range(3, max(LENGTHS)):
        chunks = [([s[p]], p) if p < len(s) else None for s in seqs]
        lg = m.run(chunks)
        for i, c in enumerate(chunks):
            if c:
                out[i][p] = lg[i, 0]
    check(out, "decode")
    return dict(one_shot=one_shot, chunked=chunked, decode=out, tol=tol)


def small_llm(loaded, **kw):
    """An LLM over ``loaded`` with small float32 defaults (each overridable)."""
    from jfp8kv.engine.llm import LLM

    kw = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": 1 << 20,
          "max_num_batched_tokens": 64, **kw}
    return LLM(loaded=loaded, **kw)


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def assert_llm_matches_transformers(llm, path) -> None:
    """Through ``llm`` (float32 cache): prefill logits, one-shot and in chunks of 6, equal
    transformers'; what an unequal batch decodes greedily is transformers' teacher-forced
    argmax (within 1e-4 of the logits' scale)."""
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 320, n).tolist() for n in (4, 19, 33)]
    outs = llm.generate(prompts, GREEDY)
    fulls = [p + o.token_ids for p, o in zip(prompts, outs)]
    for p, full, ref in zip(prompts, fulls, hf_logits(path, fulls)):
        tol = 1e-4 * np.abs(ref).max()
        for chunk in (128, 6):
            _, lg = llm.nll(full, chunk_size=chunk, return_logits=True)
            assert np.abs(lg - ref[:-1]).max() < tol, chunk
        gen = ref[len(p) - 1:-1]  # the logits each generated token was sampled from
        picked = gen[np.arange(len(gen)), full[len(p):]]
        assert (gen.max(-1) - picked <= tol).all()


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_logits(params, cache, tok, pos, slots, pt, lens, *, cfg):
    forward = mla.forward if cfg.is_mla else transformer.forward  # the latent cache's model
    hidden, cache = forward(params, cache, tok, pos, slots, pt, lens, cfg=cfg)
    return transformer.logits(params, hidden), cache


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_hf_checkpoint, family):
    got = assert_paged_paths_match(tiny_hf_checkpoint(family), PagedModel, family)
    # Different physical pages, same numbers.
    assert all(np.allclose(got["chunked"][i], got["one_shot"][i][:n], atol=got["tol"])
               for i, n in enumerate(LENGTHS))


def test_results_do_not_depend_on_physical_pages(tiny_hf_checkpoint):
    loaded = load_model(str(tiny_hf_checkpoint("qwen3")), "float32")
    rng = np.random.default_rng()
    seqs = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in LENGTHS]
    a = PagedModel(loaded, np.random.default_rng(1)).run([(s, 0) for s in seqs])
    b = PagedModel(loaded, np.random.default_rng(2)).run([(s, 0) for s in seqs])
    for i, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(a[i][:n], b[i][:n])


def test_params_are_compute_dtype(tiny_hf_checkpoint):
    loaded = load_model(str(tiny_hf_checkpoint("llama")), "bfloat16")
    assert loaded.params["embed"].dtype == jnp.bfloat16
