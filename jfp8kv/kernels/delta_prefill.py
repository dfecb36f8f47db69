"""The chunked gated delta rule (DeltaNet prefill) behind one contract: XLA or jla's Hopper
kernel, the route chosen by an explicit argument.

``chunked(q, k, v, g, beta, state, chunk=64, impl="xla")`` has ``delta_rule.chunked``'s
contract exactly (its arguments and return; shapes in ``delta_rule``'s docstring):

* ``impl="xla"``: ``delta_rule.chunked`` (the twin; every device, every dtype);
* ``impl="jla"``: the Pallas Mosaic GPU chunked Gated DeltaNet of ``jax-linear-attention``
  0.1.0 (import name ``jla``, Apache-2.0): ValueError, before anything is traced, when it
  cannot take the call (``jla_unsupported_reason``: no Hopper GPU, jla not importable,
  shapes or dtypes it does not take);
* ``impl="auto"``: "jla" where ``jla_unsupported_reason`` is None, else "xla". Decided in
  Python from the static shapes, the default device and the import (``route``), never by
  catching a failure of the call;
* ``impl="triton"``: ``delta_chunk_triton.chunked``, a candidate (XLA's chunk factors, one
  Pallas Triton kernel for the walk over the chunks; sm_89 and sm_90, default tuning). Only
  by name: "auto" never picks it until a GPU run has measured it.

jla's conventions, read from its source (wheel sha256 71a97f11...b8dc89; ``jla/ops/
reference.py``, ``jla/ops/mosaic_gpu/{gated_delta_rule,scalar_gate,scalar_gate_fused,
gated_delta_rule_kernels,_common}.py``) and how ours map onto them:

* entry: ``jla.ops.linear_attention("gated_deltanet", q, k, v, g=, beta=, scale=,
  initial_state=, output_final_state=True, use_qk_l2norm=, impl="mosaic_gpu")`` -> (o, S);
  with no context mesh its kernel-sharding wrapper calls the kernel unchanged;
* layout: q, k [B, T, Hk, K], v [B, T, H, V], g and beta [B, T, H], state [B, H, K, V]
  (the kernels keep it transposed inside and transpose back): ours;
* grouped heads: value head h reads key head h // (H / Hk): ours (``jnp.repeat``);
* recurrence: S' = exp(g_t) S; S = S' + beta_t k_t (v_t - k_t S')^T; o_t = scale q_t S (S
  including token t): ours, with g the natural-log decay (the kernels take cumsum(g) * log2
  e per 64-token chunk and use exp2);
* normalization: ``use_qk_l2norm=True`` is ``x * rsqrt(sum(x^2) + 1e-6)`` in float32, cast
  back to the input dtype; ``scale`` multiplies the output (default K**-0.5). Ours
  normalizes with the same formula and scales q by Dk**-0.5, so the adapter passes
  ``use_qk_l2norm=True, scale=Dk**-0.5`` (the normalized q/k are rounded to bf16 there, as
  the kernel's operands are anyway);
* supported: an sm_90 GPU; q, k, v of one dtype, bfloat16 or float16; K, V in {64, 128}
  (K = 256 goes to another kernel, not wrapped here); T >= 1, any length (padded to 64 with
  g = beta = 0); at most 65,535 chunks per call. Chunk size is fixed at 64: ``chunk`` only
  shapes the XLA path (the result does not depend on it);
* dtypes: g, beta, state taken as float32; o in q's dtype (= v's, as ours), the final state
  float32 (ours: the accumulation dtype, float32 for 16-bit inputs);
* arithmetic: the products on the tensor cores with bf16/f16 operands (the state is rounded
  to the input dtype for q S and k S, carried in float32), approximate exp2: agreement with
  the twin is to bf16 precision, not bits.

Padding (beta = g = 0). A padding token leaves the state alone in jla exactly: its row of
the gate-free inverse T0 = (I + A0)^-1 is the unit row (A0's row is beta_t k_t.k_s = 0 and
the blocked inverse's products keep it 0), so its correction v_new_t = sum_s T0[t, s]
exp(G_t - G_s) beta_s (...) is exactly 0 and adds nothing to the state; the chunk decay is
exp2(0) = 1 for an all-padding chunk (an approximate exp2, not a documented exact value).
So the adapter also selects the initial state, bit for bit, for every (row, head) whose
tokens are all padding (an idle row of a batch), which needs no such assumption.

Carrying jla to a machine without a registry: it pins jax==0.11.2 and Python >= 3.12 and
is pure Python; ``pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp -d .whl-jla jax-linear-attention==0.1.0`` here, then there ``python3 -m
pip install -q --no-index --no-deps --target /tmp/site .whl-jla/*.whl`` and
``PYTHONPATH=/tmp/site``. Its ``jla.ops`` imports only jax and numpy (equinox and optax,
its declared dependencies, are for its training code). Tests:
tests/kernels/test_delta_prefill.py.
"""

from __future__ import annotations

import functools
import importlib

import jax.numpy as jnp

from jfp8kv.kernels import delta_rule

