"""The rank model: how `G` EP ranks dispatch one step, and what each GPU then executes.

Holds the one rank step (`MODES`, here) that the replay, the policy checkers (`checks`) and
real ranks all run; `epoch` (the ranks, their streams and groups, the `Epoch` they step in),
`traffic` (shared-expert work, fan-out, link crossings), `fanout`, `counting` (the step's
compiled passes) and `moe` (the toy MoE layer). Takes in a step's ids `[T, L, K]` and an
`Epoch` built from a placement, its views and a policy; gives out a `StepOutcome`. Imports
`base`, `placement`, `dispatch` and `cost` (link crossings).

Dimensions: `T` tokens, `L` layers, `K` top-k, `P` physical slots, `G` GPUs = EP ranks,
`W` processes of a group, `D` hidden size of the toy MoE layer.

`MODES` holds one step function per mode, and every caller runs the same one: the in-process
replay (all `G` ranks in one process, `LOCAL` collectives), the policy checkers, and real
torch.distributed ranks (one rank per process, all-reduce and all-gather passed in as
`Collectives`). A step function takes an `Epoch` (what the steps on one placement share, for
the ranks this process holds), the step index, its ids `[T, L, K]` (any integer dtype, never
written: a table policy counted fast reads them as stored, everything else reads an int32 copy)
and the trace's source rank of each token (`[T]` or None), and returns the `StepOutcome` summed
over every process:

- "none": every rank dispatches all `T` tokens with its own view and context; rank `r` executes
  the pairs whose chosen slot lives on GPU `r`. Pair `(t, k)` is executed
  `c = #{r : gpu(choice_r) == r}` times; the output is right only if `c == 1` everywhere. The
  toy MoE layer's partial outputs are all-reduced, the mechanism that corrupts real outputs.
- "a2a": each token belongs to one source rank, which alone dispatches it (rows counted within
  its share); every non-padding pair is executed once, where it was sent.

With `Epoch.shared` both also count where each token's shared-expert work runs
(`dispatch.shared`): split over every GPU in "none"; in "a2a" on the token's own rank, or where
the policy's shared rule sends it.

Both count in one of two ways with the same results. The straightforward way (the oracle, and
what real ranks and the checkers run) builds every pair's multiplicity as torch tensors. With
`Epoch.fast`, when one CPU process holds every rank and no choices are kept, compiled loops
(`counting`) count instead, only what a configuration needs: one group of identical ranks
executes every pair exactly once (its slot counts are all there is to count); a policy with a
`table` is counted from the step's expert counts alone; a `streamed` policy (`random`) from the
draws of the ranks that hold a replica of each pair's expert; the toy-MoE error is computed
only for a step where some pair is not executed exactly once, in one pass with its exact norm
(`moe.local_error_terms`), else it is exactly 0 and the exact norm is left to the caller
(`UNMEASURED`).

By concern: this module holds the step functions and their fast counts; `epoch` the ranks,
their streams and groups and the `Epoch` they step in; `traffic` what a step counts beside
its slot loads (shared-expert work, fan-out, link crossings, wrong-weight pairs, token owners).
Their public names are importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..base import loops
from ..dispatch.kernels import dispatch_step, flat_index, tally
from ..dispatch.shared import has_pairs
from ..placement.loads import multiplicity_counts
from . import counting
from .epoch import (LOCAL, RNG_RELATIONS, Collectives, Epoch, Rank, Table, make_ranks, rank_context,
                    rank_groups)
from .moe import (UNMEASURED, all_reduced_error_terms, error_terms, local_error_terms, step_sums,
                  zero_error_terms)
from .spill import a2a_places, fetch_marks, fetched_counts, none_places, split_places
from .traffic import (a2a_fanout, fanout_counts, held_experts, link_crossings, pair_gpus,
                      share_bounds, shared_sent, shared_split, token_owners, wrong_pairs)


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What the GPUs executed for one step, every layer, summed over the group. The slot loads,
    the pair counts, the agreement and the multiplicities stay on the step's device, and so
    does the error on a resident replay (`Epoch.resident`); `drifted` and the traffic counts
    (shared, fan-out, crossings, wrong, spilled and fetched) may be on the CPU. A replay puts
    each where it keeps its counters (`Counters.record`) and copies them once a run.

    slot_load:    int64 `[L, P]` pairs executed on each slot
    multiplicity: int64 `[T, L, K]` times each pair was executed (0 at padding); None when
                  counted fast (`Epoch.fast`)
    multiplicity_counts: int64 `[L, 3]` valid pairs executed 0, 1 and >= 2 times
    valid:        int64 `[L]` non-padding pairs
    drifted:      bool `[G]` ranks that consumed an extra batch of draws before the step
    agreed:       int64 `[L]` pairs on which every rank chose the same slot; None in "a2a"
    error:        float64 `[L, 2]` the toy layer's `(||Y - Y_exact||^2, ||Y_exact||^2)`; None
                  in "a2a" or without a toy layer; counted fast, a step whose every pair is
                  executed once has error 0 and norm `UNMEASURED` (0 where no pair is valid)
    choices:      int64 `[len(ranks), T, L, K]` each held rank's slots, when kept; else None
    crossings:    int64 `[L, 2]` in "a2a" when `Epoch.count_links`: the busiest GPU's token
                  crossings of the dispatch over NVLink and RDMA (`cost.comm.a2a_crossings`)
    wrong:        int64 `[L]` in "a2a" when `Epoch.slot_experts` is set: pairs sent to a slot whose
                  weights are another expert's; else None
    shared:       float64 `[L, G]` with `Epoch.shared`: the tokens whose shared-expert work
                  each GPU runs (in "none" a `1 / G` share of every token's); else None
    fanout:       int64 `[L, 4]` when `Epoch.count_links`: the step's fan-out counts
                  (`fanout.tally`, over the whole group); else None
    spilled:      int64 `[L, G]` for a spill policy: pairs each GPU ran with fetched weights
                  (`slot_load` then counts only the pairs run on slots); else None
    fetched:      int64 `[L, G, 2]` for a spill policy: distinct experts each GPU fetched,
                  within its node and across nodes (`spill.fetched_counts`); else None
    """

    slot_load: torch.Tensor
    multiplicity: torch.Tensor | None
    multiplicity_counts: torch.Tensor
    valid: torch.Tensor
    drifted: torch.Tensor
    agreed: torch.Tensor | None = None
    error: torch.Tensor | None = None
    choices: torch.Tensor | None = None
    crossings: torch.Tensor | None = None
    wrong: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    fanout: torch.Tensor | None = None
    spilled: torch.Tensor | None = None
    fetched: torch.Tensor | None = None


