"""Incremental detokenization and stop-string search over the newly decoded text only.

Re-decoding a request's whole output on every new token costs O(length) per token. Instead,
``IncrementalDetokenizer`` decodes a short window: the tokens since the last commit point
plus the previous window's tokens as context (a window decode can differ from the full text
at its left edge -- e.g. a SentencePiece decoder drops the first token's leading space --
so the context's own text is subtracted). New text is committed only when it does not end
in U+FFFD: a trailing replacement character may be half of a multi-byte UTF-8 character
whose remaining bytes come with the next token (byte-level BPE and byte-fallback tokens
split characters), and at a commit point the decoder is at a character boundary, so the
committed text is exactly a prefix of the full decode. The held-back tail is still reported
(``text`` = committed + tail), so ``text`` always equals ``tokenizer.decode(ids)``.

``find_stop`` searches stop strings only in the text that is new since the last search, plus
``len(stop) - 1`` characters before it (a stop string may straddle the boundary).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoded a window at a time.

    ``add(ids)`` appends ids; ``text`` is ``tokenizer.decode(all ids, skip_special_tokens)``.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix", "read", "committed",
                 "tail")

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: the tokens of the previous commit, as context
        self.read = 0  # ids[:read] are committed
        self.committed = ""  # == decode(ids[:read])
        self.tail = ""  # decode(ids)[len(committed):], ends in U+FFFD (or is empty)

    @property
    def text(self) -> str:
        return self.committed + self.tail

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids) -> None:
        """Append token ids (an iterable of ints) and update the text."""
        self.ids.extend(ids)
        if self.read == len(self.ids):
            return
        context = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        window = self._decode(self.ids[self.prefix:])
        if not window.startswith(context):  # a decoder that rewrites across the edge
            self._redecode()
            return
        new = window[len(context):]
        if new.endswith(REPLACEMENT):
            self.tail = new
            return
        self.committed += new
        self.tail = ""
        self.prefix, self.read = self.read, len(self.ids)

    def _redecode(self) -> None:
        full = self._decode(self.ids)
        self.committed, self.tail = full, ""
        self.prefix = self.read = len(self.ids)


def find_stop(text: str, stops: tuple[str, ...], searched: int) -> int:
    """The earliest index in ``text`` where one of ``stops`` begins, among occurrences ending
    after ``searched`` (text[:searched] was searched before and held none), or -1."""
    cut = -1
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and (cut < 0 or i < cut):
            cut = i
    return cut
