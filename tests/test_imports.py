"""No import cycles in minillm, no function-level import that hides one (issue 27), and no import
from a layer above (issue 42).

Four checks:

1. Every module of minillm (and minillm.kernels) is imported on its own, first, in a process that has
   imported no minillm module before. A cycle between modules shows only in some import orders (the
   one whose first module is in the circle and needs a name from a module still half-initialized),
   so each module gets its own order. The process starts from a fresh interpreter that has imported
   only the third-party packages (torch, triton, ...: the slow part), then forks one child per module;
   the child sees no minillm module in sys.modules. minillm/__init__.py imports nearly everything, in
   one fixed order, so the children skip it (the package object is made without running it): each
   module's own imports decide the order, as they would if it were imported first.

2. The module-level import graph of the whole package (read with `ast`: `from .x import y` is an edge
   to module x.y when that is a module, else to x) has no cycle at all, whichever order would show it.

3. The files where the quantization circle was cut (layers/, layers/quantization/, quantize.py,
   loader/) are scanned with `ast` for import statements inside functions or classes. One is allowed
   only with a comment on its line that starts with `# lazy:` and gives a reason that is not a cycle:
   an optional dependency (`# lazy: optional dependency gguf`) or a heavy module only one path needs.

4. The layering, as a table (LAYERS: entrypoints -> engine -> executor -> worker -> model -> layers ->
   kernels -> base): every import of every module, function bodies included, goes to its own tier or
   one below.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE, KERNELS = ROOT / "minillm", ROOT / "kernels"

# third-party packages imported once before forking, so each child only pays for minillm's own code
PRELOAD = ("torch", "triton", "numpy", "safetensors", "gguf", "jinja2", "regex", "tqdm", "transformers")


def module_names() -> list[str]:
    names = []
    for base, prefix in ((PACKAGE, "minillm"), (KERNELS, "minillm.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((prefix, *parts))
            if not name.endswith(".__main__"):  # importing one runs its command
                names.append(name)
    return names


# The driver runs in a fresh interpreter: it preloads PRELOAD, then forks a child per module (two at a time:
# CI has 2 cores). The child makes `minillm` a package object without running its __init__.py, maps
# minillm.kernels to kernels/ (as minillm/__init__.py does), imports the module and reports.
DRIVER = r"""
import importlib, importlib.abc, importlib.util, json, os, re, sys, traceback, types
root, kernels, names, preload = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
version = re.search(r'^__version__ = "(.+)"$', open(os.path.join(root, "minillm", "__init__.py")).read(), re.M)[1]
for dep in preload:
    try:
        importlib.import_module(dep)
    except ImportError:
        pass
assert not any(m == "minillm" or m.startswith("minillm.") for m in sys.modules), "minillm imported before the fork"


class Kernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "minillm.kernels":
            return importlib.util.spec_from_file_location(name, os.path.join(kernels, "__init__.py"),
                                                          submodule_search_locations=[kernels])
        return None


def child(name):
    pkg = types.ModuleType("minillm")
    pkg.__path__ = [os.path.join(root, "minillm")]
    pkg.__package__ = "minillm"
    pkg.__version__ = version  # the one name minillm/__init__.py defines rather than imports
    sys.modules["minillm"] = pkg
    sys.meta_path.insert(0, Kernels())
    try:
        importlib.import_module(name)
    except BaseException as e:
        missing = e.name if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("minillm") else None
        return {"name": name, "ok": False, "missing": missing, "error": traceback.format_exc(limit=-6)}
    return {"name": name, "ok": True}


results, running = [], {}
def reap():
    pid, _ = os.wait()
    fd = running.pop(pid)
    with os.fdopen(fd) as f:
        results.append(json.loads(f.read() or '{"name": "?", "ok": false, "error": "no report"}'))
