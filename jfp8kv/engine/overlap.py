"""Device-side token hand-off between consecutive steps (overlap scheduling).

With overlap scheduling the engine dispatches step N before it reads step N-1's sampled
tokens, so a decode row of step N whose input is step N-1's last sampled token takes it
from the device. Each dispatched step leaves a *mailbox*: a fixed-size int32[size] device
array holding, at slot i, the last token sampled by row i of the step (decode rows first,
then prefill rows). ``feed`` builds step N's decode input from host tokens and mailbox
slots. The mailbox has one size per engine (the largest decode bucket), so these tiny
programs compile once per decode or prefill batch bucket, never per combination.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8kv.engine.types import TokenLogprob


@functools.partial(jax.jit, static_argnames=("size",))
def decode_mailbox(tokens, last, *, size: int):
    """tokens int32[B, S] (a decode dispatch's samples), last int32[B] (each row's last
    useful step) -> int32[size] with row i's last token at slot i (rows past size dropped)."""
    vals = jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0]
    return jnp.zeros(size, jnp.int32).at[jnp.arange(tokens.shape[0])].set(vals, mode="drop")


@jax.jit
def prefill_mailbox(mailbox, tokens, offset):
    """Put a prefill dispatch's samples int32[B] at slots offset.. of ``mailbox``."""
    idx = offset + jnp.arange(tokens.shape[0])
    return mailbox.at[idx].set(tokens.astype(jnp.int32), mode="drop")


@jax.jit
def feed(mailbox, src, host):
    """Decode input int32[B]: mailbox[src[i]] where src[i] >= 0, else host[i]."""
    return jnp.where(src >= 0, mailbox[jnp.maximum(src, 0)], host)


def tokens_of(out):
    """A step's device output (tokens, or (tokens, log-probs)) -> the tokens."""
    return out[0] if isinstance(out, tuple) else out


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose samples the host has not read yet.

    ``decode_base[i]``: decode row i's ``num_cached`` after its first token (the serialized
    value once token 0 is appended); ``prefill_out``: ``ModelRunner.prefill``'s [(rows,
    output)] parts; ``completes[i]``: prefill chunk i samples a token; ``mailbox``: see the
    module docstring (None when not overlapping)."""

    plan: Any
    decode_out: Any = None
    prefill_out: Any = None
    decode_base: list[int] = dataclasses.field(default_factory=list)
    completes: list[bool] = dataclasses.field(default_factory=list)
    mailbox: Any = None

    @property
    def outputs(self) -> tuple:
        return self.decode_out, self.prefill_out

    def make_mailbox(self, size: int, zeros) -> None:
        """Fill ``mailbox`` from the outputs (asynchronously, on the device)."""
        box = zeros
        nd = len(self.plan.decode)
        if self.decode_out is not None:
            last = np.zeros(tokens_of(self.decode_out).shape[0], np.int32)
            last[:nd] = [r.steps - 1 for r in self.plan.decode]
            box = decode_mailbox(tokens_of(self.decode_out), last, size=size)
        if self.prefill_out is not None and any(self.completes):
            offset = nd  # parts in order: each overwrites the padding rows of the one before
            for rows, out in self.prefill_out:
                box = prefill_mailbox(box, tokens_of(out), np.int32(offset))
                offset += rows
        self.mailbox = box


def warm_helpers(size: int, decode_batches, step_counts, max_prefill_rows: int) -> None:
    """Compile (and run on zeros) every helper above for these decode batch buckets and scan
    lengths and prefill outputs of up to ``max_prefill_rows`` rows, so none compiles while
    serving."""
    box = jnp.zeros(size, jnp.int32)
    for b in decode_batches:
        z = np.zeros(b, np.int32)
        for n in step_counts:
            box = decode_mailbox(np.zeros((b, n), np.int32), z, size=size)
        feed(box, z, z)
    n = 1
    while n <= max(1, max_prefill_rows):
        box = prefill_mailbox(box, np.zeros(n, np.int32), np.int32(0))
        n *= 2
    jax.block_until_ready(box)


def host_outputs(out):
    """A step's device output -> (tokens, log-prob arrays or None) on the host."""
    if isinstance(out, tuple):
        toks, (lp, vals, ids) = out
        return np.asarray(toks), (np.asarray(lp), np.asarray(vals), np.asarray(ids))
    return np.asarray(out), None


def host_parts(parts):
    """``ModelRunner.prefill``'s [(rows, output)] -> (tokens, log-prob arrays or None) on the
    host, each part's real rows in order."""
    outs = [(rows, *host_outputs(out)) for rows, out in parts]
    toks = np.concatenate([t[:n] for n, t, _ in outs])
    if outs[0][2] is None:
        return toks, None
    return toks, tuple(np.concatenate([lp[i][:n] for n, _, lp in outs]) for i in range(3))


def pick_logprob(lps, *index) -> TokenLogprob | None:
    """Row (and step) ``index`` of the host log-prob arrays, with all MAX_LOGPROBS tops."""
    if lps is None:
        return None
    lp, vals, ids = (x[index] for x in lps)
    return TokenLogprob(-1, float(lp), tuple(zip(ids.tolist(), vals.tolist())))
