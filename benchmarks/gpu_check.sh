#!/usr/bin/env bash
# One prepared check for a CUDA machine, run from anywhere in the checkout:
#   bash benchmarks/gpu_check.sh
# 1. picks the Python: $PYTHON if set, else .venv/bin/python when its torch sees CUDA, else the
#    machine's python3 (a lent GPU machine has torch, triton, numba, scipy, matplotlib, pytest and
#    hypothesis there, and nothing can be installed); the checkout goes on PYTHONPATH;
# 2. prints the GPU; 3. runs the CUDA and Triton tests (Triton kernels vs the reference policies
#    on random inputs, poisoned outputs, -1 padding, E not a power of two); 4. times the whole
#    `eplbsim run` end to end, a file in and JSON out, two lengths, `row`, once with
#    `--device cuda` and once with `--device cpu` on the same machine (the replay on the device
#    keeps its counts there and reads them back once a run); 5. times the Triton step kernels
#    directly at N = 1e8 pairs against a device copy of the same bytes; 6. runs
#    `eplbsim bench --device cuda --json` (the dispatch rows, and the replay on the device beside
#    its kernel calls in both modes, `random` among the policies); 7. runs `eplbsim ranks` on
#    NCCL with one rank per GPU (world size 1 when there is one GPU) and checks it against the
#    simulation; 8. last, with what time is left, `benchmarks/bench_engines.py --device cuda`
#    on a cut step (1024 tokens, 8 layers: the engines' own dispatch beside eplbsim's
#    policies); 9. prints a short summary table.
# The engines' releases come from $EPLBSIM_CACHE, else from `.engine-cache/` in the checkout
# when it is there (a lent machine reaches no network: stage it here first with
# `mkdir -p .engine-cache && cp -r ~/.cache/eplbsim/engines .engine-cache/` and carry it).
# Every step has a timeout. On an H200 (2026-12-04) tests took 33 s, kernels 9 s, engines
# about 250 s at full size, bench 51 s, ranks 21 s (e2e not measured then); the defaults below
# bound the whole at about 18 minutes and the steps that matter most run first. Logs and JSON go to
# $OUT (when set, e.g. by a device runner) or to a fresh temporary folder. Exit status 0 only if
# every step passed. Timeouts can be overridden: TEST_TIMEOUT, KERNEL_TIMEOUT, BENCH_TIMEOUT
# (seconds), E2E_TIMEOUT, RANKS_TIMEOUT, ENGINES_TIMEOUT.
set -euo pipefail

cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$(mktemp -d -t eplbsim-gpu-check.XXXXXX)}"
mkdir -p "$OUTDIR"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c \
    "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUTDIR PY
if [ -z "${EPLBSIM_CACHE:-}" ] && [ -d .engine-cache/engines ]; then
    export EPLBSIM_CACHE="$PWD/.engine-cache"
fi
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # silence Triton 3.9's warning
unset TRITON_INTERPRET  # compile the kernels for the GPU
declare -A STATUS
SECONDS=0

step() {  # step NAME TIMEOUT CMD...: run with a timeout, log to $OUTDIR/NAME.log, record status
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "=== $name (timeout ${limit}s) ==="
    timeout --kill-after=10 "$limit" "$@" < /dev/null 2>&1 | tee "$OUTDIR/$name.log" || rc=$?
    if [ "$rc" -eq 0 ]; then STATUS[$name]="ok"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then STATUS[$name]="TIMEOUT"
    else STATUS[$name]="FAIL($rc)"; fi
    STATUS[$name]="${STATUS[$name]} $((SECONDS - t0))s"
    echo "=== $name: ${STATUS[$name]} ==="
}

echo "=== gpu ==="
nvidia-smi --query-gpu=name,memory.total --format=csv || true
echo "python: $PY"
"$PY" - <<'EOF' || { echo "torch ($PY) sees no CUDA device: nothing to check"; exit 1; }
import torch
assert torch.cuda.is_available(), "no CUDA"
import triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name()}")
EOF

step tests "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_kernels_triton.py tests/test_dispatch.py tests/test_replay.py tests/test_moe.py \
    tests/test_observe.py -k "cuda or triton"

e2e_json() {  # the whole `eplbsim run`, a file in and JSON out, on the GPU and on its CPUs
    set -euo pipefail
    "$PY" - "$OUTDIR/e2e.json" <<'EOF'
import json, sys
from eplbsim.replay.bench import end_to_end, format_end_to_end
rows = [end_to_end(steps=(2, 66), policy="row", device=d, repeats=2, form="dir")
        for d in ("cuda", "cpu")]
for r in rows:
    print(format_end_to_end(r))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF
}
export -f e2e_json
step e2e "${E2E_TIMEOUT:-180}" bash -c e2e_json

