"""Benchmark the dispatch hot path: `python benchmarks/bench_dispatch.py [options]`.

The same as `eplbsim bench [options]` (all logic lives in `eplbsim.replay.bench`; options are
the CLI's: --device, --n, --policies, --repeats, --replay/--no-replay,
--replay-steps/-tokens/-layers, --seed, --json). Results are recorded in benchmarks/RESULTS.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from eplbsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