todo = list(names)
while todo or running:
    if todo and len(running) < 2:
        name = todo.pop(0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            report = child(name)
            with os.fdopen(w, "w") as f:
                f.write(json.dumps(report))
            os._exit(0)
        os.close(w)
        running[pid] = r
    else:
        reap()
print("RESULTS " + json.dumps(results))
"""


# ---- 1: each module imported first --------------------------------------------------------------------


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_process():
    names = module_names()
    assert "minillm.layers.quantization.gguf" in names and "minillm.kernels.w4a16" in names
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"  # as the CPU tests run (no module may need a GPU to import)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT), str(KERNELS), json.dumps(names), json.dumps(PRELOAD)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line is not None, f"the import driver failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    results = json.loads(line[len("RESULTS "):])
    assert sorted(r["name"] for r in results) == sorted(names)  # every module was tried
    failed = [r for r in results if not r["ok"]]
    # a module whose optional dependency is not installed here is not checked: say so, never pass it
    from importlib.util import find_spec

    absent = [r for r in failed if r.get("missing") and find_spec(r["missing"].split(".")[0]) is None]
    if absent:
        import warnings

        warnings.warn(f"not import-checked (optional dependency not installed): "
                      f"{', '.join(r['name'] + ' (' + r['missing'] + ')' for r in absent)}", stacklevel=1)
    broken = [r for r in failed if r not in absent]
    assert not broken, "modules that fail when imported first:\n" + "\n".join(
        f"--- {r['name']}\n{r['error']}" for r in broken)


# ---- 2: the static import graph has no cycle ----------------------------------------------------------


def module_files() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for base, prefix in ((PACKAGE, "minillm"), (KERNELS, "minillm.kernels")):
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            out[".".join((prefix, *(parts[:-1] if is_pkg else parts)))] = (path, is_pkg)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the minillm modules its module-level statements import (functions' bodies excluded)."""
    graph = {}
    for name, (path, is_pkg) in modules.items():
        here = name if is_pkg else name.rpartition(".")[0]
        edges = graph[name] = set()
        top = [n for stmt in ast.parse(path.read_text()).body
               for n in (ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt])]
        for node in top:
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(filter(None, (base, node.module)))
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        edges &= set(modules)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or one importing itself): Tarjan's."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_module_level_import_graph_has_no_cycle():
    graph = import_graph(module_files())
    assert "minillm.layers.quantization.base" in graph["minillm.layers.linear"]  # the graph sees relative imports
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_cycle_finder_bites():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# ---- 3: no function-level import that dodges a cycle ---------------------------------------------------

SCANNED = [*sorted((PACKAGE / "layers").glob("*.py")), *sorted((PACKAGE / "layers" / "quantization").glob("*.py")),
           PACKAGE / "quantize.py", *sorted((PACKAGE / "loader").glob("*.py"))]
KNOWN_EXCEPTIONS: set[str] = set()  # none left: moe.py's shared experts are built by the model files now
MARKER = re.compile(r"#\s*lazy:\s*(?P<reason>.+)$")
NOT_A_REASON = re.compile(r"cycle|circular|circle|late\b|imports this package|import order", re.I)


