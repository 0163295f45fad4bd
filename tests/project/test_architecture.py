"""The shape DESIGN.md §6 asks for, checked on the source: a top folder of a few packages, each
a concept, whose imports run one way (the package graph is a DAG, and each package imports only
what its `__init__` docstring says it may); no import cycle between modules either; `base`
imports nothing of eplbsim; the core never imports an app module (the package root, a facade,
re-exports `review`); only `plots` imports matplotlib; no module over `ROOM` lines.

An import of `a.b.c` runs the `__init__` of every package on the way that is not already
running (the importer's own packages are), so those count as edges too: a package's
re-exports can close a cycle even when no module names the other directly. A name taken from
one of the importer's own packages (`from . import find_solver`, at module level or inside a
function) is an edge to that package's `__init__`: a loop when the package imports the module,
even one deferred to call time.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "eplbsim"
APPS = ("eplbsim.cli", "eplbsim.plots", "eplbsim.review", "eplbsim.replay.sweep",
        "eplbsim.replay.bench", "eplbsim.replay.distributed", "eplbsim.replay.workers",
        "eplbsim.ranks.checks")
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
    assert len(graph) > 100  # every module was read


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


TOP_ENTRIES = 18  # modules and packages at the top of eplbsim/


def _top(name: str) -> str:
    """The top-level package (or module) of module `name`: `eplbsim.ranks` for
    `eplbsim.ranks.epoch`; the package root is its own."""
    return ".".join(name.split(".")[:2])


def _package_graph() -> dict[str, dict[str, set[str]]]:
    """Top-level package -> {package it imports: the modules whose imports make that edge}
    (the package root, a facade over every package, is left out)."""
    graph: dict[str, dict[str, set[str]]] = {}
    for name in MODULES:
        if name == FACADE:
            continue
        edges = graph.setdefault(_top(name), {})
        for target in _edges(name):
            if target != FACADE and _top(target) != _top(name):
                edges.setdefault(_top(target), set()).add(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (node -> successors) as a path that closes, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _may_import(package: str) -> set[str]:
    """The packages `package`'s `__init__` docstring says it may import: its sentence
    "Imports ..." names them in backticks ("nothing of eplbsim": none; "every package": all)."""
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    found = re.search(r"Imports (.*?)\.(\s|$)", " ".join(doc.split()))
    assert found, f"{package}'s docstring does not say what it may import (Imports ...)"
    sentence = found.group(1)
    if sentence.startswith("nothing of eplbsim"):
        return set()
    if sentence.startswith("every package"):
        return {_top(n) for n in MODULES} - {FACADE, package}
    return {f"eplbsim.{name}" for name in re.findall(r"`(\w+)`", sentence)}


PACKAGES = sorted(n for n in MODULES if n.count(".") == 1 and _is_package(n))


def test_the_top_folder_is_a_few_packages_each_a_concept():
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__"
                     and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert len(entries) <= TOP_ENTRIES, f"{len(entries)} entries at the top: {entries}"
    modules = [e[:-3] for e in entries if e.endswith(".py") and e != "__init__.py"]
    stems = [m.split("_")[0] for m in modules]
    family = sorted({m for m, s in zip(modules, stems) if stems.count(s) > 1
                     or (s != m and s in entries)})
    assert not family, f"top-level modules named by a shared prefix: {family}"
    assert "eplbsim.base" in PACKAGES and len(PACKAGES) >= 12


def test_imports_between_packages_run_one_way():
    graph = _package_graph()
    cycle = _cycle({p: set(t) for p, t in graph.items()})
    assert cycle is None, "packages import each other: " + " -> ".join(cycle) + " (" + "; ".join(
        f"{a} -> {b} by {sorted(graph[a][b])}" for a, b in zip(cycle, cycle[1:])) + ")"
    assert not graph["eplbsim.base"], f"base imports {graph['eplbsim.base']}"


def test_every_package_says_what_it_holds_and_imports_only_what_it_says():
    """Each package's `__init__` opens with a docstring of what it holds, takes in, gives out
    and may import; what it imports is within that, and what the packages may import is itself
    one way (so the docstrings draw the layers, and the code keeps to them)."""
    allowed = {p: _may_import(p) for p in PACKAGES}
    graph = _package_graph()
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        assert "Holds" in doc and "Takes in" in doc, f"{package}'s docstring: Holds ..., Takes in"
        unknown = allowed[package] - set(PACKAGES)
        assert not unknown, f"{package}'s docstring names no package {sorted(unknown)}"
        extra = {t: sorted(m) for t, m in graph.get(package, {}).items()
                 if t not in allowed[package]}
        assert not extra, f"{package} imports what its docstring does not allow: {extra}"
    assert _cycle(allowed) is None, f"the docstrings allow a cycle: {_cycle(allowed)}"


def test_the_package_checks_see_a_cycle_and_an_undeclared_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _may_import("eplbsim.base") == set()
    assert _may_import("eplbsim.dispatch") == {"eplbsim.base", "eplbsim.placement"}
    assert "eplbsim.dispatch" not in _may_import("eplbsim.solvers")
    assert "eplbsim.cost" in _package_graph()["eplbsim.ranks"]  # ranks.traffic's link crossings


ROOM = 700  # lines: a module read in one sitting


def test_every_module_fits_in_a_room():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > ROOM}
    assert not long, f"split by concern: {long}"


def test_the_layout_guide_lists_every_package_in_the_order_data_flows():
    """docs/guide/15's tree has one line a package, each below every package it may import."""
    guide = (ROOT.parent / "docs" / "guide" / "15-layout.md").read_text()
    tree = guide.split("```")[1].split("\neplbsim/\n")[1]
    listed = [f"eplbsim.{m.group(1)}" for line in tree.splitlines()
              if (m := re.match(r"  (\w+)/ ", line))]
    assert sorted(listed) == PACKAGES, f"the guide lists {listed}"
    for i, package in enumerate(listed):
        below = _may_import(package) - set(listed[:i])
        assert not below, f"the guide lists {package} above {sorted(below)}, which it imports"


def test_the_tests_mirror_the_package():
    """DESIGN.md §7: a test file lies in the folder named after the package it tests
    (`tests/dispatch/test_spill.py` beside `eplbsim/dispatch/spill.py`), or in `project/` for
    the checks of the project as a whole (README, guides, notebooks, this file); only shared
    helpers and the conftest lie at the top."""
    tests = ROOT.parent / "tests"
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert not list(tests.glob("test_*.py")), "test files at the top of tests/"
    folders = {p.parent.name for p in tests.rglob("test_*.py")}
    assert folders <= packages | {"project"}, folders - packages
    assert len(folders) >= 10


def test_a_test_imports_helpers_from_its_own_folder_or_the_shared_ones():
    """A helper shared by several test folders lives at the top of tests/ (`log_writers`,
    `cli_helpers`, ...): a test module imported from another folder resolves only when pytest
    has collected that folder first, so the folder run alone fails."""
    tests = ROOT.parent / "tests"
    crossing = []
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                if not (path.parent / f"{node.module}.py").is_file():
                    crossing.append(f"{path.relative_to(tests)} imports {node.module}")
    assert not crossing, crossing
