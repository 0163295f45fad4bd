"""The rank model: how `G` EP ranks dispatch one step, and what each GPU then executes.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from . import counting, fanout
from .cost.comm import a2a_crossings, a2a_token_counts
from .dispatch import DispatchContext, DispatchPolicy, SharedInputs
from .dispatch.kernels import dispatch_step, flat_index
from .dispatch.kernels.cpu import StreamedViews
from .dispatch.streams import Stream, coin_hits, stream_key
from .dispatch.observe import observed_groups
from .dispatch.shared import even_split, has_pairs, home, per_gpu
from .errors import InputError
from .metrics import multiplicity_counts
from .moe import ToyMoE, all_reduced_error_terms, local_error_terms
from .placement import Placement, View

RNG_RELATIONS = ("independent", "shared", "drift")
UNMEASURED = float("inf")  # an exact norm the fast path left to compute (its error is 0)


@dataclass(frozen=True)
class Collectives:
    """How the processes of a group combine tensors: `all_reduce` sums a tensor over them,
    `all_gather` stacks one from each, `[...] -> [W, ...]` in rank order."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]


# One process holding every rank: nothing to combine.
LOCAL = Collectives(all_reduce=lambda t: t, all_gather=lambda t: t.unsqueeze(0))


@dataclass(frozen=True, eq=False)
class Rank:
    """One EP rank's own state across the run: its id, the key of its counter-based stream
    (`dispatch.streams`: random and the torch-drawing policies draw from it) and, for the rng
    relation "drift", the key of its coin, which before each step decides with probability
    `drift_p` whether the rank consumes one extra batch of draws: from then on its draws sit one
    layer further along the stream (its shift, the coin's hits so far)."""

    rank: int
    key: int
    coin: int | None = None
    drift_p: float = 0.0
    _shifts: list = field(default_factory=list, repr=False)  # cache: cumulative hits [S']

    def drifted(self, step: int) -> bool:
        """Whether the rank's coin hit before step `step`."""
        return self.shift(step) > (self.shift(step - 1) if step else 0)

    def shift(self, step: int) -> int:
        """The coin's hits before steps `0 .. step` (0 without a coin)."""
        if self.coin is None:
            return 0
        if not self._shifts or len(self._shifts[0]) <= step:  # extended by doubling
            stop = max(step + 1, 2 * len(self._shifts[0]) if self._shifts else 64)
            self._shifts[:] = [np.cumsum(coin_hits(self.coin, self.drift_p, stop))]
        return int(self._shifts[0][step])

    def stream(self, step: int) -> Stream:
        """Where the rank draws in step `step`."""
        return Stream(self.key, step, self.shift(step))


def make_ranks(relation: str, seed: int, num_ranks: int, ranks: Sequence[int] | None = None,
               drift_p: float = 0.0) -> tuple[Rank, ...]:
    """Ranks whose streams are related as `independent` (rank `r` keyed from `(seed, r)`),
    `shared` (all keyed from `seed`) or `drift` (as shared, plus coins keyed from
    `(seed, r, 1)` hitting with probability `drift_p`). `ranks` (default all) picks whose to
    make: a real rank makes only its own, equal to the simulation's rank."""
    if relation not in RNG_RELATIONS:
        raise InputError(f"unknown rng relation {relation!r}; choose one of "
                         f"{', '.join(RNG_RELATIONS)}")
    return tuple(Rank(r, stream_key(seed, r) if relation == "independent" else stream_key(seed),
                      stream_key(seed, r, 1) if relation == "drift" else None, drift_p)
                 for r in (range(num_ranks) if ranks is None else ranks))


def rank_context(step: int, rank: Rank, mode: str, seed: int,
                 rank_offset: bool | None, tp: int = 1) -> DispatchContext:
    """The context `rank` dispatches step `step` with (layer 0; step kernels set the layer)."""
    return DispatchContext(step=step, layer=0, rank=rank.rank, seed=seed,
                           stream=rank.stream(step), mode=mode, rank_offset=rank_offset, tp=tp)


