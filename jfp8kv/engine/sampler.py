"""On-device sampling: greedy, temperature, top-k, top-p, seeded per request; optional
penalties, min_tokens and log-probs.

Each row's key is ``fold_in(PRNGKey(seed), counter)`` where ``counter`` is the index of
the token being sampled, so a request's samples do not depend on which other requests
share its batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.engine.types import MAX_LOGPROBS


def sample(logits, temperature, top_k, top_p, seeds, counters, *, all_greedy: bool | None):
    """logits float32[B, V]; temperature/top_p float32[B]; top_k int32[B] (<=0: off);
    seeds uint32[B]; counters int32[B]. Static: all_greedy (None: decided on the device per
    call, one executable for both: the switched structure, ``variants.py``). Returns
    int32[B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy
    args = (logits, temperature, top_k, top_p, seeds, counters, greedy)
    if all_greedy is None:
        return jax.lax.cond(jnp.any(temperature > 0), _sampled, lambda *a: a[-1], *args)
    return _sampled(*args)


def _sampled(logits, temperature, top_k, top_p, seeds, counters, greedy):
    """Temperature/top-k/top-p rows sampled, temperature-0 rows ``greedy``."""
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / t[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, top_k, v)
    srt = jnp.where(rank < k[:, None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # Keep a token if the mass before it is < top_p (the first token is always kept).
    srt = jnp.where((cum - probs) < top_p[:, None], srt, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    pick = jax.vmap(jax.random.categorical)(keys, srt)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


# -- optional per-row features: penalties, min_tokens, log-probs ---------------------------
# Either compiled in only when a batch row asks (``SamplingExtras`` present, its fields set),
# the default path above untouched, or carried by every batch in one structure
# (``SamplingArrays.switched``) where switches on the device pick what runs, so no request mix
# compiles another executable. Which dispatch does which: ``variants.Variants``.

STOP_ID_WIDTH = 8  # min_tokens' masked ids per row: the least width (a power of two) of the array


def branch(switch, fn, otherwise, *args):
    """``fn(*args)``; with a ``switch`` (a bool[] device scalar) a branch on the device that
    runs ``fn`` when it is set and ``otherwise`` (same output shapes) when not."""
    if switch is None:
        return fn(*args)
    return jax.lax.cond(switch, fn, otherwise, *args)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["history", "num_prompt", "presence", "frequency", "repetition",
                                "min_tokens", "stop_ids"], meta_fields=[])
@dataclasses.dataclass
class PenaltyArrays:
    """Host arrays of the penalty state of B rows.

    history int32[B, L]: prompt + generated ids so far, -1 padded (L fixed per runner);
    num_prompt int32[B]: how many of them are prompt; presence/frequency/repetition
    float32[B] (0, 0, 1 = off); min_tokens int32[B]; stop_ids int32[B, S]: the ids masked
    while fewer than min_tokens were generated (EOS and stop_token_ids), -1 padded.
    """

    history: np.ndarray
    num_prompt: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    min_tokens: np.ndarray
    stop_ids: np.ndarray

    def pad(self, b: int) -> "PenaltyArrays":
        """Rows up to b: no history, no penalty."""
        def grow(x, fill):
            out = np.full((b,) + x.shape[1:], fill, x.dtype)
            out[:len(x)] = x
            return out
        return PenaltyArrays(grow(self.history, -1), grow(self.num_prompt, 0),
                             grow(self.presence, 0), grow(self.frequency, 0),
                             grow(self.repetition, 1), grow(self.min_tokens, 0),
                             grow(self.stop_ids, -1))

    @classmethod
    def neutral(cls, b: int, width: int) -> "PenaltyArrays":
        """b rows with no history and no penalty (history ``width`` tokens)."""
        return cls(np.zeros((0, width), np.int32), np.zeros(0, np.int32),
                   np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32),
                   np.zeros(0, np.int32), np.zeros((0, STOP_ID_WIDTH), np.int32)).pad(b)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["penalty", "switches"],
                   meta_fields=["logprobs"])
@dataclasses.dataclass
class SamplingExtras:
    """``penalty``: PenaltyArrays or None (compiled out). ``logprobs`` (static): also return
    each sampled token's log-prob and the top MAX_LOGPROBS log-probs of the raw logits.
    ``switches``: None, or bool[2] (``SamplingArrays.switched``): whether the penalties /
    the log-probs are computed is decided on the device (else the logits pass unchanged /
    the log-probs are zeros)."""

    penalty: PenaltyArrays | None = None
    logprobs: bool = False
    switches: np.ndarray | None = None

    def switch(self, i: int):
        """switches[i] (0: penalties, 1: log-probs), or None without switches."""
        return None if self.switches is None else self.switches[i]

    def pad(self, b: int) -> "SamplingExtras":
        return SamplingExtras(None if self.penalty is None else self.penalty.pad(b), self.logprobs,
                              self.switches)

    def rows(self, start: int, end: int) -> "SamplingExtras":
        """Rows [start, end)."""
        if self.penalty is None:
            return self
        p = self.penalty
        return SamplingExtras(PenaltyArrays(*(getattr(p, f.name)[start:end]
                                              for f in dataclasses.fields(p))), self.logprobs,
                              self.switches)


@dataclasses.dataclass
class SamplingArrays:
    """A batch's host-side sampling parameters, one row per sequence."""

    temperature: np.ndarray  # float32[B]
    top_k: np.ndarray  # int32[B]
    top_p: np.ndarray  # float32[B]
    seeds: np.ndarray  # uint32[B]
    counters: np.ndarray  # int32[B]
    extras: SamplingExtras | None = None  # penalties / log-probs; None compiles them out

    @classmethod
    def empty(cls, b: int) -> "SamplingArrays":
        return cls(np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                   np.zeros(b, np.uint32), np.zeros(b, np.int32))

    def args(self):
        return (self.temperature, self.top_k, self.top_p, self.seeds, self.counters, self.extras)

    def rows(self, start: int, end: int) -> "SamplingArrays":
        """Rows [start, end)."""
        if (start, end) == (0, len(self.temperature)):
            return self
        rows = [getattr(self, f.name)[start:end] for f in dataclasses.fields(self)
                if f.name != "extras"]
        return SamplingArrays(*rows, extras=None if self.extras is None
                              else self.extras.rows(start, end))

    def padded(self, b: int) -> "SamplingArrays":
        """``b`` >= len rows: the rows, then neutral ones (greedy, no top-k/top-p)."""
        n = len(self.temperature)
        pad = SamplingArrays.empty(b)
        for f in dataclasses.fields(SamplingArrays):
            if f.name != "extras":
                getattr(pad, f.name)[:n] = getattr(self, f.name)
        pad.extras = None if self.extras is None else self.extras.pad(b)
        return pad

    def switched(self, history_width: int) -> "SamplingArrays":
        """The same rows in the one structure every request mix shares: penalty arrays always
        (neutral rows where none was asked; ``history_width`` tokens of history) and log-prob
        outputs always, each computed only where its device switch says."""
        e = self.extras or SamplingExtras()
        penalty = e.penalty
        if penalty is None:
            penalty = PenaltyArrays.neutral(len(self.temperature), history_width)
        switches = np.array([e.penalty is not None, e.logprobs])
        return dataclasses.replace(self, extras=SamplingExtras(penalty, True, switches))


def history_counts(history, num_prompt, vocab: int):
    """-> (counts int32[B, V]: occurrences in the generated part; seen bool[B, V]: in the
    prompt or the generated part). Padding (-1) is dropped."""
    b, width = history.shape
    idx = jnp.where(history >= 0, history, vocab)  # out of range: dropped by the scatter
    generated = (jnp.arange(width)[None, :] >= num_prompt[:, None]).astype(jnp.int32)
    rows = jnp.arange(b)[:, None]
    counts = jnp.zeros((b, vocab), jnp.int32).at[rows, idx].add(generated, mode="drop")
    seen = jnp.zeros((b, vocab), jnp.bool_).at[rows, idx].set(True, mode="drop")
    return counts, seen


def apply_penalties(logits, counts, seen, presence, frequency, repetition):
    """Repetition (over prompt + output), then frequency and presence (over output)."""
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    c = counts.astype(logits.dtype)
    return logits - frequency[:, None] * c - presence[:, None] * (c > 0).astype(logits.dtype)


def mask_stop_ids(logits, stop_ids, num_generated, min_tokens):
    """-inf at each row's stop_ids while num_generated < min_tokens."""
    block = (num_generated < min_tokens)[:, None] & (stop_ids >= 0)
    idx = jnp.where(block, stop_ids, logits.shape[-1])
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, idx].set(-jnp.inf, mode="drop")