def nested_imports(source: str) -> list[tuple[int, str]]:
    """(line, text) of every import statement inside a function or a class body."""
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and nested:
                found.append((child.lineno, ast.unparse(child)))
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def unexplained_nested_imports(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    bad = []
    for lineno, text in nested_imports(source):
        m = MARKER.search(lines[lineno - 1])
        reason = m["reason"].strip() if m else ""
        if len(reason.split()) < 2 or NOT_A_REASON.search(reason):
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{shown}:{lineno}: {text}" + (f"  (reason {reason!r} names a cycle)" if reason else ""))
    return bad


def test_no_function_level_import_without_a_reason():
    assert len(SCANNED) > 20 and all(p.is_file() for p in SCANNED)
    bad = [b for p in SCANNED if str(p.relative_to(ROOT)) not in KNOWN_EXCEPTIONS for b in unexplained_nested_imports(p)]
    assert not bad, ("imports inside functions, without a `# lazy: <reason>` comment that is not a cycle "
                     "(move them to the top of the file):\n" + "\n".join(bad))


@pytest.mark.parametrize("line, ok", [
    ("    from ..linear import LinearBase  # linear.py imports this package: import it late", False),
    ("    from ..linear import LinearBase", False),
    ("    import gguf  # lazy: optional dependency gguf", True),
    ("    import gguf  # lazy: avoids a cycle with linear", False),
    ("    import gguf  # lazy:", False),
])
def test_the_scan_bites(tmp_path, line, ok):
    """The scan flags a function-level import unless its comment gives a non-cycle reason."""
    path = tmp_path / "probe.py"
    path.write_text(f"import os\n\n\ndef f():\n{line}\n    return os\n\n\nclass C:\n    x = 1\n")
    assert (unexplained_nested_imports(path) == []) == ok


# ---- 4: the layers of the engine, as a table -------------------------------------------------------------
# Top to bottom (issue 42): a module may import from its own tier and from any tier below it, never from one
# above. Imports inside functions count too: a lazy import that reaches upward is the same dependency, late.
# The most specific prefix decides a module's tier. `base` is what every tier may use (argument checks, the
# tokenizer, file formats); minillm/__init__.py is the package's front door and sits on top.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entrypoints", ("minillm", "minillm.__main__", "minillm.cli", "minillm.entrypoints", "minillm.llm",
                     "minillm.bench", "minillm.labs", "minillm.eval", "minillm.notebook", "minillm.nbrun",
                     "minillm.course", "minillm.course_status", "minillm.quantize")),
    # the engine, and chapter 03 / chapter 11's one-request loops (engines of their own)
    ("engine", ("minillm.engine", "minillm.inputs", "minillm.sequence", "minillm.outputs", "minillm.generation",
                "minillm.distributed.greedy")),
    ("executor", ("minillm.executor", "minillm.distributed.measure")),
    ("worker", ("minillm.worker", "minillm.spec_decode")),
    ("model", ("minillm.models", "minillm.loader")),
    # the layers and what a forward pass reads: caches, sampling, token masks, the process group's collectives
    ("layers", ("minillm.layers", "minillm.cache", "minillm.sampling", "minillm.structured_output",
                "minillm.forward_context", "minillm.distributed", "minillm.lora")),
    ("kernels", ("minillm.kernels",)),
    ("base", ("minillm.checks", "minillm.hw", "minillm.model_files", "minillm.gguf_meta", "minillm.data",
              "minillm.stop_strings", "minillm.tokenizer", "minillm.kv_memory", "minillm.config",
              "minillm.models.registry", "minillm.lora.request")),
]
# Known upward edges, each with the step of issue 42 that removes it. The test fails when a new one appears
# and when one listed here is gone (then delete its line: the table stays true).
UPWARD_ALLOWED = {
    ("minillm.spec_decode.proposer", "minillm.sequence"): "landing 3: the proposer's state moves into the worker",
}


def layer_of(module: str) -> int:
    # "minillm" names the package's own __init__ only: a prefix of every module, it would hide new packages
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or (p != "minillm" and module.startswith(p + "."))), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no tier of LAYERS: add its prefix to the table")
    return best[1]


def all_imports(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> every minillm module it imports anywhere in the file (function bodies included)."""
    out = {}
    for name, (path, is_pkg) in modules.items():
        here = name if is_pkg else name.rpartition(".")[0]
        edges = out[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(filter(None, (base, node.module)))
                edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        edges &= set(modules)
    return out


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, targets in graph.items() for t in targets if layer_of(t) < layer_of(m)}


def test_no_module_imports_from_a_layer_above_it():
    graph = all_imports(module_files())
    found = upward_edges(graph)
    new = sorted(found - set(UPWARD_ALLOWED))
    show = "\n".join(f"  {m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})" for m, t in new)
    assert not new, f"imports from a layer above (the table is LAYERS in tests/test_imports.py):\n{show}"
    gone = sorted(set(UPWARD_ALLOWED) - found)
    assert not gone, f"no longer imported, delete from UPWARD_ALLOWED: {gone}"


def test_the_layer_check_bites():
    """A worker module that imports the engine, and a layer that imports a model, are both caught."""
    graph = {"minillm.worker.x": {"minillm.engine.scheduler", "minillm.layers.linear"},
             "minillm.layers.y": {"minillm.models.llama", "minillm.kernels.rope", "minillm.checks"},
             "minillm.engine.z": {"minillm.worker.worker", "minillm.config"}}
    assert upward_edges(graph) == {("minillm.worker.x", "minillm.engine.scheduler"),
                                   ("minillm.layers.y", "minillm.models.llama")}
    with pytest.raises(AssertionError, match="in no tier"):
        layer_of("somewhere.else")
    with pytest.raises(AssertionError, match="in no tier"):  # a new package is placed by hand, not by "minillm"
        layer_of("minillm.brand_new.module")
