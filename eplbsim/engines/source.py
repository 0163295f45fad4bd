"""Engine sources: where an engine's own EPLB files come from, and loading them without the
engine's package `__init__` (DESIGN.md §11).

An *engine source* is a folder holding the engine's package folder (`sglang/`, `vllm/`): either
an unpacked wheel of a pinned version, fetched into the user cache by `fetch` (pip, by package
name, `--no-deps`, only the files an adapter reads), or a developer's checkout (its package's
parent folder: SGLang's `python/`, vLLM's repository root).

`Modules` loads one source's modules. Every package above the files it needs becomes an empty
module whose `__path__` is the real folder, so submodules load from their files and no package
`__init__` that pulls the serving stack runs. What those modules import from the rest of the
engine is, in this order: a module the adapter supplies (`stubs`: what carries meaning), the
real file when the source has it and it loads alone, else an inert stand-in
(`standins.Finder`). While a call into the engine runs (`Modules.active`), `sys.modules` holds
this source's modules under the engine's package name and the finder answers for the rest, so
imports inside engine functions find them; before and after it holds whatever it held.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Mapping, Sequence

from ..base.errors import InputError
from .identity import rewire
from .standins import Finder, stand_in

_LOCK = threading.RLock()


def cache_root() -> Path:
    """Where fetched engines live: `$EPLBSIM_CACHE/engines`, else
    `$XDG_CACHE_HOME/eplbsim/engines`, else `~/.cache/eplbsim/engines`."""
    base = os.environ.get("EPLBSIM_CACHE")
    if base:
        return Path(base) / "engines"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "eplbsim" / "engines"


MARKER = ".eplbsim-release"  # in a fetched release's folder, once complete: its version, then
# the path prefixes kept (a fetch keeping more, for a newer adapter, fetches again)


def release_folder(engine: str, version: str) -> Path:
    """The cache folder of `engine==version` (it holds the package folder once fetched)."""
    return cache_root() / f"{engine}-{version}"


def fetched_version(folder: Path) -> str | None:
    """The release a fetched folder holds (`MARKER`), or None (not a complete fetch)."""
    try:
        return (Path(folder) / MARKER).read_text().split("\n")[0].strip() or None
    except OSError:
        return None


def _kept(folder: Path) -> list[str]:
    """The path prefixes a fetched folder kept of its wheel (`MARKER`), [] when unknown."""
    try:
        return (Path(folder) / MARKER).read_text().split()[1:]
    except OSError:
        return []


def fetch(engine: str, version: str, keep: Sequence[str]) -> Path:
    """Download the wheel of `engine==version` without dependencies through pip, unpack the
    files whose paths in the wheel start with one of `keep` into its cache folder, mark it
    complete (`MARKER`) and return the folder; a no-op when it is there with those files.
    InputError when pip cannot get the wheel or the wheel has none of the files."""
    folder = release_folder(engine, version)
    if fetched_version(folder) == version and _kept(folder) == list(keep):
        return folder
    with tempfile.TemporaryDirectory(prefix="eplbsim-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, f"{engine}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise InputError(f"pip could not download {engine}=={version}: {last}")
        staging = Path(tempfile.mkdtemp(prefix=f".{engine}-{version}-", dir=_made(cache_root())))
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                kept = [n for n in wheel.namelist() if n.startswith(tuple(keep))
                        and not n.endswith("/")]
                if not kept:
                    raise InputError(f"the {engine}=={version} wheel has no EPLB files (none "
                                     f"under {', '.join(keep)})")
                for name in kept:
                    wheel.extract(name, staging)
            (staging / MARKER).write_text("\n".join([version, *keep]) + "\n")
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return folder


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class Modules:
    """One engine source's modules, loaded on demand from `root` (the folder holding the package
    `package`), with `stubs` (module name -> module) standing in for the rest of the engine.

    `load(name)` imports `name` from its file (its parents made empty packages); `extract(name,
    functions, namespace)` compiles only the named top-level functions of a module file (also
    those nested in a top-level `if`), keeping its file name and line numbers, for a module whose
    own imports pull in the serving stack. Engine code runs inside `active()`.
    """

    def __init__(self, root: Path, package: str, stubs: Mapping[str, ModuleType],
                 label: str = "") -> None:
        self.root, self.package = Path(root), package
        self.finder = Finder(self.root, package, label or f"{package} at {root}")
        self._mods: dict[str, ModuleType] = dict(stubs)
        self._depth = 0  # how deep `active` is entered (by the thread holding the lock)
        for name, stub in stubs.items():
            parent, _, leaf = name.rpartition(".")
            self._package(parent)
            setattr(self._mods[parent], leaf, stub)

    def _file(self, name: str) -> Path:
        return self.root.joinpath(*name.split("."))

    def _package(self, name: str) -> ModuleType:
        """`name` and its parents as packages of this source whose `__init__` never runs
        (unless stubbed or loaded): stand-ins (`standins.StandInModule`) whose submodules load
        from their files; `sys.modules` holds them while the source is active. Returns the
        package `name`."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            pkg = ".".join(parts[:i])
            if pkg not in self._mods:
                mod = ModuleType(pkg)
                mod.__path__ = [str(self._file(pkg))]
                mod.__package__ = pkg
                self._mods[pkg] = stand_in(mod, "its package __init__ is not run: it pulls in "
                                           "the serving stack", self.finder.label)
                if i > 1:
                    setattr(self._mods[".".join(parts[:i - 1])], parts[i - 1], mod)
        return self._mods[name]

    def supply(self, package: str, **names: Any) -> None:
        """Put `names` into the package `package` (made as `_package` makes it): what an
        adapter supplies that the engine imports from a package rather than a module."""
        mod = self._package(package)
        for key, value in names.items():
            setattr(mod, key, value)

    @contextmanager
    def active(self) -> Iterator["Modules"]:
        """`sys.modules` holds this source's modules while the block runs (one thread at a
        time); the engine's names there before are put back after. Cheap, as the replay enters
        it once a call of the engine's: nested in itself it does nothing more; it scans
        `sys.modules` for the package's names only when the package is there (another source
        active, or the engine installed), and on leaving takes back the names it knows (its
        own modules and every one its finder found)."""
        with _LOCK:
            if self._depth:
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
                return
            prefix = self.package + "."
            saved = {k: v for k, v in sys.modules.items() if k == self.package
                     or k.startswith(prefix)} if self.package in sys.modules else {}
            for k in saved:
                del sys.modules[k]
            sys.modules.update(self._mods)
            sys.meta_path.insert(0, self.finder)
            self._depth = 1
            try:
                yield self
            finally:
                self._depth = 0
                sys.meta_path.remove(self.finder)
                for k in set(self._mods) | self.finder.found:
                    if k in sys.modules:
                        self._mods[k] = sys.modules.pop(k)
                sys.modules.update(saved)

    @property
    def stood(self) -> dict[str, str]:
        """The engine modules standing in so far (`standins`), and why each does."""
        return dict(self.finder.stood)

    def load(self, name: str) -> ModuleType:
        """The engine module `name` (e.g. `sglang.srt.eplb.expert_location`), from its file."""
        importlib.invalidate_caches()  # files written since the last import are seen
        with self.active():
            if name in self._mods:
                return self._mods[name]
            parent, _, leaf = name.rpartition(".")
            self._package(parent)
            sys.modules.update(self._mods)
            path = self._file(name)
            file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            if not file.is_file():
                raise InputError(f"{self.root}: the engine source lacks "
                                 f"{file.relative_to(self.root)}")
            spec = importlib.util.spec_from_file_location(
                name, file, submodule_search_locations=[str(path)] if path.is_dir() else None)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            rewire(vars(mod))
            setattr(self._mods[parent], leaf, mod)
            self._mods[name] = mod
            return mod

    def extract(self, name: str, functions: Sequence[str], namespace: dict[str, Any],
                bare: bool = False) -> dict:
        """Compile the top-level functions `functions` of module `name`'s file (the first
        definition of each, looking inside top-level `if` blocks too; `Class.method` for a
        method, compiled as a function of its own name taking `self`) into `namespace`, with
        the file's name and line numbers; `bare`: without their decorators (a `torch.compile`
        the engine wraps them in). Returns the namespace. InputError naming a function the
        file lacks."""
        file = self._file(name).with_suffix(".py")
        if not file.is_file():
            raise InputError(f"{self.root}: the engine source lacks {file.relative_to(self.root)}")
        tree = ast.parse(file.read_text(), str(file))
        found: dict[str, ast.stmt] = {}
        for node in _top_level(tree.body):
            for f in functions:
                owner, _, leaf = f.rpartition(".")
                if owner and isinstance(node, ast.ClassDef) and node.name == owner:
                    node_ = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                                  and n.name == leaf), None)
                elif not owner and isinstance(node, ast.FunctionDef) and node.name == f:
                    node_ = node
                else:
                    continue
                if node_ is not None:
                    found.setdefault(f, node_)
        lacking = [f for f in functions if f not in found]
        if lacking:
            raise InputError(f"{file}: no function {', '.join(lacking)}")
        if bare:
            for node in found.values():
                node.decorator_list = []
        module = ast.Module(body=[found[f] for f in functions], type_ignores=[])
        namespace.setdefault("__name__", name)
        with self.active():
            exec(compile(module, str(file), "exec"), namespace)  # noqa: S102 - engine's code
        rewire(namespace)
        return namespace


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of `body`, and those of its `if` blocks, in order."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        else:
            yield node


