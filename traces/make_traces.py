"""Regenerate the shipped synthetic traces in this folder, deterministically.

Run from the repository root:  python traces/make_traces.py
Only calls eplbsim.traces.synth.synthesize and eplbsim.traces.trace.save_trace, and writes
synthesized routing in the shapes hooks and tools log it (a per-token JSONL log; `shapes/`: one
small log of each shape guide 03 reads) with the standard library; same output on every run.
"""

import csv
import json
from pathlib import Path

import numpy as np

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


SHAPES = "shapes"
QWEN15 = dict(model="Qwen/Qwen1.5-MoE-A2.7B-Chat", experts=60, top_k=4)  # its published shape
HOOK_LAYERS = (0, 8, 16, 23)  # the layers a per-layer hook was attached to


def _routing(seed: int, steps: int, tokens: int, layers: int):
    """A skewed scenario's `[T_s, L, K]` steps with Qwen1.5-MoE's experts and top-k, and
    seeded gating weights of the same shape (each token's summing to 1)."""
    trace = synthesize("skewed", steps=steps, tokens=tokens, layers=layers,
                       experts=QWEN15["experts"], top_k=QWEN15["top_k"], seed=seed)
    rng = np.random.default_rng(seed)
    ids = [trace.step(s).numpy() for s in range(steps)]
    return ids, [np.round(rng.dirichlet(np.ones(QWEN15["top_k"]), a.shape[:2]), 4) for a in ids]


def _lines(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_shapes(folder: Path) -> None:
    """One small log of each shape guide 03 reads (module doc), each as its tool writes it."""
    folder.mkdir(exist_ok=True)
    header = {"type": "meta", "model_id": QWEN15["model"], "vllm_version": "0.8.5"}
    ids, gates = _routing(2, steps=3, tokens=24, layers=len(HOOK_LAYERS))
    hooks = folder / "hook_layers"
    hooks.mkdir(exist_ok=True)
    for j, layer in enumerate(HOOK_LAYERS):  # a file a layer, token_idx restarting each pass
        _lines(hooks / f"moe_layer{layer}.jsonl", [header] + [
            {"layer": layer, "token_idx": t, "topk_ids": step[t, j].tolist(),
             "topk_weights": g[t, j].tolist()}
            for step, g in zip(ids, gates) for t in range(step.shape[0])])
    ids, gates = _routing(3, steps=1, tokens=16, layers=4)
    (folder / "nested.json").write_text(json.dumps({"model": QWEN15["model"], "router_data": [
        {f"token_{178 + t}": {f"layer_{j}": {"selected_experts": ids[0][t, j].tolist(),
                                             "selected_probs": gates[0][t, j].tolist()}
                              for j in range(4)}} for t in range(16)]}, indent=1) + "\n")
    with open(folder / "gates.csv", "w", newline="") as f:  # a column per expert
        out = csv.writer(f)
        out.writerow(["layer", "token"] + [f"expert_{e}" for e in range(QWEN15["experts"])])
        for j in range(2):
            for t in range(16):
                row = [0.0] * QWEN15["experts"]
                for e, w in zip(ids[0][t, j], gates[0][t, j]):
                    row[e] = float(w)
                out.writerow([j, t] + row)
    counts = synthesize("skewed", steps=8, tokens=256, layers=4, experts=QWEN15["experts"],
                        top_k=QWEN15["top_k"], seed=4).counts().sum(0)  # [L, E]
    (folder / "counts.json").write_text(json.dumps(
        {"model": QWEN15["model"], "num_layers": 4, "num_experts": QWEN15["experts"],
         "logical_count": counts.tolist()}) + "\n")
    ids, _ = _routing(5, steps=3, tokens=8, layers=2)
    records = [header] + [{"request_id": f"req-{r}", "token_idx": t, "layer": j,
                           "topk_ids": step[t, j].tolist()}
                          for r, step in enumerate(ids) for t in range(8) for j in range(2)
                          if not (r == 1 and t == 5 and j == 1)]  # a token the hook lost
    _lines(folder / "requests_ragged.jsonl", records)


if __name__ == "__main__":
    write_shapes(HERE / SHAPES)
    print(f"{SHAPES}/: one small log of each shape")
    write_log(HERE / LOG)
    print(f"{LOG}: {WARMUP_ROWS} warm-up rows, then skewed {LOG_SIZES}")
    for filename, (scenario, options) in TRACES.items():
        trace = synthesize(scenario, **SIZES, **options)
        save_trace(trace, HERE / filename)
        print(f"{filename}: {scenario} {trace.meta['params']}")