def _dispatch(epoch: Epoch, i: int, step: int, topk_ids: torch.Tensor,
              out: np.ndarray | None = None) -> torch.Tensor:
    """Held rank `i`'s checked choices for `topk_ids [T, L, K]`: int64 `[T, L, K]` (written
    into `out` by a named CPU kernel, `dispatch_step`)."""
    ctx = epoch.context(step, i)
    return dispatch_step(epoch.policy, topk_ids, epoch.views[i], ctx, epoch.name, out)


def _drift(epoch: Epoch, step: int) -> torch.Tensor:
    """Every rank's drift flag for step `step`, bool `[G]` on the CPU (held ranks' coins,
    gathered; one process holding every rank gathers nothing, so nothing leaves the host)."""
    hits = epoch.drifted(step)
    if epoch.comm is LOCAL:
        return hits
    return epoch.comm.all_gather(hits.long().to(epoch.device)).reshape(-1).bool().cpu()


def _slot_counts(phys: torch.Tensor, executed: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Pairs of `phys [T, L, K]` executed (where `executed`) on each slot, int64 `[L * P]`."""
    n = phys.shape[1] * num_slots
    return tally(torch.where(executed, flat_index(phys, num_slots), n), n)


def weighed_error_terms(epoch: Epoch, step: int, topk_ids: torch.Tensor,
                        runs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`all_reduced_error_terms` where each pair runs with the weights its slot holds
    (`Epoch.slot_experts`): `runs` are each group's `(phys [T, L, K],
    executed [T, L, K])` in this process (`none_step`); a pair run on a slot holding expert
    `h` adds expert `h`'s output for the token, one holding nothing valid adds nothing. The
    ranks of this process sum their outputs; the group's all-reduce sums the processes'."""
    right = torch.zeros(topk_ids.shape, dtype=torch.int64, device=topk_ids.device)
    wrong_sums = None
    for phys, executed in runs:
        holds = held_experts(epoch.slot_experts, phys, topk_ids)  # [T, L, K]
        ok = executed & (holds == topk_ids)
        right += ok
        bad = executed & ~ok & (holds >= 0)
        if bad.any():
            part = step_sums(epoch.moe, step, torch.where(bad, holds, -1), bad.long())[1]
            wrong_sums = part if wrong_sums is None else wrong_sums + part
    exact, weighted = step_sums(epoch.moe, step, topk_ids, right)
    if wrong_sums is not None:
        weighted = weighted + wrong_sums
    return error_terms(epoch.comm.all_reduce(weighted) - exact, exact, epoch.squares)


def none_step(epoch: Epoch, step: int, topk_ids: torch.Tensor,
              src_rank: torch.Tensor | None = None) -> StepOutcome:
    """"none" mode (module doc) for one step `topk_ids [T, L, K]`; `src_rank` is not used
    (every rank sees every token).

    One computation serves each group of `epoch.groups`; every rank of the group still counts
    on its own: a pair is executed by each member whose GPU holds the group's choice. Agreement
    compares every rank's choices with rank 0's, across processes."""
    if epoch.counts_fast(topk_ids.device):
        return _none_counted(epoch, step, topk_ids)
    topk_ids = _own_ids(topk_ids)
    T, L, K = topk_ids.shape
    device, P = topk_ids.device, epoch.placement.num_slots
    spills = epoch.policy.spill is not None
    drifted = _drift(epoch, step)
    valid = topk_ids >= 0
    executed_here = torch.zeros(topk_ids.shape, dtype=torch.int64, device=device)
    slot_load = torch.zeros(L * epoch.num_places, dtype=torch.int64, device=device)
    marks = None  # the experts each GPU fetched, for a spill policy
    agree = valid.clone()
    first = None
    choices: list[torch.Tensor | None] = [None] * len(epoch.ranks)
    known = []  # each group's choices, when counting fan-out
    runs = []  # each group's (choices, pairs its ranks here executed): `weighed_error_terms`
    for n, group in enumerate(epoch.groups):
        phys = _dispatch(epoch, group[0], step, topk_ids)
        if spills:
            phys = none_places(epoch, group[0], phys, topk_ids).run
        executed = epoch.members(device)[n][epoch.gpu_of(phys)] & valid  # [T, L, K]
        executed_here += executed
        runs.append((phys, executed))
        if epoch.count_links:
            known.append(phys)
        slot_load += _slot_counts(phys, executed, epoch.num_places)
        if spills:
            here = fetch_marks(epoch, topk_ids, phys, executed)
            marks = here if marks is None else marks | here
        if first is None:
            first = phys
        else:
            agree &= phys == first
        for i in group:
            choices[i] = phys
    comm = epoch.comm
    leads = comm.all_gather(first)  # [W, T, L, K] the first held rank of every process
    split = comm.all_reduce((valid & ~agree).to(torch.int32))  # pairs held ranks split on
    agree = valid & (split == 0) & (leads == leads[0]).all(0)
    multiplicity = comm.all_reduce(executed_here)
    valid_pairs = valid.sum((0, 2))  # [L]
    if epoch.moe is None:
        error = None
    elif epoch.executes_once:  # exactly 0; the norm is left to the caller (`UNMEASURED`)
        error = zero_error_terms(valid_pairs)
    elif epoch.slot_experts is not None:
        error = weighed_error_terms(epoch, step, topk_ids, runs)
    else:
        error = all_reduced_error_terms(epoch.moe, step, topk_ids, executed_here,
                                        comm.all_reduce, epoch.squares)
    slot_load, spilled = split_places(comm.all_reduce(slot_load), L, P)
    return StepOutcome(slot_load=slot_load, multiplicity=multiplicity,
                       multiplicity_counts=multiplicity_counts(multiplicity, valid),
                       valid=valid_pairs, drifted=drifted,
                       agreed=agree.sum((0, 2)), error=error,
                       choices=torch.stack(choices) if epoch.keep_choices else None,
                       shared=shared_split(epoch, topk_ids),
                       fanout=fanout_counts(epoch, topk_ids.shape,
                                            _executing(epoch, step, topk_ids, known),
                                            has_pairs(topk_ids).sum(0)),
                       **_spill_counts(epoch, spilled, marks))


def _spill_counts(epoch: Epoch, spilled: torch.Tensor,
                  marks: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """`StepOutcome`'s `spilled [L, G]` and `fetched [L, G, 2]` (None without a spill policy)
    from the group's pairs run with fetched weights per GPU and this process's `marks [L, G,
    E]` (`spill.fetch_marks`)."""
    if marks is None:
        return {}
    return {"spilled": spilled, "fetched": fetched_counts(epoch, epoch.comm.all_reduce(
        marks.to(torch.int32)))}


def a2a_step(epoch: Epoch, step: int, topk_ids: torch.Tensor,
             src_rank: torch.Tensor | None = None) -> StepOutcome:
    """"a2a" mode (module doc) for one step `topk_ids [T, L, K]`: each token's owner is its
    `src_rank [T]`, else a contiguous share (`token_owners`); each held rank dispatches its own
    rows (the others' may hold anything: a real rank holds only its own tokens)."""
    T, L, K = topk_ids.shape
    device = topk_ids.device
    if src_rank is None:
        bounds = share_bounds(T, epoch.num_ranks).tolist()
        rows = [torch.arange(bounds[rank.rank], bounds[rank.rank + 1], device=device)
                for rank in epoch.ranks]
    else:
        owners = token_owners(T, epoch.num_ranks, src_rank).to(device)
        rows = [(owners == rank.rank).nonzero().squeeze(1) for rank in epoch.ranks]
    drifted = _drift(epoch, step)
    if epoch.counts_fast(device):
        return _a2a_counted(epoch, step, topk_ids, src_rank, rows, drifted)
    topk_ids = _own_ids(topk_ids)
    phys = torch.full(topk_ids.shape, -1, dtype=torch.int64, device=device)
    mine = torch.zeros(T, dtype=torch.bool, device=device)
    choices = []
    for i, own in enumerate(rows):
        chosen = _dispatch(epoch, i, step, topk_ids[own])
        phys[own] = chosen
        mine[own] = True
        if epoch.keep_choices:  # this rank's pairs only, -1 elsewhere
            choices.append(torch.full_like(phys, -1).index_copy_(0, own, chosen))
    sent = (topk_ids >= 0) & mine.view(T, 1, 1)  # [T, L, K] the pairs held ranks sent
    comm = epoch.comm
    marks = None
    if epoch.policy.spill is not None:
        phys = a2a_places(epoch, phys, topk_ids, rows).run
        marks = fetch_marks(epoch, topk_ids, phys, sent)
    multiplicity = comm.all_reduce(sent.long())
    # every pair is dispatched by its owner alone: a valid pair is one that some rank sent
    slot_load = comm.all_reduce(_slot_counts(phys, sent, epoch.num_places))
    slot_load, spilled = split_places(slot_load, L, epoch.placement.num_slots)
    gpu = pair_gpus(epoch, phys)
    shared, dest = shared_sent(epoch, step, gpu, rows)
    return StepOutcome(slot_load=slot_load, multiplicity=multiplicity,
                       multiplicity_counts=multiplicity_counts(multiplicity, multiplicity > 0),
                       valid=comm.all_reduce(sent.sum((0, 2))), drifted=drifted,
                       choices=torch.stack(choices) if epoch.keep_choices else None,
                       crossings=link_crossings(epoch, src_rank, gpu, dest),
                       wrong=wrong_pairs(epoch, topk_ids, phys, comm.all_reduce), shared=shared,
                       fanout=a2a_fanout(epoch, src_rank, gpu, sent),
                       **_spill_counts(epoch, spilled, marks))


def _none_counted(epoch: Epoch, step: int, topk_ids: torch.Tensor) -> StepOutcome:
    """`none_step` counted fast (module doc): one held process, CPU, every rank held."""
    T, L, K = topk_ids.shape
    P = epoch.placement.num_slots
    drifted = _drift(epoch, step)
    mult = None  # [T, L, K] where some pair may be executed other than once
    known = None  # each group's choices, where this way of counting made them
    marks = None  # a spill policy's fetched experts per GPU
    if epoch.policy.table is not None:
        ids = topk_ids.numpy()  # as stored
        slot_load, counts, agreed = epoch.table.count(ids)
        if counts[:, 0].any() or counts[:, 2].any():
            mult = epoch.table.multiplicity(ids)
    elif epoch.policy.streamed:
        streams = [rank.stream(step) for rank in epoch.ranks]
        slot_load, counts, agreed, done = epoch.streamed.count(topk_ids.numpy(), streams)
        if counts[:, 0].any() or counts[:, 2].any():
            mult = done
    elif len(epoch.groups) == 1:  # every rank chooses alike: each valid pair executed once
        topk_ids = _own_ids(topk_ids)
        phys = _dispatch(epoch, 0, step, topk_ids, epoch.scratch(topk_ids.shape))
        if epoch.policy.spill is not None:  # the pass that places the pairs counts them
            applied = none_places(epoch, 0, phys, topk_ids)
            phys, marks, slot_load = applied.run, applied.marks, applied.counts.numpy()
            agreed = slot_load.sum(1)
        else:
            slot_load, agreed = counting.slot_counts(phys.numpy(), P)
        counts = _executed_once(agreed)
        known = [phys]
    else:
        topk_ids = _own_ids(topk_ids)
        ids = topk_ids.numpy()
        done = None
        known = []
        slot_gpu = epoch.placement.slot_gpu.numpy()
        for group in epoch.groups:
            phys = _dispatch(epoch, group[0], step, topk_ids).numpy()
            if epoch.count_links:
                known.append(torch.from_numpy(phys))
            if done is None:
                done = counting.Executed.start(phys, P)
            member = np.zeros(epoch.num_ranks, np.bool_)
            member[[epoch.ranks[i].rank for i in group]] = True
            counting.execute(done, phys, member, slot_gpu)
        counts, agreed = counting.pair_counts(ids, done)
        slot_load = done.slot_load
        if counts[:, 0].any() or counts[:, 2].any():
            mult = done.mult
    valid = counts.sum(1)
    if epoch.moe is None:
        error = None
    elif mult is None:  # exactly 0; the norm is left to the caller
        error = zero_error_terms(torch.from_numpy(valid))
    else:
        error = local_error_terms(epoch.moe, step, topk_ids, torch.from_numpy(mult))
    slot_load, spilled = split_places(torch.from_numpy(slot_load), L, P)
    return StepOutcome(slot_load=slot_load, multiplicity=None,
                       multiplicity_counts=torch.from_numpy(counts),
                       valid=torch.from_numpy(valid), drifted=drifted,
                       agreed=torch.from_numpy(agreed), error=error,
                       shared=shared_split(epoch, topk_ids),
                       fanout=fanout_counts(epoch, topk_ids.shape,
                                            _executing(epoch, step, topk_ids, known),
                                            has_pairs(topk_ids).sum(0)),
                       **_spill_counts(epoch, spilled, marks))


def _a2a_counted(epoch: Epoch, step: int, topk_ids: torch.Tensor,
                 src_rank: torch.Tensor | None, rows: Sequence[torch.Tensor],
                 drifted: torch.Tensor) -> StepOutcome:
    """`a2a_step` counted fast (module doc): a table policy's contiguous shares counted in one
    pass through each rank's table (`counting.sent_loads`) unless the links are counted;
    otherwise every rank's own rows (slices of contiguous shares when there is no `src_rank`)
    dispatched into one buffer, counted once."""
    if (epoch.policy.table is not None and src_rank is None and not epoch.count_links
            and epoch.slot_experts is None and not epoch.shared):
        slot_load = epoch.table.sent_loads(topk_ids.numpy(),
                                           share_bounds(topk_ids.shape[0], epoch.num_ranks))
        valid = slot_load.sum(1)
        return StepOutcome(slot_load=torch.from_numpy(slot_load), multiplicity=None,
                           multiplicity_counts=torch.from_numpy(_executed_once(valid)),
                           valid=torch.from_numpy(valid), drifted=drifted)
    topk_ids = _own_ids(topk_ids)
    out = epoch.scratch(topk_ids.shape)
    phys = torch.from_numpy(out)
    for i, own in enumerate(rows):
        if src_rank is None and len(own):  # contiguous: views, no copies
            lo, hi = int(own[0]), int(own[-1]) + 1
            chosen = _dispatch(epoch, i, step, topk_ids[lo:hi], out[lo:hi])
            if chosen.data_ptr() != phys[lo:hi].data_ptr():  # not a named kernel: copy
                phys[lo:hi] = chosen
        else:
            phys[own] = _dispatch(epoch, i, step, topk_ids[own])
    marks = None
    if epoch.policy.spill is not None:  # the pass that places the pairs counts them
        applied = a2a_places(epoch, phys, topk_ids, rows)
        phys, marks, slot_load = applied.run, applied.marks, applied.counts.numpy()
        valid = slot_load.sum(1)
    else:
        slot_load, valid = counting.slot_counts(phys.numpy(), epoch.placement.num_slots)
    slot_load, spilled = split_places(torch.from_numpy(slot_load), topk_ids.shape[1],
                                      epoch.placement.num_slots)
    gpu = pair_gpus(epoch, phys)
    shared, dest = shared_sent(epoch, step, gpu, rows)
    return StepOutcome(slot_load=slot_load, multiplicity=None,
                       multiplicity_counts=torch.from_numpy(_executed_once(valid)),
                       valid=torch.from_numpy(valid), drifted=drifted,
                       crossings=link_crossings(epoch, src_rank, gpu, dest),
                       wrong=wrong_pairs(epoch, topk_ids, phys, LOCAL.all_reduce), shared=shared,
                       fanout=a2a_fanout(epoch, src_rank, gpu, topk_ids >= 0),
                       **_spill_counts(epoch, spilled, marks))


def _executing(epoch: Epoch, step: int, topk_ids: torch.Tensor,
               known: Sequence[torch.Tensor] | None) -> Iterator[torch.Tensor]:
    """"none": for each group of `epoch.groups` in turn, the GPU that executes each pair of
    `topk_ids [T, L, K]`, int64 `[T, L, K]` (-1 at padding and where no rank of the group
    executes it), from the group's choices `known` (one `[T, L, K]` a group) or, when None,
    its choices made again: a table policy's looked up in its rank's table."""
    for n, group in enumerate(epoch.groups):
        if known is not None:
            phys = known[n]
        elif epoch.policy.table is not None:
            phys = torch.from_numpy(loops.pair_table(epoch.table.tables[group[0]],
                                                        topk_ids.numpy(), -1))
        else:
            phys = _dispatch(epoch, group[0], step, _own_ids(topk_ids))
        gpu = epoch.gpu_of(phys)
        yield torch.where(epoch.members(phys.device)[n][gpu], gpu, -1)


def _executed_once(valid: np.ndarray) -> np.ndarray:
    """The `[L, 3]` counts of pairs executed 0, 1 and >= 2 times when each of the `valid
    [L]` pairs is executed exactly once."""
    return np.stack([np.zeros_like(valid), valid, np.zeros_like(valid)], 1)


def _own_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """The step's ids as policies take them: int32, a copy of the caller's (which may be a
    view of the trace's storage, in any integer dtype)."""
    return topk_ids.to(torch.int32, copy=True)


MODES: dict[str, Callable[..., StepOutcome]] = {
    "none": none_step,
    "a2a": a2a_step,
}


__all__ = ["LOCAL", "MODES", "RNG_RELATIONS", "UNMEASURED", "Collectives", "Epoch", "Rank",
           "StepOutcome", "Table", "a2a_step", "make_ranks", "none_step", "rank_context",
           "rank_groups", "share_bounds", "token_owners"]
