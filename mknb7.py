import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

cells = [
    new_markdown_cell("""# The field's dispatch policies, side by side

Every policy in `POLICIES`: the engines' own, as published (`trtllm`, `ascend`, `ascend-fixed`,
`sglang-lp`, `sglang-lp-golden`, `lplb`, `lplb-atomic`, `waterfill`, `waterfill-dynamic`,
vLLM's `flat` and `hash`, SGLang's `static`, `random` and `row`), and eplbsim's (`ordinal`,
`lp`, `quota`). Each has a rank-invariance class in "none" mode: only invariant ones keep every
pair executed exactly once without all-to-all. Waterfill places each token's shared-expert work,
which needs the all-to-all: it runs in "a2a" only, and with it in the list every row counts
the model's shared expert (DeepSeek-V3's one, a routed pair's worth a token and layer).
This notebook replays them on three traces that stress different things: `skewed` (a few hot
experts), `template` (packed templated prompts: the row trap) and `burst` (a cold expert
suddenly hot)."""),
    new_code_cell("""%matplotlib inline
from eplbsim import RunSpec, compare, synthesize
from eplbsim.cli.registries import policy_rows
from eplbsim.dispatch import POLICIES
from eplbsim.plots import policy_comparison
from eplbsim.results import format_table

for row in policy_rows():
    print(f"{row['name']:17s} {row['class']:32s} {row['summary']}")"""),
    new_markdown_cell("""## 1. Three traces, every policy, both modes

The same small setup everywhere: 8 GPUs in 2 nodes, 16 redundant slots, the `deepseek`
solver's placement from the whole trace."""),
    new_code_cell("""spec = RunSpec.of(gpus=8, gpus_per_node=4, redundant=16)
sizes = dict(steps=8, tokens=256, layers=4, experts=64, top_k=8, seed=0)
results = {}
for scenario in ("skewed", "template", "burst"):
    trace = synthesize(scenario, **sizes)
    results[scenario] = compare(trace, list(POLICIES), ["none", "a2a"], spec)
    print(scenario)
    print(format_table([r.row() for r in results[scenario]]))
    print()"""),
    new_markdown_cell("""## 2. Who corrupts "none" mode?

A policy whose ranks disagree drops and doubles pairs: `agree < 1`, pairs executed 0 or 2+ times,
and the toy MoE layer's all-reduced output is wrong. The class in the registry predicts it."""),
    new_code_cell("""for scenario, rs in results.items():
    for r in rs:
        if r.spec.dispatch.mode != "none":
            continue  # waterfill has no "none" row
        m = r.metrics
        predicted = POLICIES[r.policy].invariant()
        observed = m["rank_agreement"] == 1.0 and m["output_rel_error"] == 0.0
        assert predicted == observed or not predicted, (scenario, r.policy)
        if scenario == "template":
            print(f"{r.policy:17s} class {'invariant' if predicted else 'variant':9s} "
                  f"agreement {m['rank_agreement']:.3f}, output error {m['output_rel_error']:.3f}")"""),
    new_markdown_cell("""## 3. Balance among the invariant ones

On the template trace `row` and `hash` fall into the row trap (a hot expert's pairs always
land on the same replica), while `ordinal`, `trtllm`, `lplb` and `quota` split each expert's
pairs evenly. `quota` is the batch's LP optimum rounded to integers, the best any dispatch can do
for that batch."""),
    new_code_cell("""policy_comparison(results["template"])"""),
    new_markdown_cell("""## 4. The shared expert: Waterfill

Above, 256 tokens a step over 8 ranks is 32 tokens a rank, below Waterfill's 64-token minimum,
so every rank kept its tokens' shared work and `waterfill` equalled `row`. At 2048 tokens a step
each rank sends part of its shared work to the GPUs with room below the fill level: the static
mode from its own counts (no collective), the dynamic one from every rank's (one all-reduce).
The routed pairs are `row`'s in all three rows, so replica skew is the same; only the GPU load
moves. `shared` is one step's shared work per GPU."""),
    new_code_cell("""big = dict(sizes, tokens=2048)
for scenario in ("skewed", "template", "burst"):
    trace = synthesize(scenario, **big)
    rs = compare(trace, ["row", "waterfill", "waterfill-dynamic"], ["a2a"], spec)
    print(scenario)
    for r in rs:
        m = r.metrics
        shared = r.counters.shared[0, 0].int().tolist()
        print(f"  {r.policy:17s} gpu_imb {m['gpu_imbalance']:.4f}  skew_mean "
              f"{m['replica_skew_mean']:.4f}  shared {shared}")
    assert rs[1].metrics["gpu_imbalance"] <= rs[0].metrics["gpu_imbalance"]"""),
]
nb = new_notebook(cells=cells, metadata={
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"}})
nbformat.write(nb, "notebooks/07_field.ipynb")
