"""The engines' own EPLB code as policies and solvers (DESIGN.md §11).

Holds the sources (`source`, fetched by package name), one adapter an engine
(`sglang`, `vllm`), the stand-ins for what their EPLB files import, each simulated rank's
answers to every channel through which engine code learns its rank (`identity`: every call into
an engine runs as its rank), the engines' weight movers
(`sglang_updater`, `vllm_rearrange`, `vllm_async`), the twins' conformance (`conform`) and the
release bisect (`bisect`). Takes in an engine source (a release or a checkout); gives out
policies, solvers and updaters that run the engine's own code. Imports `base`, `placement`,
`solvers` and `dispatch`.

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `T` tokens, `K` top-k.

`ENGINES` names each supported engine: the release fetched by default (`pinned`), the releases
the tests run against (`tested`), which files of a wheel a fetch keeps, and its adapter. An
engine algorithm is a policy or solver named `ENGINE:ALGORITHM` (`ENGINE_POLICIES`,
`ENGINE_SOLVERS`) in every entry point; it runs the code of an engine source:
- by default the pinned release in the user cache (`eplbsim engines fetch`);
- `ENGINE==VERSION`: any release, fetched into the cache on first use;
- `ENGINE=PATH`: a folder, such as a branch's checkout (the folder holding the package:
  SGLang's `python/`, vLLM's repository root; a repository root holding `python/sglang` is
  taken too).
One adapter serves every release: it keys on what the code imports and calls, not on a version
(`sglang`, `vllm`). Adapters load on first use, so naming one costs nothing until it runs.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .. import dispatch
from ..base.errors import InputError
from ..dispatch import DispatchPolicy
from . import identity, sglang as _sglang, sglang_runtime, vllm as _vllm
from .source import cache_root, fetch, fetched_version, release_folder


@dataclass(frozen=True)
class Engine:
    """A supported engine: the release fetched by default (`pinned`), those CI fetches and the
    tests run against (`tested`), the path prefixes a fetch keeps of its wheel (`keep`), the
    adapter class and the engine functions it `exposes` (name -> what for)."""

    pinned: str
    tested: tuple[str, ...]
    keep: tuple[str, ...]
    adapter: type
    exposes: Mapping[str, str]


ENGINES: dict[str, Engine] = {
    "sglang": Engine(_sglang.PINNED, ("0.5.14", "0.5.16", "0.5.17", _sglang.PINNED), _sglang.KEEP,
                     _sglang.SGLang, _sglang.EXPOSES),
    "vllm": Engine(_vllm.PINNED, (_vllm.PINNED, "0.34.0"), _vllm.KEEP, _vllm.VLLM,
                   _vllm.EXPOSES),
}

# name -> (engine, algorithm, what it is, in one line)
ENGINE_POLICIES: dict[str, tuple[str, str, str]] = {
    "sglang:static": ("sglang", "static", "SGLang's per-rank static tables"),
    "sglang:dynamic": ("sglang", "dynamic", "SGLang's dynamic dispatch: row % n without an "
                       "a2a backend, randint(0, 65536) % n from the rank's default generator "
                       "with one"),
    "sglang:fake": ("sglang", "fake", "SGLang's fake dispatch: each rank draws its router "
                    "logits anew from its generator, takes its own top-k and dispatches it as "
                    "dynamic (the trace's ids give the shape only)"),
    "sglang:auto": ("sglang", "auto", "whatever SGLang's own settings logic picks for the "
                    "server flags of --engine-args (its _handle_eplb_and_dispatch), in the "
                    "row's mode"),
    "sglang:lp": ("sglang", "lp", "SGLang's LP dispatch: its LPLBSolver per layer and batch, "
                  "the barrier method by its torch reference, one float32 draw a pair from "
                  "the rank's generator"),
    "sglang:waterfill": ("sglang", "waterfill", "SGLang's dynamic dispatch, each token's "
                         "shared expert placed by its Waterfill (static mode)"),
    "sglang:waterfill-dynamic": ("sglang", "waterfill-dynamic", "SGLang's dynamic dispatch, "
                                 "each token's shared expert placed by its Waterfill (dynamic "
                                 "mode, SGLANG_DISABLE_STATIC_WATERFILL=1)"),
    "vllm:hash": ("vllm", "hash", "vLLM's map kernel: Knuth's hash of the token index"),
}
ENGINE_SOLVERS: dict[str, tuple[str, str, str]] = {
    **{f"sglang:{s}": ("sglang", s, f"SGLang's eplb_algorithms {s}")
       for s in _sglang.SOLVER_NAMES},
    "vllm:default": ("vllm", "default", "vLLM's DefaultEplbPolicy"),
    "vllm:flashlb": ("vllm", "flashlb", "vLLM's FlashlbEplbPolicy, from a checkout of its main "
                     "branch (--engine-source vllm=PATH: no release up to 0.34.0 has it)"),
}

Sources = tuple[tuple[str, str], ...]  # ((engine, path), ...): the engine sources in use


def as_sources(sources: Mapping[str, Any] | Sources | None) -> Sources:
    """`{engine: PATH or "=VERSION"}` (the `ENGINE=PATH` and `ENGINE==VERSION` forms) as a
    sorted tuple of `(engine, folder)`: a release fetched first when it is not in the cache
    (`fetch_engine`), a path resolved to the folder holding the engine's package. InputError
    for an unknown engine or a folder without the package."""
    items = dict(sources or {})
    out = []
    for engine, given in items.items():
        if engine not in ENGINES:
            raise InputError(f"unknown engine {engine!r} in an engine source; choose one of "
                             f"{', '.join(ENGINES)}")
        text = str(given)
        if text.startswith("="):  # ENGINE==VERSION: a release
            out.append((engine, str(fetch_engine(engine, text[1:]))))
            continue
        folder = Path(text)
        if not (folder / engine).is_dir() and (folder / "python" / engine).is_dir():
            folder = folder / "python"  # a repository root: SGLang keeps its package there
        if not (folder / engine).is_dir():
            raise InputError(f"engine source {engine}={given}: no folder {engine}/ there (give "
                             f"the folder holding the package: SGLang's python/, vLLM's "
                             f"checkout, or ENGINE==VERSION for a release)")
        out.append((engine, str(folder.resolve())))
    return tuple(sorted(out))


def label(engine: str, sources: Sources = ()) -> str:
    """What rows say ran: `sglang 0.5.23` for a fetched release (the pinned one by default),
    `sglang at PATH` for another folder."""
    path = dict(sources).get(engine)
    if path is None:
        return f"{engine} {ENGINES[engine].pinned}"
    version = release_of(engine, path)
    return f"{engine} {version}" if version else f"{engine} at {path}"


def release_of(engine: str, path: str | Path) -> str | None:
    """The release `path` is the fetched folder of (in the cache, complete), else None: a
    copy or checkout is a folder, whatever it holds."""
    version = fetched_version(Path(path))
    if version is None or Path(path).resolve() != release_folder(engine, version).resolve():
        return None
    return version


def release(engine: str, version: str | None = None) -> Path | None:
    """The cache folder of a fetched release of `engine` (default the pinned one), or None
    when it is not fetched."""
    version = version or ENGINES[engine].pinned
    folder = release_folder(engine, version)
    return folder if fetched_version(folder) == version else None


@lru_cache(maxsize=16)
def adapter(engine: str, sources: Sources = ()) -> Any:
    """The adapter of `engine` on its source (the given one, else the pinned release in the
    cache); InputError when the pinned release is not fetched or the folder holds no EPLB
    code the adapter can run."""
    spec = ENGINES[engine]
    path = dict(sources).get(engine)
    folder = Path(path) if path else release(engine)
    if folder is None:
        raise InputError(f"{engine} {spec.pinned} is not fetched: run `eplbsim engines fetch` "
                         f"(it downloads the wheel, no dependencies)")
    return spec.adapter(folder, label(engine, sources))


def fetched(engine: str) -> list[str]:
    """The releases of `engine` in the cache, complete, oldest first."""
    root = cache_root()
    found = [fetched_version(f) for f in root.glob(f"{engine}-*")] if root.is_dir() else []
    return sorted((v for v in found if v and release(engine, v)), key=version_key)


def version_key(version: str) -> tuple:
    """A sort key for release numbers: `0.5.9` before `0.5.16`, a suffix after its number."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                 for p in version.replace("-", ".").split("."))


