"""Benchmarks, one module each, run from the repository root as ``python -m bench.NAME``:

* ``offline``: offline throughput of ``jfp8kv.LLM`` against an ideal time (issue 12);
* ``serving`` (a subpackage): the server load generator, the GPU matrix, merge and plot;
* ``kernels``: the Pallas kernels against the copy ceiling and JAX's paged attention;
* ``decode_floor``: the jitted decode step against its memory floor;
* ``capacity``: tokens the KV pool holds per storage format;
* ``quality`` (GPU) and ``quality_cpu`` (the engine vs ``fakequant``): fp8 KV quality;
* ``peer_hf``: the outside peer, transformers ``generate``;
* ``ptx_stats``: static PTX statistics of the prefill kernel (no GPU).

Shared code: ``common`` (paths, machine record, measured ceilings), ``fakequant`` (the
independent fake quantization, also used by tests), ``internals`` (the one place that
reaches past jfp8kv's public API). Device orchestration scripts are in ``bench/device/``;
``bench/results/`` holds JSON and PNG only.
"""