@contextmanager
def interpreted() -> Iterator[None]:
    """`TRITON_INTERPRET=1` while the block defines kernels (Triton reads it at `@jit`), and
    two gaps of Triton's interpreter mended (`_mend_atomic_mask`, `_mend_nested_jit`)."""
    _mend_atomic_mask()  # imports triton, before the switch: its own library stays as it is
    _mend_nested_jit()
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _mend_atomic_mask() -> None:
    """Triton's interpreter refuses an atomic's mask built as `block & scalar` (its dtype is
    then not numpy's bool: "mask has unsupported dtype"); cast the mask to bool first. A fix in
    Triton's interpreter alone: the engine's kernel runs unchanged."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_atomic_rmw, "mended", False):
        return
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        mask = interpreter.TensorHandle(np.asarray(mask.data, dtype=np.bool_), mask.dtype)
        return original(self, rmw_op, ptr, val, mask, sem, scope)

    create_atomic_rmw.mended = True
    builder.create_atomic_rmw = create_atomic_rmw


def _mend_nested_jit() -> None:
    """A jit function Triton defined before the interpreter was on (`tl.zeros` and the rest of
    `triton.language.standard`, when triton was imported without `TRITON_INTERPRET`) refuses to
    be called ("outside of the scope of a kernel") when an interpreted kernel calls it;
    interpret it as the interpreter does its own nested functions. Only reached from
    interpreted kernels: compiled kernels never call `JITFunction.__call__`."""
    from triton.runtime import interpreter, jit

    if getattr(jit.JITFunction.__call__, "mended", False):
        return

    def call(self, *args, **kwargs):
        return interpreter.InterpretedFunction(self.fn)(*args, **kwargs)

    call.mended = True
    jit.JITFunction.__call__ = call


@functools.lru_cache(maxsize=1024)
def _parameters(fn: Any) -> Any:
    """`inspect.signature(fn).parameters`, read once a function (an engine call reads them
    every time: a step calls thousands)."""
    return inspect.signature(fn).parameters


def call(fn: Any, label: str, **known: Any) -> Any:
    """Call the engine function `fn` by its signature: each parameter it names takes the value
    `known` has under that name; a parameter with a default that `known` lacks keeps it.
    InputError naming a required parameter `known` does not have (an entry point that changed
    beyond what the adapter knows)."""
    try:
        parameters = _parameters(fn)
    except (TypeError, ValueError):  # no signature to read: call with what is known
        return fn(**known)
    given: dict[str, Any] = {}
    for name, p in parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in known:
            given[name] = known[name]
        elif p.default is p.empty:
            raise InputError(f"{label}: {getattr(fn, '__qualname__', fn)} takes {name!r}, "
                             f"which eplbsim does not know how to give (parameters: "
                             f"{', '.join(parameters)})")
    positional = [given.pop(n) for n, p in parameters.items()
                  if p.kind is p.POSITIONAL_ONLY and n in given]
    return fn(*positional, **given)
