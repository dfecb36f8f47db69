"""GGUF tokenizers built without torch equal transformers' own GGUF conversion.

``jfp8kv.models.gguf_tokenizer`` builds byte-level BPE tokenizers from a GGUF's metadata with
the ``tokenizers`` library; the reference is ``AutoTokenizer.from_pretrained(...,
gguf_file=...)`` (transformers' converter, which needs torch). Both must give the same ids,
tokens, decoded text and chat-template rendering on a varied set of strings, for tiny files of
each supported pre-tokenizer kind and for the default SmolLM2 GGUF. The default model must
load with torch made unimportable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jfp8kv.models import gguf_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world!", "  two leading spaces", "trailing   \n\n\t  ", "    ", "", "x",
    "über café naïve 日本語 😀🎉 Ω≈ç√", "Привет, мир", "السلام عليكم", "\u00a0nbsp\u200bzero-width",
    "1234567890 3.14159 1e-10 007", "1 2 3 10 100 1000 10000 123456789",
    "def f(x):\n    return x**2  # square\n\n\tif a != b: pass", "a\r\nb\rc\n",
    "it's they're we've I'm you'll he'd IT'S", "mixed CASE WoRdS___--==>>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|im_end|>",
    "<think>reason</think> ok", "\x00\x01ctrl\x7f ÿ", "ab" * 150,
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "über 😀\n  code:\n\tx = 1"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again <think>"}],
]
# Extra vocabulary entries that exercise each rule for llama.cpp token types.
_EXTRA = [("<think>", 4), ("</think>", 4),  # USER_DEFINED: plain added tokens
          ("<｜mislabel｜>", 3),  # CONTROL spelled outside the byte alphabet: not special
          ("naïve", 1)]  # stored as raw text: re-spelled byte by byte


def write_tokenizer_gguf(path: Path, tokenizer, pre: str, add_bos: bool | None = None) -> None:
    """A GGUF holding only ``tokenizer``'s metadata, written as llama.cpp's converter does."""
    import gguf

    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_ids)
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    tokens += [t for t, _ in _EXTRA]
    types += [gguf.TokenType(k) for _, k in _EXTRA]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(tokenizer.chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def reference_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


def assert_same_tokenizer(mine, ref) -> None:
    assert len(mine) == len(ref) and mine.all_special_ids == ref.all_special_ids
    assert (mine.bos_token, mine.eos_token, mine.pad_token, mine.unk_token) == (
        ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert mine.chat_template == ref.chat_template
    for text in TEXTS:
        for special in (False, True):
            ids = ref(text, add_special_tokens=special)["input_ids"]
            assert mine(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
        assert mine.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), text
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), (text, skip)
    for messages in MESSAGES:
        for prompt in (False, True):
            kw = dict(add_generation_prompt=prompt)
            assert mine.apply_chat_template(messages, tokenize=False, **kw) == \
                ref.apply_chat_template(messages, tokenize=False, **kw)
            assert list(mine.apply_chat_template(messages, tokenize=True, **kw)) == \
                list(ref.apply_chat_template(messages, tokenize=True, **kw))


@pytest.mark.parametrize("pre,add_bos", [("default", None), ("smollm", False),
                                         ("llama-bpe", True), ("qwen2", None)])
def test_tiny_gguf_tokenizer_equals_transformers(tiny_tokenizer_dir, tmp_path, pre, add_bos):
    from transformers import AutoTokenizer

    path = tmp_path / f"tok-{pre}.gguf"
    write_tokenizer_gguf(path, AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)), pre,
                         add_bos)
    mine = gguf_tokenizer.load_gguf_tokenizer(path)
    assert_same_tokenizer(mine, reference_tokenizer(path))
    assert "<think>" in mine.get_vocab() and "<｜mislabel｜>" not in mine.all_special_tokens


def test_smollm2_tokenizer_equals_transformers(smollm2_gguf_path):
    mine = gguf_tokenizer.load_gguf_tokenizer(smollm2_gguf_path)
    assert_same_tokenizer(mine, reference_tokenizer(smollm2_gguf_path))


def test_unknown_kind_uses_transformers_with_torch(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "tok-starcoder.gguf"
    write_tokenizer_gguf(path, AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)),
                         "starcoder")
    assert_same_tokenizer(gguf_tokenizer.load_gguf_tokenizer(path), reference_tokenizer(path))


# Run before anything imports torch: `import torch` (and transformers' availability probe)
# then behave as if torch were not installed.
_NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + code], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=timeout)


def test_unknown_kind_without_torch_names_what_works(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "tok-starcoder.gguf"
    write_tokenizer_gguf(path, AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)),
                         "starcoder")
    proc = run_without_torch(
        "from jfp8kv.models.gguf_tokenizer import load_gguf_tokenizer\n"
        f"try:\n    load_gguf_tokenizer({str(path)!r})\n"
        "except ValueError as e:\n    print('ValueError:', e)\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ValueError:" in proc.stdout and "'starcoder'" in proc.stdout
    assert "pip install torch" in proc.stdout and "qwen2" in proc.stdout


def test_default_model_loads_and_serves_imports_without_torch(smollm2_gguf_path):
    """The README's first command needs no torch: the default model loads (weights, config,
    tokenizer) and the server modules import with torch unimportable."""
    proc = run_without_torch(
        "import json\n"
        "from jfp8kv.models.loader import load_model\n"
        "import jfp8kv.serve.app, jfp8kv.engine.llm\n"
        "m = load_model(None, 'bfloat16')\n"
        "prompt = m.tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi über'}],\n"
        "                                         tokenize=False, add_generation_prompt=True)\n"
        "print(json.dumps({'torch': sys.modules['torch'] is not None, 'prompt': prompt,\n"
        "    'ids': m.tokenizer.encode(prompt, add_special_tokens=False),\n"
        "    'layers': len(m.params['layers']), 'eos': list(m.config.eos_token_ids)}))\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = reference_tokenizer(smollm2_gguf_path)
    want = ref.apply_chat_template([{"role": "user", "content": "Hi über"}], tokenize=False,
                                   add_generation_prompt=True)
    assert got["torch"] is False and got["prompt"] == want
    assert got["ids"] == ref.encode(want, add_special_tokens=False)
    assert got["layers"] == 30 and 2 in got["eos"]
