"""The serving benchmark and its tools.

* ``python -m bench.serving``: the load generator against any OpenAI-compatible server
  (``client.py``);
* ``python -m bench.serving.matrix``: the GPU matrix, real server processes, bf16 vs fp8;
* ``python -m bench.serving.merge``: merge device outputs into bench/results/serving-h200.json;
* ``python -m bench.serving.plot``: that JSON as one PNG.
"""