def rank_groups(views: Sequence[View], policy: DispatchPolicy,
                rank_offset: bool | None = None,
                contexts: Sequence[DispatchContext] | None = None,
                top_k: int = 1) -> tuple[tuple[int, ...], ...]:
    """Positions of `views` whose choices are provably identical, in order: for a policy
    rank-invariant under `rank_offset` (`DispatchPolicy.invariant`), ranks with equal views;
    for one whose invariance is observed (`DispatchPolicy.observed`, given the ranks'
    `contexts` in "none" and the trace's `top_k`), ranks of equal inputs when its calls draw
    nothing (`dispatch.observe.observed_groups`); for every other one, one rank a group."""
    if policy.observed is not None and contexts is not None and contexts[0].mode == "none":
        return observed_groups(views, contexts, policy, top_k)
    if not policy.invariant(rank_offset):
        return tuple((i,) for i in range(len(views)))
    groups: list[list[int]] = []
    for i, view in enumerate(views):
        for group in groups:
            first = views[group[0]]
            if torch.equal(first.log2phy, view.log2phy) and torch.equal(first.logcnt,
                                                                        view.logcnt):
                group.append(i)
                break
        else:
            groups.append([i])
    return tuple(map(tuple, groups))


@dataclass(frozen=True, eq=False)
class Epoch:
    """What the steps served by one placement share, for the ranks this process holds.

    name, policy: the policy's reported name and its registry entry
    placement:    the placement in service; `views[i]` is what `ranks[i]` knows of it
    groups:       positions in `ranks` with provably identical choices (`rank_groups`)
    num_ranks:    `G`, the group's ranks over every process
    mode, seed, rank_offset: the run's dispatch settings
    moe:          the toy MoE layer whose output error "none" measures (None: not measured)
    comm:         how this process's counts combine with the others'
    keep_choices: return every held rank's choices (the checkers read them)
    fast:         count with compiled loops where that is possible (module doc)
    count_links:  count each step's fan-out (`fanout`: the GPUs and nodes each token's executed
                  choices reach) and, in "a2a", its token crossings between GPUs and nodes
                  (what the cost model's communication reads)
    held:         int64 `[L, P]` the expert whose weights each slot holds, when the ranks serve
                  different placements (a switch in progress, `schedule.switch`: `views[i]`
                  is then of the placement rank `i` serves, `placement` the new one); "a2a"
                  counts the pairs sent to a slot holding another expert. None when every
                  rank serves `placement`
    shared:       count where each token's shared-expert work runs (`StepOutcome.shared`)
    tp:           the attention tensor-parallel size (`DispatchContext.tp`)
    """

    name: str
    policy: DispatchPolicy
    placement: Placement
    ranks: tuple[Rank, ...]
    views: tuple[View, ...]
    groups: tuple[tuple[int, ...], ...]
    num_ranks: int
    mode: str
    seed: int = 0
    rank_offset: bool | None = None
    moe: ToyMoE | None = None
    comm: Collectives = LOCAL
    keep_choices: bool = False
    fast: bool = False
    count_links: bool = False
    held: torch.Tensor | None = None
    shared: bool = False
    tp: int = 1

    def context(self, step: int, i: int) -> DispatchContext:
        """The context held rank `i` dispatches step `step` with (`rank_context`)."""
        return rank_context(step, self.ranks[i], self.mode, self.seed, self.rank_offset, self.tp)

    @property
    def device(self) -> torch.device:
        """The device the epoch's views (and so its collectives' tensors) live on."""
        return self.views[0].log2phy.device

    def counts_fast(self, device: torch.device) -> bool:
        """Whether this epoch's steps on `device` are counted by the compiled loops."""
        return (self.fast and device.type == "cpu" and self.comm is LOCAL
                and len(self.ranks) == self.num_ranks and not self.keep_choices)

    @cached_property
    def _scratch(self) -> list[np.ndarray]:
        return []

    def scratch(self, shape: tuple[int, ...]) -> np.ndarray:
        """An int64 array of `shape`, the same memory at every step of the epoch (what a step's
        fast count consumes before the next: a fresh array of tens of MB a step costs more in
        page faults than the dispatch that fills it)."""
        n = int(np.prod(shape))
        if not self._scratch or self._scratch[0].size < n:
            self._scratch[:] = [np.empty(n, np.int64)]
        return self._scratch[0][:n].reshape(shape)

    @cached_property
    def streamed(self) -> StreamedViews:
        """The views arranged for counting a streamed policy (`DispatchPolicy.streamed`)."""
        return StreamedViews.of(list(self.views), self.placement.slot_gpu)

    @cached_property
    def table(self) -> "Table":
        """The policy's tables counted once for the epoch (policies with a `table`)."""
        return Table.of(self)


