"""The incremental detokenizer equals full re-decoding on random token sequences (multi-byte
characters split across tokens included), and the windowed stop-string search equals a
search of the whole text."""

import numpy as np
import pytest

from jfp8kv.engine.detokenizer import IncrementalDetokenizer, find_stop


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path):
    from jfp8kv.models.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def _partial_tokens(tok, rng, want=300):
    """Tokens whose own text ends in U+FFFD (a piece of a multi-byte character), plus
    tokens of multi-byte text."""
    ids = rng.choice(len(tok), min(len(tok), 20000), replace=False)
    partial = [int(i) for i in ids if tok.decode([int(i)]).endswith("\ufffd")][:want]
    text = "héllo wörld — ünïcödé 日本語のテキスト 😀🎉 ∑∫√ ﬁ"
    return partial + tok.encode(text, add_special_tokens=False)


def _check(tok, seed, trials=150):
    rng = np.random.default_rng(seed)
    special = [t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None]
    multi = _partial_tokens(tok, rng)
    assert multi
    for _ in range(trials):
        n = int(rng.integers(1, 40))
        mode = rng.integers(3)
        ids = rng.integers(0, len(tok), n)
        if mode > 0:
            frac = 1.0 if mode == 1 else 0.6
            ids = np.where(rng.random(n) < frac, rng.choice(multi, n), ids)
        ids = ids.tolist()
        if special and rng.random() < 0.3:
            ids.insert(int(rng.integers(len(ids) + 1)), special[0])
        d = IncrementalDetokenizer(tok)
        i = 0
        while i < len(ids):
            k = int(rng.integers(1, 4))
            d.add(ids[i:i + k])
            i = min(i + k, len(ids))
            full = tok.decode(ids[:i], skip_special_tokens=True)
            assert d.text == full, (ids[:i], d.text, full)
            assert full.startswith(d.committed) and not d.committed.endswith("\ufffd")


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_equals_full_decode_smollm2(smollm2_tokenizer, seed):
    _check(smollm2_tokenizer, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_equals_full_decode_tiny(tiny_tokenizer, seed):
    _check(tiny_tokenizer, seed)


def test_windowed_stop_search_equals_full_search():
    rng = np.random.default_rng(0)
    alphabet = list("abcé😀 ")
    for _ in range(500):
        stops = tuple("".join(rng.choice(alphabet, int(rng.integers(1, 4))))
                      for _ in range(int(rng.integers(1, 3))))
        text, searched, found = "", 0, -1
        while len(text) < 30 and found < 0:
            text += "".join(rng.choice(alphabet, int(rng.integers(1, 4))))
            found = find_stop(text, stops, searched)
            searched = len(text)
            expect = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            assert found == expect, (text, stops)
