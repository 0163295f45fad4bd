"""Old module paths, kept importing for one release after a module moved (issue 49 gave the
package its data-flow layout): `import eplbsim.rank_epoch`, `from eplbsim.errors import
InputError` and `eplbsim.spec.parts` give the very module that now lives at the new path, never
a second copy, with a DeprecationWarning naming the new path.

`OLD_NAMES` maps each old name (below `eplbsim.`) to its new one. `install(package)` puts a
finder first on `sys.meta_path` that answers only those names, importing the new module when an
old name is first imported (so `import eplbsim` and every `--help` import nothing more), and
`attribute(package, name)` is the package's `__getattr__` for `eplbsim.topology` and the like.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

OLD_NAMES = {
    # the run schema was `eplbsim/spec/` until issue 43
    "spec": "runspec", "spec.flags": "runspec.flags", "spec.knobs": "runspec.knobs",
    "spec.parts": "runspec.parts", "spec.runspec": "runspec.run",
    "spec.source": "runspec.source", "spec.values": "runspec.values",
    # issue 49: the shared ground
    "compiled": "base.compiled", "errors": "base.errors", "files": "base.files",
    "limits": "base.limits", "patching": "base.patching", "progress": "base.progress",
    "registry": "base.registry", "simd": "base.simd",
    # where experts live
    "loads": "placement.loads", "placement_io": "placement.io", "topology": "placement.topology",
    # the rank step
    "checks": "ranks.checks", "counting": "ranks.counting", "fanout": "ranks.fanout",
    "moe": "ranks.moe", "rank_epoch": "ranks.epoch", "rank_traffic": "ranks.traffic",
    # the verdict
    "evidence": "review.evidence", "report": "review.page",
    "review_invariance": "review.invariance", "review_measures": "review.measures",
    "verdict": "review.verdict",
    # running replays
    "bench": "replay.bench", "distributed": "replay.distributed",
    "executors": "replay.executors", "results": "replay.results", "sweep": "replay.sweep",
    "workers": "replay.workers",
    # the rest joins the package of its concept
    "bisect": "engines.bisect", "figures": "plots.figures",
    # one name a module: no two modules called migration or chunks
    "metrics.chunks": "metrics.counters", "schedule.migration": "schedule.transfers",
    "solvers.migration": "solvers.few_moves", "traces.chunks": "traces.prefill_chunks",
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the old names of one package: the loader hands out the new module itself."""

    def __init__(self, package: str) -> None:
        self.new = {f"{package}.{old}": f"{package}.{new}" for old, new in OLD_NAMES.items()}
        self.spec_of: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.new:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = self.new[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.spec_of[new] = module.__spec__  # the import machinery sets the old name's next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported: its own spec goes back in place."""
        module.__spec__ = self.spec_of[module.__name__]


def install(package: str) -> None:
    """Put the finder of `package`'s old names first on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(package))


def attribute(package: str, name: str) -> ModuleType:
    """The module an old name `package.name` stands for (a package's `__getattr__`); an
    AttributeError for any other name."""
    if name not in OLD_NAMES:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")