@dataclass(frozen=True)
class StepOutcome:
    """What the GPUs executed for one step, every layer, summed over the group.

    slot_load:    int64 `[L, P]` pairs executed on each slot (CPU)
    multiplicity: int64 `[T, L, K]` times each pair was executed (0 at padding); None when
                  counted fast (`Epoch.fast`)
    counts:       int64 `[L, 3]` valid pairs executed 0, 1 and >= 2 times (CPU)
    valid:        int64 `[L]` non-padding pairs (CPU)
    drifted:      bool `[G]` ranks that consumed an extra batch of draws before the step
    agreed:       int64 `[L]` pairs on which every rank chose the same slot; None in "a2a"
    error:        float64 `[L, 2]` the toy layer's `(||Y - Y_exact||^2, ||Y_exact||^2)`; None
                  in "a2a" or without a toy layer; counted fast, a step whose every pair is
                  executed once has error 0 and norm `UNMEASURED` (0 where no pair is valid)
    choices:      int64 `[len(ranks), T, L, K]` each held rank's slots, when kept; else None
    crossings:    int64 `[L, 2]` in "a2a" when `Epoch.count_links`: the busiest GPU's token
                  crossings of the dispatch over NVLink and RDMA (`cost.comm.a2a_crossings`)
    wrong:        int64 `[L]` in "a2a" when `Epoch.held` is set: pairs sent to a slot whose
                  weights are another expert's (CPU); else None
    shared:       float64 `[L, G]` with `Epoch.shared`: the tokens whose shared-expert work
                  each GPU runs (in "none" a `1 / G` share of every token's; CPU); else None
    fanout:       int64 `[L, 4]` when `Epoch.count_links`: the step's fan-out counts
                  (`fanout.tally`, over the whole group; CPU); else None
    """

    slot_load: torch.Tensor
    multiplicity: torch.Tensor | None
    counts: torch.Tensor
    valid: torch.Tensor
    drifted: torch.Tensor
    agreed: torch.Tensor | None = None
    error: torch.Tensor | None = None
    choices: torch.Tensor | None = None
    crossings: torch.Tensor | None = None
    wrong: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    fanout: torch.Tensor | None = None


def _dispatch(epoch: Epoch, i: int, step: int, topk_ids: torch.Tensor,
              out: np.ndarray | None = None) -> torch.Tensor:
    """Held rank `i`'s checked choices for `topk_ids [T, L, K]`: int64 `[T, L, K]` (written
    into `out` by a named CPU kernel, `dispatch_step`)."""
    ctx = epoch.context(step, i)
    return dispatch_step(epoch.policy, topk_ids, epoch.views[i], ctx, epoch.name, out)


def _drift(epoch: Epoch, step: int) -> torch.Tensor:
    """Every rank's drift flag for step `step`, bool `[G]` (held ranks' coins, gathered)."""
    hits = torch.tensor([rank.drifted(step) for rank in epoch.ranks], dtype=torch.int64)
    return epoch.comm.all_gather(hits.to(epoch.device)).reshape(-1).bool().cpu()


