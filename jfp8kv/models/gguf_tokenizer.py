"""The tokenizer a GGUF file describes, built without torch.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary, merges, token types,
special token ids and chat template as ``tokenizer.*`` metadata. For byte-level BPE files
(``tokenizer.ggml.model == "gpt2"``: SmolLM2, Qwen2/Qwen3, Llama 3) this module reads that
metadata with the ``gguf`` package and builds the fast tokenizer with the ``tokenizers``
library, wrapped in transformers' ``PreTrainedTokenizerFast`` so that ``encode``, ``decode``
and ``apply_chat_template`` behave as for any Hugging Face tokenizer. The result equals
transformers' own GGUF conversion (tests/models/test_gguf_tokenizer.py compares them), which
needs torch since transformers 5.x reads GGUF metadata through torch.

Other tokenizer models (sentencepiece ``llama``, ...) and pre-tokenizer kinds not listed in
``SPLIT_PATTERNS`` go through transformers' converter, which needs torch installed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# Pre-tokenizer kind (tokenizer.ggml.pre) -> the split pattern its merges were learned with.
# Kinds in DEFAULT_SPLIT_KINDS use GPT-2's pattern, which tokenizers' ByteLevel applies itself.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN,
                  "llama-v3": _LLAMA3_PATTERN, "smaug-bpe": _LLAMA3_PATTERN,
                  "qwen2": _QWEN2_PATTERN, "deepseek-r1-qwen": _QWEN2_PATTERN}
DEFAULT_SPLIT_KINDS = (None, "default", "gpt2", "smollm")
# llama.cpp token types (gguf.TokenType): CONTROL tokens become special added tokens,
# USER_DEFINED ones plain added tokens; both are then matched whole in the text.
_CONTROL, _USER_DEFINED = 3, 4


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level vocabularies.

    Bytes that are printable Latin-1 characters (other than space and the soft hyphen) stand
    for themselves; the remaining 68 bytes take code points 256, 257, ... in byte order.
    """
    printable = [b for b in range(256) if (0x21 <= b <= 0x7E) or (0xA1 <= b <= 0xAC)
                 or (0xAE <= b <= 0xFF)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def _value(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value: str, int, float or bool scalar, or a list for an array."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    strings = field.types[-1] == gguf.GGUFValueType.STRING

    def item(index: int) -> Any:
        part = field.parts[index]
        return bytes(part).decode("utf-8") if strings else part[0].item()

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [item(i) for i in field.data]
    return item(field.data[0])


def read_metadata(reader: Any) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of an open ``gguf.GGUFReader`` (keys without the prefix)."""
    keys = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token")
    meta = {k: _value(reader, f"tokenizer.ggml.{k}") for k in keys}
    meta["chat_template"] = _value(reader, "tokenizer.chat_template")
    return meta


def is_supported(meta: dict[str, Any]) -> bool:
    """Whether ``build_byte_level_bpe`` can build this file's tokenizer exactly."""
    return (meta["model"] == "gpt2" and meta["tokens"] is not None and bool(meta["merges"])
            and (meta["pre"] in DEFAULT_SPLIT_KINDS or meta["pre"] in SPLIT_PATTERNS))


def build_byte_level_bpe(meta: dict[str, Any]) -> Any:
    """A ``PreTrainedTokenizerFast`` for a byte-level BPE file (``is_supported(meta)``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = set(byte_to_char().values())

    def spelled(token: str) -> str:  # a token stored as raw text is re-spelled byte by byte
        if set(token) <= alphabet:
            return token
        return "".join(byte_to_char()[b] for b in token.encode("utf-8"))

    tokens = meta["tokens"]
    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False,
                                   continuing_subword_prefix="", end_of_word_suffix=""))
    pattern = SPLIT_PATTERNS.get(meta["pre"])
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    types = meta["token_type"] or []
    # A control token spelled outside the byte alphabet is a converter mislabel: adding it
    # would grow the vocabulary past the embedding rows, so it is left out.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, types)
                                if kind == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        index = meta[key]
        return None if index is None else tokens[index]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), add_bos_token=bool(meta["add_bos_token"]),
        add_eos_token=bool(meta["add_eos_token"]), chat_template=meta["chat_template"])


def _via_transformers(path: Path, meta: dict[str, Any]) -> Any:
    """transformers' GGUF converter: the fallback for tokenizers built here cannot build."""
    what = f"tokenizer model {meta['model']!r} with pre-tokenizer {meta['pre']!r}"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                             local_files_only=True)
    except ImportError as e:
        raise ValueError(
            f"{path}: jfp8kv builds byte-level BPE GGUF tokenizers (tokenizer model 'gpt2', "
            f"pre-tokenizers {sorted(k for k in DEFAULT_SPLIT_KINDS if k)} or "
            f"{sorted(SPLIT_PATTERNS)}) itself; this file's {what} needs transformers' GGUF "
            f"converter, which needs torch (`pip install torch`). Or pass the Hugging Face "
            f"checkpoint directory instead. ({e})") from e
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(f"could not build a tokenizer from the metadata of {path} "
                         f"({what}): {e}") from e


def load_gguf_tokenizer(path: Path, reader: Any = None) -> Any:
    """The tokenizer of the GGUF file at ``path`` (pass its open ``GGUFReader`` if you have one).

    Raises ValueError when the file has no tokenizer metadata, or when its tokenizer kind needs
    transformers' converter and torch is not installed.
    """
    import gguf

    path = Path(path)
    reader = reader if reader is not None else gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    if meta["tokens"] is None:
        raise ValueError(f"{path} has no tokenizer metadata (tokenizer.ggml.tokens); use a GGUF "
                         "file converted with its tokenizer or a Hugging Face checkpoint directory")
    if is_supported(meta):
        return build_byte_level_bpe(meta)
    return _via_transformers(path, meta)