def availability(engine: str, sources: Sources = ()) -> dict[str, str | None]:
    """Each of `engine`'s algorithms (its policies and solvers, `ENGINE:ALGORITHM`, and the
    candidate lists it publishes, `ENGINE:views`) against the source: None when its functions
    are there, else the first one missing (the adapter's `missing`)."""
    run = adapter(engine, sources)
    names = {n: a for table in (ENGINE_POLICIES, ENGINE_SOLVERS)
             for n, (e, a, _) in table.items() if e == engine}
    return {f"{engine}:views": run.missing("views"),
            **{n: run.missing(a) for n, a in names.items()}}


def fetch_engine(engine: str, version: str | None = None) -> Path:
    """Fetch the release `version` of `engine` (default the pinned one) into the cache
    (`source.fetch`): its wheel without dependencies, only the EPLB files kept. A no-op when
    it is there; otherwise it says so on stderr when that is a terminal, since it downloads."""
    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    spec = ENGINES[engine]
    version = version or spec.pinned
    if release(engine, version) is None and sys.stderr.isatty():  # as progress bars are
        print(f"fetching {engine}=={version} (the wheel, no dependencies)", file=sys.stderr)
    return fetch(engine, version, spec.keep)


def engine_code(names: Any, sources: Any = ()) -> str | None:
    """What engine code the engine algorithms among `names` ran (`label`, joined by ", "), or
    None when none of them is an engine's."""
    engines = sorted({n.partition(":")[0] for n in names if is_engine_name(n)})
    return ", ".join(label(e, as_sources(sources)) for e in engines) or None


