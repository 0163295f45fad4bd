"""Regenerate the shipped synthetic traces in this folder, deterministically.

Run from the repository root:  python traces/make_traces.py
Only calls eplbsim.traces.synth.synthesize and eplbsim.traces.trace.save_trace (and writes one
per-token JSONL log of a synthesized trace); same output on every run.
"""

import json
from pathlib import Path

from eplbsim.traces.synth import synthesize
from eplbsim.traces.trace import save_trace

HERE = Path(__file__).resolve().parent
SIZES = dict(steps=32, tokens=256, layers=4, experts=64, top_k=8, seed=0)

TRACES = {
    "skewed_small.npz": ("skewed", {}),
    "template_small.npz": ("template", {}),
    "uniform_small.npz": ("uniform", {}),
}

LOG = "moe_routes_small.jsonl"
LOG_SIZES = dict(steps=16, tokens=48, layers=4, experts=64, top_k=8, seed=1)
WARMUP_ROWS = 512  # a start-up profiling pass: every row routed alike


def write_log(path: Path) -> None:
    """A per-token router log shaped like a serving engine's: a header record of type "meta",
    then a profiling pass of `WARMUP_ROWS` identical rows, then the skewed scenario's steps;
    one record per token holding every layer's top-k ids, token indices restarting at each
    step."""
    trace = synthesize("skewed", **LOG_SIZES)
    warm = trace.step(0)[0].tolist()  # one token's [L][K] ids, repeated
    steps = [[warm] * WARMUP_ROWS] + [trace.step(s).tolist() for s in range(trace.num_steps)]
    header = {"type": "meta", "model": "synthetic: eplbsim's skewed scenario",
              "num_layers": trace.num_layers, "top_k": trace.top_k,
              "note": "made by traces/make_traces.py; step 0 is a profiling pass"}
    lines = [json.dumps(header)] + [json.dumps({"type": "route", "token_idx": t, "topk_ids": ids})
                                     for step in steps for t, ids in enumerate(step)]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_log(HERE / LOG)
    print(f"{LOG}: {WARMUP_ROWS} warm-up rows, then skewed {LOG_SIZES}")
    for filename, (scenario, options) in TRACES.items():
        trace = synthesize(scenario, **SIZES, **options)
        save_trace(trace, HERE / filename)
        print(f"{filename}: {scenario} {trace.meta['params']}")
