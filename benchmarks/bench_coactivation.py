"""Co-activation counting (`traces.coactivation`) and the fan-out pass (`fanout.mark` and
`fanout.tally`, what a replay with a cost model adds a step) beside the counting pass
(`counting.expert_counts`) on the DeepSeek-V3-shaped bench trace (`bench.skewed_trace`): best of
a few runs each, after a warm-up call that compiles them. Prints one line per pass and its ratio
to the counting pass. The fan-out pass reads each pair's GPU as 8 GPUs of contiguous experts
would place it (`expert // (E / 8)`): its cost does not depend on which GPUs they are.

    python benchmarks/bench_coactivation.py [STEPS] [TOKENS] [LAYERS]
"""

from __future__ import annotations

import sys
import time

import numpy as np

from eplbsim.base.loops import expert_counts
from eplbsim.ranks import fanout
from eplbsim.replay.bench import skewed_trace
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
    gpus = [np.where(ids[a:b] >= 0, ids[a:b] // (trace.num_experts // 8), -1)
             for a, b in zip(offsets[:-1], offsets[1:])]  # [T, L, K] a step

    def fan_out():
        for gpu in gpus:
            sets = fanout.empty(gpu.shape[0], layers, 8)
            fanout.mark(sets, gpu)
            fanout.tally(sets, np.zeros(layers, np.int64), 8)

    count(), pair_count(), fan_out()  # compile
    assert (np.stack([np.diag(m) for m in pair_count()]) == count().sum(0)).all()
    t_count, t_pairs, t_fan = best(count), best(pair_count), best(fan_out)
    print(f"trace: {steps} steps x {tokens} tokens x {layers} layers, E={trace.num_experts}, "
          f"K={trace.top_k}: {pairs:.3g} pairs")
    print(f"counting pass (expert_counts): {t_count * 1e3:.1f} ms, "
          f"{pairs / t_count / 1e6:.0f} M pairs/s")
    print(f"co-activation (K x K a token and layer): {t_pairs * 1e3:.1f} ms, "
          f"{pairs / t_pairs / 1e6:.0f} M pairs/s; {t_pairs / t_count:.1f}x the counting pass")
    print(f"fan-out (mark the GPU sets, tally them; 8 GPUs): {t_fan * 1e3:.1f} ms, "
          f"{pairs / t_fan / 1e6:.0f} M pairs/s; {t_fan / t_count:.1f}x the counting pass")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