def is_engine_name(name: Any) -> bool:
    """Whether `name` names an engine algorithm (`ENGINE:ALGORITHM`, a policy or a solver)."""
    return isinstance(name, str) and (name in ENGINE_POLICIES or name in ENGINE_SOLVERS)


def _entry(table: Mapping[str, tuple[str, str, str]], name: str, kind: str
           ) -> tuple[str, str, str]:
    if name not in table:
        raise InputError(f"unknown {kind} {name!r}; the engines' are {', '.join(table)}")
    return table[name]


# placement -> {(label, algorithm, a2a, rank): per-layer dispatch state}
_STATE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _cached(placement: Any, key: tuple, make: Callable[[], Any]) -> Any:
    per = _STATE.setdefault(placement, {})
    if key not in per:
        per[key] = make()
    return per[key]


def _layout(placement: Any, algorithm: str, a2a: bool) -> _sglang.Layout:
    topo = placement.topology
    return _sglang.Layout(placement.num_layers, placement.num_experts, placement.num_slots,
                          topo.num_gpus, topo.num_nodes, None, algorithm, a2a)


def sglang_metadata(adapter_: Any, placement: Any, algorithm: str, a2a: bool, rank: int) -> Any:
    """Rank `rank`'s `ExpertLocationMetadata` for `placement`, built through the engine (a
    placement given as a mapping: `init_by_mapping`; one a solver published, which carries its
    replica `order`: `_init_raw`, as `init_by_eplb` ends), cached per placement."""
    def make() -> Any:
        layout = _layout(placement, algorithm, a2a)
        order = placement.order
        return (adapter_.startup(layout, placement.phy2log, rank) if order is None else
                adapter_.rebalanced(layout, placement.phy2log, order, rank))
    return _cached(placement, (adapter_.label, "metadata", algorithm, a2a, rank), make)


def sglang_infos(adapter_: Any, placement: Any, algorithm: str, a2a: bool, rank: int) -> list:
    """Rank `rank`'s per-layer `ExpertLocationDispatchInfo` for `placement` (`init_new` on
    `sglang_metadata`), cached per placement."""
    return _cached(placement, (adapter_.label, algorithm, a2a, rank), lambda: adapter_.infos(
        _layout(placement, algorithm, a2a),
        sglang_metadata(adapter_, placement, algorithm, a2a, rank), rank))


