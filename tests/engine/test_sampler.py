"""The sampler's optional features against numpy references of their formulas."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfp8kv.engine import sampler
from jfp8kv.engine.sampler import PenaltyArrays, SamplingExtras

V = 50


def ref_penalize(logits, prompt, output, presence, frequency, repetition):
    """vLLM/HF repetition penalty over prompt + output, then OpenAI frequency/presence."""
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, c in Counter(output).items():
        out[t] -= frequency * c + presence
    return out


def _rows(rng):
    """Three rows: all penalties, none (defaults), repetition only; random histories."""
    prompts = [rng.integers(0, V, 7).tolist(), rng.integers(0, V, 3).tolist(),
               rng.integers(0, V, 5).tolist()]
    outputs = [rng.integers(0, 10, 9).tolist(), rng.integers(0, V, 4).tolist(), []]
    presence = np.array([0.7, 0.0, 0.0], np.float32)
    frequency = np.array([0.3, 0.0, 0.0], np.float32)
    repetition = np.array([1.8, 1.0, 0.6], np.float32)
    width = 24
    history = np.full((3, width), -1, np.int32)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        history[i, :len(p) + len(o)] = p + o
    pen = PenaltyArrays(history, np.array([len(p) for p in prompts], np.int32), presence,
                        frequency, repetition, np.zeros(3, np.int32), np.full((3, 8), -1, np.int32))
    return prompts, outputs, pen


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng()
    prompts, outputs, pen = _rows(rng)
    logits = rng.normal(0, 3, (3, V)).astype(np.float32)
    counts, seen = sampler.history_counts(jnp.asarray(pen.history), jnp.asarray(pen.num_prompt), V)
    got = np.asarray(sampler.apply_penalties(jnp.asarray(logits), counts, seen, pen.presence,
                                             pen.frequency, pen.repetition))
    for i in range(3):
        want = ref_penalize(logits[i], prompts[i], outputs[i], pen.presence[i],
                            pen.frequency[i], pen.repetition[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])  # defaults change nothing


def test_min_tokens_masks_stop_ids_until_reached():
    logits = jnp.zeros((2, V))
    stop_ids = jnp.array([[3, 7, -1], [3, -1, -1]], jnp.int32)
    out = np.asarray(sampler.mask_stop_ids(logits, stop_ids, jnp.array([1, 2]),
                                           jnp.array([2, 2])))
    assert np.isneginf(out[0, [3, 7]]).all() and np.isfinite(np.delete(out[0], [3, 7])).all()
    assert np.isfinite(out[1]).all()  # row 1 has generated min_tokens already


def test_sample_step_greedy_takes_penalized_argmax_and_counts_it():
    rng = np.random.default_rng()
    prompts, outputs, pen = _rows(rng)
    logits = rng.normal(0, 3, (3, V)).astype(np.float32)
    extras = SamplingExtras(jax.tree.map(jnp.asarray, pen), logprobs=True)
    state = sampler.init_state(extras, V)
    zeros = jnp.zeros(3, jnp.int32)
    toks, state, (lp, vals, ids) = sampler.sample_step(
        jnp.asarray(logits), state, jnp.zeros(3), zeros, jnp.ones(3), zeros.astype(jnp.uint32),
        zeros, extras, all_greedy=True)
    toks = np.asarray(toks)
    for i in range(3):
        want = ref_penalize(logits[i], prompts[i], outputs[i], pen.presence[i],
                            pen.frequency[i], pen.repetition[i])
        assert toks[i] == want.argmax()
        assert int(state[0][i, toks[i]]) == outputs[i].count(toks[i]) + 1
    # log-probs are of the raw logits, not the penalized ones
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(3), toks], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-ref, axis=-1)[:, :20], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], ref.argmax(-1))


def test_no_extras_is_plain_sample():
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(0, 3, (4, V)).astype(np.float32))
    args = (jnp.full(4, 0.8), jnp.array([0, 5, 0, 2], jnp.int32), jnp.full(4, 0.9),
            jnp.arange(4, dtype=jnp.uint32), jnp.arange(4, dtype=jnp.int32))
    toks, state, lp = sampler.sample_step(logits, None, *args, None, all_greedy=False)
    assert state is None and lp is None
    np.testing.assert_array_equal(toks, sampler.sample(logits, *args, all_greedy=False))


def test_device_side_greedy_switch_equals_the_static_paths():
    """all_greedy=None (CPU: one executable) samples as all_greedy=False when a row has a
    temperature, and returns the argmax when none has."""
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(0, 3, (4, V)).astype(np.float32))
    rest = (jnp.array([0, 5, 0, 2], jnp.int32), jnp.full(4, 0.9),
            jnp.asarray(rng.integers(0, 2**31, 4), jnp.uint32), jnp.arange(4, dtype=jnp.int32))
    run = jax.jit(sampler.sample, static_argnames="all_greedy")
    for temps in (jnp.array([0.0, 0.8, 0.0, 1.3]), jnp.zeros(4)):
        want = run(logits, temps, *rest, all_greedy=False)
        np.testing.assert_array_equal(run(logits, temps, *rest, all_greedy=None), want)
    np.testing.assert_array_equal(run(logits, jnp.zeros(4), *rest, all_greedy=None),
                                  np.asarray(logits).argmax(-1))


def test_switched_structure_equals_each_static_one():
    """``SamplingArrays.switched`` (the CPU's one executable for every feature mix) samples the
    tokens and returns the log-probs of the structure compiled for that mix; a switched-off
    feature changes nothing (penalties) or returns zeros (log-probs). One jitted function
    serves all four mixes below without a retrace."""
    rng = np.random.default_rng()
    _, _, pen = _rows(rng)
    logits = jnp.asarray(rng.normal(0, 3, (3, V)).astype(np.float32))
    traces = []

    def step(logits, *args, all_greedy):
        toks, _, lp = sampler.sample_step(logits, sampler.init_state(args[-1], V), *args,
                                          all_greedy=all_greedy)
        return toks, lp

    @jax.jit
    def run(logits, *args):
        traces.append(1)
        return step(logits, *args, all_greedy=None)

    for penalty in (None, pen):
        for logprobs in (False, True):
            arrays = sampler.SamplingArrays(
                np.array([0.0, 0.9, 1.2], np.float32), np.array([0, 7, 0], np.int32),
                np.array([1.0, 0.8, 0.95], np.float32),
                rng.integers(0, 2**31, 3).astype(np.uint32), np.array([4, 0, 2], np.int32),
                None if (penalty, logprobs) == (None, False) else SamplingExtras(penalty, logprobs))
            want_toks, want_lp = jax.jit(functools.partial(step, all_greedy=False))(
                logits, *arrays.args())
            toks, lp = run(logits, *arrays.switched(pen.history.shape[1]).args())
            np.testing.assert_array_equal(toks, want_toks)
            if logprobs:
                for got, want in zip(lp, want_lp):
                    np.testing.assert_array_equal(got, want)
            else:
                assert want_lp is None and not any(np.asarray(x).any() for x in lp)
    assert len(traces) == 1


@pytest.mark.parametrize("b, t", [(3, 7), (1, 5)])  # 21: 2 blocks of 8 + 5; 5: < a block
def test_prompt_scoring_in_blocks_equals_all_positions_at_once(monkeypatch, b, t):
    """``steps.score_positions`` (blocks of ``score_block`` positions and a remainder)
    gives ``token_logprobs`` of the whole [B, T, V] logits, for a tied and an untied head."""
    from jfp8kv.engine import steps

    monkeypatch.setattr(steps, "SCORE_BLOCK", 8)
    assert steps.score_block(V) == 8
    rng = np.random.default_rng()
    hidden = jnp.asarray(rng.standard_normal((b, t, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((16, V)), jnp.float32)
    for params in ({"lm_head": w}, {"embed": w.T}):
        want = sampler.token_logprobs(hidden @ w, targets)
        got = steps.score_positions(params, hidden, targets)
        assert [g.shape for g in got] == [x.shape for x in want]
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
        logp = np.asarray(jax.nn.log_softmax(hidden @ w, axis=-1))  # ids up to near-ties:
        np.testing.assert_allclose(np.take_along_axis(logp, np.asarray(got[2]), -1), got[1],
                                   rtol=1e-5, atol=1e-5)
        assert (np.asarray(got[2]) == np.asarray(want[2])).mean() > 0.95


def test_scoring_blocks_are_bounded_in_bytes():
    from jfp8kv.engine import steps

    assert steps.score_block(49152) == 256  # SmolLM2: 48 MiB of float32 logits per block
    assert steps.score_block(151936) == 64 and steps.score_block(248320) == 64
    assert steps.score_block(1000) == steps.SCORE_BLOCK and steps.score_block(10 ** 9) == 8
    for v in (49152, 151936, 248320):
        assert steps.score_block(v) * v * 4 <= steps.SCORE_BYTES