def _slot_counts(phys: torch.Tensor, executed: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Pairs of `phys [T, L, K]` executed (where `executed`) on each slot, int64 `[L * P]`."""
    return torch.bincount(flat_index(phys, num_slots)[executed],
                          minlength=phys.shape[1] * num_slots)


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
    drifted = _drift(epoch, step)
    valid = topk_ids >= 0
    slot_gpu = epoch.placement.slot_gpu.to(device)
    executed_here = torch.zeros(topk_ids.shape, dtype=torch.int64, device=device)
    slot_load = torch.zeros(L * P, dtype=torch.int64, device=device)
    agree = valid.clone()
    first = None
    choices: list[torch.Tensor | None] = [None] * len(epoch.ranks)
    known = []  # each group's choices, when counting fan-out
    for group in epoch.groups:
        phys = _dispatch(epoch, group[0], step, topk_ids)
        member = torch.zeros(epoch.num_ranks, dtype=torch.bool, device=device)
        member[[epoch.ranks[i].rank for i in group]] = True
        executed = member[slot_gpu[phys.clamp(min=0)]] & valid  # [T, L, K]
        executed_here += executed
        if epoch.count_links:
            known.append(phys)
        slot_load += _slot_counts(phys, executed, P)
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
    error = (None if epoch.moe is None else
             all_reduced_error_terms(epoch.moe, step, topk_ids, executed_here, comm.all_reduce))
    return StepOutcome(comm.all_reduce(slot_load).view(L, P).cpu(), multiplicity,
                       multiplicity_counts(multiplicity, valid), valid.sum((0, 2)).cpu(),
                       drifted, agree.sum((0, 2)).cpu(), error,
                       torch.stack(choices) if epoch.keep_choices else None,
                       shared=_shared_split(epoch, topk_ids),
                       fanout=_fanout(epoch, topk_ids.shape,
                                      _executing(epoch, step, topk_ids, known),
                                      has_pairs(topk_ids).sum(0)))


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
    multiplicity = comm.all_reduce(sent.long())
    # every pair is dispatched by its owner alone: a valid pair is one that some rank sent
    slot_load = comm.all_reduce(_slot_counts(phys, sent, epoch.placement.num_slots))
    gpu = _pair_gpus(epoch, phys)
    shared, dest = _shared_sent(epoch, step, gpu, rows)
    return StepOutcome(slot_load.view(L, -1).cpu(), multiplicity,
                       multiplicity_counts(multiplicity, multiplicity > 0),
                       comm.all_reduce(sent.sum((0, 2))).cpu(), drifted,
                       choices=torch.stack(choices) if epoch.keep_choices else None,
                       crossings=_crossings(epoch, src_rank, gpu, dest),
                       wrong=_wrong(epoch, topk_ids, phys, comm.all_reduce), shared=shared,
                       fanout=_a2a_fanout(epoch, src_rank, gpu, sent))


def _none_counted(epoch: Epoch, step: int, topk_ids: torch.Tensor) -> StepOutcome:
    """`none_step` counted fast (module doc): one held process, CPU, every rank held."""
    T, L, K = topk_ids.shape
    P = epoch.placement.num_slots
    drifted = _drift(epoch, step)
    mult = None  # [T, L, K] where some pair may be executed other than once
    known = None  # each group's choices, where this way of counting made them
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
        error = torch.zeros(L, 2, dtype=torch.float64)
        error[:, 1] = torch.from_numpy(np.where(valid > 0, UNMEASURED, 0.0))
    else:
        error = local_error_terms(epoch.moe, step, topk_ids, torch.from_numpy(mult))
    return StepOutcome(torch.from_numpy(slot_load), None, torch.from_numpy(counts),
                       torch.from_numpy(valid), drifted, torch.from_numpy(agreed), error,
                       shared=_shared_split(epoch, topk_ids),
                       fanout=_fanout(epoch, topk_ids.shape,
                                      _executing(epoch, step, topk_ids, known),
                                      has_pairs(topk_ids).sum(0)))


def _a2a_counted(epoch: Epoch, step: int, topk_ids: torch.Tensor,
                 src_rank: torch.Tensor | None, rows: Sequence[torch.Tensor],
                 drifted: torch.Tensor) -> StepOutcome:
    """`a2a_step` counted fast (module doc): a table policy's contiguous shares counted in one
    pass through each rank's table (`counting.sent_loads`) unless the links are counted;
    otherwise every rank's own rows (slices of contiguous shares when there is no `src_rank`)
    dispatched into one buffer, counted once."""
    if (epoch.policy.table is not None and src_rank is None and not epoch.count_links
            and epoch.held is None and not epoch.shared):
        slot_load = epoch.table.sent_loads(topk_ids.numpy(),
                                           share_bounds(topk_ids.shape[0], epoch.num_ranks))
        valid = slot_load.sum(1)
        return StepOutcome(torch.from_numpy(slot_load), None,
                           torch.from_numpy(_executed_once(valid)), torch.from_numpy(valid),
                           drifted)
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
    slot_load, valid = counting.slot_counts(phys.numpy(), epoch.placement.num_slots)
    gpu = _pair_gpus(epoch, phys)
    shared, dest = _shared_sent(epoch, step, gpu, rows)
    return StepOutcome(torch.from_numpy(slot_load), None,
                       torch.from_numpy(_executed_once(valid)), torch.from_numpy(valid), drifted,
                       crossings=_crossings(epoch, src_rank, gpu, dest),
                       wrong=_wrong(epoch, topk_ids, phys, LOCAL.all_reduce), shared=shared,
                       fanout=_a2a_fanout(epoch, src_rank, gpu, topk_ids >= 0))


def _shared_split(epoch: Epoch, topk_ids: torch.Tensor) -> torch.Tensor | None:
    """"none": every GPU's `1 / G` share of the step's tokens per layer, float64 `[L, G]`
    (`dispatch.shared.even_split`), when `epoch.shared`; else None."""
    if not epoch.shared:
        return None
    return even_split(has_pairs(topk_ids).sum(0), epoch.num_ranks).cpu()


def _pair_gpus(epoch: Epoch, phys: torch.Tensor) -> torch.Tensor | None:
    """"a2a": the GPU of each pair's chosen slot, int64 `[T, L, K]` of `phys [T, L, K]` (-1 where
    -1), when the step counts shared work or links (what reads it); else None."""
    if not (epoch.shared or epoch.count_links):
        return None
    slot_gpu = epoch.placement.slot_gpu.to(phys.device)
    return torch.where(phys >= 0, slot_gpu[phys.clamp(min=0)], -1)


def _shared_sent(epoch: Epoch, step: int, gpu: torch.Tensor | None,
                 rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """"a2a": `(tokens per GPU, float64 [L, G] summed over the group; the GPU each held token's
    shared work runs on, int64 [T, L], -1 elsewhere)` when `epoch.shared`, else `(None, None)`.
    Each held rank places its own rows' shared work: at home (`home`), or by the policy's
    shared rule, which knows the GPUs of its pairs (`gpu [T, L, K]`, `_pair_gpus`) and the
    group's counts (one all-reduce of them)."""
    if not epoch.shared:
        return None, None
    G, comm, rule = epoch.num_ranks, epoch.comm, epoch.policy.shared
    dest = torch.full(gpu.shape[:2], -1, dtype=torch.int64, device=gpu.device)
    if rule is None:
        for rank, own in zip(epoch.ranks, rows):
            dest[own] = home(gpu[own], rank.rank)
    else:
        local = [per_gpu(gpu[own], G) for own in rows]  # [L, G] each
        tokens = torch.zeros(G, dtype=torch.int64, device=gpu.device)
        for rank, own in zip(epoch.ranks, rows):
            tokens[rank.rank] = len(own)
        routed, tokens = comm.all_reduce(torch.stack(local).sum(0)), comm.all_reduce(tokens)
        for i, own in enumerate(rows):
            inputs = SharedInputs(gpu[own], local[i], routed, tokens)
            dest[own] = rule(inputs, epoch.context(step, i))
    shared = per_gpu(dest.unsqueeze(-1), G).to(torch.float64)
    return comm.all_reduce(shared).cpu(), dest


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
            phys = torch.from_numpy(counting.pair_table(epoch.table.tables[group[0]],
                                                        topk_ids.numpy(), -1))
        else:
            phys = _dispatch(epoch, group[0], step, _own_ids(topk_ids))
        slot_gpu = epoch.placement.slot_gpu.to(phys.device)
        member = torch.zeros(epoch.num_ranks + 1, dtype=torch.bool, device=phys.device)
        member[[epoch.ranks[i].rank for i in group]] = True  # member[-1]: padding, never
        gpu = torch.where(phys >= 0, slot_gpu[phys.clamp(min=0)], -1)
        yield torch.where(member[gpu], gpu, -1)


