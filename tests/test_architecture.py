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


def _imports(name: str, path: Path, known: set[str], type_checking: bool = True) -> set[str]:
    """pdserve modules that `name` imports at module level, in functions and (unless `type_checking` is False) in
    TYPE_CHECKING blocks: an import only the type checker sees still ties the two modules together."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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


def _graph(type_checking: bool = True) -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods), type_checking) for name, path in mods.items()}


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
    """None, even through TYPE_CHECKING imports."""
    assert _cycle(_graph()) is None


def test_type_checking_imports_count(tmp_path: Path) -> None:
    """The graph sees an import made only for the type checker (so a cycle through one fails the test above)."""
    path = tmp_path / "probe.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from pdserve.engine.request import Request\n", encoding="utf-8")
    known = set(_modules())
    assert _imports("pdserve.x", path, known) == {"pdserve.engine.request"}
    assert _imports("pdserve.x", path, known, type_checking=False) == set()


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


# ---- one owner for request state, one face for the server ----------------------------------------------------------
SCHEDULER = "pdserve.engine.scheduler"
QUEUES = {"waiting", "running", "requests"}  # the scheduler's request queues and its map of requests
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "remove", "pop", "popleft", "popitem",
            "clear", "sort", "reverse", "update", "setdefault", "add", "discard", "rotate"}


def _owner(node: ast.expr) -> str:
    """The source text of the expression an attribute hangs off (`eng.scheduler` for `eng.scheduler.waiting`)."""
    return ast.unparse(node.value) if isinstance(node, ast.Attribute) else ""


def state_writes(module: str, source: str) -> list[str]:
    """Where `source` (module `module`) writes request state that only the scheduler may write:
    - an assignment (=, +=, annotated) to an attribute named `num_computed_tokens`, anywhere but the scheduler
      (engine/request.py's Request.__init__ sets its initial value);
    - a call of `append_output_token` (a request's tokens grow only in the scheduler);
    - a mutation of a request queue (`waiting`, `running`, `requests`): assigning the attribute, assigning or
      deleting one of its items, or calling a mutating method on it; counted when it hangs off an expression
      named `...scheduler`, or anywhere inside pdserve/engine/ (other engine classes own no such queues)."""
    if module == SCHEDULER:
        return []
    in_engine = module.startswith("pdserve.engine.")
    out: list[str] = []

    def queue(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in QUEUES
                and (in_engine or _owner(node).split(".")[-1] == "scheduler"))

    tree = ast.parse(source)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in [e for x in targets for e in (x.elts if isinstance(x, ast.Tuple) else [x])]:
            init = module == "pdserve.engine.request" and _owner(t) == "self"
            if isinstance(t, ast.Attribute) and t.attr == "num_computed_tokens" and not init:
                out.append(f"{module}:{node.lineno} assigns {ast.unparse(t)}")
            if queue(t) or (isinstance(t, ast.Subscript) and queue(t.value)):
                out.append(f"{module}:{node.lineno} writes {ast.unparse(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "append_output_token" and module != "pdserve.engine.request":
                out.append(f"{module}:{node.lineno} calls {ast.unparse(f)}")
            if f.attr in MUTATORS and queue(f.value):
                out.append(f"{module}:{node.lineno} calls {ast.unparse(f)}")
    return out


def test_request_state_has_one_writer() -> None:
    """num_computed_tokens, a request's tokens and the scheduler's queues are written only in engine/scheduler.py
    (Scheduler.schedule and update_from_output and the finish paths); every other module reads them."""
    bad = [w for name, path in _modules().items() for w in state_writes(name, path.read_text(encoding="utf-8"))]
    assert bad == []


def test_the_one_writer_check_can_fail() -> None:
    """The check above catches each kind of write it names (so its silence means something)."""
    writes = """
def f(eng, req, self):
    req.num_computed_tokens += 1
    req.num_computed_tokens = 0
    eng.scheduler.waiting.append(req)
    eng.scheduler.requests[req.request_id] = req
    del eng.scheduler.requests["x"]
    eng.scheduler.running = []
    req.append_output_token(5)
"""
    assert len(state_writes("pdserve.server.serving", writes)) == 7
    assert len(state_writes("pdserve.engine.core", "def g(self):\n    self.running.remove(1)\n")) == 1
    reads = "def h(eng, r):\n    n = r.num_computed_tokens\n    q = len(eng.scheduler.waiting)\n    self.running = 1\n"
    assert state_writes("pdserve.server.metrics", reads) == []
    assert state_writes(SCHEDULER, writes) == []


CLIENT = "pdserve.engine.client"
ENGINE_INTERNALS = {"engine", "_engine"}  # what a server module must never reach through


def client_api() -> set[str]:
    """The engine client's public names: EngineClient's methods and properties, and the attributes its
    __init__ sets, that do not start with `_`."""
    tree = ast.parse((PKG / "engine" / "client.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names |= {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and _owner(t) == "self"}
    return {n for n in names if not n.startswith("_")}


def client_misuse(module: str, source: str, api: set[str]) -> list[str]:
    """What server module `module` does with the engine beyond the client's public face: an import from
    pdserve.engine other than pdserve.engine.client (whose plain types it re-exports) or from pdserve.model; an
    attribute named `engine`/`_engine` (the engine behind a client); a name used on an expression named
    `...client` that is not EngineClient's public API."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if (node.module.startswith("pdserve.engine") and node.module != CLIENT) or \
                    node.module.startswith("pdserve.model"):
                out.append(f"{module}:{node.lineno} imports {node.module}")
        elif isinstance(node, ast.Import):
            out += [f"{module}:{node.lineno} imports {a.name}" for a in node.names
                    if a.name.startswith(("pdserve.engine", "pdserve.model"))]
        elif isinstance(node, ast.Attribute):
            if node.attr in ENGINE_INTERNALS:
                out.append(f"{module}:{node.lineno} reaches {ast.unparse(node)}")
            elif _owner(node).split(".")[-1] == "client" and node.attr not in api:
                out.append(f"{module}:{node.lineno} uses {ast.unparse(node)}, not the client's public API")
    return out


def test_server_uses_only_the_engine_client() -> None:
    """server/ reaches an engine only through EngineClient's public methods and the plain data it exports."""
    api = client_api()
    assert {"process_inputs", "add_requests", "stream", "abort", "tokenizer", "model_info"} <= api
    bad = [m for name, path in _modules().items() if name.startswith("pdserve.server.")
           for m in client_misuse(name, path.read_text(encoding="utf-8"), api)]
    assert bad == []


def test_the_client_check_can_fail() -> None:
    api = client_api()
    misuse = """
from pdserve.engine.engine import LLMEngine
import pdserve.model.runner
def f(self, served):
    self.client.engine.scheduler
    served.client._engine
    self.client.kv_transfer
"""
    found = client_misuse("pdserve.server.x", misuse, api)
    assert len(found) == 5, found  # two imports, .engine, ._engine, and kv_transfer (not in the client's API)
    assert client_misuse("pdserve.server.x", "def g(self):\n    self.client.abort('x')\n", api) == []


def forward_problems(sources: dict[str, str], registry: str) -> list[str]:
    """What breaks "one forward definition per architecture" in the model layer's `sources` (file name -> text)
    and `registry` (model/architectures.py):
    - a decoder layer class (`...DecoderLayer`) without exactly one `forward`, or with a second forward-like method;
    - any `forward_*` / `_forward_*` method (a second path, as `forward_native` was);
    - a CausalLM subclass that writes its own `forward` or `hidden_states` (the stack is written once, in CausalLM;
      an architecture brings its decoder layer, its embedding and its weight names);
    - MODEL_CLASSES naming an architecture twice, or mapping one to a class that is not a CausalLM subclass of the
      model layer."""
    out: list[str] = []
    stacks: set[str] = set()
    for fname, text in sources.items():
        for cls in [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]:
            methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if cls.name.endswith("DecoderLayer") and (methods.count("forward") != 1 or
                                                     [m for m in methods if "forward" in m and m != "forward"]):
                out.append(f"{fname}: {cls.name} has forward methods {methods}")
            out += [f"{fname}: {cls.name}.{m}" for m in methods if m.startswith(("forward_", "_forward_"))]
            if "CausalLM" in [ast.unparse(b) for b in cls.bases]:
                stacks.add(cls.name)
                out += [f"{fname}: {cls.name}.{m} (a second stack)" for m in methods if m in ("forward",
                                                                                           "hidden_states")]
    table = next(n.value for n in ast.walk(ast.parse(registry)) if isinstance(n, ast.AnnAssign | ast.Assign)
                 and "MODEL_CLASSES" in ast.unparse(n.target if isinstance(n, ast.AnnAssign) else n.targets[0]))
    assert isinstance(table, ast.Dict)
    names = [ast.literal_eval(k) for k in table.keys if k is not None]
    out += [f"architectures.py: {n} registered {names.count(n)} times" for n in sorted(set(names))
            if names.count(n) > 1]
    out += [f"architectures.py: {ast.unparse(v)} is no CausalLM of the model layer" for v in table.values
            if ast.unparse(v) not in stacks]
    return out


def _model_sources() -> dict[str, str]:
    return {str(p.relative_to(PKG)): p.read_text(encoding="utf-8") for p in (PKG / "model").rglob("*.py")}


def test_one_forward_definition_per_architecture() -> None:
    """Each architecture is registered once and its decoder layer written once (its `forward`); the stack around
    the layers is CausalLM's alone; no `forward_native`-style second copy anywhere, and the native code holds no
    hand-written decoder: the whole-stack program is recorded from the Python definition."""
    sources = _model_sources()
    assert forward_problems(sources, sources["model/architectures.py"]) == []
    assert any(re.search(r"class \w+DecoderLayer\(", t) for t in sources.values())
    native = [f"{p.name}: {m.group(0)}" for p in (PKG / "kernels" / "csrc").iterdir()
              for m in re.finditer(r"\b(?:class|struct)\s+\w*(?:Decoder|Layer|Model)\w*", p.read_text())]
    assert native == []


def test_the_forward_check_can_fail() -> None:
    sources = _model_sources()
    registry = sources["model/architectures.py"]
    twice = registry.replace('"MistralForCausalLM": LlamaForCausalLM,',
                             '"MistralForCausalLM": LlamaForCausalLM,\n    "LlamaForCausalLM": LlamaForCausalLM,')
    assert twice != registry and len(forward_problems(sources, twice)) == 1
    second = """
class GemmaDecoderLayer(nn.Module):
    def forward(self, x): ...
    def forward_native(self, x): ...
class GemmaForCausalLM(CausalLM):
    def forward(self, ids): ...
class Stray:
    def _forward_fast(self): ...
"""
    assert len(forward_problems({**sources, "model/gemma.py": second}, registry)) == 4
    stray = registry.replace('"Qwen3ForCausalLM": LlamaForCausalLM,', '"Qwen3ForCausalLM": Stray,')
    assert len(forward_problems(sources, stray)) == 1


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
