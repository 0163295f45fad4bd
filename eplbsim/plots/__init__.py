"""Matplotlib figures from replay Results; the only eplbsim package that imports matplotlib.

Holds the figures by family and the paper figures (`figures`: `FIGURES`, rebuilt by
`eplbsim figures`). Takes in `Results` and traces; gives out matplotlib figures. Imports `base`,
`placement`, `traces`, `solvers`, `dispatch`, `schedule`, `engines` (its policies' names, for
their styles), `metrics`, `runspec` and `replay`.

Dimensions: `S` steps, `L` MoE layers, `E` logical experts, `P` physical slots, `R` max replicas
of one expert, `G` GPUs = EP ranks.

Every figure function is pure: it reads `Results` (metrics, `slot_load [S, L, P]`,
`true_load [S, L, E]`, `epochs`) and returns a new `matplotlib.figure.Figure`, built directly
rather than through pyplot, so nothing here selects a backend or touches global state: a script
saves it with ``fig.savefig(path)`` or :func:`save_figure` (``plt.savefig`` saves pyplot's
current figure, which this is not), and a notebook (after ``%matplotlib inline``) shows it as a
cell's last expression. Nothing is computed beyond what the plot needs; numbers come from the
metrics `replay` already measured. Each policy has its own colour and marker, the same
in every figure (`policy_style`: Okabe-Ito's colour-blind safe hues first); modes take fills
and line styles. An axis of counts, shares or times starts at 0 and one of max / mean ratios
at 1.0, or its label says where it starts.

By family: `style` (colours, markers, the paper style, saving, the shared drawing helpers),
`runs` (one comparison's runs), `paper` (the notebooks' figures), `trace` (one trace's, before
any placement), `review` (the review page's), `legibility` (`illegible`: the texts of a figure
that overlap or leave the canvas, measured; notebooks assert ``not illegible(fig)`` beside
each figure they show).
"""

from __future__ import annotations

from matplotlib.figure import Figure  # what every figure function returns

from .legibility import illegible
from .paper import (expert_load_heatmap, policy_mode_bars, predictor_time_series,
                    redundancy_curves, replica_loads_pair, solver_gap_lines, switch_hazard,
                    time_bars_and_stalls, workload_batching)
from .review import REVIEW_BARS, review_figure
from .runs import policy_comparison, replica_loads_over_time, time_series_figure
from .style import (OKABE_ITO, PAPER_STYLE, POLICY_COLORS, POLICY_MARKERS, paper_style,
                    policy_style, policy_styles, save_figure)
from .trace import (TRACE_FIGURES, coactivation_heatmap, step_imbalance, top_share_over_steps,
                    trace_figures)
from .traffic import balance_against_traffic, communication_and_time

__all__ = ["Figure", "OKABE_ITO", "PAPER_STYLE", "POLICY_COLORS", "POLICY_MARKERS", "REVIEW_BARS",
           "TRACE_FIGURES", "balance_against_traffic", "coactivation_heatmap",
           "communication_and_time", "expert_load_heatmap", "illegible", "paper_style",
           "policy_comparison", "policy_mode_bars", "policy_style", "policy_styles",
           "predictor_time_series", "redundancy_curves", "replica_loads_over_time",
           "replica_loads_pair", "review_figure", "save_figure", "solver_gap_lines",
           "step_imbalance", "switch_hazard", "time_bars_and_stalls", "time_series_figure",
           "top_share_over_steps", "trace_figures", "workload_batching"]
