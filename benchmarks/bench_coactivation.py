"""Co-activation counting (`traces.coactivation`) beside the counting pass (`counting.
expert_counts`) on the DeepSeek-V3-shaped bench trace (`bench.skewed_trace`): best of a few
runs each, after a warm-up call that compiles both. Prints one line per pass and their ratio.

    python benchmarks/bench_coactivation.py [STEPS] [TOKENS] [LAYERS]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from eplbsim.bench import skewed_trace
from eplbsim.counting import expert_counts
from eplbsim.traces.coactivation import coactivation


def best(fn, repeats: int = 3) -> float:
    """The shortest of `repeats` wall-clock runs of `fn`, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(steps: int = 4, tokens: int = 4096, layers: int = 58) -> None:
    trace = skewed_trace(steps, tokens, layers)
    ids = trace.topk_ids.numpy()
    offsets = trace.step_offsets.numpy()
    pairs = float(trace.num_tokens) * layers * trace.top_k
    count = lambda: expert_counts(ids, offsets, trace.num_experts)  # noqa: E731
    pair_count = lambda: coactivation(trace)  # noqa: E731
    count(), pair_count()  # compile
    assert (np.stack([np.diag(m) for m in pair_count()]) == count().sum(0)).all()
    t_count, t_pairs = best(count), best(pair_count)
    print(f"trace: {steps} steps x {tokens} tokens x {layers} layers, E={trace.num_experts}, "
          f"K={trace.top_k}: {pairs:.3g} pairs")
    print(f"counting pass (expert_counts): {t_count * 1e3:.1f} ms, "
          f"{pairs / t_count / 1e6:.0f} M pairs/s")
    print(f"co-activation (K x K a token and layer): {t_pairs * 1e3:.1f} ms, "
          f"{pairs / t_pairs / 1e6:.0f} M pairs/s; {t_pairs / t_count:.1f}x the counting pass")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
