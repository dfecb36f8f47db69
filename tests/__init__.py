"""The test suite as one package (``tests.kernels``, ``tests.models``, ...). Without this
file pytest put ``tests/`` itself on sys.path, so ``import kernels`` found ``tests/kernels``:
transformers 5.25 depends on Hugging Face's ``kernels`` package and imports it, and got ours."""
