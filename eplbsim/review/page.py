"""A review's page (`review.Report`) as Markdown and as self-contained HTML (its figures
embedded as PNG data), one screen of headings: verdict, correctness, balance, time,
rebalancing, the rules, set-up. It reads a report's fields only (no import of `review`, which
imports this module), and matplotlib only when it draws."""

from __future__ import annotations

import base64
import html as _html
import io
from typing import Any

from .verdict import EXIT, exit_statuses, interval_words, number, rules

Report = Any  # a `review.Report`


def figure_png(report: Report) -> dict[str, str]:
    """The report's small multiples (`plots.review_figure`) as base64 PNG data by name."""
    from ..plots import review_figure

    buffer = io.BytesIO()
    review_figure(report.series, report.candidate, report.baseline).savefig(buffer, format="png")
    return {"summary": base64.b64encode(buffer.getvalue()).decode("ascii")}


def _table(rows: list[list[Any]], head: list[str]) -> list[str]:
    """A Markdown table."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _cell(value: Any) -> str:
    return number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else str(value)


def sections(report: Report) -> list[tuple[str, list[str]]]:
    """`(heading, Markdown lines)` of each section of the page."""
    r = report
    t = r.time
    verdict = [*r.headline, "", "Why:", *[f"- {reason}" for reason in r.reasons]]
    if r.warnings:
        verdict += ["", *[f"- {w}" for w in r.warnings]]
    out = [("Verdict: " + r.verdict, verdict), ("Correctness", _correctness(r)),
           ("Balance, held out", _balance(r)), ("Time", _time(r))]
    if r.rebalance:
        rb = r.rebalance
        out.append(("Rebalancing", [
            f"Every {rb['every']} steps ({rb['mode']}): {rb['rebalances']} rebalance(s), "
            f"{rb['moved_slots']} slots moved, stalls {number(rb['stall_ms'])} ms, hazard steps "
            f"{rb['hazard_steps']}. {number(rb['ms_per_step_with'])} ms a step against "
            f"{number(rb['ms_per_step_without'])} without: net {number(rb['net_ms'])} ms over the "
            f"scored steps."
            + (f" The baseline's solver moved {rb['baseline_moved_slots']} slots, stalls "
               f"{number(rb['baseline_stall_ms'])} ms." if "baseline_stall_ms" in rb else "")]))
    out.append(("How the verdict is reached", [
        f"{i}. {rule}" for i, rule in enumerate(
            rules(t["min_effect_pct"], t["level"], r.setup["kind"]), 1)] + [
        "", f"`eplbsim review` exits with status {EXIT[r.verdict]} for this verdict (exit "
            f"statuses: {exit_statuses()}), so a CI job can gate on it."]))
    s = r.setup
    solver = (f"solver {s['solver']}" if s["solver"] == s["baseline_solver"] else
              f"solvers {s['solver']} against {s['baseline_solver']}")
    out.append(("Set-up", [f"{r.candidate} against {r.baseline} in \"{r.mode}\" mode; placed "
                           f"on steps {s['placed_steps']}, scored on {s['scored_steps']} (the "
                           f"log's own step numbers); {s['gpus']} GPUs, "
                           f"{s['slots']} slots, {solver}, {s['seeds']} seed(s).",
                           "", f"Views: {s['views_why']}."]))
    return out


def _correctness(r: Report) -> list[str]:
    inv = r.invariance
    ce = inv["counterexample"]
    lines = [f"Claimed: {inv['claimed']}. Observed: {inv['observed']} "
             f"({inv['searched']} batch(es) searched)."]
    if ce:
        lines += ["", f"Smallest counterexample: step {ce['step']} (the log's own number), "
                      f"layer {ce['layer']}, "
                      f"token {ce['token']} of a {ce['rows']}-row batch, expert "
                      f"{ce['expert']}.", ""]
        lines += _table([[rank, slot] for rank, slot in ce["choices"].items()],
                        ["rank", "slot chosen"])
    late = inv.get("replay_disagrees")
    if late:
        lines += ["", f"The replay disagrees from step {late['step']}, layer "
                      f"{late['layer']} ({late['agreed']} of {late['pairs']} pairs agreed"
                  + ("; ranks were switching placements at different steps"
                     if late["during_switch"] else "") + ")."]
    moved = inv.get("moved")
    if moved is not None:
        wrong = ("no pair ran on a slot holding another expert" if moved["first_wrong_step"]
                 is None else f"pairs run on slots holding another expert from step "
                              f"{moved['first_wrong_step']}")
        lines += ["", f"Weights moved by {moved['engine']}'s own updater at each rebalance: "
                      f"slot mismatch {number(moved['slot_mismatch'])}, "
                      f"{moved['lost_experts']} lost expert(s), {moved['map_mismatch']} rank "
                      f"map(s) differing from what the dispatch reads; {wrong}."]
    return lines + ["", f"Toy MoE output error on the scored steps: "
                        f"{number(inv['output_rel_error'])}; rank agreement "
                        f"{number(inv['rank_agreement'])}."]


def _balance(r: Report) -> list[str]:
    b = r.balance
    d = b["difference"]
    lines = _table([[k, b["candidate"][k], b["baseline"][k]] for k in b["candidate"]],
                   ["metric", r.candidate, r.baseline])
    lines += ["", f"GPU imbalance (routed pairs), candidate less baseline: "
                  f"{number(d['difference'])}, {interval_words(d['interval'])}."]
    if len(b["per_layer"]["candidate"]) > 1:
        lines.append("Worst layers (GPU imbalance): " + ", ".join(
            f"layer {w['layer']} {number(w['candidate'])} (baseline {number(w['baseline'])})"
            for w in b["worst_layers"]) + ".")
    for who in ("candidate", "baseline"):
        for s in b["starved"][who]:
            lines.append(f"- {getattr(r, who)} starves slot {s['slot']} (layer {s['layer']}, "
                         f"expert {s['expert']}, {s['replicas']} replicas): "
                         f"{number(s['share_of_even'])} of its even share; the expert's pairs "
                         f"by row % {s['replicas']}: {s['row_residues']}")
    return lines


def _time(r: Report) -> list[str]:
    t = r.time
    boot = t["bootstrap"]
    lines = _table([[k, t["candidate"][k], t["baseline"][k]] for k in t["candidate"]],
                   ["", r.candidate, r.baseline])
    lines += ["", f"These times are the scored steps' ({r.setup['scored_steps']}, each policy "
                  f"on the placement solved from the steps before them), so `eplbsim run`, which "
                  f"prices every step on a placement solved from all of them, gives other "
                  f"figures for the same policy.",
              f"Difference {number(t['difference_ms'])} ms a step, "
                  f"{number(t['difference_pct'])}% ({_spread(t)}; over {boot['seeds']} "
                  f"seed(s), whose spread is {number(t['spread_ms'])} ms). Minimum effect "
                  f"{number(t['min_effect_pct'])}%.",
              f"Cost model {t['cost']} ({t['model']}, {t['model_from']}, on {t['device']}). "
              f"The {t['decides']['term']} term decides: "
              + ", ".join(f"{k} {number(v)} ms" if v else f"{k} none (it bounds no GPU in any "
                          f"step and layer at these sizes)"
                          for k, v in t["decides"]["ms_per_step"].items())
              + "."]
    m = t["measured"]
    lines.append("Measured: " + (
        f"{number(m['candidate_ms_per_step'])} ms a step against "
        f"{number(m['baseline_ms_per_step'])} ({m['source']})." if "unavailable" not in m
        else f"not priced: {m['unavailable']}"))
    lines += ["", "Held-out windows (each placed on every step before it):", ""]
    lines += _table([[w["scored_steps"], w["placed_steps"], w["difference_ms"], w["difference_pct"],
                      w["gpu_imbalance_difference"]] for w in t["windows"]],
                    ["scored steps", "placed on", "ms a step", "%", "GPU imbalance"])
    return lines


def _spread(time: dict) -> str:
    """The time difference's interval in ms and in %, and how it was drawn; or why there is
    none."""
    if time["interval_pct"] is None:
        return interval_words(None)
    lo, hi = time["interval_pct"]
    boot = time["bootstrap"]
    return (f"{interval_words(time['interval_ms'], ' ms')}, {number(lo)}% to {number(hi)}%: a "
            f"block bootstrap of {boot['resamples']} resamples, blocks of {boot['block_steps']} "
            f"steps")


def markdown(report: Report) -> str:
    """The page as Markdown (`report.md`)."""
    lines = [f"# Review: {report.candidate} against {report.baseline}", ""]
    for heading, body in sections(report):
        lines += [f"## {heading}", "", *body, ""]
    return "\n".join(lines)


def html(report: Report) -> str:
    """The page as one self-contained HTML document (`report.html`): the Markdown's sections,
    and the small multiples embedded."""
    parts = [f"<h1>Review: {_html.escape(report.candidate)} against "
             f"{_html.escape(report.baseline)}</h1>"]
    figures = figure_png(report)
    for i, (heading, body) in enumerate(sections(report)):
        parts.append(f"<h2>{_html.escape(heading)}</h2>")
        parts.append(_body_html(body))
        if i == 0:
            parts += [f'<img alt="{name}" src="data:image/png;base64,{data}" '
                      f'style="max-width:100%">' for name, data in figures.items()]
    style = ("body{font-family:sans-serif;max-width:70em;margin:1em auto;line-height:1.35}"
             "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:2px 8px}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>eplbsim review"
            f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>")


def _body_html(lines: list[str]) -> str:
    """Markdown lines of one section (paragraphs, bullets, tables) as HTML."""
    out, table = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            rows = [[c.strip() for c in row.strip("|").split("|")] for row in table
                    if not set(row) <= set("|-")]
            cells = "".join("<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{_html.escape(c)}"
                                             f"</{'th' if i == 0 else 'td'}>" for c in row)
                            + "</tr>" for i, row in enumerate(rows))
            out.append(f"<table>{cells}</table>")
            table = []
        if line.startswith("- "):
            out.append(f"<li>{_html.escape(line[2:])}</li>")
        elif line:
            out.append(f"<p>{_html.escape(line)}</p>")
    return "".join(out)
