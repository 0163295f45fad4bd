"""SGLang's own EPLB code, run in the simulator: the adapter for SGLang 0.5.23 (DESIGN.md §11).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` EP ranks, `T` tokens,
`K` top-k.

The engine's modules (`sglang/srt/eplb/...`, read from an engine source, never imported through
`sglang/__init__`) see the runtime they expect through a few stand-ins this adapter supplies:
- `sglang.srt.runtime_context`: `get_exec().moe` (dispatch algorithm, a2a backend, redundant
  experts, EPLB algorithm), `get_parallel()` (EP size, nodes), `get_device()` (the CPU) and
  `get_resources()` (the global expert-location metadata, set per rank before each use);
- `sglang.srt.elastic_ep.elastic_ep`: elastic EP off, every rank healthy;
- `sglang.srt.model_loader`: a model whose expert-location config is the trace's (layers,
  experts, groups).

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

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator, NamedTuple

import torch

from ..errors import InputError
from .source import Modules, interpreted

VERSION = "0.5.23"
PACKAGE = "sglang"
_EPLB = "sglang/srt/eplb/"
FILES = (
    _EPLB + "__init__.py",
    _EPLB + "expert_location.py",
    _EPLB + "expert_location_dispatch.py",
    _EPLB + "eplb_algorithms/__init__.py",
    _EPLB + "eplb_algorithms/deepseek.py",
    _EPLB + "eplb_algorithms/deepseek_vec.py",
    _EPLB + "eplb_algorithms/elasticity_aware.py",
    _EPLB + "lplb_solver.py",
    "sglang/test/kernels/lplb.py",
    "sglang/srt/layers/moe/waterfill.py",
    "sglang/kernels/ops/moe/deepep_waterfill_kernels.py",
)
SOLVER_NAMES = ("deepseek", "deepseek_vec", "elasticity_aware")
EXPOSES = {
    "ExpertLocationMetadata.init_by_mapping": "per-rank candidate lists at start-up",
    "ExpertLocationMetadata._init_raw": "the lists init_by_eplb publishes after a rebalance",
    "ExpertLocationDispatchInfo.init_new": "a layer's dispatch info",
    "topk_ids_logical_to_physical": "dispatch: static, dynamic, fake",
    "LPLBSolver": "lp: its LP per layer and batch, the barrier method by its torch reference "
                  "(sglang/test/kernels/lplb.py), the two CUDA kernels around it by eplbsim's "
                  "CPU stand-ins (eplbsim.dispatch.sglang_lp), the draw by "
                  "dispatch_probability_torch_reference",
    "eplb_algorithms.rebalance_experts": "solvers: " + ", ".join(SOLVER_NAMES),
    "WaterfillBalancer.expand_topk": "Waterfill's shared-expert placement, static and dynamic, "
                                     "its Triton kernels under the interpreter",
}
A2A_BACKEND = "deepep"  # any backend but "none" turns on per-rank narrowing and randint


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
    """SGLang 0.5.23's EPLB functions from the engine source `root` (the folder holding
    `sglang/`), labelled `label` (what rows say ran)."""

    engine = PACKAGE
    version = VERSION

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = Path(root), label
        self._settings = SimpleNamespace(
            moe=SimpleNamespace(ep_dispatch_algorithm="dynamic", moe_a2a_backend="none",
                                ep_join_mode=None, ep_num_redundant_experts=0,
                                eplb_algorithm="deepseek", init_expert_location="trivial"),
            parallel=SimpleNamespace(ep_size=1, nnodes=1, tp_size=1, elastic_ep_initial_size=None,
                                     ep_join_rank_offset=0, moe_ep_group=None),
            device=SimpleNamespace(device="cpu"),
            resources=SimpleNamespace(expert_location_metadata=None, lplb_solvers={}),
            model=None, waterfill_dynamic=False, all_reduced=None)
        self._waterfill: ModuleType | None = None
        self.modules = Modules(self.root, PACKAGE, self._stubs())
        self.location = self._need("sglang.srt.eplb.expert_location",
                                   ("ExpertLocationMetadata", "ModelConfigForExpertLocation"))
        self.dispatch_module = self._need("sglang.srt.eplb.expert_location_dispatch",
                                          ("ExpertLocationDispatchInfo",
                                           "topk_ids_logical_to_physical"))
        self.algorithms = self._need("sglang.srt.eplb.eplb_algorithms",
                                     ("rebalance_experts", "EplbAlgorithm"))
        self.lplb = self._need("sglang.srt.eplb.lplb_solver", ("LPLBSolver",))
        self.references = self._need("sglang.test.kernels.lplb",
                                     ("solve_ipm_torch_reference",
                                      "dispatch_probability_torch_reference"))
        for name in ("init_by_mapping", "init_by_eplb", "_init_raw"):
            if not hasattr(self.location.ExpertLocationMetadata, name):
                raise InputError(f"{self.label}: ExpertLocationMetadata has no {name} "
                                 f"(the adapter is for SGLang {VERSION})")

    def _need(self, module: str, names: tuple[str, ...]) -> ModuleType:
        """Load `module`; InputError naming what it lacks (another version's source)."""
        try:
            mod = self.modules.load(module)
        except InputError:
            raise
        except Exception as exc:  # an engine module that does not load here: say which
            raise InputError(f"{self.label}: {module} does not load "
                             f"({type(exc).__name__}: {exc}); the adapter is for SGLang "
                             f"{VERSION}") from None
        lacking = [n for n in names if not hasattr(mod, n)]
        if lacking:
            raise InputError(f"{self.label}: {module} has no {', '.join(lacking)} (the adapter "
                             f"is for SGLang {VERSION})")
        return mod

    def _stubs(self) -> dict[str, ModuleType]:
        """The stand-ins for the engine modules the EPLB files import (module docstring)."""
        s = self._settings
        runtime = ModuleType("sglang.srt.runtime_context")
        runtime.get_exec = lambda: s
        runtime.get_parallel = lambda: s.parallel
        runtime.get_device = lambda: s.device
        runtime.get_resources = lambda: s.resources
        elastic = ModuleType("sglang.srt.elastic_ep.elastic_ep")
        elastic.elastic_expanded_world_enabled = lambda: False

        class ElasticEPStateManager:
            """Every rank healthy, no elastic state."""

            @staticmethod
            def instance() -> None:
                return None

            @staticmethod
            def healthy_rank_state() -> torch.Tensor:
                return torch.ones(s.parallel.ep_size, dtype=torch.int32)

        elastic.ElasticEPStateManager = ElasticEPStateManager
        loader = ModuleType("sglang.srt.model_loader")
        loader.get_model_architecture = lambda model_config: (_model_class(self), "eplbsim")
        warm = ModuleType("sglang.kernels.ops.lplb.torch_solver")
        warm.warmup = lambda *args, **kwargs: None  # it JIT-compiles CUDA code
        environ = ModuleType("sglang.srt.environ")
        environ.envs = SimpleNamespace(SGLANG_DISABLE_STATIC_WATERFILL=SimpleNamespace(
            get=lambda: s.waterfill_dynamic))
        topk = ModuleType("sglang.srt.layers.moe.topk")
        topk.StandardTopKOutput = NamedTuple("StandardTopKOutput", [
            ("topk_weights", torch.Tensor), ("topk_ids", torch.Tensor), ("router_logits", Any)])
        comm = ModuleType("sglang.srt.distributed.communication_op")
        comm.moe_expert_parallel_all_reduce = lambda buf: s.all_reduced.clone()
        return {m.__name__: m for m in (runtime, elastic, loader, warm, _lp_kernels(self),
                                        environ, topk, comm)}

    @contextmanager
    def _configured(self, layout: Layout) -> Iterator[None]:
        """The engine's settings for `layout`, and its modules active."""
        s = self._settings
        s.moe.ep_dispatch_algorithm = layout.algorithm
        s.moe.moe_a2a_backend = A2A_BACKEND if layout.a2a else "none"
        s.moe.ep_num_redundant_experts = layout.num_slots - layout.num_experts
        s.parallel.ep_size, s.parallel.nnodes = layout.num_gpus, layout.num_nodes
        s.parallel.tp_size = layout.num_gpus
        s.model = layout
        with self.modules.active():
            yield

    def _model_config(self, layout: Layout) -> SimpleNamespace:
        return SimpleNamespace(hf_config=layout)

    def startup(self, layout: Layout, phy2log: torch.Tensor, rank: int) -> Any:
        """Rank `rank`'s `ExpertLocationMetadata` at start-up (`init_by_mapping`)."""
        with self._configured(layout):
            return self.location.ExpertLocationMetadata.init_by_mapping(
                self._model_config(layout), phy2log.clone(), moe_ep_rank=rank)

    def rebalanced(self, layout: Layout, phy2log: torch.Tensor, log2phy: torch.Tensor,
                   rank: int) -> Any:
        """Rank `rank`'s metadata after a live rebalance to a solver's `(phy2log [L, P],
        log2phy [L, E, R])`: what `init_by_eplb` builds from its solver's output."""
        with self._configured(layout), _distributed_rank(rank):
            return self.location.ExpertLocationMetadata._init_raw(
                ep_size=layout.num_gpus, physical_to_logical_map=phy2log.clone(),
                logical_to_all_physical_map=log2phy.clone())

    def by_eplb(self, layout: Layout, logical_count: torch.Tensor, solver: str,
                rank: int) -> Any:
        """Rank `rank`'s metadata from `init_by_eplb(logical_count [W, L, E] or [L, E])` with
        the engine's solver `solver` (its `--eplb-algorithm`)."""
        self._check_solver(solver)
        self._settings.moe.eplb_algorithm = solver
        with self._configured(layout), _distributed_rank(rank):
            return self.location.ExpertLocationMetadata.init_by_eplb(
                self._model_config(layout), logical_count.clone())

    def infos(self, layout: Layout, metadata: Any) -> list[Any]:
        """Every layer's `ExpertLocationDispatchInfo` for `metadata` published as the global
        metadata (`init_new`)."""
        with self._configured(layout):
            self._settings.resources.expert_location_metadata = metadata
            try:
                Info = self.dispatch_module.ExpertLocationDispatchInfo
                return [Info.init_new(layer) for layer in range(layout.num_layers)]
            finally:
                self._settings.resources.expert_location_metadata = None

    def dispatch(self, topk_ids: torch.Tensor, info: Any,
                 generator: torch.Generator | None) -> torch.Tensor:
        """`topk_ids_logical_to_physical(topk_ids [T, K], info)` with `generator` as torch's
        default generator during the call; padding (-1) goes in as expert 0 and comes back
        as -1. -> int64 `[T, K]`."""
        valid = topk_ids >= 0
        ids = topk_ids.clamp(min=0).to(torch.int32)
        with self.modules.active(), _default_generator(generator, ids.device):
            phys = self.dispatch_module.topk_ids_logical_to_physical(ids, info)
        return torch.where(valid, phys.long(), -1)

    def lp_dispatch(self, topk_ids: torch.Tensor, metadata: Any, info: Any, layer: int,
                    generator: torch.Generator | None) -> torch.Tensor:
        """SGLang's LP dispatch of one layer (`ep_dispatch_algorithm="lp"`): the engine's
        `LPLBSolver` for the layer of `metadata`, its `solve` on the batch's valid ids (no
        all-reduce: each simulated rank counts the ids it dispatches), then
        `dispatch_probability_torch_reference` with one float32 `torch.rand` a pair from
        `generator`, as the CUDA path draws when given none. -> int64 `[T, K]`, -1 at padding."""
        valid = topk_ids >= 0
        with self.modules.active(), _default_generator(generator, torch.device("cpu")):
            solver = self.lplb.LPLBSolver(
                phy2log=metadata.physical_to_logical_map[layer],
                log2phy=metadata.logical_to_all_physical_map[layer],
                num_gpus=metadata.ep_size, ep_group=None,
                logical_to_all_physical_map_num_valid=(
                    metadata.logical_to_all_physical_map_num_valid[layer]))
            prob = solver.solve(topk_ids[valid].to(torch.int32).view(-1, 1))
            ids = topk_ids.clamp(min=0).to(torch.int32)
            u = torch.rand(ids.numel(), dtype=torch.float32)
            phys = self.references.dispatch_probability_torch_reference(
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
        if self._waterfill is None:
            with interpreted():
                self._waterfill = self._need("sglang.srt.layers.moe.waterfill",
                                             ("WaterfillBalancer",))
        s = self._settings
        s.waterfill_dynamic = dynamic
        s.all_reduced = torch.cat([routed, tokens]).to(torch.int64)
        s.parallel.moe_ep_group = SimpleNamespace(world_size=G, rank_in_group=rank)
        ids = gpu.to(torch.int32).contiguous()
        weights = torch.ones(ids.shape, dtype=torch.float32)
        with self.modules.active(), torch._dynamo.config.patch(disable=True):
            balancer = self._waterfill.WaterfillBalancer(
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
        algo = self.algorithms
        hierarchical = num_groups is not None and num_groups % num_nodes == 0
        name = solver + ("_hierarchical" if hierarchical else "")
        layout = Layout(load.shape[0], load.shape[1], num_slots, num_gpus, num_nodes, num_groups)
        with self._configured(layout):
            phy2log, log2phy, _ = algo.rebalance_experts(
                tokens_per_expert=load.unsqueeze(0),
                num_physical_experts=num_slots, num_local_physical_experts=num_slots // num_gpus,
                num_groups=num_groups, num_nodes=num_nodes, algorithm=algo.EplbAlgorithm[name])
        return phy2log.long(), log2phy.long()

    def _check_solver(self, solver: str) -> None:
        if solver not in SOLVER_NAMES or not hasattr(self.algorithms.EplbAlgorithm, solver):
            raise InputError(f"{self.label} has no EPLB algorithm {solver!r}; choose one of "
                             f"{', '.join(SOLVER_NAMES)}")


def _lp_kernels(adapter: SGLang) -> ModuleType:
    """A CPU `sglang.kernels.ops.lplb.cuda_solver`: the barrier solve is the engine's own torch
    reference (a singular system, which it refuses and the kernel's clamped pivots get
    through, is taken as not converged: 0.5 everywhere, the kernel's answer to that); its two
    other kernels, which have none, are eplbsim's stand-ins computing what their CUDA sources
    do (`dispatch.sglang_lp.lp_inputs`, `slot_shares`), written into the engine's buffers as the
    kernels write."""
    from ..dispatch import sglang_lp

    mod = ModuleType("sglang.kernels.ops.lplb.cuda_solver")

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
            x = adapter.references.solve_ipm_torch_reference(A, b, c, num_iters)
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


@contextmanager
def _distributed_rank(rank: int) -> Iterator[None]:
    """`torch.distributed.get_rank()` answers `rank` during the block (the engine's `_init_raw`
    reads it for `static`'s table when no rank is passed)."""
    dist = torch.distributed
    saved = dist.get_rank
    dist.get_rank = lambda group=None: rank
    try:
        yield
    finally:
        dist.get_rank = saved
