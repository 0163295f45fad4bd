"""Regenerate the shipped synthetic traces in this folder, deterministically.

Run from the repository root:  python traces/make_traces.py
Only calls eplbsim.traces.synth.synthesize and eplbsim.traces.trace.save_trace; same output on every run.
"""

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

if __name__ == "__main__":
    for filename, (scenario, options) in TRACES.items():
        trace = synthesize(scenario, **SIZES, **options)
        save_trace(trace, HERE / filename)
        print(f"{filename}: {scenario} {trace.meta['params']}")