def _fanout(epoch: Epoch, shape: Sequence[int], gpus: Iterable[torch.Tensor],
            tokens: torch.Tensor, owners: torch.Tensor | None = None) -> torch.Tensor | None:
    """The step's fan-out counts, int64 `[L, 4]` (`fanout.tally`), of the GPUs each pair
    reaches, given as `gpus` (`[T, L, K]` each, -1: nowhere; the step's ids have `shape`),
    their sets united over the group's processes; `tokens [L]`: the group's tokens with a valid
    pair; `owners [T]`: each token's source rank ("a2a"; None in "none"). None (nothing
    counted) unless `count_links`."""
    if not epoch.count_links:
        return None
    sets = fanout.empty(shape[0], shape[1], epoch.num_ranks)
    for gpu in gpus:
        fanout.mark(sets, gpu.cpu().numpy())
    if epoch.comm is not LOCAL:
        sets = epoch.comm.all_reduce(torch.from_numpy(sets).to(epoch.device)).cpu().numpy()
    return torch.from_numpy(fanout.tally(sets, tokens.cpu().numpy(),
                                         epoch.placement.topology.gpus_per_node,
                                         None if owners is None else owners.cpu().numpy()))


def _a2a_fanout(epoch: Epoch, src_rank: torch.Tensor | None, gpu: torch.Tensor | None,
                sent: torch.Tensor) -> torch.Tensor | None:
    """"a2a": `_fanout` of the held ranks' choices (`gpu [T, L, K]`, `_pair_gpus`, -1 where
    not held), `sent [T, L, K]` the valid pairs they sent, tokens owned as `token_owners`
    says."""
    if not epoch.count_links:
        return None
    tokens = epoch.comm.all_reduce(sent.any(-1).sum(0))
    owners = token_owners(gpu.shape[0], epoch.num_ranks, src_rank)
    return _fanout(epoch, gpu.shape, [gpu], tokens, owners)


