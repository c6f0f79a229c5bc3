"""Imports between the top-level folders run one way, downward (README, "Layout"), no modules
import each other in a circle, and no module imports another's private names.

Every module of the seven packages is parsed with ast (nothing is imported), and every import
counts: module level, inside functions, under TYPE_CHECKING, relative, and
`importlib.import_module("...")` / `__import__("...")` with a literal name.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# folder -> the folders it may import: each may import any folder below it.
MAY_IMPORT = {
    "bench": {"serving", "training", "spec", "drafters", "tree", "verifier"},
    "serving": {"spec", "drafters", "tree", "verifier"},
    "training": {"spec", "drafters", "tree", "verifier"},
    "spec": {"drafters", "tree", "verifier"},
    "drafters": {"tree", "verifier"},
    "tree": {"verifier"},          # its argument checks (verifier/checks.py); verifier imports no tree
    "verifier": set(),
}
FOLDERS = tuple(MAY_IMPORT)
# verifier/'s floors, bottom first: a module imports only from its own floor or those below.
VERIFIER_FLOORS = (
    ("cpu", ("verifier/cpu/", "verifier/__init__.py")),       # the probe, the C kernels, the cache
    ("hand-off", ("verifier/batch.py", "verifier/checks.py", "verifier/block_manager.py", "verifier/memory.py")),
    ("attention", ("verifier/attention/",)),                   # the backends and the KV cache
    ("model", ("verifier/model/",)),                           # config, modules, weights, loaders, tokenizer
    ("sampling", ("verifier/sampling/",)),                     # parameters, sampler, grammars
    ("graphs", ("verifier/graphs/",)),                         # bucketed fixed-buffer steps, CUDA graphs
    ("runner", ("verifier/runner.py",)),                       # the runners' contract, the dense runner
    ("quantized", ("verifier/quantized/",)),                   # the quantized CPU runner
    ("target", ("verifier/target.py", "verifier/parallel.py")),
)
# The `tercel` entry dispatches `tercel bench`, so it alone in serving/ may import bench/. Its
# edge still enters the cycle check: bench/ can never import serving/.
ENTRY_POINTS = {"serving/cli.py": {"bench"}}


@dataclass(frozen=True)
class Import:
    path: str                   # the importing file, relative to the repository root
    line: int
    module: str                 # the imported module, absolute
    names: tuple[str, ...]      # `from module import names`; () for `import module`


def imports_of(source: str, path: str) -> list[Import]:
    """Every import in one module's source, wherever it sits."""
    package = path.removesuffix(".py").split("/")[:-1]      # the package a relative import starts from
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append(Import(path, node.lineno, module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            found.append(Import(path, node.lineno, node.args[0].value, ()))
    return found


def _dynamic_import(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return (name in ("import_module", "__import__") and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str))


def scan() -> list[Import]:
    found = []
    for folder in FOLDERS:
        for file in sorted((ROOT / folder).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            found += imports_of(file.read_text(encoding="utf-8"), path)
    return found


def folder_edges(imports: list[Import]) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) -> where, as "path:line"."""
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in imports:
        src, dst = imp.path.split("/")[0], imp.module.split(".")[0]
        if dst in FOLDERS and dst != src:
            edges.setdefault((src, dst), []).append(f"{imp.path}:{imp.line}")
    return edges


def layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = imp.path.split("/")[0], imp.module.split(".")[0]
        if dst in FOLDERS and dst != src and dst not in MAY_IMPORT[src] | ENTRY_POINTS.get(imp.path, set()):
            bad.append(f"{imp.path}:{imp.line}: imports {imp.module}, but {src}/ may import only "
                       f"{', '.join(sorted(MAY_IMPORT[src])) or 'no other folder'}")
    return bad


def folder_cycle(edges) -> list[str] | None:
    """A cycle of folders, e.g. ["spec", "drafters", "spec"], or None."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, str] = {}        # "open" while on the DFS stack, then "done"

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node], path = "open", path + [node]
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def verifier_floor(path: str) -> int:
    """The floor of a verifier/ file ("verifier/x/__init__.py" for the package verifier.x)."""
    for i, (_, prefixes) in enumerate(VERIFIER_FLOORS):
        if any(path == p or p.endswith("/") and path.startswith(p) for p in prefixes):
            return i
    raise KeyError(f"{path} is on no floor of VERIFIER_FLOORS")


def module_path(module: str) -> str | None:
    """The file of a repository module (a package's __init__.py), or None."""
    for path in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
        if (ROOT / path).is_file():
            return path
    return None


def verifier_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if not imp.path.startswith("verifier/"):
            continue
        for module in [imp.module] + [f"{imp.module}.{n}" for n in imp.names]:
            dst = module_path(module) if module.startswith("verifier") else None
            if dst and verifier_floor(dst) > verifier_floor(imp.path):
                bad.append(f"{imp.path}:{imp.line}: imports {module}, on the {VERIFIER_FLOORS[verifier_floor(dst)][0]} "
                           f"floor above its own ({VERIFIER_FLOORS[verifier_floor(imp.path)][0]})")
    return bad


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def module_edges(imports: list[Import], modules: set[str]) -> set[tuple[str, str]]:
    """(importing module, imported module) within `modules`; `from package import module`
    counts as an import of both."""
    edges = set()
    for imp in imports:
        src = module_name(imp.path)
        targets = [imp.module] + [f"{imp.module}.{n}" for n in imp.names]
        edges |= {(src, dst) for dst in targets if dst in modules and dst != src}
    return edges


def private_imports(imports: list[Import]) -> list[str]:
    return [f"{imp.path}:{imp.line}: from {imp.module} import {name}"
            for imp in imports for name in imp.names
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))]


