"""Which executables the runner compiles per shape: plain or switched, per sampler mode.

A dispatch's sampler features (log-probs, penalties and min_tokens, prompt scoring) change
the step's argument structure, and so its executable. Two ways to carry them:

* per mix: only the features a batch asks for are in its arguments (``SamplingExtras``
  fields, ``Scoring``), and the sampler mode ``all_greedy`` is static. Nothing is computed
  that no row asked for, but each mix is its own executable, compiled on first use: on a
  GPU server each one stalls every running request (the H100 soak's 7 compiles after
  /health, docs/lab/serving-notes.md).
* switched: every feature's arrays are always there (``SamplingArrays.switched``,
  ``Scoring`` with a switch) and bool device scalars pick what runs (``sampler.branch``),
  greedy or sampled too (``all_greedy=None``): one executable per shape serves every mix,
  so the warm-up covers them all.

``Variants`` is the host-side policy. With ``feature_executables="switched"`` (the default)
a dispatch whose batch asks for a feature runs the switched structure; a plain one keeps its
branch-free executables (decode one per sampler mode; prefill, which decides greedy on the
device already, one), unless ``switch_plain`` (a CPU, where a compile costs more than
a branch: then one executable per shape in all). Plain dispatches stay plain because the
switched structure carries the penalty history, rows x max_model_len int32, on every call:
at 256 prefill rows and a 131,072-token context that is 134 MB per dispatch. Per shape that
is one executable more than per mix (the switched one), compiled by the warm-up.
``"per-mix"`` is the former GPU policy, kept for an A/B of the switched structure's cost
(bench.offline ``--feature-executables``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jfp8kv.engine.sampler import SamplingArrays, Scoring


@dataclasses.dataclass(frozen=True)
class Variants:
    """``feature_executables``: "switched" or "per-mix" (``EngineConfig``'s);
    ``switch_plain``: plain dispatches through the switched executable too;
    ``history_width``: the penalty history's tokens (the runner's max_model_len in pages)."""

    feature_executables: str
    switch_plain: bool
    history_width: int

    def switched(self, kind: str, features: bool) -> bool:
        """Whether a ``kind`` ("decode" or "prefill") dispatch, with or without ``features``
        (log-probs, penalties, prompt scoring), runs the switched structure."""
        if self.feature_executables != "switched":
            return False
        return features or self.switch_plain

    def of(self, kind: str) -> tuple[tuple[bool | None, bool], ...]:
        """The (all_greedy, switched) variants a ``kind`` shape compiles at warm-up: the plain
        ones (decode per sampler mode, prefill one: it decides greedy on the device) unless
        plain dispatches are switched, and the switched one."""
        plain_modes = (None,) if kind == "prefill" else (True, False)
        plain = () if self.switched(kind, False) else tuple((g, False) for g in plain_modes)
        return plain + (((None, True),) if self.switched(kind, True) else ())

    def sampling(self, sampling: SamplingArrays, b: int, switched: bool) -> SamplingArrays:
        """A batch's sampling rows padded to ``b``; ``switched``: in the one structure every
        feature mix shares."""
        padded = sampling.padded(b)
        return padded.switched(self.history_width) if switched else padded

    @staticmethod
    def scoring(b: int, t: int, targets, switched: bool) -> Scoring | None:
        """``steps.prefill``'s ``scoring`` argument for a [b, t] dispatch: ``switched``:
        always there, switched on the device by whether ``targets`` (int32[b, t]) are given;
        else only with ``targets`` (its own executable)."""
        if switched:
            scored = targets is not None
            return Scoring(targets if scored else np.zeros((b, t), np.int32), np.bool_(scored))
        return None if targets is None else Scoring(targets)
