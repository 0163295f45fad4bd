"""Conformance: each eplbsim twin of an engine algorithm against the engine function it models
(DESIGN.md §11).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `G` ranks, `T` tokens,
`K` top-k.

Every row runs its engine function and its twin on the same seeded cases: random placements
(every expert at least once, the rest drawn, slots shuffled), on one node (4 GPUs) and on two
(8 GPUs, 4 a node), in both modes where the engine has two behaviours, at start-up
(`init_by_mapping`) and after a live rebalance (`init_by_eplb`'s lists, in its solver's replica
order), with padding rows (-1) in every batch. Deterministic paths must be equal bit for bit;
SGLang's `randint` draws come from torch's CPU generator, the same as the twin's, so they are
compared bit for bit too. Solvers are compared on the placements they return and, where those
differ (ties, float32), on the max GPU load, which is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from ..dispatch.policies import (DispatchContext, hash_policy, random_policy, row_policy,
                                 static_table)
from ..dispatch.sglang_lp import sglang_lp_policy
from ..dispatch.shared import SharedInputs, per_gpu, waterfill_dynamic, waterfill_static
from ..placement import VIEWS, Placement, full_view
from ..placement.topology import Topology
from ..solvers import solve
from . import (ENGINES, ENGINE_SOLVERS, adapter, engine_policy, label, release_of, sglang_infos,
               version_key)
from .sglang import LIST_VIEWS

LAYOUTS = ((4, 4), (8, 4))  # (GPUs, GPUs a node): one node, two nodes
CASES = 6  # random placements per layout


@dataclass
class Row:
    """One conformance row: the `twin` against the engine's `function`, on `path` (start-up,
    rebalance or a solve), over `cases` comparisons of which `equal` were bit for bit equal;
    `note` says what differed and by how much."""

    engine: str
    function: str
    twin: str
    path: str
    cases: int
    equal: int
    note: str = ""
    absent: bool = False  # the source has no such function (`note` says which is missing)

    @property
    def conforms(self) -> bool:
        """Equal in every case, or absent from the source (nothing to hold the twin to)."""
        return self.absent or (self.cases > 0 and self.equal == self.cases)

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "function": self.function, "twin": self.twin,
                "path": self.path, "cases": self.cases, "equal": self.equal,
                "conforms": self.conforms, "absent": self.absent, "note": self.note}


def _placements(seed: int, cases: int = CASES) -> Iterator[Placement]:
    """`cases` random placements per layout: `E = 8` experts, 1 to 2 spare slots a GPU."""
    gen = torch.Generator().manual_seed(seed)
    for G, per_node in LAYOUTS:
        topo = Topology(G, per_node)
        for _ in range(cases):
            E, L = 8, 2
            P = E + G * int(torch.randint(1, 3, (1,), generator=gen))
            rows = [torch.cat([torch.randperm(E, generator=gen),
                               torch.randint(0, E, (P - E,), generator=gen)])
                    [torch.randperm(P, generator=gen)] for _ in range(L)]
            yield Placement(torch.stack(rows), E, topo)


def _batch(placement: Placement, gen: torch.Generator, tokens: int = 24, k: int = 3
           ) -> torch.Tensor:
    """A batch of ids `[T, K]` for the placement's experts with padding rows (-1) and one
    padded slot."""
    ids = torch.randint(0, placement.num_experts, (tokens, k), generator=gen)
    ids[::7] = -1
    ids[1, 0] = -1
    return ids


def _ordered(placement: Placement, order: torch.Tensor) -> Placement:
    """`placement` published by a live rebalance, its lists in the solver's order `[L, E, R]`."""
    return Placement(placement.phy2log, placement.num_experts, placement.topology, order)


def _rebalanced(run: Any, placement: Placement, seed: int) -> Placement:
    """The placement SGLang's `init_by_eplb` publishes for seeded loads, with its order."""
    topo = placement.topology
    gen = torch.Generator().manual_seed(seed)
    load = torch.randint(1, 1000, (placement.num_layers, placement.num_experts), generator=gen)
    phy2log, order = run.solve("deepseek", load.double(), placement.num_slots, topo.num_gpus,
                               topo.num_nodes, None)
    return _ordered(Placement(phy2log, placement.num_experts, topo), order)


