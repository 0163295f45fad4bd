"""SGLang's own EPLB code, run in the simulator, from any release or checkout (DESIGN.md §11).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` EP ranks, `T` tokens,
`K` top-k.

The engine's modules load from their files, never through `sglang/__init__` (`source.Modules`);
what they import from the rest of the engine is, in this order, what this adapter supplies, the
real file when it loads alone, or an inert stand-in (`standins`). The adapter supplies what carries
meaning, and only that:
- the deployment's settings, in every shape a release has read them (`sglang_runtime`);
- the elastic-EP state (off: every rank healthy) and the model's expert layout (the trace's
  layers, experts and groups, through `model_loader.get_model_architecture`);
- the global expert-location metadata, published per rank before each use (the resources, and
  the module global of releases that kept it there), and the all-reduce Waterfill calls;
- the platform (not HIP, not NPU) and CPU stand-ins for the LP path's two CUDA kernels.

Where the EPLB code lives moves too (`srt/managers/` up to 0.4.7, `srt/eplb/` from 0.4.10), so
each role is looked for under every name it has had (`ROLES`), and the entry points are called
by their signatures (`source.call`: `init_by_mapping(server_args, model_config, ...)` in 0.5.16,
`(model_config, ...)` in 0.5.23). An algorithm is available when the functions it calls are in
the source (`NEEDS`, `SGLang.missing`).

Per-rank dispatch info is built the engine's way: `ExpertLocationMetadata.init_by_mapping(...,
moe_ep_rank=r)` at start-up, published as the global metadata, then
`ExpertLocationDispatchInfo.init_new(layer)`. After a live rebalance the engine builds the
metadata with `init_by_eplb`, which runs its solver and then `ExpertLocationMetadata._init_raw`
on the solver's `(phy2log, log2phy)` with no rank (so no narrowing; `static`'s table reads
`torch.distributed.get_rank()`, answered with the rank during the call): `rebalanced` does
that with a given solver output. Dispatch is `topk_ids_logical_to_physical` with the rank's
generator as torch's default generator during the call.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator, NamedTuple

import torch

from ..base.errors import InputError
from ..placement import refuse_empty_slots
from . import identity, sglang_runtime
from .source import Modules, call, interpreted
from .standins import stand_in

PACKAGE = "sglang"
PINNED = "0.5.23"  # the release `engines fetch` takes by default, and the tests run against
KEEP = ("sglang/srt/eplb/", "sglang/srt/managers/expert_location", "sglang/srt/managers/eplb",
        "sglang/jit_kernel/lplb/", "sglang/kernels/ops/lplb/", "sglang/test/kernels/lplb.py",
        "sglang/srt/layers/moe/waterfill.py", "sglang/kernels/ops/moe/deepep_waterfill",
        "sglang/version.py", "sglang/srt/server_args.py", "sglang/srt/arg_groups/parallel_hook.py",
        "sglang/srt/layers/moe/topk.py")  # what a fetch keeps of a wheel: paths starting so
ROLES = {  # what the adapter calls -> the modules it has lived in, newest first
    "location": ("sglang.srt.eplb.expert_location", "sglang.srt.managers.expert_location"),
    "dispatch": ("sglang.srt.eplb.expert_location_dispatch",
                 "sglang.srt.managers.expert_location_dispatch"),
    "algorithms": ("sglang.srt.eplb.eplb_algorithms", "sglang.srt.managers.eplb_algorithms"),
    "lplb": ("sglang.srt.eplb.lplb_solver",),
    "references": ("sglang.test.kernels.lplb",),
    "waterfill": ("sglang.srt.layers.moe.waterfill",),
    "updater": ("sglang.srt.eplb.expert_location_updater",
                "sglang.srt.managers.expert_location_updater"),
}
EXTRACTED = {  # functions compiled alone out of modules that pull in the serving stack:
    # role -> the (module, function) it has been, newest first
    "settings": (("sglang.srt.arg_groups.parallel_hook", "handle_eplb_and_dispatch"),
                 ("sglang.srt.server_args", "ServerArgs._handle_eplb_and_dispatch")),
    "selection": (("sglang.srt.layers.moe.topk", "fused_topk_torch_native"),),
}
TRITON_ROLES = ("waterfill",)  # modules whose Triton kernels run under the interpreter
_VIEWS = (("location", "ExpertLocationMetadata.init_by_mapping"),
          ("location", "ModelConfigForExpertLocation"),
          ("dispatch", "ExpertLocationDispatchInfo.init_new"),
          ("dispatch", "topk_ids_logical_to_physical"))
NEEDS = {  # algorithm -> the (role, name) it calls
    "views": _VIEWS,
    "rebalanced": (("location", "ExpertLocationMetadata._init_raw"),),
    "static": _VIEWS, "dynamic": _VIEWS,
    "fake": (*_VIEWS, ("dispatch", "transform_select_experts_inputs"), ("selection", None)),
    "auto": (*_VIEWS, ("settings", None)),
    "lp": (*_VIEWS, ("lplb", "LPLBSolver"), ("references", "solve_ipm_torch_reference"),
           ("references", "dispatch_probability_torch_reference")),
    "waterfill": (*_VIEWS, ("waterfill", "WaterfillBalancer")),
    "waterfill-dynamic": (*_VIEWS, ("waterfill", "WaterfillBalancer")),
    "updater": (*_VIEWS, ("updater", "_update_expert_weights"),
                ("location", "ExpertLocationMetadata.update")),
    **{s: (("algorithms", "rebalance_experts"), ("algorithms", f"EplbAlgorithm.{s}"))
       for s in ("deepseek", "deepseek_vec", "elasticity_aware")},
}
LIST_VIEWS = {"0.5.14": "sglang-0.5.14", "0.5.16": "sglang-0.5.16", "0.5.17": "sglang"}
# release -> the view (`placement.VIEWS`) equal to its candidate lists, up to the next release
SOLVER_NAMES = ("deepseek", "deepseek_vec", "elasticity_aware")
EXPOSES = {
    "ExpertLocationMetadata.init_by_mapping": "per-rank candidate lists at start-up",
    "ExpertLocationMetadata._init_raw": "the lists init_by_eplb publishes after a rebalance",
    "ExpertLocationDispatchInfo.init_new": "a layer's dispatch info",
    "topk_ids_logical_to_physical": "dispatch: static, dynamic, fake",
    "transform_select_experts_inputs": "fake: each rank's router logits drawn anew",
    "fused_topk_torch_native": "fake: each rank's top-k of its own logits",
    "ServerArgs._handle_eplb_and_dispatch": "auto: the dispatch algorithm the release picks "
                                            "for the flags given (handle_eplb_and_dispatch "
                                            "in arg_groups/parallel_hook.py from 0.5.23)",
    "LPLBSolver": "lp: its LP per layer and batch, the barrier method by its torch reference "
                  "(sglang/test/kernels/lplb.py), the two CUDA kernels around it by eplbsim's "
                  "CPU stand-ins (eplbsim.dispatch.sglang_lp), the draw by "
                  "dispatch_probability_torch_reference",
    "eplb_algorithms.rebalance_experts": "solvers: " + ", ".join(SOLVER_NAMES),
    "WaterfillBalancer.expand_topk": "Waterfill's shared-expert placement, static and dynamic, "
                                     "its Triton kernels under the interpreter",
}
A2A_BACKEND = sglang_runtime.A2A_BACKEND
_LAYOUT_FLAGS = {"ep_size": "--gpus", "ep_num_redundant_experts": "--redundant"}  # the run's, never the flags'

PLATFORM = {"is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False,
            "is_cuda": False, "is_cpu": True}  # the engine's platform checks, on this CPU run


def _declare(settings: Any, source: str, **fields: Any) -> None:
    """`declare_resolution` (0.5.23): the settings logic's decisions, written as ServerArgs'
    resolving view would show them."""
    for key, value in fields.items():
        setattr(settings, key, value)


_QUIET = logging.getLogger("eplbsim.engines.sglang")  # the engine's warnings, not shown
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False
_EXTRACTED_NAMES = {"logger": _QUIET, "torch": torch, "F": torch.nn.functional,
                    "resolving_view": lambda settings: settings,
                    "resolved_view": lambda settings: settings,
                    "declare_resolution": _declare}  # what the EXTRACTED functions read


@dataclass
class Layout:
    """What the engine's settings say of the deployment: `E` experts, `P` slots on `G` ranks
    over `nodes` nodes, `L` layers, expert groups, the dispatch algorithm and whether an a2a
    backend runs (the "a2a" mode)."""

    num_layers: int
    num_experts: int
    num_slots: int
    num_gpus: int
    num_nodes: int
    num_groups: int | None = None
    algorithm: str = "dynamic"
    a2a: bool = False


class SGLang:
    """SGLang's EPLB functions from the engine source `root` (the folder holding `sglang/`),
    labelled `label` (what rows say ran)."""

    engine = PACKAGE

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = Path(root), label
        self._settings = sglang_runtime.Settings(label)
        self._settings_extra = SimpleNamespace(model=None, waterfill_dynamic=False,
                                               all_reduced=None)
        self._roles: dict[str, ModuleType | str] = {}
        self._functions: dict[str, Any] = {}
        self._missing: dict[str, str | None] = {}
        self.prefix = identity.register(self.root)
        self.modules = Modules(self.root, PACKAGE, self._stubs(), label)
        ranks = identity.getters("sglang", identity.SGLANG_GETTERS, identity.SGLANG_GROUPS)
        for package in ("sglang.srt.distributed", "sglang.srt.distributed.parallel_state",
                        "sglang.srt.layers.dp_attention"):  # where the rank getters live
            self.modules.supply(package, **ranks)
        if self.missing("views") is not None:
            raise InputError(f"{label}: {self.missing('views')}; no SGLang EPLB code there "
                             f"(the folder holding sglang/: a release, or a checkout's python/)")

    # -- what the source has --------------------------------------------------------------

    def role(self, role: str) -> ModuleType:
        """The module playing `role` (`ROLES`); InputError saying why there is none."""
        found = self._find(role)
        if isinstance(found, str):
            raise InputError(f"{self.label}: {found}")
        return found

    def _find(self, role: str) -> ModuleType | str:
        """The module playing `role`, loaded, or why there is none (cached)."""
        if role not in self._roles:
            self._roles[role] = self._load_role(role)
        return self._roles[role]

    def _load_role(self, role: str) -> ModuleType | str:
        names = ROLES[role]
        for name in names:
            file = self.root.joinpath(*name.split("."))
            if not (file.with_suffix(".py").is_file() or (file / "__init__.py").is_file()):
                continue
            try:
                if role in TRITON_ROLES:  # Triton kernels, defined as the module loads
                    with interpreted():
                        return self.modules.load(name)
                with _optional("einops", self.label):  # the updater logs metrics with it
                    return self.modules.load(name)
            except InputError:
                raise
            except Exception as exc:  # an engine module that does not load here: say why
                return f"{name} does not load ({type(exc).__name__}: {exc})"
        return f"no {' or '.join(n.replace('.', '/') + '.py' for n in names)}"

    def missing(self, algorithm: str) -> str | None:
        """Why `algorithm` (`NEEDS`: a policy's, a solver's, `views` or `rebalanced`) cannot
        run from this source: the first function it calls that the source lacks; None when it
        can."""
        if algorithm not in self._missing:  # what a source has does not change
            self._missing[algorithm] = self._lacks(algorithm)
        return self._missing[algorithm]

    def _lacks(self, algorithm: str) -> str | None:
        for role, name in NEEDS[algorithm]:
            if role in EXTRACTED:
                found = self._function(role)
                if isinstance(found, str):
                    return found
                continue
            mod = self._find(role)
            if isinstance(mod, str):
                return mod
            target: Any = mod
            for part in name.split("."):
                target = getattr(target, part, None)
                if target is None:
                    return f"{mod.__name__} has no {name}"
        return None

    def _function(self, role: str) -> Any:
        """The function playing `role` (`EXTRACTED`), compiled alone from its file with the
        names it reads supplied (`_EXTRACTED_NAMES`), or why there is none (cached)."""
        if role not in self._functions:
            tried = []
            for module, function in EXTRACTED[role]:
                if not self.root.joinpath(*module.split(".")).with_suffix(".py").is_file():
                    tried.append(f"no {module.replace('.', '/')}.py")
                    continue
                try:
                    space = self.modules.extract(module, (function,), dict(_EXTRACTED_NAMES),
                                                 bare=True)
                except InputError as exc:
                    tried.append(str(exc).rpartition(": ")[2] + f" in {module}")
                    continue
                self._functions[role] = space[function.rpartition(".")[2]]
                break
            else:
                self._functions[role] = "; ".join(tried)
        return self._functions[role]

    def need(self, algorithm: str) -> None:
        """InputError, in one line, when `algorithm` cannot run from this source."""
        why = self.missing(algorithm)
        if why is not None:
            raise InputError(f"{self.label} cannot run {algorithm}: {why}")

    @property
    def location(self) -> ModuleType:
        return self.role("location")

    @property
    def dispatch_module(self) -> ModuleType:
        return self.role("dispatch")

    def _stubs(self) -> dict[str, ModuleType]:
        """The modules the adapter supplies (module docstring)."""
        s, extra = self._settings, self._settings_extra
        elastic = ModuleType("sglang.srt.elastic_ep.elastic_ep")
        elastic.elastic_expanded_world_enabled = lambda: False

        class ElasticEPStateManager:
            """Every rank healthy, no elastic state."""

            @staticmethod
            def instance() -> None:
                return None

            @staticmethod
            def healthy_rank_state() -> torch.Tensor:
                return torch.ones(s.ep_size, dtype=torch.int32)

        elastic.ElasticEPStateManager = ElasticEPStateManager
        loader = ModuleType("sglang.srt.model_loader")
        loader.get_model_architecture = lambda model_config: (_model_class(self), "eplbsim")
        utils = ModuleType("sglang.srt.utils")
        for name, answer in PLATFORM.items():
            setattr(utils, name, lambda answer=answer: answer)
        utils.get_bool_env_var = _bool_env
        utils.get_int_env_var = lambda name, default=0: int(os.environ.get(name, default))
        environ = ModuleType("sglang.srt.environ")
        environ.envs = SimpleNamespace(
            SGLANG_DISABLE_STATIC_WATERFILL=SimpleNamespace(get=lambda: extra.waterfill_dynamic),
            SGLANG_EPLB_P2P_BATCH_CHUNK_SIZE=SimpleNamespace(  # environ.py's default, 0.5.23
                get=lambda: int(os.environ.get("SGLANG_EPLB_P2P_BATCH_CHUNK_SIZE", 32))))
        topk = ModuleType("sglang.srt.layers.moe.topk")
        topk.StandardTopKOutput = NamedTuple("StandardTopKOutput", [
            ("topk_weights", torch.Tensor), ("topk_ids", torch.Tensor), ("router_logits", Any)])
        comm = ModuleType("sglang.srt.distributed.communication_op")
        comm.moe_expert_parallel_all_reduce = lambda buf: extra.all_reduced.clone()
        mods = [elastic, loader, utils, environ, topk, comm]
        for package in ("sglang.kernels.ops.lplb", "sglang.jit_kernel.lplb"):  # moved in 0.5.17
            warm = ModuleType(f"{package}.torch_solver")
            warm.warmup = lambda *args, **kwargs: None  # it JIT-compiles CUDA code
            mods += [warm, _lp_kernels(self, f"{package}.cuda_solver")]
        return {**sglang_runtime.modules(s), **{m.__name__: m for m in mods}}

    @contextmanager
    def _configured(self, layout: Layout) -> Iterator[None]:
        """The engine's settings for `layout`, and its modules active."""
        s = self._settings
        s.ep_dispatch_algorithm = layout.algorithm
        s.moe_a2a_backend = A2A_BACKEND if layout.a2a else "none"
        s.ep_num_redundant_experts = layout.num_slots - layout.num_experts
        s.ep_size, s.nnodes = layout.num_gpus, layout.num_nodes
        s.tp_size = layout.num_gpus
        self._settings_extra.model = layout
        with self.modules.active():
            yield

    def _known(self, layout: Layout, **more: Any) -> dict[str, Any]:
        """What the engine's entry points may take, by parameter name (`source.call`)."""
        return {"server_args": self._settings, "model_config": SimpleNamespace(hf_config=layout),
                "ep_size": layout.num_gpus, **more}

    def startup(self, layout: Layout, phy2log: torch.Tensor, rank: int) -> Any:
        """Rank `rank`'s `ExpertLocationMetadata` at start-up (`init_by_mapping`); InputError
        in one line for a `phy2log [L, P]` with an empty slot (-1), which the engine takes
        for no expert."""
        refuse_empty_slots(phy2log, f"{self.label}'s init_by_mapping")
        with self._configured(layout), self.as_rank(layout, rank, "init_by_mapping"):
            return call(self.location.ExpertLocationMetadata.init_by_mapping, self.label,
                        **self._known(layout, physical_to_logical_map=phy2log.clone(),
                                      moe_ep_rank=rank))

    def rebalanced(self, layout: Layout, phy2log: torch.Tensor, log2phy: torch.Tensor,
                   rank: int) -> Any:
        """Rank `rank`'s metadata after a live rebalance to a solver's `(phy2log [L, P],
        log2phy [L, E, R])`: what `init_by_eplb` builds from its solver's output. InputError
        in one line for a `phy2log` with an empty slot (-1)."""
        refuse_empty_slots(phy2log, f"{self.label}'s ExpertLocationMetadata")
        self.need("rebalanced")
        with self._configured(layout), self.as_rank(layout, rank, "_init_raw"):
            return call(self.location.ExpertLocationMetadata._init_raw, self.label,
                        **self._known(layout, physical_to_logical_map=phy2log.clone(),
                                      logical_to_all_physical_map=log2phy.clone()))

    def by_eplb(self, layout: Layout, logical_count: torch.Tensor, solver: str,
                rank: int) -> Any:
        """Rank `rank`'s metadata from `init_by_eplb(logical_count [W, L, E] or [L, E])` with
        the engine's solver `solver` (its `--eplb-algorithm`)."""
        self._check_solver(solver)
        self._settings.eplb_algorithm = solver
        with self._configured(layout), self.as_rank(layout, rank, "init_by_eplb"):
            return call(self.location.ExpertLocationMetadata.init_by_eplb, self.label,
                        **self._known(layout, logical_count=logical_count.clone()))

    def as_rank(self, layout: Layout, rank: int, function: str, tp: int = 1) -> Any:
        """The block's calls into this source run as rank `rank` of `layout`'s deployment
        (`identity.as_rank`: every channel answers it; an exception of the engine's names
        `function`)."""
        return identity.as_rank(identity.Identity(rank, layout.num_gpus, layout.num_nodes, tp),
                                self.prefix, self.label, function)

    def infos(self, layout: Layout, metadata: Any, rank: int = 0) -> list[Any]:
        """Every layer's `ExpertLocationDispatchInfo` for `metadata` published as the global
        metadata (`init_new`), on rank `rank`."""
        with self._configured(layout), self._published(metadata), \
                self.as_rank(layout, rank, "ExpertLocationDispatchInfo.init_new"):
            new = self.dispatch_module.ExpertLocationDispatchInfo.init_new
            return [call(new, self.label, layer_id=layer, ep_rank=rank)
                    for layer in range(layout.num_layers)]

    @contextmanager
    def _published(self, metadata: Any) -> Iterator[None]:
        """`metadata` as the global expert-location metadata during the block: in the
        resources (0.5.16 and later) and in the module global of releases that kept it there."""
        location = self.location
        kept = hasattr(location, "_global_expert_location_metadata")
        self._settings.expert_location_metadata = metadata
        if kept:
            location._global_expert_location_metadata = metadata
        try:
            yield
        finally:
            self._settings.expert_location_metadata = None
            if kept:
                location._global_expert_location_metadata = None

    def dispatch(self, topk_ids: torch.Tensor, info: Any,
                 generator: torch.Generator | None) -> torch.Tensor:
        """`topk_ids_logical_to_physical(topk_ids [T, K], info)` with `generator` as torch's
        default generator during the call; padding (-1) goes in as expert 0 and comes back
        as -1 (the engine gets a copy: it may write into it). -> int64 `[T, K]`."""
        padded = bool((topk_ids < 0).any())
        ids = (topk_ids.clamp(min=0).to(torch.int32) if padded
               else topk_ids.to(torch.int32, copy=True))
        with self.modules.active(), _default_generator(generator, ids.device):
            phys = call(self.dispatch_module.topk_ids_logical_to_physical, self.label,
                        topk_ids=ids, info=info)
        return torch.where(topk_ids >= 0, phys.long(), -1) if padded else phys.long()

    def picks(self, flags: dict[str, Any], layout: Layout) -> str:
        """The dispatch algorithm this release's own settings logic picks
        (`ServerArgs._handle_eplb_and_dispatch`, `handle_eplb_and_dispatch` from 0.5.23) for
        the server flags `flags` (`sglang_runtime.flags`) on `layout`: ServerArgs' defaults,
        the layout's EP size, redundant experts and a2a backend (the mode's: none, or
        `A2A_BACKEND` in "a2a"), then the flags. InputError, in one line: a flag that
        contradicts the layout, the release's own refusal (its message), or no algorithm
        picked (EPLB off)."""
        self.need("auto")
        s = sglang_runtime.Settings(self.label)
        s.ep_dispatch_algorithm, s.eplb_algorithm = None, "auto"
        s.ep_size = s.tp_size = layout.num_gpus
        s.nnodes = layout.num_nodes
        s.ep_num_redundant_experts = layout.num_slots - layout.num_experts
        s.moe_a2a_backend = A2A_BACKEND if layout.a2a else "none"
        for key, value in flags.items():
            mine = getattr(s, key)
            if key in _LAYOUT_FLAGS and value != mine:
                flag = next(f for f, (field, _) in sglang_runtime.FLAGS.items() if field == key)
                raise InputError(f"--engine-args give {flag} {value}, but this run has "
                                 f"{mine} ({_LAYOUT_FLAGS[key]})")
            setattr(s, key, value)
        if (s.moe_a2a_backend != "none") != layout.a2a:
            raise InputError(f"--engine-args give --moe-a2a-backend {s.moe_a2a_backend}, but "
                             f"this row runs mode {'a2a' if layout.a2a else 'none'} (none "
                             f"means --moe-a2a-backend none)")
        try:
            with self.modules.active(), identity.for_every_rank(
                    layout.num_gpus, layout.num_nodes, self.prefix, self.label,
                    "handle_eplb_and_dispatch"):
                call(self._function("settings"), self.label, self=s, server_args=s)
        except identity.EngineError as error:  # the release's own refusal, in its words
            exc = error.__cause__
            if not isinstance(exc, (ValueError, AssertionError)):
                raise
            where = traceback.extract_tb(exc.__traceback__)[-1]
            why = " ".join(str(exc).split()) or (f"its check `{where.line}` fails "
                                                  f"({Path(where.filename).name}:"
                                                  f"{where.lineno})")
            raise InputError(f"{self.label} refuses these flags: {why}") from None
        if s.ep_dispatch_algorithm is None:
            raise InputError(f"{self.label} picks no dispatch algorithm for these flags (EPLB "
                             f"off, trivial expert location): add --enable-eplb")
        return s.ep_dispatch_algorithm

    def fake_ids(self, topk_ids: torch.Tensor, info: Any,
                 generator: torch.Generator | None) -> torch.Tensor:
        """The experts a rank runs under SGLang's `fake` dispatch: its router logits drawn
        anew by `transform_select_experts_inputs` (`uniform_(5, 10)` from `generator`, as
        torch's default generator during the call), then its top-k of them by the engine's
        torch-native selection (`fused_topk_torch_native`, softmax), `K` of `topk_ids [T, K]`;
        padding stays -1. -> int64 `[T, K]`."""
        self.need("fake")
        T, K = topk_ids.shape
        E = info.partial_logical_to_all_physical_map.shape[0]
        logits = torch.empty(T, E, dtype=torch.float32)
        with self.modules.active(), _default_generator(generator, logits.device):
            logits, _ = call(self.dispatch_module.transform_select_experts_inputs, self.label,
                             router_logits=logits, correction_bias=None, info=info)
            _, ids = call(self._function("selection"), self.label, hidden_states=logits,
                          gating_output=logits, topk=K, renormalize=False)
        return torch.where(topk_ids >= 0, ids.long(), -1)

    def lp_dispatch(self, topk_ids: torch.Tensor, metadata: Any, info: Any, layer: int,
                    generator: torch.Generator | None) -> torch.Tensor:
        """SGLang's LP dispatch of one layer (`ep_dispatch_algorithm="lp"`): the engine's
        `LPLBSolver` for the layer of `metadata`, its `solve` on the batch's valid ids (no
        all-reduce: each simulated rank counts the ids it dispatches), then
        `dispatch_probability_torch_reference` with one float32 `torch.rand` a pair from
        `generator`, as the CUDA path draws when given none. -> int64 `[T, K]`, -1 at padding."""
        self.need("lp")
        valid = topk_ids >= 0
        with self.modules.active(), _default_generator(generator, torch.device("cpu")):
            solver = self.role("lplb").LPLBSolver(
                phy2log=metadata.physical_to_logical_map[layer],
                log2phy=metadata.logical_to_all_physical_map[layer],
                num_gpus=metadata.ep_size, ep_group=None,
                logical_to_all_physical_map_num_valid=(
                    metadata.logical_to_all_physical_map_num_valid[layer]))
            prob = solver.solve(topk_ids[valid].to(torch.int32).view(-1, 1))
            ids = topk_ids.clamp(min=0).to(torch.int32)
            u = torch.rand(ids.numel(), dtype=torch.float32)
            phys = self.role("references").dispatch_probability_torch_reference(
                ids, prob, info.partial_logical_to_all_physical_map, u)
        return torch.where(valid, phys.long(), -1)

    def waterfill(self, gpu: torch.Tensor, rank: int, layer: int, dynamic: bool,
                  routed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Where SGLang's Waterfill sends each of rank `rank`'s tokens' shared expert in one
        layer: its `WaterfillBalancer.expand_topk` on the tokens' routed pairs, given as the
        GPU of each pair's slot `gpu [T, K]` (-1 padding; the balancer reads only GPUs, so each
        GPU goes in as one slot of its own), in its
        static or `dynamic` mode (`SGLANG_DISABLE_STATIC_WATERFILL`), where its all-reduce
        answers every rank's routed pairs per GPU `routed [G]` and tokens `tokens [G]`.
        torch.compile is off during the call (its small-batch helper then runs eagerly).
        -> the GPU of each token's shared work, int64 `[T]`, -1 for a token with no pair."""
        G = routed.numel()
        self.need("waterfill")
        extra = self._settings_extra
        extra.waterfill_dynamic = dynamic
        extra.all_reduced = torch.cat([routed, tokens]).to(torch.int64)
        ids = gpu.to(torch.int32).contiguous()
        weights = torch.ones(ids.shape, dtype=torch.float32)
        with self.modules.active(), torch._dynamo.config.patch(disable=True), \
                identity.as_rank(identity.Identity(rank, G), self.prefix, self.label,
                                 "WaterfillBalancer.expand_topk"):
            balancer = call(self.role("waterfill").WaterfillBalancer, self.label,
                            num_routed_experts=G, world_size=G, rank=rank, layer_id=layer,
                            shared_weight=1.0)
            topk = sys.modules["sglang.srt.layers.moe.topk"].StandardTopKOutput
            out = balancer.expand_topk(topk(weights, ids, None), ids.shape[0])
        shared = out.topk_ids[:, -1].long()
        return torch.where(shared >= 0, shared // 2, -1)  # 2 experts a rank once expanded

    def solve(self, solver: str, load: torch.Tensor, num_slots: int, num_gpus: int,
              num_nodes: int, num_groups: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's solver `solver` on `load [L, E]` (`eplb_algorithms.rebalance_experts`,
        hierarchical when the groups divide over the nodes, as its `auto` decides) ->
        `(phy2log [L, P], log2phy [L, E, R])` in the solver's replica order."""
        self._check_solver(solver)
        algo = self.role("algorithms")
        hierarchical = num_groups is not None and num_groups % num_nodes == 0
        name = solver + ("_hierarchical" if hierarchical else "")
        layout = Layout(load.shape[0], load.shape[1], num_slots, num_gpus, num_nodes, num_groups)
        with self._configured(layout), identity.for_every_rank(
                num_gpus, num_nodes, self.prefix, self.label, "rebalance_experts"):
            phy2log, log2phy, _ = call(
                algo.rebalance_experts, self.label, tokens_per_expert=load.unsqueeze(0),
                num_physical_experts=num_slots, num_local_physical_experts=num_slots // num_gpus,
                num_groups=num_groups, num_nodes=num_nodes, algorithm=algo.EplbAlgorithm[name])
        return phy2log.long(), log2phy.long()

    def _check_solver(self, solver: str) -> None:
        if solver not in SOLVER_NAMES:
            raise InputError(f"{self.label}: eplbsim runs SGLang's EPLB algorithms "
                             f"{', '.join(SOLVER_NAMES)}, not {solver!r}")
        self.need(solver)


def _lp_kernels(adapter: SGLang, name: str) -> ModuleType:
    """A CPU LP kernel module `name` (`sglang.kernels.ops.lplb.cuda_solver`, or its 0.5.16
    place under `jit_kernel`): the barrier solve is the engine's own torch
    reference (a singular system, which it refuses and the kernel's clamped pivots get
    through, is taken as not converged: 0.5 everywhere, the kernel's answer to that); its two
    other kernels, which have none, are eplbsim's stand-ins computing what their CUDA sources
    do (`dispatch.sglang_lp.lp_inputs`, `slot_shares`), written into the engine's buffers as the
    kernels write."""
    from ..dispatch import sglang_lp

    mod = ModuleType(name)

    def prep_lp_inputs(A_full, b, t1, global_counts, log_single, log_replicated, B1,
                       A_base_row_sum):
        A, b_new, t1_new = sglang_lp.lp_inputs(
            {"single": log_single, "replicated": log_replicated, "B1": B1, "A": A_full,
             "base_row_sum": A_base_row_sum}, global_counts)
        A_full.copy_(A)
        b.copy_(b_new)
        t1.copy_(t1_new)

    def solve_ipm(A, b, c, num_iters=sglang_lp.IPM_STEPS, result=None):
        try:
            x = adapter.role("references").solve_ipm_torch_reference(A, b, c, num_iters)
        except torch.linalg.LinAlgError:  # singular: the kernel's clamped pivots go on, and
            x = torch.full_like(c, 0.5)  # its result on such a system is taken as failed
        return x if result is None else result.copy_(x)

    def extract_log2phy_prob(log2phy_prob, x, t1, phy_single, phy_replicated, log2phy):
        slots = phy_single.numel() + phy_replicated.numel()
        log2phy_prob.copy_(sglang_lp.slot_shares(
            {"replicated_slots": phy_replicated, "single_slot": phy_single}, x, t1, log2phy,
            slots))

    mod.prep_lp_inputs, mod.solve_ipm = prep_lp_inputs, solve_ipm
    mod.extract_log2phy_prob = extract_log2phy_prob
    return mod


def _model_class(adapter: SGLang) -> type:
    """A model class whose expert-location config is the adapter's current layout."""
    Config = adapter.location.ModelConfigForExpertLocation

    class Model:
        @staticmethod
        def get_model_config_for_expert_location(layout: Layout) -> Any:
            return Config(num_layers=layout.num_layers, num_logical_experts=layout.num_experts,
                          num_groups=layout.num_groups)

    return Model


def _bool_env(name: str, default: str = "false") -> bool:
    """SGLang's `get_bool_env_var`: the variable, read now, as true for "true" or "1"."""
    return os.environ.get(name, default).strip().lower() in ("true", "1")


@contextmanager
def _optional(name: str, label: str) -> Iterator[None]:
    """An inert stand-in for the third-party module `name` while the block imports an engine
    module, when `name` is not installed (`standins`: using it says so)."""
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        yield
        return
    sys.modules[name] = stand_in(ModuleType(name), f"{name} is not installed", label)
    try:
        yield
    finally:
        sys.modules.pop(name, None)


@contextmanager
def _default_generator(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """Torch's default generator on `device` holds `generator`'s state during the block, and
    `generator` takes the state it ends in; the default's own state is put back after."""
    if generator is None:
        yield
        return
    cuda = device.type == "cuda"
    get = torch.cuda.get_rng_state if cuda else torch.get_rng_state
    put = torch.cuda.set_rng_state if cuda else torch.set_rng_state
    saved = get()
    put(generator.get_state())
    try:
        yield
        generator.set_state(get())
    finally:
        put(saved)