IMPLS = ("xla", "jla", "auto", "triton")
JLA_CHUNK = 64
JLA_HEAD_DIMS = (64, 128)
JLA_DTYPES = ("bfloat16", "float16")
JLA_MAX_CHUNKS = 65535
JLA_VERSION = "0.1.0"


@functools.cache
def _load_jla():
    """jla's ``linear_attention`` (ImportError if jla or its Mosaic GPU kernels do not
    import). Tests replace this with a stand-in."""
    jla = importlib.import_module("jla")
    if getattr(jla, "__version__", None) != JLA_VERSION:
        raise ImportError(f"jla {getattr(jla, '__version__', '?')} is not the {JLA_VERSION} "
                          "this adapter was written against")
    importlib.import_module("jla.ops.mosaic_gpu.gated_delta_rule")  # registers the kernel
    return importlib.import_module("jla.ops").linear_attention


def _is_hopper() -> bool:
    from jfp8kv.kernels import is_hopper

    return is_hopper()


def jla_importable() -> str | None:
    """None when jla 0.1.0 and its Mosaic GPU Gated DeltaNet import here, else why not."""
    try:
        _load_jla()
    except ImportError as err:  # the probe of ``route``, not a fallback around a call
        return f"jla does not import here ({err})"
    return None


def jla_unsupported_reason(q, k, v, g, beta, state) -> str | None:
    """Why jla's kernel cannot take this call (None if it can): the checks of jla's
    ``scalar_gate.unsupported_reason`` on our shapes, then a Hopper GPU and the import."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if k.shape != q.shape or v.shape[:2] != (b, t) or hv % hk:
        return f"shapes q {q.shape}, k {k.shape}, v {v.shape}: grouped heads need Hk | Hv"
    if g.shape != (b, t, hv) or beta.shape != (b, t, hv) or state.shape != (b, hv, dk, dv):
        return f"g {g.shape}, beta {beta.shape}, state {state.shape} do not fit"
    names = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(names) != 1 or names.pop() not in JLA_DTYPES:
        return f"q, k, v must share a dtype in {JLA_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}"
    if dk not in JLA_HEAD_DIMS or dv not in JLA_HEAD_DIMS:
        return f"head dims Dk={dk}, Dv={dv} must be in {JLA_HEAD_DIMS}"
    if t == 0 or -(-t // JLA_CHUNK) > JLA_MAX_CHUNKS:
        return f"T={t}: jla takes 1 to {JLA_MAX_CHUNKS * JLA_CHUNK} tokens per call"
    if not _is_hopper():
        return "jla's Mosaic GPU kernels need an sm_90 (Hopper) GPU"
    return jla_importable()


def route(q, k, v, g, beta, state, impl: str) -> str:
    """"xla", "jla" or "triton" for this call under ``impl`` (see the module docstring);
    ValueError for an unknown impl, or for "jla" when jla cannot take the call."""
    if impl not in IMPLS:
        raise ValueError(f"unknown delta-rule prefill impl {impl!r}; choose one of {list(IMPLS)}")
    if impl in ("xla", "triton"):
        return impl
    reason = jla_unsupported_reason(q, k, v, g, beta, state)
    if impl == "jla" and reason is not None:
        raise ValueError(f"impl='jla' cannot run this call: {reason}")
    return "xla" if reason is not None else "jla"


def chunked(q, k, v, g, beta, state, chunk: int = 64, impl: str = "xla"):
    """``delta_rule.chunked``'s contract: q, k [B, T, Hk, Dk] raw, v [B, T, Hv, Dv], g, beta
    [B, T, Hv] (padding tokens beta = g = 0), state [B, Hv, Dk, Dv] -> (out [B, T, Hv, Dv] in
    v's dtype, final state [B, Hv, Dk, Dv] in the accumulation dtype). Static: chunk (the
    XLA and Triton paths'), impl ("xla" | "jla" | "auto" | "triton", decided by ``route`` at
    trace time). Nothing is donated."""
    path = route(q, k, v, g, beta, state, impl)
    if path == "xla":
        return delta_rule.chunked(q, k, v, g, beta, state, chunk)
    if path == "triton":
        from jfp8kv.kernels import delta_chunk_triton

        return delta_chunk_triton.chunked(q, k, v, g, beta, state, chunk)
    return jla_chunked(q, k, v, g, beta, state)


def jla_chunked(q, k, v, g, beta, state):
    """The call mapped onto jla's ``linear_attention`` (no checks: ``route`` made them)."""
    linear_attention = _load_jla()
    f32 = jnp.float32
    g, beta = g.astype(f32), beta.astype(f32)
    out, final = linear_attention(
        "gated_deltanet", q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5,
        initial_state=state.astype(f32), output_final_state=True, use_qk_l2norm=True,
        impl="mosaic_gpu")
    idle = jnp.all((beta == 0) & (g == 0), axis=1)  # [B, Hv]: no token touches the state
    final = jnp.where(idle[..., None, None], state.astype(f32), final.astype(f32))
    return out.astype(v.dtype), final