def _sglang_rows(sources: Any, seed: int, cases: int) -> list[Row]:
    run = adapter("sglang", sources)
    who = label("sglang", sources)
    tally: dict[tuple[str, str, str], list[int]] = {}
    dispatches = (("dynamic", "sglang:dynamic"), ("fake", "sglang:fake"), ("lp", "sglang:lp"))
    present = [(a, e) for a, e in dispatches if run.missing(a) is None]
    seen = list_view(sources)
    absent = [Row(who, f"{a} dispatch", {"lp": f"sglang-lp (view {seen})",
                                         "fake": f"own top-k, then row or random (view {seen})"}
                  .get(a, f"row or random (view {seen})"), "-", 0, 0, run.missing(a), True)
              for a, _ in dispatches if run.missing(a) is not None]

    def count(function: str, twin: str, path: str, same: bool) -> None:
        cell = tally.setdefault((function, twin, path), [0, 0])
        cell[0] += 1
        cell[1] += bool(same)

    gen = torch.Generator().manual_seed(seed)
    for i, start in enumerate(_placements(seed, cases)):
        rebalanced = _rebalanced(run, start, seed + i)
        for path, placement in (("start-up", start), ("rebalance", rebalanced)):
            G = placement.topology.num_gpus
            for mode in ("none", "a2a"):
                a2a = mode == "a2a"
                ids = _batch(placement, gen)
                for r in range(G):
                    view = VIEWS[seen](placement, r, mode)
                    infos = sglang_infos(run, placement, "static", a2a, r)
                    lists = torch.stack([x.partial_logical_to_all_physical_map for x in infos])
                    R = view.log2phy.shape[-1]
                    count("ExpertLocationMetadata lists", f"view {seen}", f"{path}, {mode}",
                          torch.equal(lists[..., :R], view.log2phy)
                          and bool((lists[..., R:] == -1).all()))
                    table = torch.stack([x.partial_logical_to_rank_dispatch_physical_map
                                         for x in infos])
                    count("static tables", f"static (view {seen})", f"{path}, {mode}",
                          torch.equal(table, static_table(view, r, 0)))
                    twin = random_policy if a2a else row_policy
                    name = f"{'random' if a2a else 'row'} (view {seen})"
                    twins = {"dynamic": (twin, name), "lp": (sglang_lp_policy,
                                                             f"sglang-lp (view {seen})"),
                             "fake": (_fake_twin(twin), f"own top-k, then {name}")}
                    for algorithm, engine in present:
                        mine_fn, twin_name = twins[algorithm]
                        for layer in range(placement.num_layers):
                            ctx = DispatchContext(layer=layer, rank=r, mode=mode,
                                                  generator=torch.Generator().manual_seed(seed + r))
                            got = engine_policy(engine, sources)(ids, view, replace(
                                ctx, generator=torch.Generator().manual_seed(seed + r)))
                            count(f"{algorithm} dispatch", twin_name, f"{path}, {mode}",
                                  torch.equal(got, mine_fn(ids, view, ctx)))
    rows = [Row(who, f, t, p, n, e) for (f, t, p), (n, e) in tally.items()] + absent
    return rows + _waterfill_rows(run, who, seed) + _solver_rows("sglang", sources, seed, cases)


def list_view(sources: Any) -> str:
    """The view eplbsim names for the candidate lists of SGLang source `sources`: that of the
    newest release in `sglang.LIST_VIEWS` at or before the source's, `sglang` (the pinned
    release's) for a checkout."""
    path = dict(sources).get("sglang")
    version = release_of("sglang", path) if path else None
    if version is None:
        return "sglang"
    known = [v for v in LIST_VIEWS if version_key(v) <= version_key(version)]
    return LIST_VIEWS[max(known, key=version_key)] if known else "sglang"


