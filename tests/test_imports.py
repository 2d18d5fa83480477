"""The package's import structure, read from the source with ``ast`` (nothing is imported).

- No import cycle among the modules of ``gdn_pass/``, ``inductor_ext/``,
  ``harness/`` and ``tests/`` (imports of other trees, ``benchmarks/`` included, are not
  followed). Every import statement is an edge, at module level or inside a
  function (a function-level import is a lazy edge, not a missing one). An
  edge goes to the module named: ``import a.b`` and ``from a import b`` (``b``
  a module) lead to ``a.b``; ``from a.b import name`` (``name`` not a module)
  leads to ``a.b``, the package's ``__init__``. The parent packages that
  Python initialises on the way are not edges: a package's ``__init__``
  re-exporting its submodules would otherwise close a cycle with every
  submodule importing a sibling.
- The core (``gdn_pass/*.py`` but the command line; not ``gdn_pass/vllm``,
  not the checker ``gdn_pass/checker``, which runs engines) never imports
  ``gdn_pass.vllm``: the vLLM adapter registers what the core
  needs (``gdn_pass.opaque_ops.register_engine``).
- The core loads no module of ours by a name string: no ``import_module`` /
  ``__import__`` of one (nor of a computed name), and no string that is a
  submodule's dotted name (a table of modules to load later).
- No two classes of the package share a name (a name says one thing).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("gdn_pass", "inductor_ext", "harness", "tests")
# What runs the pass rather than being it: the command line and the checker behind it.
APPLICATION = ("gdn_pass.cli", "gdn_pass.__main__", "gdn_pass.checker")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = name if is_package else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(name: str, path: Path, known: dict[str, Path], source: str | None = None) -> set[str]:
    """Modules of ours that ``name`` (at ``path``) imports, anywhere in its source."""
    targets = set()
    source = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    # Test modules import a sibling by its bare name where they put their folder on
    # sys.path (tests/gpu: ``from vllm_engines import ...``).
    folder = module_name(path.parent / "__init__.py") if path.parent != ROOT else ""
    resolved = set()
    for target in targets:
        if target in known:
            resolved.add(target)
        elif name.startswith("tests.") and f"{folder}.{target}" in known:
            resolved.add(f"{folder}.{target}")
    resolved.discard(name)
    return resolved


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(name: str) -> bool:
    return (within(name, "gdn_pass") and not within(name, "gdn_pass.vllm")
            and not any(within(name, app) for app in APPLICATION))


def _describe(graph: dict[str, set[str]], component: set[str]) -> str:
    edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
    return "; ".join(edges)


def test_the_analysis_sees_the_import_edges():
    known = modules()
    source = """
import gdn_pass.report
from gdn_pass import opaque_ops, GDNStatePass
from . import compat
from .rows import HostRows

def lazy():
    from gdn_pass.vllm import install
    import inductor_ext.gated_gather as gg
"""
    found = imports("gdn_pass.vllm.example", ROOT / "gdn_pass/vllm/example.py", known, source)
    assert found == {"gdn_pass.report", "gdn_pass.opaque_ops", "gdn_pass", "gdn_pass.vllm.compat",
                     "gdn_pass.vllm.rows", "gdn_pass.vllm", "inductor_ext.gated_gather"}
    graph = import_graph()
    assert "gdn_pass.opaque_ops" in graph["gdn_pass.state_pass"]
    assert "gdn_pass.vllm.metadata_hook" in graph["gdn_pass.vllm.plugin"]  # function-level
    assert "tests.vllm.test_metadata_hook" in graph["tests.vllm.test_builders"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "\n".join(_describe(graph, c) for c in found)


def test_the_wheel_holds_no_harness():
    """What only tests and benchmarks use stays out of the package: nothing in it imports ``harness``."""
    graph = import_graph()
    bad = sorted(f"{name} -> {target}" for name, targets in graph.items()
                 if within(name, "gdn_pass") or within(name, "inductor_ext")
                 for target in targets if within(target, "harness"))
    assert not bad, bad


def test_core_does_not_import_the_vllm_adapter():
    graph = import_graph()
    bad = sorted(f"{name} -> {target}" for name, targets in graph.items() if is_core(name)
                 for target in targets if within(target, "gdn_pass.vllm"))
    assert not bad, bad


def test_the_plugin_does_not_import_the_checkers_engines():
    """``gdn_pass.vllm.checker`` (the engines behind ``gdn-pass check`` / ``demo``) sits on the
    plugin, never under it: no other module of the adapter imports it."""
    graph = import_graph()
    assert "gdn_pass.vllm.checker.scenarios" in graph  # the analysis sees the package
    bad = sorted(f"{name} -> {target}" for name, targets in graph.items()
                 if within(name, "gdn_pass.vllm") and not within(name, "gdn_pass.vllm.checker")
                 for target in targets if within(target, "gdn_pass.vllm.checker"))
    assert not bad, bad


def _loads_by_name(path: Path, known: dict[str, Path]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in known and "." in node.value:
            # A submodule's name as a value (a table of modules to load later, a sys.modules key);
            # the bare package names are also the logger's and the op namespace.
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            continue
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called not in ("import_module", "__import__"):
            continue
        for arg in node.args[:1]:
            text = ast.unparse(arg)
            if not isinstance(arg, ast.Constant) or str(arg.value).split(".")[0] in TREES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {called}({text})")
    return found


def test_core_loads_no_module_by_name():
    """No ``import_module`` / ``__import__`` of our modules in the core, nor of a computed name,
    and no string that is one of our modules' names."""
    known = modules()
    bad = [line for name, path in known.items() if is_core(name) for line in _loads_by_name(path, known)]
    assert not bad, bad


def _class_names(paths) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_two_classes_share_a_name():
    known = modules()
    names = _class_names(path for name, path in known.items() if within(name, "gdn_pass"))
    assert "GDNStatePass" in names  # the analysis sees the classes
    shared = {name: where for name, where in names.items() if len(where) > 1}
    assert not shared, shared