kernel_bench() {
    "$PY" - "$OUTDIR/triton_kernels.json" <<'EOF'
"""Triton step kernels at N = 1e8 pairs (DeepSeek-V3 shape: L=58, K=8, E=256, P=288) against
a device copy moving the same bytes (4 B id read + 8 B slot write a pair)."""
import json, os, sys, time
import torch
from eplbsim.dispatch.kernels.triton_dispatch import ordinal_step_triton, row_step_triton
from eplbsim.placement import Placement, full_view
from eplbsim.placement.topology import Topology

DEV = os.environ.get("KERNEL_DEVICE", "cuda")  # cpu only for a dry run under TRITON_INTERPRET=1
L, K, E, P, N = 58, 8, 256, 288, int(float(os.environ.get("KERNEL_N", "1e8")))
T = max(1, N // (L * K))
gen = torch.Generator().manual_seed(0)
p2l = torch.stack([torch.cat([torch.arange(E), torch.randint(0, E, (P - E,), generator=gen)])
                   for _ in range(L)])
view = full_view(Placement(p2l, E, Topology(32))).to(DEV)
dev = torch.Generator(device=DEV).manual_seed(0)
hot = torch.randint(0, 16, (T, L, K), device=DEV, generator=dev, dtype=torch.int32)
ids = torch.randint(0, E, (T, L, K), device=DEV, generator=dev, dtype=torch.int32)
ids = torch.where(torch.rand(T, L, K, device=DEV, generator=dev) < 0.3, hot, ids)
del hot
offsets = 5 + torch.arange(L, device=DEV)
out = torch.empty(T, L, K, dtype=torch.int64, device=DEV)
n = ids.numel()
src = torch.empty(n * 12 // 2, dtype=torch.uint8, device=DEV)  # copy: 6N read + 6N written
dst = torch.empty_like(src)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)

def best(fn, repeats=5):
    fn(); sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); sync()
        times.append(time.perf_counter() - t0)
    return min(times)

copy = best(lambda: dst.copy_(src))
rows = []
for name, fn in [("row", lambda: row_step_triton(ids, view.log2phy, view.logcnt, out=out)),
                 ("ordinal", lambda: ordinal_step_triton(ids, view.log2phy, view.logcnt,
                                                         offsets, out=out))]:
    s = best(fn)
    rows.append({"kernel": f"{name}_step_triton", "n": n, "ns_per_pair": s / n * 1e9,
                 "gbps": 12 * n / s / 1e9, "copy_gbps": 12 * n / copy / 1e9,
                 "frac_of_copy": copy / s})
from eplbsim.dispatch.policies import DispatchContext, ordinal_policy, row_policy
first = ordinal_step_triton(ids, view.log2phy, view.logcnt, offsets).clone()
again = ordinal_step_triton(ids, view.log2phy, view.logcnt, offsets)
assert torch.equal(first, again), "ordinal kernel is not deterministic"
rows_out = row_step_triton(ids, view.log2phy, view.logcnt)
for l in (0, L // 2, L - 1):  # the reference policies on the same device, at full size
    ctx = DispatchContext(step=5, layer=l)
    assert torch.equal(first[:, l], ordinal_policy(ids[:, l], view, ctx)), f"ordinal layer {l}"
    assert torch.equal(rows_out[:, l], row_policy(ids[:, l], view, ctx)), f"row layer {l}"
print("full-size check against the reference policies (3 layers): ok")
for r in rows:
    print(f"{r['kernel']:22s} n={r['n']:.0e} {r['ns_per_pair']:.4f} ns/pair "
          f"{r['gbps']:.0f} GB/s = {r['frac_of_copy']:.0%} of copy ({r['copy_gbps']:.0f} GB/s)")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF
}
export -f kernel_bench
step kernels "${KERNEL_TIMEOUT:-120}" bash -c kernel_bench

bench_json() {
    set -euo pipefail
    "$PY" -m eplbsim.cli bench --device cuda --replay-repeats 1 --no-end-to-end --json \
        > "$OUTDIR/bench.json"
}
export -f bench_json
step bench "${BENCH_TIMEOUT:-240}" bash -c bench_json


ranks_nccl() {
    set -euo pipefail
    local world
    world=$("$PY" -c "import torch; print(max(1, min(torch.cuda.device_count(), 8)))")
    "$PY" -m eplbsim.cli ranks --world-size "$world" --device cuda --scenario skewed \
        --steps 8 --tokens 1024 --layers 4 --redundant 16 --policies static,random,row,ordinal
}
export -f ranks_nccl
step ranks "${RANKS_TIMEOUT:-180}" bash -c ranks_nccl

# the engines' own code last, on a cut step (1024 tokens, 8 layers): what time is left
step engines "${ENGINES_TIMEOUT:-120}" "$PY" benchmarks/bench_engines.py --device cuda \
    --tokens 1024 --layers 8 --json "$OUTDIR/engines.json"


echo
echo "=== summary (logs and JSON in $OUTDIR) ==="
for name in tests e2e kernels bench ranks engines; do
    printf '%-8s %s\n' "$name" "${STATUS[$name]:-skipped}"
done
grep -hE '^[0-9]+ passed|passed|failed|error' "$OUTDIR/tests.log" 2>/dev/null | tail -1 || true
grep -h "configurations: every metric" "$OUTDIR/ranks.log" 2>/dev/null || true
"$PY" - "$OUTDIR" <<'EOF' || true
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return []
kern = load("triton_kernels.json")
if kern:
    print(f"\n{'triton kernel':22s} {'N':>6s} {'ns/pair':>8s} {'GB/s':>6s} {'of copy':>8s}")
    for r in kern:
        print(f"{r['kernel']:22s} {r['n']:6.0e} {r['ns_per_pair']:8.4f} {r['gbps']:6.0f} "
              f"{r['frac_of_copy']:8.0%}")
rows = load("bench.json")
rows = rows.get("rows", []) if isinstance(rows, dict) else rows
disp = [r for r in rows if "ns_per_pair_ours" in r]
if disp:
    print(f"\n{'policy':8s} {'N':>6s} {'ours':>8s} {'torch':>8s} {'roof':>8s} "
          f"{'speedup':>8s} {'ours/roof':>9s}   (ns per pair)")
    for r in disp:
        o, s, f = r["ns_per_pair_ours"], r["ns_per_pair_straightforward"], r["ns_per_pair_roofline"]
        print(f"{r['policy']:8s} {r['n']:6.0e} {o:8.4f} {s:8.4f} {f:8.4f} {s / o:7.1f}x "
              f"{o / f:8.2f}x")
rep = [r for r in rows if r.get("kind") == "replay"]
if rep:
    print(f"\n{'mode':5s} {'replay':8s} {'ranks':>5s} {'S':>3s} {'T':>5s} {'L':>3s} "
          f"{'replay s':>9s} {'M pairs/s':>10s} {'kernel s':>9s} {'replay/kernel':>14s}")
    for r in rep:
        print(f"{r['mode']:5s} {r['policy']:8s} {r['ranks']:5d} {r['steps']:3d} {r['tokens']:5d} "
              f"{r['layers']:3d} {r['replay_seconds']:9.3f} {r['replay_pairs_per_s'] / 1e6:10.1f} "
              f"{r['kernel_seconds']:9.3f} {r['replay_over_kernel']:14.2f}")
e2e = load("e2e.json")
if e2e:
    print(f"\n{'end to end':10s} {'device':6s} {'M pairs/s':>10s} {'start-up s':>11s}")
    for r in e2e:
        rate, start = r["e2e_pairs_per_s"], r["startup_s"]
        print(f"{r['policy']:10s} {r['device']:6s} "
              + ("lost in the noise" if rate is None else f"{rate / 1e6:10.1f} {start:11.2f}"))
eng = load("engines.json")
if eng:
    print(f"\n{'mode':5s} {'policy':15s} {'ours s':>8s} {'straight s':>10s} {'ours/row':>9s} "
          f"{'ours/roof':>10s}   (a DeepSeek-V3 step on the GPU)")
    for r in eng:
        st = "-" if r["straight_s"] is None else f"{r['straight_s']:.4f}"
        print(f"{r['mode']:5s} {r['policy']:15s} {r['ours_s']:8.4f} {st:>10s} "
              f"{r['ours_s'] / r['row_s']:9.2f} {r['ours_s'] / r['roof_s']:10.1f}")
EOF
echo "total ${SECONDS}s"
for name in tests e2e kernels bench ranks engines; do
    case "${STATUS[$name]:-ok}" in ok*) ;; *) exit 1 ;; esac
done