def engine_policy(name: str, sources: Sources = (), engine_args: str = "") -> DispatchPolicy:
    """The `DispatchPolicy` that runs engine algorithm `name` from its source; `engine_args`:
    the SGLang server flags `sglang:auto` reads (`sglang_runtime.FLAGS`), ignored by the
    others."""
    return _engine_policy(name, as_sources(sources),
                          engine_args if name == "sglang:auto" else "")


def auto_algorithm(placement: Any, mode: str, sources: Sources = (),
                   engine_args: str = "") -> str:
    """The dispatch algorithm `sglang:auto` runs on `placement` in `mode`: what the SGLang
    source's settings logic picks for `engine_args` (`SGLang.picks`), cached per placement."""
    run = adapter("sglang", as_sources(sources))
    a2a = mode == "a2a"
    return _cached(placement, (run.label, "auto", engine_args, a2a), lambda: run.picks(
        sglang_runtime.flags(engine_args), _layout(placement, "dynamic", a2a)))


@lru_cache(maxsize=64)
def _engine_policy(name: str, sources: Sources, engine_args: str = "") -> DispatchPolicy:
    engine, algorithm, summary = _entry(ENGINE_POLICIES, name, "policy")
    source = label(engine, sources) + "'s own code"
    if algorithm.startswith("waterfill"):  # routed by its dynamic dispatch, shared by Waterfill
        return DispatchPolicy(_engine_policy("sglang:dynamic", sources).fn, source=source,
                              summary=summary, modes=("a2a",),
                              shared=_waterfill_rule(sources, algorithm.endswith("dynamic")))
    reroutes = algorithm == "fake"
    if engine == "sglang":
        if algorithm == "auto":  # the flags are read now, so a bad one fails before any work
            chosen = sglang_runtime.flags(engine_args).get("ep_dispatch_algorithm")
            reroutes = chosen == "fake"

        def fn(topk_ids: torch.Tensor, view: Any, ctx: Any) -> torch.Tensor:
            run = adapter("sglang", sources)
            run.need(algorithm)
            picked = (auto_algorithm(view.placement, ctx.mode, sources, engine_args)
                      if algorithm == "auto" else algorithm)
            run.need(picked)
            a2a = ctx.mode == "a2a"
            infos = sglang_infos(run, view.placement, picked, a2a, ctx.rank)
            ids = topk_ids.cpu()
            gen = ctx.generator  # the engine draws on the CPU: its stream's, there
            if gen is None and ctx.stream is not None:
                gen = ctx.stream.generator(ctx.layer, "cpu")
            elif gen is not None and gen.device.type != "cpu":
                gen = None
            with run.as_rank(_layout(view.placement, picked, a2a), ctx.rank,
                             "topk_ids_logical_to_physical", ctx.tp):
                if picked == "lp":
                    meta = sglang_metadata(run, view.placement, picked, a2a, ctx.rank)
                    return run.lp_dispatch(ids, meta, infos[ctx.layer], ctx.layer,
                                           gen).to(topk_ids.device)
                if picked == "fake":
                    ids = run.fake_ids(ids, infos[ctx.layer], gen)
                return run.dispatch(ids, infos[ctx.layer], gen).to(topk_ids.device)

        def observed(view: Any, ctx: Any) -> Any:
            """What rank `ctx.rank`'s calls read: the algorithm picked and its dispatch infos
            of every layer (an LP dispatch also its metadata)."""
            run = adapter("sglang", sources)
            picked = (auto_algorithm(view.placement, ctx.mode, sources, engine_args)
                      if algorithm == "auto" else algorithm)
            a2a = ctx.mode == "a2a"
            infos = sglang_infos(run, view.placement, picked, a2a, ctx.rank)
            meta = sglang_metadata(run, view.placement, picked, a2a, ctx.rank) \
                if picked == "lp" else None
            return picked, infos, meta
    else:
        def fn(topk_ids: torch.Tensor, view: Any, ctx: Any) -> torch.Tensor:
            run = adapter("vllm", sources)
            log2phy, counts = _cached(view.placement, (run.label, "maps"), lambda: run.logical_maps(
                view.placement.phy2log, view.placement.num_experts))
            ids = topk_ids if topk_ids.is_cuda else topk_ids.cpu()  # compiled on CUDA
            topo = view.placement.topology
            with run.as_rank(identity.Identity(ctx.rank, topo.num_gpus, topo.num_nodes, ctx.tp),
                             "eplb_map_to_physical_and_record"):
                phys, _ = run.dispatch(ids, log2phy[ctx.layer], counts[ctx.layer])
            return phys.to(topk_ids.device)

        def observed(view: Any, ctx: Any) -> Any:
            """What every rank's calls read: the placement (its candidate lists and counts
            are made from it, the same for every rank)."""
            return view.placement.phy2log
    fn.__name__ = name
    return DispatchPolicy(fn, source=source, summary=summary, reroutes=reroutes,
                          observed=observed)