def token_logprobs(logits, tokens):
    """Raw logits [..., V], tokens [...] -> (logprob [...], top values [..., K], top ids
    [..., K]), K = MAX_LOGPROBS (or V if smaller)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    vals, ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
    return tok, vals, ids.astype(jnp.int32)


def zero_logprobs(tokens, vocab: int):
    """``token_logprobs``' outputs for ``tokens`` [...], zeros (a switched-off branch)."""
    k = min(MAX_LOGPROBS, vocab)
    return (jnp.zeros(tokens.shape, jnp.float32), jnp.zeros(tokens.shape + (k,), jnp.float32),
            jnp.zeros(tokens.shape + (k,), jnp.int32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["targets", "switch"],
                   meta_fields=[])
@dataclasses.dataclass
class Scoring:
    """Prompt scoring on a prefill dispatch (``steps.prefill``): ``targets`` int32[B, T], the
    next token at each position; ``switch``: None (scored), or a bool[] deciding on the
    device (the switched structure: every prefill carries it, most switched off)."""

    targets: np.ndarray
    switch: np.ndarray | None = None


def init_state(extras: SamplingExtras | None, vocab: int):
    """The scan-carried token-count state: None, or (counts, seen) from the history (zeros
    where the penalty switch is off)."""
    if extras is None or extras.penalty is None:
        return None
    b = extras.penalty.history.shape[0]
    return branch(extras.switch(0), functools.partial(history_counts, vocab=vocab),
                  lambda *_: (jnp.zeros((b, vocab), jnp.int32), jnp.zeros((b, vocab), bool)),
                  extras.penalty.history, extras.penalty.num_prompt)


def sample_step(logits, state, temperature, top_k, top_p, seeds, counters, extras, *,
                all_greedy: bool | None):
    """``sample`` with the optional features. ``counters`` is also the number of tokens
    generated so far (min_tokens). Returns (tokens, new state, log-probs or None)."""
    raw = logits
    if state is not None:
        p = extras.penalty

        def penalized(logits):
            logits = apply_penalties(logits, *state, p.presence, p.frequency, p.repetition)
            return mask_stop_ids(logits, p.stop_ids, counters, p.min_tokens)

        logits = branch(extras.switch(0), penalized, lambda x: x, logits)
    toks = sample(logits, temperature, top_k, top_p, seeds, counters, all_greedy=all_greedy)
    if state is not None:
        rows = jnp.arange(toks.shape[0])
        state = (state[0].at[rows, toks].add(1), state[1].at[rows, toks].set(True))
    lp = None
    if extras is not None and extras.logprobs:
        lp = branch(extras.switch(1), token_logprobs,
                    lambda x, t: zero_logprobs(t, x.shape[-1]), raw, toks)
    return toks, state, lp


def sampling_of(seqs, eos_token_ids, history_width: int) -> SamplingArrays:
    """The host arrays of ``seqs``' (scheduler ``Sequence``s) sampling: their parameters,
    seeds and counters, and when any asks for penalties or log-probs the extras: each
    row's token history at ``history_width`` (one compile per batch bucket) and the ids
    min_tokens masks (EOS unless ignore_eos, and stop_token_ids), bucketed in width."""
    penalized = any(s.params.uses_penalties for s in seqs)
    logprobs = any(s.params.logprobs is not None for s in seqs)
    extras = None
    if penalized or logprobs:
        penalties = _penalty_arrays(seqs, eos_token_ids, history_width) if penalized else None
        extras = SamplingExtras(penalties, logprobs)
    return SamplingArrays(
        temperature=np.array([s.params.temperature for s in seqs], np.float32),
        top_k=np.array([s.params.top_k for s in seqs], np.int32),
        top_p=np.array([s.params.top_p for s in seqs], np.float32),
        seeds=np.array([s.seed for s in seqs], np.uint32),
        counters=np.array([s.num_generated for s in seqs], np.int32),
        extras=extras)


def _penalty_arrays(seqs, eos_token_ids, width: int) -> PenaltyArrays:
    history = np.full((len(seqs), width), -1, np.int32)
    stops = [sorted(set(s.params.stop_token_ids)
                    | (set() if s.params.ignore_eos else set(eos_token_ids)))
             if s.params.min_tokens > 0 else [] for s in seqs]
    longest = max(map(len, stops))
    stop_ids = np.full((len(seqs), max(STOP_ID_WIDTH, 1 << max(0, (longest - 1).bit_length()))),
                       -1, np.int32)
    for i, s in enumerate(seqs):  # (rows with tokens in flight use no penalty)
        t = s.tokens
        history[i, :len(t)] = t
        stop_ids[i, :len(stops[i])] = stops[i]
    p = [s.params for s in seqs]
    return PenaltyArrays(
        history=history,
        num_prompt=np.array([len(s.prompt_token_ids) for s in seqs], np.int32),
        presence=np.array([x.presence_penalty for x in p], np.float32),
        frequency=np.array([x.frequency_penalty for x in p], np.float32),
        repetition=np.array([x.repetition_penalty for x in p], np.float32),
        min_tokens=np.array([x.min_tokens for x in p], np.int32),
        stop_ids=stop_ids)
