"""Dispatch policies with their properties, in the `POLICIES` registry.

Holds the policies (`policies`), their kernels (`kernels/`), the counter-based random
streams, the shared experts' rules and the batch LP. Takes in `topk_ids [T, K]`, a rank's view
and its context; gives out `phys [T, K]`. Imports `base` and `placement`.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` logical experts, `R` max candidates.

A registry entry is a :class:`DispatchPolicy`: the reference function (`policies.py`, the
semantics and the oracle), whether its choice is rank-invariant in "none" mode, the fast step
kernels to run it with per device (`kernels/`), where it comes from, the modes it runs in, and
for a policy that places the shared experts' work (Waterfill) its rule (`shared.py`). A new
policy is one function and one line in `POLICIES`; every entry point also takes a bare callable
with the policy signature (an unregistered prototype: rank-variant as far as the simulator
knows, no kernel) or a `DispatchPolicy` of one's own.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..base.errors import InputError
from ..base.registry import FILE_FORM, lookup, name_of
from ..placement import View
from .policies import (DispatchContext, Policy, ascend_fixed_policy, ascend_policy,
                       ascend_replicas, candidate_counts, colocate_policy, flat_policy,
                       hash_policy, lp_golden_policy, lp_policy, lplb_atomic_policy,
                       lplb_policy, occurrence_index,
                       ordinal_policy, quota_policy, random_policy, replica_slots, row_policy,
                       static_policy, static_table, trtllm_policy, unmapped_policy,
                       unmapped_table)
from .metro import metro_policy
from .sglang_lp import sglang_lp_policy
from .spill import LLEP, MOONEP, SPILL_RULES, SpillRule
from .shared import WATERFILL, SharedInputs, SharedRule, waterfill_dynamic, waterfill_static

StepKernel = Callable  # (topk_ids [T, L, K], view, ctx) -> phys int64 [T, L, K]
USER = "a callable given by the user"


@dataclass(frozen=True, eq=False, kw_only=True)
class DispatchPolicy:
    """A policy and the properties the simulator relies on.

    fn:             the reference `(topk_ids [T, K], view, ctx) -> phys [T, K]`
    rank_invariant: in "none" mode the choice reads nothing of the rank but its view (the ids,
                    the view, step and layer): ranks with equal views choose alike, so they may
                    share one computation. False when it reads `ctx.rank` or the rank's
                    generator, and for anything not known to be invariant.
    kernels:        device type ("cpu", "cuda") -> step kernels to try in order, each a name
                    `module.function` under `eplbsim.dispatch.kernels` (imported on first use;
                    one that cannot import, e.g. without triton, is skipped) or a callable
                    `(topk_ids [T, L, K], view, ctx) -> phys [T, L, K]` bit-identical to
                    stacking `fn` over the layers. Without one, `fn` runs layer by layer.
    source:         where the policy comes from
    summary:        what it does, in one line
    table:          for a policy whose choice reads nothing of a pair but its (layer, expert):
                    `(view, ctx) -> int64 [L, E]` the slot each expert's pairs go to, so that
                    `fn(ids, view, ctx)[t, k] == table(view, ctx)[ctx.layer, ids[t, k]]` at
                    every step; the replay then counts from expert counts alone. None otherwise.
    offset_by_rank: with `ctx.rank_offset` True the choice adds the rank in every mode
                    (TensorRT-LLM's `offset_by_ep_rank`), so it is then rank-variant in "none"
    shared:         where each token's shared-expert work runs in "a2a" (`shared.SharedRule`);
                    None: on the token's own rank
    modes:          the modes the policy runs in
    streamed:       the choice is candidate `draw % n_e` of the rank's view, the draw its
                    stream's (`dispatch.streams`, as `random`): "none" is then counted from the
                    draws that decide something (`kernels.cpu.StreamedViews`)
    reroutes:       the policy routes each token anew, as SGLang's `fake` dispatch draws its
                    router logits: a slot it returns may hold another expert than the pair's
                    (only its range is checked). Agreement still compares the slots; the
                    output error counts each of the pair's executions, valued as the pair's.
    spill:          a token-spill rule (`spill.SpillRule`): after the policy's choice, the step's
                    surplus pairs run at other GPUs, with the expert's weights fetched where
                    the GPU holds none (DESIGN.md §15); None: every pair runs where chosen
    window_kernels: for a rank-invariant policy whose choice reads nothing of the step but
                    each token's row within it (`row`): device type -> kernels, as `kernels`,
                    `(topk_ids [N, L, K], view, rows [N]) -> phys [N, L, K]` for several steps'
                    tokens concatenated, `rows` each token's row within its own step, bit for bit
                    what stacking the steps' calls gives: a replay kept on a device dispatches
                    a window of steps in one call (`ranks.window`). Empty: step by step.
    observed:       for a policy not declared rank-invariant (an engine's code):
                    `(view, ctx) -> inputs`, what a rank's call reads beyond the ids, the layer
                    and a generator; in "none", ranks of equal inputs share one call when a
                    probe observes the call to draw nothing (`dispatch.observe`). None: one
                    call a rank
    """

    fn: Policy = field(kw_only=False)
    rank_invariant: bool = False
    kernels: Mapping[str, tuple[str | StepKernel, ...]] = field(default_factory=dict)
    source: str = USER
    summary: str = ""
    table: Callable[[View, DispatchContext], torch.Tensor] | None = None
    offset_by_rank: bool = False
    shared: SharedRule | None = None
    modes: tuple[str, ...] = ("none", "a2a")
    streamed: bool = False
    reroutes: bool = False
    observed: Callable[[View, DispatchContext], Any] | None = None
    spill: SpillRule | None = None
    window_kernels: Mapping[str, tuple[str | Callable[..., torch.Tensor], ...]] = field(
        default_factory=dict)

    @property
    def places_shared(self) -> bool:
        """Whether the policy places the shared experts' work (it has a `shared` rule)."""
        return self.shared is not None

    def invariant(self, rank_offset: bool | None = None) -> bool:
        """Whether ranks with equal views choose alike in "none" mode under `rank_offset`."""
        return self.rank_invariant and not (rank_offset is True and self.offset_by_rank)

    def invariance(self) -> str:
        """The rank-invariance class in "none" mode, in words."""
        if "none" not in self.modes:
            return "a2a only"
        if not self.rank_invariant:
            return "variant"
        return "invariant unless --rank-offset" if self.offset_by_rank else "invariant"

    def __call__(self, topk_ids: torch.Tensor, view: View, ctx: DispatchContext) -> torch.Tensor:
        """The reference policy on one layer: `(topk_ids [T, K], view, ctx) -> phys [T, K]`."""
        return self.fn(topk_ids, view, ctx)


_ROW = {"cpu": ("cpu.row_step",), "cuda": ("cuda.row_step", "torch_step.row_step")}
_ORDINAL = {"cpu": ("cpu.ordinal_step",), "cuda": ("cuda.ordinal_step",)}
_TABLE = {"cpu": ("cpu.static_step",), "cuda": ("torch_step.static_step",)}
SGLANG_LP = ("SGLang 0.5.23's LP dispatch (python/sglang/srt/eplb/lplb_solver.py LPLBSolver, "
             "its torch references in sglang/test/kernels/lplb.py)")
TRTLLM_ROUTE = ("TensorRT-LLM's MoE route kernel (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/"
                "moeLoadBalance/moeLoadBalanceKernels.cu moeComputeRouteKernel @ada8389e)")
LPLB = ("DeepSeek LPLB (deepseek-ai/LPLB lplb/resources/csrc-tmpl/minilp.cu kernel_solve and "
        "kernel_map_idx, read in a verbatim copy at shizhengLi/deepseek-lplb-learning ba2936a2)")
ASCEND = ("vllm-ascend's static replica choice (vllm-project/vllm-ascend vllm_ascend/eplb/core/"
          "eplb_utils.py generate_log2phy_map @182b75ea")


def _ascend_table(view: View, ctx: DispatchContext) -> torch.Tensor:
    """`ascend`'s choice as a table: replica `rank % n_e` of every expert, int64 `[L, E]`."""
    return _slots(view, ascend_replicas(view.logcnt, ctx, False))


def _ascend_fixed_table(view: View, ctx: DispatchContext) -> torch.Tensor:
    """`ascend-fixed`'s choice as a table, int64 `[L, E]`."""
    return _slots(view, ascend_replicas(view.logcnt, ctx, True))


def _slots(view: View, replica: torch.Tensor) -> torch.Tensor:
    """The slot of replica `replica [L, E]` of every expert, int64 `[L, E]`."""
    return view.log2phy.gather(-1, replica.unsqueeze(-1)).squeeze(-1).long()


def _static_table(view: View, ctx: DispatchContext) -> torch.Tensor:
    """`static`'s choice as a table: the rank's own `static_table`, int64 `[L, E]`."""
    return static_table(view, ctx.rank, ctx.seed)


POLICIES: dict[str, DispatchPolicy] = {
    "static": DispatchPolicy(
        static_policy, kernels=_TABLE, table=_static_table,
        source="SGLang before its fix (per-rank replica tables)",
        summary="each rank's own fixed table expert -> one replica"),
    "random": DispatchPolicy(
        random_policy, streamed=True,
        kernels={"cpu": ("cpu.random_step",), "cuda": ("torch_step.random_step",)},
        source="SGLang before its fix (per-rank randint)",
        summary="a draw in [0, 65536) % n_e from the rank's own stream (Philox, counter-based)"),
    "row": DispatchPolicy(
        row_policy, rank_invariant=True, kernels=_ROW, source="SGLang's fix",
        window_kernels={"cuda": ("cuda.row_rows", "torch_step.row_rows"),
                        "cpu": ("torch_step.row_rows",)},
        summary="the token's row in the batch, row % n_e"),
    "ordinal": DispatchPolicy(
        ordinal_policy, rank_invariant=True, kernels=_ORDINAL,
        source="eplbsim",
        summary="(occurrence index of the expert in the batch + step + layer [+ rank in a2a]) "
        "% n_e"),
    "flat": DispatchPolicy(
        flat_policy, rank_invariant=True, kernels={"cpu": ("cpu.flat_step",)},
        source="vLLM, the earlier generation",
        summary="the flat pair position, (row * K + k) % n_e"),
    "hash": DispatchPolicy(
        hash_policy, rank_invariant=True, kernels={"cpu": ("cpu.hash_step",)}, source="vLLM",
        summary="Knuth's multiplicative hash of the row, % n_e"),
    "lp": DispatchPolicy(
        lp_policy, source="eplbsim (after SGLang's LP dispatch)",
        summary="samples the batch's LP-optimal replica fractions with the rank's generator"),
    "sglang-lp": DispatchPolicy(
        sglang_lp_policy, source=SGLANG_LP,
        summary="the batch's LP shares by SGLang's 5 float32 barrier steps, each pair drawn "
        "(float32) from the rank's own generator"),
    "lp-golden": DispatchPolicy(
        lp_golden_policy, rank_invariant=True,
        source="eplbsim, after a fix proposed for SGLang's LP dispatch (the golden-ratio draw "
        "of its earlier non-fused path)",
        summary="the batch's LP-optimal fractions, pair i drawn as frac(i x 0.618...)"),
    "trtllm": DispatchPolicy(
        trtllm_policy, rank_invariant=True, offset_by_rank=True, source=TRTLLM_ROUTE,
        summary="(earlier pairs of the expert in the 1024-pair block + block index "
        "[+ rank with --rank-offset]) % n_e"),
    "ascend": DispatchPolicy(
        ascend_policy, table=_ascend_table, source=ASCEND + ", its rule without attention TP)",
        summary="every pair of an expert to replica ep_rank % n_e"),
    "ascend-fixed": DispatchPolicy(
        ascend_fixed_policy, table=_ascend_fixed_table,
        source=ASCEND + ", its rule with attention TP, --tp > 1)",
        summary="every pair of expert e to replica (tp_rank + dp_rank + e) % n_e; ep_rank % n_e "
        "at TP 1"),
    "lplb": DispatchPolicy(
        lplb_policy, rank_invariant=True, source=LPLB + ", the deterministic variant",
        summary="the batch's LP fractions; the k-th pair of an expert to the replica holding "
        "(499k + 41) mod n in its share"),
    "lplb-atomic": DispatchPolicy(
        lplb_atomic_policy, source=LPLB + ", as its kernel counts (atomic, per block)",
        summary="lplb with each block's occurrence order drawn from the rank's generator"),
    "waterfill": DispatchPolicy(
        row_policy, rank_invariant=True, kernels=_ROW, shared=waterfill_static, modes=("a2a",),
        source=WATERFILL + ", its static mode",
        summary="row % n_e; each token's shared expert to a rank drawn by its room below the "
        "fill level of the sending rank's own counts"),
    "waterfill-dynamic": DispatchPolicy(
        row_policy, rank_invariant=True, kernels=_ROW, shared=waterfill_dynamic, modes=("a2a",),
        source=WATERFILL + ", its dynamic mode (SGLANG_DISABLE_STATIC_WATERFILL=1)",
        summary="waterfill with the fill level of every rank's counts and tokens (one "
        "all-reduce)"),
    "quota": DispatchPolicy(
        quota_policy, rank_invariant=True, source="eplbsim",
        summary="the batch's LP-optimal integer quotas, filled in occurrence order"),
    "colocate": DispatchPolicy(
        colocate_policy, rank_invariant=True, source="eplbsim (DESIGN.md §13)",
        summary="the first candidate on a GPU the token already sends an earlier pair to, else "
        "ordinal's"),
    "metro": DispatchPolicy(
        metro_policy, rank_invariant=True,
        source="METRO (arXiv 2512.09277), its routing as the paper describes it (no code read); "
        "in a2a each rank routes its own tokens, where METRO all-gathers the global top-k",
        summary="each expert's pairs to one candidate: the GPU that has activated the fewest "
        "experts (memory-bound decode)"),
    "spill": DispatchPolicy(
        ordinal_policy, rank_invariant=True, kernels=_ORDINAL, spill=SPILL_RULES["spill"],
        source=MOONEP + "; in a2a the ranks all-gather their counts first",
        summary="ordinal's choice, then each GPU over capacity (exact balance, --spill-slack "
        "more) spills its hottest experts' surplus to GPUs with room, which fetch the weights"),
    "spill-local": DispatchPolicy(
        ordinal_policy, kernels=_ORDINAL, spill=SPILL_RULES["spill-local"],
        source="eplbsim: spill ported naively, each rank planning from its own tokens' counts "
        "(in none its share of the batch times G; in a2a its own pairs, no all-gather)",
        summary="spill planned from each rank's own counts: ranks disagree in none"),
    "llep": DispatchPolicy(
        ordinal_policy, rank_invariant=True, kernels=_ORDINAL, spill=SPILL_RULES["llep"],
        source=LLEP + "; in a2a the ranks all-gather their counts first",
        summary="ordinal's choice, then the hottest slots over 1.1 x the mean spill chunks of "
        ">= 1024 pairs (or the rest) to the least-loaded GPUs, which fetch the weights"),
}


def is_file_policy(name: Any) -> bool:
    """Whether `name` names a function in a Python file, `path/to/file.py:function`."""
    return isinstance(name, str) and ".py:" in name


def file_policy(name: str, kind: str = "policy") -> Policy:
    """The function `path/to/file.py:function` names (the file run as a module of its own,
    read again when it changes): a policy, or whatever `kind` of function the caller takes
    (a solver); InputError, naming the `kind`, when the file or the function is missing, the
    file does not run, or the name is not a callable."""
    path, _, function = name.rpartition(":")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise InputError(f"{kind} {name}: no file {path}")
    return _loaded(str(file), file.stat().st_mtime_ns, function, f"{kind} {name}")


@lru_cache(maxsize=32)
def _loaded(file: str, mtime: int, function: str, name: str) -> Policy:
    spec = importlib.util.spec_from_file_location(f"eplbsim_user_policy_{abs(hash(file))}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: say what went wrong in it, in one line
        raise InputError(f"{name}: the file does not run ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise InputError(f"{name}: {file} has no function {function!r}")
    return fn


class FilePolicies(Mapping):
    """The `file.py:function` names of policies (or of another `kind` of function: solvers)
    as a registry a name check reads: it holds every such name (it lists none)."""

    forms = (FILE_FORM,)  # what an error listing the choices says of them (`registry.unknown`)

    def __init__(self, kind: str = "policy") -> None:
        self.kind = kind

    def __getitem__(self, key: str) -> Policy:
        if not is_file_policy(key):
            raise KeyError(key)
        return file_policy(key, self.kind)

    def __contains__(self, key: object) -> bool:
        return is_file_policy(key)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


# Faults to replay, not policies to choose: each breaks the policy contract (a slot holding the
# pair's expert) on purpose, so the registry-wide contracts over `POLICIES` leave them out.
FAULTS: dict[str, DispatchPolicy] = {
    "unmapped": DispatchPolicy(
        unmapped_policy, rank_invariant=True, table=unmapped_table, reroutes=True,
        source="a fault: sglang #18213 / #39580 (a model path that passes no map to top-k)",
        summary="the logical id as the physical slot: right on the trivial placement only"),
}

# `ENGINE:ALGORITHM` -> `(sources, engine_args) -> DispatchPolicy` running that engine's own
# code, filled in by `eplbsim.engines` (which needs this module, not the other way round).
ENGINE_POLICIES: dict[str, Callable[[Any, str], DispatchPolicy]] = {}
RANK_SCOPES: dict[str, Callable[[Callable, str, str], Callable]] = {}  # what runs a file's
# policy as the dispatching rank to every channel its code may read (`engines.identity`,
# which fills it): `(fn, file, name) -> fn`


def resolve_policy(policy: str | Policy | DispatchPolicy, sources: Any = (),
                   engine_args: str = "") -> tuple[str, DispatchPolicy]:
    """The registry entry a policy stands for, and the name it reports.

    policy:      a registry name (`POLICIES`, `FAULTS`), an engine algorithm
                 (`ENGINE:ALGORITHM`: `eplbsim.engines`), `path/file.py:function`, a
                 `DispatchPolicy`, or a bare callable `(topk_ids [T, K], view, ctx) ->
                 phys [T, K]` (wrapped as a rank-variant entry without kernels)
    sources:     the engine source an engine algorithm runs from (default the pinned release)
    engine_args: the engine's server flags, where its code reads them
    Returns `(name, entry)`; InputError for an unknown name.
    """
    if isinstance(policy, DispatchPolicy):
        return name_of(policy, POLICIES), policy
    if isinstance(policy, str) and ":" in policy and policy in ENGINE_POLICIES:
        return policy, ENGINE_POLICIES[policy](sources, engine_args)
    if is_file_policy(policy):
        fn = file_policy(policy)
        for scope in RANK_SCOPES.values():  # the file's code as the rank it runs for
            fn = scope(fn, policy.rpartition(":")[0], policy)
        return policy, DispatchPolicy(fn, source=f"{USER} ({policy})")
    if isinstance(policy, str) and policy in FAULTS:
        return policy, FAULTS[policy]
    entry = lookup(POLICIES, policy, "policy")
    if isinstance(entry, DispatchPolicy):
        return name_of(policy), entry
    if not callable(entry):
        raise InputError(f"a policy is a name, a DispatchPolicy or a callable, got {policy!r}")
    return name_of(policy), DispatchPolicy(entry)


__all__ = ["FAULTS", "POLICIES", "USER", "DispatchContext", "DispatchPolicy", "Policy",
           "SharedInputs", "candidate_counts", "occurrence_index", "replica_slots",
           "resolve_policy"]
