"""The shape DESIGN.md §6 asks for, checked on the source: no import cycle anywhere in eplbsim,
the core never imports an app module (the package root, a facade, re-exports `review`), and
only `plots` imports matplotlib.

An import of `a.b.c` runs the `__init__` of every package on the way that is not already
running (the importer's own packages are), so those count as edges too: a package's
re-exports can close a cycle even when no module names the other directly. A name taken from
one of the importer's own packages (`from . import find_solver`, at module level or inside a
function) is an edge to that package's `__init__`: a loop when the package imports the module,
even one deferred to call time.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "eplbsim"
APPS = ("eplbsim.cli", "eplbsim.sweep", "eplbsim.figures", "eplbsim.plots", "eplbsim.bench",
        "eplbsim.distributed", "eplbsim.checks", "eplbsim.review", "eplbsim.review_invariance",
        "eplbsim.review_measures", "eplbsim.report", "eplbsim.verdict", "eplbsim.workers")
FACADE = "eplbsim"  # the package root re-exports what a notebook reaches for, `review` too


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _import_nodes(name: str):
    """`(node, base)` for each import statement anywhere in `name`'s source: `base` the
    absolute module a `from` import reads from (None for a plain `import`)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            yield node, base


def _imports(name: str) -> set[str]:
    """Every module name `name` imports, absolute, anywhere in its source."""
    found = set()
    for node, base in _import_nodes(name):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in MODULES)
    return found


def _from_own_package(name: str) -> set[str]:
    """The packages of `name` (its own `__init__`s) it takes a name other than a submodule
    from, e.g. `eplbsim.solvers` for `from . import find_solver` in `eplbsim.solvers.x`."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)} - {name}
    return {base for node, base in _import_nodes(name)
            if base in own and any(f"{base}.{a.name}" not in MODULES for a in node.names)}


def _edges(name: str) -> set[str]:
    """The eplbsim modules importing `name` runs or reads from (module doc)."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    edges = _from_own_package(name)
    for target in _imports(name):
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            step = ".".join(parts[:i])
            if step in MODULES and step not in own:
                edges.add(step)
    edges.discard(name)
    return edges


def _is_app(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPS)


def test_the_package_has_no_import_cycle():
    graph = {name: _edges(name) for name in MODULES}
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(graph) > 40  # every module was read


def test_the_core_never_imports_an_app_and_only_plots_imports_matplotlib():
    for name in MODULES:
        if not _is_app(name) and name != FACADE:
            apps = sorted(t for t in _edges(name) if _is_app(t))
            assert not apps, f"core module {name} imports the app module(s) {apps}"
    plotting = {name for name in MODULES
                if any(t.split(".")[0] == "matplotlib" for t in _imports(name))}
    assert plotting and all(n == "eplbsim.plots" or n.startswith("eplbsim.plots.") for n in plotting)


def test_the_checker_sees_relative_and_nested_imports():
    assert "eplbsim.dispatch.policies" in _edges("eplbsim.dispatch.kernels.cpu")
    assert "eplbsim.schedule" in _edges("eplbsim.runspec.parts")  # a package __init__ on the way
    assert "eplbsim.plots" in _edges("eplbsim.cli.run")  # imported inside a function


def test_a_solver_never_reaches_back_into_the_registry():
    """The registry (`eplbsim.solvers`) imports every solver, so a solver that took a name from
    it (even at call time: affinity once fetched its balance solver so) closes a loop; a solver
    that builds on another gets it handed in (`COMPOSED_OPTIONS`)."""
    solvers = [n for n in _below("eplbsim.solvers") if n != "eplbsim.solvers"]
    assert "eplbsim.solvers.affinity" in solvers
    for name in solvers:
        assert "eplbsim.solvers" not in _edges(name), f"{name} imports the solver registry"
    # the checker sees such an import, as it saw affinity's `from . import find_solver`
    assert _from_own_package("eplbsim.engines.conform") == {"eplbsim.engines"}


def _below(layer: str) -> set[str]:
    """The modules of package `layer` (itself too)."""
    return {n for n in MODULES if n == layer or n.startswith(layer + ".")}


def test_imports_go_one_way_between_the_layers():
    """Solvers never see tokens, so they never reach the dispatch layer or the engines (engine
    solvers are resolved above, `engines.resolve_solver`); the dispatch layer knows no engine
    (the engines register into it); a trace knows no metric (the load reductions both use are
    in `eplbsim.placement.loads`)."""
    forbidden = {"eplbsim.solvers": ("eplbsim.engines", "eplbsim.dispatch", "eplbsim.metrics"),
                 "eplbsim.dispatch": ("eplbsim.engines",),
                 "eplbsim.traces": ("eplbsim.metrics", "eplbsim.engines", "eplbsim.dispatch")}
    for layer, above in forbidden.items():
        for name in _below(layer):
            wrong = sorted(t for t in _edges(name) for a in above if t in _below(a))
            assert not wrong, f"{name} imports {wrong}"
    assert "eplbsim.placement.loads" in _edges("eplbsim.traces.summary")


ROOM = 700  # lines: a module read in one sitting


def test_every_module_fits_in_a_room():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > ROOM}
    assert not long, f"split by concern: {long}"
