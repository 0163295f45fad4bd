"""Figures of balance against traffic (DESIGN.md §13): where each placement solver sits between
GPU imbalance and fan-out, and what each costs in communication and in the whole MoE time.

Each takes `cases`, a dict from a case's name (a trace, a topology) to its Results, one a solver
(every one with a cost model, so that fan-out and time are counted); a solver keeps its colour
and marker in every panel, in the order solvers first appear.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..base.errors import InputError
from ..replay.results import Results
from .style import from_baseline, styles_in_order


def _solvers(cases: dict[str, Sequence[Results]]) -> dict[str, dict[str, str]]:
    """Each solver's colour and marker, in the order solvers first appear."""
    return styles_in_order(r.solver for rs in cases.values() for r in rs)


def _checked(cases: dict[str, Sequence[Results]]) -> None:
    if not cases or any(r.metrics.get("fanout_gpus") is None for rs in cases.values()
                        for r in rs):
        raise InputError("balance against traffic needs results with a cost model (fan-out "
                         "is counted with the links): replay with cost='roofline'")


def balance_against_traffic(cases: dict[str, Sequence[Results]]) -> Figure:
    """One panel a case: each solver's `fanout_gpus` (distinct GPUs a token and layer) against
    its `gpu_imbalance`, one marker a solver; lower and further left is better on both."""
    _checked(cases)
    styles = _solvers(cases)
    fig = Figure(figsize=(2.6 * len(cases) + 1.2, 3.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(cases), squeeze=False, sharey=True)[0])
    top = max(r.metrics["fanout_gpus"] for rs in cases.values() for r in rs)
    for ax, (case, results) in zip(axes, cases.items()):
        for r in results:
            m = r.metrics
            ax.plot(m["gpu_imbalance"], m["fanout_gpus"], linestyle="none", markersize=8,
                    label=r.solver, **styles[r.solver])
        ax.set_title(case)
        right = max(r.metrics["gpu_imbalance"] for r in results)
        ax.set_xlim(0.99, 1 + 1.2 * (right - 1) + 0.01)  # a ratio axis from 1.0
        ax.set_ylim(-0.03 * top, 1.1 * top)
        ax.set_xlabel("max / mean GPU load")
    axes[0].set_ylabel("fan-out (GPUs a token\nand layer)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", title="solver")
    return fig


def communication_and_time(cases: dict[str, Sequence[Results]]) -> Figure:
    """One panel a case: each solver's `comm_ms` and `moe_ms` (a step of the whole model)
    side by side, bars in the solver's colour, communication hatched."""
    _checked(cases)
    styles = _solvers(cases)
    fig = Figure(figsize=(2.6 * len(cases) + 0.6, 2.9), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(cases), squeeze=False)[0])
    for ax, (case, results) in zip(axes, cases.items()):
        x = np.arange(len(results))
        comm = [r.metrics["comm_ms"] for r in results]
        moe = [r.metrics["moe_ms"] for r in results]
        colors = [styles[r.solver]["color"] for r in results]
        ax.bar(x - 0.2, comm, 0.4, color=colors, hatch="///", edgecolor="white",
               label="comm_ms")
        ax.bar(x + 0.2, moe, 0.4, color=colors, label="moe_ms")
        ax.set_xticks(x, [r.solver for r in results], rotation=30, ha="right")
        ax.set_title(case)
        from_baseline(ax, 0.0)
    axes[0].set_ylabel("ms a step")
    axes[0].legend(loc="upper left", fontsize="small")
    return fig
