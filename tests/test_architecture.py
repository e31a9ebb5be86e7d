"""The code's shape, checked: layers depend one way, no import cycles, small files and functions.

Read with `ast` (nothing is imported), so the rules hold for every module, optional extras included; whether the
router loads torch is also checked by importing it in a fresh interpreter.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
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


def _targets(node: ast.Import | ast.ImportFrom, pkg: str) -> list[str]:
    """The dotted names an import statement names (relative ones resolved against `pkg`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        root = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
        base = ".".join([*root, base] if base else root)
    return [f"{base}.{a.name}" for a in node.names] + [base]


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
        targets = _targets(node, pkg) if isinstance(node, (ast.Import, ast.ImportFrom)) else []
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


# package -> packages it must not import (at module level or in functions); a package's prefix covers its modules
LAYER_RULES = {
    # the model takes tensors and plain data
    "pdserve.model": ("pdserve.engine", "pdserve.server", "pdserve.kv_transfer", "pdserve.router", "pdserve.api",
                      "pdserve.llm"),
    "pdserve.engine": ("pdserve.server", "pdserve.router", "pdserve.api", "pdserve.llm"),
    # below the engine: it reaches requests and blocks through kv_transfer/base.py's structural types
    "pdserve.kv_transfer": ("pdserve.engine", "pdserve.model", "pdserve.server", "pdserve.router", "pdserve.api",
                            "pdserve.llm"),
    # beside the server: HTTP to the instances only, no engine and no torch (test_router_loads_no_torch)
    "pdserve.router": ("pdserve.engine", "pdserve.model", "pdserve.server", "pdserve.llm"),
    "pdserve.deploy.ray.ingress": ("pdserve.engine", "pdserve.model", "pdserve.server", "pdserve.llm"),
    # shared by the server and the router
    "pdserve.api": ("pdserve.engine", "pdserve.model", "pdserve.server", "pdserve.router", "pdserve.kv_transfer",
                    "pdserve.llm"),
    "pdserve.outputs": ("pdserve.engine", "pdserve.model", "pdserve.server"),
}
# what the engine may import of the KV transfer: the interface and the factory, never a connector or the manager
ENGINE_KV_TRANSFER = ("pdserve.kv_transfer.base", "pdserve.kv_transfer.factory")


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_layers_depend_one_way() -> None:
    """model/ and kernels take tensors and plain data; engine/ imports nothing from server/; the KV transfer sits
    below the engine; the router and the shared HTTP pieces (api/) import neither the server nor the engine."""
    graph = _graph()
    bad = [f"{mod} -> {dep}" for mod, deps in graph.items() for low, banned in LAYER_RULES.items()
           if _under(mod, low) for dep in deps if any(_under(dep, b) for b in banned)]
    assert bad == []


def test_engine_uses_the_kv_transfer_interface_only() -> None:
    """The engine builds its KV transfer with the factory and calls it through the interface (kv_transfer/base.py);
    connector modules are the factory's business."""
    bad = [f"{mod} -> {dep}" for mod, deps in _graph().items() if _under(mod, "pdserve.engine")
           for dep in deps if _under(dep, "pdserve.kv_transfer") and dep not in ENGINE_KV_TRANSFER]
    assert bad == []


def _module_level_imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(pdserve modules, top-level names of other packages) that importing `name` runs: module-level imports only
    (not in functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours: set[str] = set()
    theirs: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit([*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)])
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, pkg):
                    if target.split(".")[0] != "pdserve":
                        theirs.add(target.split(".")[0])
                        continue
                    while target and target not in known:
                        target = target.rpartition(".")[0]
                    if target:
                        ours.add(target)

    visit(tree.body)
    return ours, theirs


def _loaded_by(roots: list[str]) -> tuple[set[str], set[str]]:
    """Every pdserve module (parent packages included) and every other top-level package that importing `roots`
    loads, following module-level imports."""
    mods = _modules()
    known = set(mods)
    seen: set[str] = set()
    external: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            mod = ".".join(parts[:i])
            if mod in seen or mod not in mods:
                continue
            seen.add(mod)
            ours, theirs = _module_level_imports(mod, mods[mod], known)
            external |= theirs
            todo += sorted(ours)
    return seen, external


def _package(pkg: str) -> list[str]:
    """Every module of a pdserve package, the package itself included."""
    return sorted(m for m in _modules() if _under(m, pkg))


@pytest.mark.parametrize("pkg", ["pdserve.router", "pdserve.deploy.ray.ingress", "pdserve.api"])
def test_router_imports_no_engine_and_no_torch(pkg: str) -> None:
    """Read from the source: what importing any module of the router (or the Ray ingress, or the shared HTTP pieces)
    loads holds no engine, model or server module and no torch; so each router process and Ray ingress actor starts
    without the ~300 MB torch costs."""
    loaded, external = _loaded_by(_package(pkg))
    assert not {m for m in loaded for b in ("pdserve.engine", "pdserve.model", "pdserve.server") if _under(m, b)}
    assert not external & {"torch", "transformers", "safetensors", "gguf", "zmq"}


def _loaded_in_fresh_interpreter(code: str, banned: tuple[str, ...]) -> list[str]:
    """Runs `code` in a new interpreter; the modules under `banned` it left in sys.modules."""
    check = f"import sys; bad = {banned!r}; " \
            "print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in bad)))"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + "\n" + check], capture_output=True,
                         text=True, timeout=300, cwd=PKG.parent, check=True)
    return list(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


def test_router_loads_no_torch() -> None:
    """The same, checked by importing for real in a fresh interpreter: every router module, the router's app
    (built), the Ray ingress, the `pdserve router` command line, and pdserve's public names leave torch, the engine
    and the model unloaded."""
    code = f"""
        import importlib, importlib.util
        for name in {_package("pdserve.router") + _package("pdserve.api")!r}:
            importlib.import_module(name)
        from pdserve import EngineConfig, SamplingParams
        from pdserve.router.app import create_router_app
        from pdserve.router.serving import RouterConfig
        from pdserve.cli import build_parser
        create_router_app(RouterConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"]))
        build_parser().parse_args(["router", "--decode", "http://127.0.0.1:9"])
        EngineConfig(dtype="bfloat16"), SamplingParams(max_tokens=4)
        if importlib.util.find_spec("ray") is not None:
            import pdserve.deploy.ray.ingress
    """
    assert _loaded_in_fresh_interpreter(code, ("torch", "pdserve.engine", "pdserve.model", "pdserve.server",
                                               "pdserve.llm")) == []


def test_kv_transfer_loads_nothing_above_it() -> None:
    """Importing every KV-transfer module for real (connectors included) loads no engine, server, router or HTTP
    module: the package sits below the engine."""
    code = f"""
        import importlib, importlib.util
        for name in {_package("pdserve.kv_transfer")!r}:
            importlib.import_module(name)
    """
    assert _loaded_in_fresh_interpreter(code, ("pdserve.engine", "pdserve.server", "pdserve.router", "pdserve.api",
                                               "pdserve.llm")) == []


def test_public_names_still_load() -> None:
    """`from pdserve import LLM, ...` still works (pdserve/__init__.py loads them on first use)."""
    code = ("import sys; from pdserve import LLM, EngineConfig, SamplingParams, RequestOutput, CompletionOutput; "
            "print(LLM.__module__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PKG.parent, check=True)
    assert out.stdout.split() == ["pdserve.llm", "True"]


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
