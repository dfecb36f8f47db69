"""The installed versions of jfp8kv's run-time dependencies sit inside pyproject's bounds, and
the dependencies whose APIs the code leans on are bounded on both sides.

The kernels use experimental Pallas and Mosaic GPU APIs that change between jax releases, so a
fresh install must not pick a jax newer than the newest one the tests passed with; this test
is how CI proves the bounds it claims (run on the machine whose versions they name).
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUNDED_BOTH_SIDES = ("jax", "jaxlib", "transformers", "gguf")


def _requirements(group: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
    reqs = (Requirement(line) for line in lines)
    return {r.name.lower(): r for r in reqs}


def test_leaned_on_dependencies_have_lower_and_upper_bounds():
    reqs = _requirements()
    for name in BOUNDED_BOTH_SIDES:
        ops = {spec.operator for spec in reqs[name].specifier}
        assert ops & {">=", ">"} and ops & {"<=", "<"}, f"{name}: {reqs[name]}"
    for extra in ("cuda12", "cuda13"):
        assert _requirements(extra)["jax"].specifier == reqs["jax"].specifier


@pytest.mark.parametrize("name", sorted(_requirements()))
def test_installed_version_is_inside_the_bounds(name):
    req = _requirements()[name]
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{name} is a run-time dependency but is not installed")
    assert req.specifier.contains(version, prereleases=True), \
        f"installed {name} {version} is outside pyproject's {req.specifier}"