def _executed_once(valid: np.ndarray) -> np.ndarray:
    """The `[L, 3]` counts of pairs executed 0, 1 and >= 2 times when each of the `valid
    [L]` pairs is executed exactly once."""
    return np.stack([np.zeros_like(valid), valid, np.zeros_like(valid)], 1)


def _crossings(epoch: Epoch, src_rank: torch.Tensor | None, gpu: torch.Tensor | None,
               shared: torch.Tensor | None = None) -> torch.Tensor | None:
    """The busiest GPU's token crossings of every layer's dispatch, int64 `[L, 2]` (NVLink,
    RDMA), the group's processes' counts summed, from the GPUs of the held ranks' choices
    (`gpu [T, L, K]`, `_pair_gpus`: -1 where not held or padding) and the GPUs their shared work
    runs on (`shared [T, L]`, one more destination of the token; None: none) of tokens owned as
    `token_owners` says; None unless `count_links`."""
    if not epoch.count_links:
        return None
    topo = epoch.placement.topology
    owners = token_owners(gpu.shape[0], epoch.num_ranks, src_rank).to(gpu.device)
    dest = gpu if shared is None else torch.cat([gpu, shared.unsqueeze(-1)], -1)  # [T, L, K+]
    counts = [a2a_token_counts(owners, dest[:, layer], topo) for layer in range(gpu.shape[1])]
    gpu_tokens = epoch.comm.all_reduce(torch.stack([g for g, _ in counts]))  # [L, G, G]
    node_tokens = epoch.comm.all_reduce(torch.stack([n for _, n in counts]))  # [L, G, N]
    return a2a_crossings(gpu_tokens, node_tokens, topo).round().long().cpu()


