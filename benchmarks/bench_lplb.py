"""DeepSeek LPLB on its published setups (DESIGN.md §10): the `lplb` placement over each
redundancy topology, then the per-batch LP's max / mean GPU load, from the LP's fractions (the
published metric) and from the integer mapping the `lplb` policy executes.

The setup (LPLB's `tests/test_solve.py`): 256 experts; placement history
`(N(0, 1) 0.15 + 1).clamp(0) 2^20`, the batch's loads `(N(0, 1) 0.3 + 1).clamp(0) 2^12`,
drawn from `torch.manual_seed(seed)` on the CPU (LPLB seeds CUDA with 42, so the draws differ).
The executed mapping runs on a batch of `sum(load)` top-1 pairs holding exactly those counts.
Each setup is placed twice: from the independent history, as the test draws it, and from the
batch's own loads.

    python benchmarks/bench_lplb.py [--seeds 5]
"""

from __future__ import annotations

import argparse

import torch

from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.batch_lp import gpu_load, optimal_fractions
from eplbsim.dispatch.policies import DispatchContext
from eplbsim.placement import full_view
from eplbsim.placement.topology import Topology
from eplbsim.solvers import solve

E = 256
# (name, topology, GPUs, redundant slots a GPU, torus rows, published max / mean bound)
SETUPS = [("cube EP32 (8+2)", "cube", 32, 2, 8, 1.07),
          ("cube EP64 (4+2)", "cube", 64, 2, 8, 1.10),
          ("ring EP32 (8+1)", "ring", 32, 1, 8, 1.07),
          ("hypercube EP16 (16+2)", "hypercube", 16, 2, 8, 1.03),
          ("torus 8x4 EP32 (8+2)", "torus", 32, 2, 8, 1.01),
          ("cube EP32 (8+4)", "cube", 32, 4, 8, 1.07)]


def run(kind: str, gpus: int, redundant: int, rows: int, seed: int,
        own: bool) -> tuple[float, float]:
    """`(LP fractions' max / mean GPU load, executed mapping's)` of one setup and seed, the
    placement solved from the independent history, or from the batch's own loads (`own`)."""
    gen = torch.Generator().manual_seed(seed)
    history = ((torch.randn(1, E, generator=gen) * 0.15 + 1).clamp(min=0) * 2 ** 20).double()
    load = ((torch.randn(E, generator=gen) * 0.3 + 1).clamp(min=0) * 2 ** 12).long()
    topo = Topology(gpus)
    placement = solve("lplb", load.double().view(1, E) if own else history,
                      E + gpus * redundant, topo, redundancy=kind, torus_rows=rows)
    view = full_view(placement, 0)
    frac = optimal_fractions(load, view.log2phy[0], view.logcnt[0], placement.slot_gpu, gpus)
    lp = gpu_load(load.double().unsqueeze(1) * frac, view.log2phy[0], view.logcnt[0],
                  placement.slot_gpu, gpus)
    ids = torch.repeat_interleave(torch.arange(E), load)
    ids = ids[torch.randperm(len(ids), generator=gen)].view(-1, 1)
    phys = POLICIES["lplb"](ids, view, DispatchContext())
    executed = torch.bincount(placement.slot_gpu[phys.view(-1)], minlength=gpus).double()
    return float(lp.max() / lp.mean()), float(executed.max() / executed.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("max / mean GPU load, worst of the seeds: LP fractions / executed mapping, and the "
          "seeds whose LP figure meets the bound, with the placement solved from the "
          "independent history and from the batch's own loads")
    print(f"{'setup':24s} {'bound':>6s} {'history: LP':>12s} {'executed':>9s} {'met':>5s} "
          f"{'own: LP':>8s} {'executed':>9s} {'met':>5s}")
    for name, kind, gpus, redundant, rows, bound in SETUPS:
        cells = []
        for own in (False, True):
            got = [run(kind, gpus, redundant, rows, seed, own) for seed in range(args.seeds)]
            lp, executed = max(g[0] for g in got), max(g[1] for g in got)
            met = sum(g[0] < bound for g in got)
            cells.append(f"{lp:12.4f} {executed:9.4f} {met:>2d}/{len(got):<2d}")
        print(f"{name:24s} {bound:6.2f} " + " ".join(cells))


if __name__ == "__main__":
    main()
