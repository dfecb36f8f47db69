"""bench.profile_trace: the device-kernel summary of a profiler trace (synthetic events, and
a real CPU trace, whose device section is empty)."""

import jax
import jax.numpy as jnp

from bench import profile_trace


def _trace(kernels):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    host = [{"ph": "X", "pid": 2, "tid": 1, "ts": 0.0, "dur": 1e6, "name": "python"}]
    dev = [{"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name}
           for name, ts, dur in kernels]
    return {"traceEvents": meta + host + dev}


def test_summary_counts_busy_span_and_kinds():
    # Two overlapping kernels (10-20, 15-30) then a gap, then a GEMM (40-50): busy 30 of a
    # 40 us span; host events are ignored.
    trace = _trace([("loop_add_fusion", 10.0, 10.0), ("jfp8kv_paged_decode", 15.0, 15.0),
                    ("sm90_xmma_gemm_bf16", 40.0, 10.0)])
    s = profile_trace.summarize(profile_trace.device_events(trace), per=2)
    assert s["kernels"] == 1.5
    assert s["span_us"] == 20.0 and s["busy_us"] == 15.0 and s["idle_us"] == 5.0
    assert set(s["by_kind"]) == {"fusion", "pallas", "gemm"}
    assert s["by_kind"]["pallas"] == {"kernels": 0.5, "us": 7.5}
    assert s["top"][0]["name"] == "jfp8kv_paged_decode" and s["top"][0]["kind"] == "pallas"


def test_kinds():
    assert profile_trace.kind_of("jfp8kv_store_kv") == "pallas"
    assert profile_trace.kind_of("triton_gemm_dot_3") == "gemm"
    assert profile_trace.kind_of("input_reduce_fusion_2") == "fusion"
    assert profile_trace.kind_of("Memcpy DtoD") == "copy"
    assert profile_trace.kind_of("xyz") == "other"


def test_cpu_trace_has_no_device_kernels(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    s = profile_trace.profile(lambda: f(x).block_until_ready(), log_dir=str(tmp_path))
    assert s["kernels"] == 0 and "no device kernel" in s["note"]
