"""The code's shape, checked: layers depend one way, no import cycles, small files and functions.

Read with `ast` (nothing is imported), so the rules hold for every module, optional extras included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "pdserve"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """pdserve modules that `name` imports at module level or in functions (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                root = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*root, base] if base else root)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules (a package's __init__ importing its own submodules does not count)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if n.startswith(m + "."):  # a submodule importing its parent package's re-exports
                continue
            if m.startswith(n + "."):  # a package importing its own submodules
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_cycles() -> None:
    assert _cycle(_graph()) is None


def test_layers_depend_one_way() -> None:
    """model/ and kernels take tensors and plain data: they import nothing from engine/, server/ or disagg/;
    engine/ imports nothing from server/; nothing below the server imports the server."""
    graph = _graph()
    rules = {"pdserve.model": ("pdserve.engine", "pdserve.server", "pdserve.disagg", "pdserve.llm"),
             "pdserve.engine": ("pdserve.server", "pdserve.llm"),
             "pdserve.outputs": ("pdserve.engine", "pdserve.model", "pdserve.server")}
    bad = [f"{mod} -> {dep}" for mod, deps in graph.items() for low, banned in rules.items()
           if mod == low or mod.startswith(low + ".")
           for dep in deps if any(dep == b or dep.startswith(b + ".") for b in banned)]
    assert bad == []


def test_no_private_imports_across_modules() -> None:
    """No module imports another module's private (`_name`) names."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve"):
                bad += [f"{name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


@pytest.mark.parametrize("limit", [MAX_FILE_LINES])
def test_files_are_small(limit: int) -> None:
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert big == {}


def test_functions_are_small() -> None:
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def _classes(path: Path) -> list[ast.ClassDef]:
    return [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef)]


def test_one_forward_definition_per_architecture() -> None:
    """Each decoder layer is written once (its `forward`); no `forward_native`-style second copy anywhere, and the
    native code holds no hand-written decoder: the whole-stack program is recorded from the Python definition."""
    layers, extra = [], []
    for path in (PKG / "model").rglob("*.py"):
        for cls in _classes(path):
            methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if cls.name.endswith("DecoderLayer"):
                layers.append(cls.name)
                assert methods.count("forward") == 1 and not [m for m in methods if "forward" in m and
                                                                 m != "forward"], f"{path.name}: {cls.name}"
            extra += [f"{path.name}: {cls.name}.{m}" for m in methods if m.startswith(("forward_", "_forward_"))]
    assert layers and extra == []
    native = [f"{p.name}: {m.group(0)}" for p in (PKG / "kernels" / "csrc").iterdir()
              for m in re.finditer(r"\b(?:class|struct)\s+\w*(?:Decoder|Layer|Model)\w*", p.read_text())]
    assert native == []


# feature probes of PyTorch itself, not choices among our own objects
_HASATTR_ALLOWED = {("cpu_linear.py", "onednn_available")}


def test_no_duck_typed_kernel_choice() -> None:
    """The model layer picks kernels from typed objects (KernelSelection, PackedMatrix), never by asking an object
    what it has: no getattr with a default, no hasattr, no `type: ignore[attr-defined]` under pdserve/model."""
    bad = []
    for path in (PKG / "model").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "type: ignore[attr-defined]" in text:
            bad.append(f"{path.name}: type: ignore[attr-defined]")
        tree = ast.parse(text)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(fn):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                if call.func.id == "getattr" and len(call.args) > 2:
                    bad.append(f"{path.name}:{call.lineno} getattr with a default in {fn.name}")
                if call.func.id == "hasattr" and (path.name, fn.name) not in _HASATTR_ALLOWED:
                    bad.append(f"{path.name}:{call.lineno} hasattr in {fn.name}")
    assert bad == []
