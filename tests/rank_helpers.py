"""Running the rank step (`ranks.MODES`) from tests on views built by hand."""

from eplbsim.dispatch import resolve_policy
from eplbsim.ranks import LOCAL, MODES, Epoch, make_ranks, rank_groups


def epoch(policy, views, mode="none", groups=None, seed=0, rank_offset=False, comm=LOCAL,
          ranks=None, keep_choices=False, moe=None):
    """An Epoch over `views` (one per held rank; all `G` ranks unless `ranks` says which)."""
    name, entry = resolve_policy(policy)
    own = make_ranks("independent", seed, len(views)) if ranks is None else tuple(ranks)
    groups = rank_groups(views, entry) if groups is None else tuple(map(tuple, groups))
    G = len(views) if ranks is None else views[0].placement.topology.num_gpus
    return Epoch(name=name, policy=entry, placement=views[0].placement, ranks=own,
                 views=tuple(views), groups=groups, num_ranks=G, mode=mode, seed=seed,
                 rank_offset=rank_offset, moe=moe, comm=comm, keep_choices=keep_choices)


def step(ids, views, policy, mode="none", s=0, src_rank=None, **kw):
    """One step `ids [T, L, K]` of `mode` on `views` (`epoch`'s keywords pass through)."""
    return MODES[mode](epoch(policy, views, mode, **kw), s, ids, src_rank)