def _wrong(epoch: Epoch, topk_ids: torch.Tensor, phys: torch.Tensor,
           all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Pairs of `topk_ids [T, L, K]` sent (`phys [T, L, K]`, -1 where not sent) to a slot
    whose weights are another expert's (`Epoch.held`), int64 `[L]` summed over the group;
    None when `held` is not set."""
    if epoch.held is None:
        return None
    held = epoch.held.flatten()[flat_index(phys.clamp(min=0), epoch.held.shape[1])]
    wrong = (phys >= 0) & (held != topk_ids)  # [T, L, K]
    return all_reduce(wrong.sum((0, 2))).cpu()


@dataclass(frozen=True, eq=False)
class Table:
    """A table policy's choices for one epoch, counted per (layer, expert) once.

    tables:    int32 `[G, L, E]` each rank's table (`DispatchPolicy.table`), ranks in order
    executed:  bool `[G, L, E]` the rank's table slot is on its own GPU (it executes the pairs
               in "none")
    times:     int32 `[L, E]` ranks that execute an expert's pairs in "none" (`c` of each pair)
    agree:     bool `[L, E]` every rank chooses the same slot for the expert
    num_slots: `P`
    """

    tables: np.ndarray
    executed: np.ndarray
    times: np.ndarray
    agree: np.ndarray
    num_slots: int

    @classmethod
    def of(cls, epoch: Epoch) -> "Table":
        """Every rank's table of `epoch` (every rank held, in rank order), counted."""
        tables = torch.stack([epoch.policy.table(view, epoch.context(0, i)).cpu()
                              for i, view in enumerate(epoch.views)]).numpy().astype(np.int32)
        G = tables.shape[0]
        executed = epoch.placement.slot_gpu.numpy()[tables] == np.arange(G).reshape(G, 1, 1)
        return cls(tables, executed, executed.sum(0, dtype=np.int32),
                   (tables == tables[0]).all(0), epoch.placement.num_slots)

    def sent_loads(self, ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """"a2a" pairs per (layer, slot), int64 `[L, P]`, of a step's ids `[T, L, K]` whose
        rank `r` owns rows `offsets[r]:offsets[r + 1]`: each rank sends its pairs of an expert
        to its table's slot, where they are executed once."""
        return counting.sent_loads(self.tables, ids, offsets, self.num_slots)

    def count(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(slot_load [L, P], counts [L, 3], agreed [L])`, int64, of a step's ids
        `[T, L, K]`, from its expert counts alone."""
        n = counting.expert_counts(ids, np.array([0, ids.shape[0]]), self.times.shape[1])[0]
        slot_load = counting.table_loads(self.tables, n, self.executed, self.num_slots)
        c = self.times  # [L, E]
        counts = np.stack([(n * (c == 0)).sum(1), (n * (c == 1)).sum(1),
                           (n * (c >= 2)).sum(1)], 1)
        return slot_load, counts, (n * self.agree).sum(1)

    def multiplicity(self, ids: np.ndarray) -> np.ndarray:
        """Times each pair of `ids [T, L, K]` is executed, int32 `[T, L, K]` (0 at padding)."""
        return counting.pair_table(self.times, ids)


def _own_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """The step's ids as policies take them: int32, a copy of the caller's (which may be a
    view of the trace's storage, in any integer dtype)."""
    return topk_ids.to(torch.int32, copy=True)


MODES: dict[str, Callable[..., StepOutcome]] = {
    "none": none_step,
    "a2a": a2a_step,
}


def token_owners(num_tokens: int, num_ranks: int,
                 src_rank: torch.Tensor | None = None) -> torch.Tensor:
    """Source rank of each token in "a2a", int64 `[T]`: the trace's `src_rank` when given, else
    contiguous shares differing by at most one, the first `T % G` ranks taking one more."""
    if src_rank is not None:
        if src_rank.numel() and int(src_rank.max()) >= num_ranks:
            raise InputError(f"the trace's src_rank names rank {int(src_rank.max())}, but there "
                             f"are only {num_ranks} GPUs")
        return src_rank.long()
    return torch.repeat_interleave(torch.arange(num_ranks),
                                   torch.from_numpy(np.diff(share_bounds(num_tokens, num_ranks))))


def share_bounds(num_tokens: int, num_ranks: int) -> np.ndarray:
    """Where the contiguous shares of `token_owners` start, int64 `[G + 1]`: rank `r` owns
    rows `bounds[r]:bounds[r + 1]`."""
    base, extra = divmod(num_tokens, num_ranks)
    sizes = np.full(num_ranks, base, np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])