def _fake_twin(twin: Any) -> Any:
    """SGLang's `fake` dispatch as eplbsim would write it: router logits `uniform(5, 10)` from
    the rank's generator, the rank's own top-k of them, then `twin` on those ids."""
    def fake(topk_ids: torch.Tensor, view: Any, ctx: DispatchContext) -> torch.Tensor:
        logits = torch.empty(topk_ids.shape[0], view.placement.num_experts)
        logits.uniform_(5, 10, generator=ctx.generator)
        own = logits.topk(topk_ids.shape[1], dim=-1).indices
        return twin(torch.where(topk_ids >= 0, own, -1), view, ctx)
    return fake


def _waterfill_rows(run: Any, who: str, seed: int) -> list[Row]:
    """SGLang's `WaterfillBalancer` (its Triton kernels interpreted) against the `waterfill`
    and `waterfill-dynamic` shared rules, on every rank of seeded batches: random GPUs for the
    pairs, padding rows, 80 tokens a rank (the fused kernel) and 32 (below its 64-token
    threshold: the shared work stays home)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for dynamic, rule, name in ((False, waterfill_static, "waterfill"),
                                (True, waterfill_dynamic, "waterfill-dynamic")):
        if run.missing(name) is not None:
            rows.append(Row(who, "WaterfillBalancer", f"{name} shared rule", "-", 0, 0,
                            run.missing(name), True))
            continue
        cases = equal = 0
        for (G, _), T in ((layout, T) for layout in LAYOUTS for T in (80, 32)):
            L, K = 2, 3
            gpus = [torch.randint(0, G, (T, L, K), generator=gen) for _ in range(G)]
            for g in gpus:
                g[::9] = -1
            local = [per_gpu(g, G) for g in gpus]
            routed, tokens = sum(local), torch.full((G,), T)
            for r in range(G):
                mine = rule(SharedInputs(gpus[r], local[r], routed, tokens),
                            DispatchContext(rank=r, mode="a2a"))
                for layer in range(L):
                    got = run.waterfill(gpus[r][:, layer], r, layer, dynamic, routed[layer],
                                        tokens)
                    cases += 1
                    equal += torch.equal(got, mine[:, layer])
        mode = "SGLANG_DISABLE_STATIC_WATERFILL=1" if dynamic else "static"
        rows.append(Row(who, f"WaterfillBalancer ({mode}, interpreted)", f"{name} shared rule",
                        "a2a, 80 and 32 tokens a rank", cases, equal))
    return rows


def _vllm_rows(sources: Any, seed: int, cases: int) -> list[Row]:
    run = adapter("vllm", sources)
    who = label("vllm", sources)
    maps = [0, 0]
    kernel = [0, 0]
    gen = torch.Generator().manual_seed(seed)
    for placement in _placements(seed, cases):
        log2phy, counts = run.logical_maps(placement.phy2log, placement.num_experts)
        view = full_view(placement)
        R = view.log2phy.shape[-1]
        maps[0] += 1
        maps[1] += torch.equal(log2phy[..., :R], view.log2phy) and torch.equal(counts, view.logcnt)
        for layer in range(placement.num_layers):
            ids = _batch(placement, gen)
            phys, load = run.dispatch(ids, log2phy[layer], counts[layer])
            twin = hash_policy(ids, view, DispatchContext(layer=layer))
            mine = torch.bincount(twin[twin >= 0], minlength=load.numel())
            kernel[0] += 1
            kernel[1] += torch.equal(phys, twin) and torch.equal(load, mine)
    return [Row(who, "compute_logical_maps", "view full", "start-up", *maps),
            Row(who, "eplb_map_to_physical_and_record (interpreted)", "hash",
                "start-up and rebalance", *kernel, "recorded load compared too"),
            *_solver_rows("vllm", sources, seed, cases)]


SOLVER_TWINS = {"flashlb": "flashlb"}  # an engine solver -> eplbsim's twin (else `deepseek`)


def _solver_rows(engine: str, sources: Any, seed: int, cases: int) -> list[Row]:
    """`engine`'s solvers the source has, each against its twin (`SOLVER_TWINS`, else
    eplbsim's `deepseek`): on tie-free loads the placements must be equal; on loads with ties
    (the engines sort float32 loads with torch, unstably, where numpy's stable sort breaks ties
    by index) the max GPU load must be, and the note says how many placements differed.
    `deepseek_vec` is another algorithm: no twin."""
    gen = torch.Generator().manual_seed(seed)
    run = adapter(engine, sources)
    rows = []
    for name, (owner, algorithm, _) in ENGINE_SOLVERS.items():
        if owner != engine or algorithm == "deepseek_vec" or run.missing(algorithm):
            continue
        twin = SOLVER_TWINS.get(algorithm, "deepseek")
        free, tied, ordered = [0, 0], [0, 0, 0], 0
        for G, per_node in LAYOUTS:
            topo = Topology(G, per_node)
            for case in range(cases):
                E, L = 16, 2
                P = E + G
                load = torch.randperm(10_000, generator=gen)[:L * E].view(L, E).double() + 1
                ties = torch.randint(1, 3, (L, E), generator=gen).double()
                for cell, weights in ((free, load), (tied, ties)):
                    mine = solve(twin, weights, P, topo)
                    theirs = (run.solve(weights, P, G, topo.num_nodes, 1, algorithm)
                              if engine == "vllm"
                              else run.solve(algorithm, weights, P, G, topo.num_nodes, 1)[0])
                    same = torch.equal(theirs, mine.phy2log)
                    if cell is free and engine == "sglang":
                        order = run.solve(algorithm, weights, P, G, topo.num_nodes, 1)[1]
                        R = mine.order.shape[-1]
                        ordered += torch.equal(order[..., :R], mine.order)
                    cell[0] += 1
                    cell[1] += same if cell is free else _max_gpu(
                        weights, Placement(theirs, E, topo)) == _max_gpu(weights, mine)
                    if cell is tied:
                        cell[2] += same
        who = label(engine, sources)
        note = (f"replica order equal in {ordered}/{free[0]} (the engine sorts equal-load "
                f"replicas with torch's unstable sort)" if engine == "sglang" else "")
        rows.append(Row(who, f"{name} solver", f"solver {twin}", "solve, tie-free loads",
                        *free, note))
        rows.append(Row(who, f"{name} solver", f"solver {twin}",
                        "solve, loads with ties (max GPU load)", *tied[:2],
                        f"{tied[2]}/{tied[0]} placements equal; " + _float32_case(
                            run, engine, algorithm, twin)))
    return rows


def _float32_case(run: Any, engine: str, algorithm: str, twin: str) -> str:
    """The engine's float32 loads against the twin's (`twin`) float64 ones where it shows:
    loads `[2^24 + 1, 2^24, 1, 1]` on 2 GPUs of 3 slots, the max GPU load of each side."""
    topo = Topology(2)
    load = torch.tensor([[2.0 ** 24 + 1, 2.0 ** 24, 1.0, 1.0]], dtype=torch.float64)
    theirs = (run.solve(load, 6, 2, 1, 1, algorithm) if engine == "vllm"
              else run.solve(algorithm, load, 6, 2, 1, 1)[0])
    engine_max = _max_gpu(load, Placement(theirs, 4, topo))
    twin_max = _max_gpu(load, solve(twin, load, 6, topo))
    return (f"loads [2^24+1, 2^24, 1, 1] (float32 in the engine): max GPU load {engine_max:.1f} "
            f"vs {twin_max:.1f}")


def _max_gpu(load: torch.Tensor, placement: Placement) -> float:
    """Max over layers of the max GPU load of `placement`'s even-split promise."""
    slot = placement.expected_load(load)  # [L, P]
    G = placement.topology.num_gpus
    return float(slot.view(slot.shape[0], G, -1).sum(-1).max())


_ENGINE_ROWS: dict[str, Callable[[Any, int, int], list[Row]]] = {
    "sglang": _sglang_rows,
    "vllm": _vllm_rows,
}


def conformance(engines: Any = None, sources: Any = (), seed: int = 0,
                cases: int = CASES) -> list[Row]:
    """The conformance rows of `engines` (default all in `ENGINES`) on their sources, over
    `cases` random placements (and solver loads) per layout."""
    chosen = list(ENGINES) if not engines else list(engines)
    rows: list[Row] = []
    for engine in chosen:
        rows += _ENGINE_ROWS[engine](sources, seed, cases)
    return rows


__all__ = ["Row", "conformance"]
