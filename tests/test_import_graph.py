"""The package's imports run one way (config -> kvcache -> kernels -> models -> engine ->
serve/cli): no module of jfp8kv reaches itself through imports, counting imports made inside
functions (the ones that held the old circles together), and the layers never import
upward. Read from the source with ``ast``: nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jfp8kv"
# Lower number = lower layer; a module may import its own layer or any lower one.
LAYERS = {"config": 0, "config_fields": 0, "config_hf": 0, "config_v4": 0, "kvcache": 1,
          "kernels": 2, "models": 3, "engine": 4, "entrypoints": 5, "calibrate": 6,
          "serve": 5, "cli": 5, "__main__": 6, "__init__": 6}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """jfp8kv modules that ``path`` imports anywhere in its body (``from a import b`` counts
    as a.b when that is a module, else as a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` (a path back to its first module), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else LAYERS["__init__"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_layers_import_downward_only():
    up = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps
                if layer(b) > layer(a))
    assert not up, up


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("src,want", [("from jfp8kv.models import mla", "jfp8kv.models.mla"),
                                      ("from jfp8kv import kernels", "jfp8kv.kernels"),
                                      ("from . import cache", "jfp8kv.kvcache.cache")])
def test_imports_are_read_as_modules(tmp_path, src, want):
    f = tmp_path / "x.py"
    f.write_text(src)
    known = {"jfp8kv.models.mla", "jfp8kv.models", "jfp8kv.kernels", "jfp8kv.kvcache.cache",
             "jfp8kv.kvcache"}
    assert imports_of(f, "jfp8kv.kvcache.x", known) == {want}