IMPORTS = scan()


def test_every_folder_imports_only_the_folders_below_it():
    """serving -> spec -> drafters -> tree, verifier; training -> spec, drafters; bench -> any."""
    bad = layer_violations(IMPORTS)
    assert not bad, "imports against the folder order:\n" + "\n".join(bad)


def test_the_folder_graph_has_no_cycle():
    """Module-level and lazy imports alike: a lazy import hides a cycle from Python, not from here."""
    edges = folder_edges(IMPORTS)
    cycle = folder_cycle(edges)
    assert cycle is None, (" -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {', '.join(edges[a, b][:3])}" for a, b in zip(cycle, cycle[1:])))


def test_verifier_floors_import_only_downward():
    """verifier/ in floors (VERIFIER_FLOORS): cpu, hand-off types, attention, model, sampling, the
    runners' contract, the quantized runner, the target; every verifier/ file is on one."""
    for file in (ROOT / "verifier").rglob("*.py"):
        verifier_floor(file.relative_to(ROOT).as_posix())
    bad = verifier_violations(IMPORTS)
    assert not bad, "upward imports inside verifier/:\n" + "\n".join(bad)


def test_no_import_circle_between_modules():
    """Inside a folder too, lazy imports included: a function-level import that closes a circle
    is a layering the code does not state."""
    modules = {module_name(f.relative_to(ROOT).as_posix()) for folder in FOLDERS
               for f in (ROOT / folder).rglob("*.py")}
    edges = module_edges(IMPORTS, modules)
    cycle = folder_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another():
    """`from x import _y` reaches into x's internals: make _y public or restructure."""
    bad = private_imports(IMPORTS)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


MAX_LAZY_IMPORTS = 40      # issue 65: imports at the top, where a reader and these checks see them


