"""Every third-party module jfp8kv imports is a declared dependency, and torch is not one.

``pip install -e .`` (no extras) must be enough to run the README's server command, so each
import under jfp8kv/ must resolve to a distribution listed in pyproject's ``dependencies``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def imported_top_level_modules(package_dir: Path) -> set[str]:
    names = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"jfp8kv", "__future__"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_runtime_import_is_declared_and_torch_is_not():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = {normalized(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0])
                for r in project["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    modules = imported_top_level_modules(REPO_ROOT / "jfp8kv")
    assert {"jax", "gguf", "tokenizers", "transformers"} <= modules
    missing = {m: dists.get(m) for m in modules
               if not {normalized(d) for d in dists.get(m, [m])} & declared}
    assert not missing, f"imported by jfp8kv but not declared in pyproject: {missing}"
    assert "torch" not in declared and "torch" not in modules
