"""Inert stand-ins for the parts of an engine its EPLB code imports but a simulation does not run
(DESIGN.md §11, "Every release"), as Sphinx's autodoc mocks the modules it cannot import.

An engine's EPLB modules import names from the rest of the engine: its logging, its environment
flags, its distributed helpers, its config classes. Each release moves and renames them. An
engine source loads as follows (`Finder`, installed while a source is active):
- a module the adapter supplies (what carries meaning: the settings, the expert-location
  metadata, the platform) is the adapter's;
- else the module's real file, when the source has it and it loads without the serving stack;
- else an inert stand-in module (`StandInModule`).

A stand-in module answers every attribute with an inert object (`Inert`) named after where it
came from. Holding, passing, calling, subclassing or decorating with one does nothing; so a module
that only imports and wires names loads. Using one's value (truth, numbers, iteration, indexing,
comparison) raises an `InputError` naming it and why it stands in: that is the point where the
EPLB call really needed something of the engine that eplbsim does not supply.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base.errors import InputError
from .identity import rewire


def _refuse(self: "Inert", *args: Any, **kwargs: Any) -> Any:
    raise InputError(f"{object.__getattribute__(self, '_inert_label')} used "
                     f"{object.__getattribute__(self, '_inert_name')}, which eplbsim stands in "
                     f"for ({object.__getattribute__(self, '_inert_why')}): the engine's EPLB "
                     f"call needs it, and no adapter supplies it")


class Inert:
    """An object standing in for `name` (module doc): inert until its value is used."""

    def __init__(self, name: str, why: str, label: str) -> None:
        object.__setattr__(self, "_inert_name", name)
        object.__setattr__(self, "_inert_why", why)
        object.__setattr__(self, "_inert_label", label)

    def _child(self, name: str) -> "Inert":
        return Inert(name, object.__getattribute__(self, "_inert_why"),
                     object.__getattribute__(self, "_inert_label"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._child(f"{object.__getattribute__(self, '_inert_name')}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and (callable(args[0]) or isinstance(args[0], type)):
            return args[0]  # a decorator: the function or class it decorates, as it is
        return self._child(f"{object.__getattribute__(self, '_inert_name')}(...)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (InertBase,)  # a class may derive from a stand-in

    def __repr__(self) -> str:
        return f"<eplbsim stand-in for {object.__getattribute__(self, '_inert_name')}>"

    __bool__ = __int__ = __float__ = __index__ = __len__ = __iter__ = _refuse
    __getitem__ = __setitem__ = __contains__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __floordiv__ = __mod__ = __and__ = __or__ = __neg__ = _refuse
    __hash__ = object.__hash__


class InertBase:
    """The base a class deriving from a stand-in gets instead: it takes any arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass


class StandInModule(ModuleType):
    """A module standing in for an engine module (module doc); a package, so its submodules
    load: a name that is a submodule file in its folder is that module, any other an `Inert`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        d = self.__dict__
        for folder in d.get("__path__", []):
            base = Path(folder) / name
            if base.with_suffix(".py").is_file() or base.is_dir():
                return importlib.import_module(f"{self.__name__}.{name}")
        return Inert(f"{self.__name__}.{name}", d["_standin_why"], d["_standin_label"])


def stand_in(module: ModuleType, why: str, label: str) -> ModuleType:
    """Turn `module` (empty or half-run) into a stand-in: its own names dropped, `why` said."""
    keep = {"__name__", "__spec__", "__loader__", "__package__", "__path__", "__file__"}
    for key in [k for k in module.__dict__ if k not in keep]:
        del module.__dict__[key]
    module.__dict__.setdefault("__path__", [])
    module._standin_why, module._standin_label = why, label
    module.__class__ = StandInModule
    return module


class _Loader(importlib.abc.Loader):
    """Runs an engine module's real file (`file`, None: there is none) and turns the module into
    a stand-in when there is none or it does not load here."""

    def __init__(self, file: Path | None, label: str, stood: dict[str, str]) -> None:
        self.file, self.label, self.stood = file, label, stood

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.file is None:
            folder = module.__spec__.submodule_search_locations or []
            why = ("the engine source has its folder but no __init__.py"
                   if any(Path(f).is_dir() for f in folder) else "the engine source lacks it")
        else:
            try:
                code = compile(self.file.read_bytes(), str(self.file), "exec")
                exec(code, module.__dict__)  # noqa: S102 - the engine's own code
                rewire(module.__dict__)
                return
            except Exception as exc:  # it needs the serving stack: stand in for it
                why = f"it does not load without the serving stack: {type(exc).__name__}: {exc}"
        self.stood[module.__name__] = why
        stand_in(module, why, self.label)


class Finder(importlib.abc.MetaPathFinder):
    """The import rule of the module doc for `package`'s modules under `root` not already in
    `sys.modules`: the real file, else a stand-in. `stood` records each stand-in and why;
    `found` every module name it gave a spec for."""

    def __init__(self, root: Path, package: str, label: str) -> None:
        self.root, self.package, self.label = Path(root), package, label
        self.stood: dict[str, str] = {}
        self.found: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        self.found.add(fullname)
        base = self.root.joinpath(*fullname.split("."))
        if (base / "__init__.py").is_file():
            file, search = base / "__init__.py", [str(base)]
        elif base.with_suffix(".py").is_file():
            file, search = base.with_suffix(".py"), None
        else:  # no file: a stand-in package, whose submodules may still be real files
            file, search = None, [str(base)]
        spec = importlib.util.spec_from_loader(fullname, _Loader(file, self.label, self.stood),
                                               origin=str(file) if file else None,
                                               is_package=search is not None)
        if search is not None:
            spec.submodule_search_locations = search
        if file is not None:
            spec.has_location = True
        return spec


__all__ = ["Finder", "Inert", "InertBase", "StandInModule", "stand_in"]
