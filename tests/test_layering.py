"""Layering of the project's modules: no import cycles, converters above the library.

The import graph is read from the source with `ast` (nothing is imported): every `import` /
`from ... import` statement of every module of maskahead_jax/ and converters/, at module level
AND inside functions, gives an edge to the project module it names (`from pkg import name` goes
to the submodule pkg.name when there is one, else to pkg). Parent packages a statement
initialises on the way (`import a.b.c` also runs a/__init__ and a/b/__init__) are not edges:
with them every package __init__ that re-exports its submodules would close a cycle with each
submodule that imports a sibling.

The rule: converters sit above the library. converters may import maskahead_jax; maskahead_jax
never imports converters at module level (importing maskahead_jax loads no converters module);
the two places that need them (`load_pretrained`, `maskahead convert`) import them when called.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("maskahead_jax", "converters")

# Cycles outside this test's scope, each as the frozenset of its modules; remove an entry once
# its cycle is gone (a known cycle that no longer exists fails test_known_cycles_still_exist).
KNOWN_CYCLES: set[frozenset[str]] = set()  # none left (cli <-> profile was untangled, issue 36)


def _modules() -> dict[str, str]:
    """module name -> file, for every .py file of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = os.path.relpath(dirpath, ROOT).split(os.sep)
            for f in sorted(filenames):
                if f.endswith(".py"):
                    name = rel if f == "__init__.py" else rel + [f[:-3]]
                    out[".".join(name)] = os.path.join(dirpath, f)
    return out


def _resolve(name: str, mods) -> str | None:
    """The longest prefix of a dotted name that is a project module (None: not ours)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def import_edges(mods: dict[str, str]) -> dict[str, set[tuple[str, int]]]:
    """module -> {(imported project module, line)}, module-level and function-level alike."""
    edges: dict[str, set[tuple[str, int]]] = {m: set() for m in mods}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    edges[mod].add((r, node.lineno))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components (iterative), those with more than one module."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def _describe(comp, edges) -> str:
    lines = [f"cycle among {sorted(comp)}:"]
    for m in sorted(comp):
        for t, line in sorted(edges[m]):
            if t in comp:
                lines.append(f"  {m}:{line} imports {t}")
    return "\n".join(lines)


def _graph():
    mods = _modules()
    edges = import_edges(mods)
    return mods, edges, {m: {t for t, _ in es} for m, es in edges.items()}


def test_the_graph_sees_module_and_function_level_imports():
    mods, _, graph = _graph()
    assert {"maskahead_jax.api", "maskahead_jax.model.container", "converters.load",
            "converters.hf_config"} <= set(mods)
    assert "maskahead_jax.model.container" in graph["converters.load"]  # module level
    assert "converters.load" in graph["maskahead_jax.api"]  # inside load_pretrained
    assert "maskahead_jax.sharding" in graph["converters.load"]  # `from maskahead_jax import sharding`
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_cycles():
    _, edges, graph = _graph()
    comps = strongly_connected(graph)
    for comp in comps:
        print(_describe(comp, edges))
    unexpected = [c for c in comps if c not in KNOWN_CYCLES]
    assert not unexpected, "\n".join(_describe(c, edges) for c in unexpected)
    for comp in comps:  # the API <-> converters cycle must never come back, known or not
        assert not ({"maskahead_jax.api"} <= comp and any(m.startswith("converters") for m in comp))


def _import_time_nodes(node):
    """The statements that run when the module is imported: all but function bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield child
        yield from _import_time_nodes(child)


def test_library_never_imports_converters_at_module_level():
    bad = []
    for mod, path in _modules().items():
        if not mod.startswith("maskahead_jax"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _import_time_nodes(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "converters" for n in names):
                bad.append(f"{mod}:{node.lineno}")
    assert not bad, f"maskahead_jax imports converters at module level: {bad}"


def test_importing_the_library_loads_no_converter_and_both_orders_work():
    code = ("import sys, maskahead_jax; bad = [m for m in sys.modules if m.split('.')[0] == 'converters']; "
            "assert not bad, bad; import converters.load; "
            "from maskahead_jax.api import Model; assert Model is maskahead_jax.Model is converters.load.Model")
    for c in (code, "import converters.load, maskahead_jax; assert converters.load.Model is maskahead_jax.Model"):
        r = subprocess.run([sys.executable, "-c", c], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert r.returncode == 0, r.stderr[-2000:]


def test_known_cycles_still_exist():
    """Keeps KNOWN_CYCLES honest: an entry whose cycle is gone must be removed."""
    comps = strongly_connected(_graph()[2])
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in comps]
    assert not stale, f"these known cycles are gone, remove them from KNOWN_CYCLES: {stale}"


def test_modules_and_functions_stay_small():
    """Issue 54's size rule for the library: no module of maskahead_jax/ over 400 lines, no
    function (or method) over 80; a module that grows past it is split by job."""
    big_modules, big_functions = [], []
    for mod, path in _modules().items():
        if not mod.startswith("maskahead_jax"):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if src.count("\n") > 400:
            big_modules.append(f"{mod}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    big_functions.append(f"{mod}.{node.name}: {n} lines")
    assert big_modules == [] and big_functions == []


def test_policies_stay_small():
    """Issue 54's knob budget: no registered policy with more than 28 fields, none adding more
    than 8 to a registered policy it extends, and the eviction part (schedules aside) <= 10."""
    import dataclasses

    from maskahead_jax.policies import names
    from maskahead_jax.policies.eviction import Eviction
    from maskahead_jax.policies.registry import entry

    classes = {entry(n).cls for n in names() if entry(n).cls.__module__.startswith("maskahead_jax")}
    width = lambda c: len(dataclasses.fields(c))
    too_wide = [(c.__name__, width(c)) for c in classes if width(c) > 28]
    too_much = [(c.__name__, b.__name__, width(c) - width(b)) for c in classes for b in c.__mro__[1:2]
                if b in classes and width(c) - width(b) > 8]
    assert too_wide == [] and too_much == [] and len(classes) > 10
    assert width(Eviction) <= 10