def lazy_imports(source: str, path: str) -> list[tuple[str, bool]]:
    """Every import inside a function, as ("path:line: statement", whether it says why: a
    `# lazy: <reason>` on its own line, or on the line above a run of import lines it is in)."""
    lines = source.splitlines()
    nodes = {node.lineno: node for fn in ast.walk(ast.parse(source, path))
             if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return [(f"{path}:{line}: {ast.unparse(nodes[line])}", _says_why(lines, line - 1)) for line in sorted(nodes)]


def _says_why(lines: list[str], i: int) -> bool:
    if "# lazy:" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1                             # up a run of import lines to the comment above it
    return i > 0 and lines[i - 1].strip().startswith("# lazy:")


def all_lazy_imports() -> list[tuple[str, bool]]:
    found = []
    for folder in FOLDERS:
        for file in sorted((ROOT / folder).rglob("*.py")):
            found += lazy_imports(file.read_text(encoding="utf-8"), file.relative_to(ROOT).as_posix())
    return found


def test_imports_sit_at_the_top_but_a_few_that_say_why():
    """An import inside a function hides an edge from the reader (and made cycles easy): at most
    MAX_LAZY_IMPORTS in the source, each for a real cost (an optional or heavy package, a CLI
    that loads only its subcommand) said in a `# lazy:` comment."""
    found = all_lazy_imports()
    silent = [where for where, why in found if not why]
    assert not silent, "function-level imports without a `# lazy:` reason:\n" + "\n".join(silent)
    assert len(found) <= MAX_LAZY_IMPORTS, f"{len(found)} function-level imports:\n" + "\n".join(w for w, _ in found)


def test_the_lazy_import_check_reads_reasons_where_they_are_written():
    source = ("import os\n"
              "def f():\n    import torch  # lazy: heavy\n"
              "def g():\n    # lazy: optional\n    import ray\n    from ray import serve\n"
              "def h():\n    x = 1\n    import gguf\n")
    assert [(w.split(": ", 1)[1], why) for w, why in lazy_imports(source, "verifier/x.py")] == [
        ("import torch", True), ("import ray", True), ("from ray import serve", True), ("import gguf", False)]


def test_every_folder_was_scanned():
    scanned = {imp.path.split("/")[0] for imp in IMPORTS}
    assert scanned == set(FOLDERS)


def test_the_checks_catch_lazy_guarded_relative_dynamic_and_private_imports():
    """The checks themselves: each kind of import that Python runs late is still an edge."""
    source = ("import importlib\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from serving import app\n"
              "from .ngram import _Index\n"
              "def f():\n    from spec.engine import LLMEngine\n    importlib.import_module('training.data')\n")
    found = imports_of(source, "drafters/x.py")
    assert [b.split(": ")[1] for b in layer_violations(found)] == [
        "imports serving, but drafters/ may import only tree, verifier",
        "imports spec.engine, but drafters/ may import only tree, verifier",
        "imports training.data, but drafters/ may import only tree, verifier"]
    assert private_imports(found) == ["drafters/x.py:5: from drafters.ngram import _Index"]
    assert not private_imports(imports_of("from __future__ import annotations\n", "spec/x.py"))
    assert folder_cycle({("spec", "drafters"), ("drafters", "tree")}) is None
    assert folder_cycle({("spec", "drafters"), ("drafters", "tree"), ("tree", "spec")}) == [
        "drafters", "tree", "spec", "drafters"]
    # the entry's exception is not a way round the order: bench/ importing serving/ closes a cycle
    assert layer_violations(imports_of("from bench.cli import run_bench\n", "serving/cli.py")) == []
    assert layer_violations(imports_of("from bench.cli import run_bench\n", "serving/app.py"))
    assert folder_cycle({("serving", "bench"), ("bench", "serving")})
    # modules: a lazy import back, and `from package import module`, close circles as well
    lazy = imports_of("from verifier import b\n", "verifier/a.py") + imports_of("def f():\n    import verifier.a\n",
                                                                              "verifier/b.py")
    assert folder_cycle(module_edges(lazy, {"verifier", "verifier.a", "verifier.b"})) == [
        "verifier.a", "verifier.b", "verifier.a"]
    # verifier/'s floors: the model reaching up into the quantized runner is refused, down is not
    assert verifier_violations(imports_of("from verifier.quantized import qlinear\n", "verifier/model/moe.py"))
    assert not verifier_violations(imports_of("from verifier.model.moe import SparseMoeBlock\n",
                                              "verifier/quantized/quantize.py"))