def _waterfill_rule(sources: Sources, dynamic: bool) -> Callable:
    """SGLang's Waterfill as a shared rule (`dispatch.shared`): every layer's
    `WaterfillBalancer.expand_topk` on the rank's tokens, its all-reduce answered with every
    rank's routed pairs per GPU and tokens."""
    def rule(inputs: Any, ctx: Any) -> torch.Tensor:
        run = adapter("sglang", sources)
        gpu = inputs.gpu.cpu()
        out = torch.stack([run.waterfill(gpu[:, layer], ctx.rank, layer, dynamic,
                                         inputs.routed[layer].cpu(), inputs.tokens.cpu())
                           for layer in range(gpu.shape[1])], 1)
        return out.to(inputs.gpu.device)
    return rule


dispatch.RANK_SCOPES["identity"] = identity.file_scope
dispatch.ENGINE_POLICIES.update(
    {name: (lambda sources, engine_args="", name=name: engine_policy(name, sources, engine_args))
     for name in ENGINE_POLICIES})


def engine_solver(name: str, sources: Sources = ()) -> Callable:
    """The solver callable that runs engine solver `name` from its source: `(load [L, E],
    num_slots, topology, num_groups=1) -> (phy2log [L, P], {"order": log2phy [L, E, R]})` for
    SGLang (its replica order), `phy2log` for vLLM."""
    return _engine_solver(name, as_sources(sources))


def resolve_solver(solver: Any, sources: Any = ()) -> Any:
    """`solver` as the solvers' registry takes it: an engine solver's name (`sglang:deepseek`)
    becomes the callable running it from `sources` (`engine_solver`), a `file.py:function`
    name the function in that file; anything else (a registry name, a callable) is returned
    as it is."""
    if dispatch.is_file_policy(solver):
        return dispatch.file_policy(solver, "solver")
    return engine_solver(solver, sources) if is_engine_name(solver) else solver


@lru_cache(maxsize=64)
def _engine_solver(name: str, sources: Sources) -> Callable:
    engine, algorithm, _ = _entry(ENGINE_SOLVERS, name, "solver")

    def solver(load: np.ndarray, num_slots: int, topology: Any, num_groups: int = 1) -> Any:
        run = adapter(engine, sources)
        weight = torch.from_numpy(np.asarray(load, dtype=np.float64))
        if engine == "vllm":
            return run.solve(weight, num_slots, topology.num_gpus, topology.num_nodes,
                             num_groups, algorithm).numpy()
        phy2log, log2phy = run.solve(algorithm, weight, num_slots, topology.num_gpus,
                                     topology.num_nodes, num_groups)
        return phy2log.numpy(), {"order": log2phy.numpy()}
    solver.__name__ = name
    solver.__doc__ = f"{label(engine, sources)}'s own {algorithm} solver."
    return solver


__all__ = ["ENGINES", "ENGINE_POLICIES", "ENGINE_SOLVERS", "adapter", "as_sources",
           "auto_algorithm", "availability", "engine_policy", "engine_solver", "fetch_engine", "fetched",
           "is_engine_name", "label", "ran", "release", "resolve_solver", "version_key"]
