"""A review's verdict from its findings (`review.Report`'s sections, plain dicts): the rules, the
one line each axis gets, and the reasons, each with its numbers. Pure functions; no replay.

The rules (`rules()` words them for the page), in the order they are tried:
1. A candidate whose ranks choose different replicas in "none" mode, or whose pairs run on slots
   holding another expert after a rebalance (`--migration`: the engine's updater moved the
   weights, `migration.replayed`), corrupts the layer's output: **not recommended**, whatever
   else holds.
2. Fewer than `MIN_SCORED_STEPS` scored steps, or, reviewing a dispatch change, no replicated
   expert carrying load in them (the dispatch choice cannot matter): **insufficient evidence**.
3. A candidate whose dispatch buffer overflows (`--dispatch-buffer-gib`, `--dispatch-cap`: a
   rank dispatches more tokens a step than the buffer its physical slots leave admits) where
   its baseline's does not: **not recommended** (DESIGN.md §16).
4. A rebalance schedule whose stalls outweigh the time it saves: **not recommended**.
5. The time difference is the candidate's step time over the baseline's, in %, with its interval
   over resampled steps and seeds (`evidence`); `m` is the minimum effect.
   - When the `measured` cost model priced both and its difference has the other sign from the
     run's cost model's, the cost models disagree: **insufficient evidence**, both shown.
   - **Recommend** only when the interval lies wholly below `-m` (faster by more than the
     minimum effect), the candidate is faster on every held-out window, and, reviewing a
     dispatch change, its GPU imbalance is not worse beyond its own interval (the interval of
     the difference lies above 0). A placement change for traffic trades balance for fewer
     destinations by design: its GPU imbalance is reported beside the time, which decides.
   - **Not recommended** when the interval lies wholly above `+m`.
   - Anything else is **insufficient evidence**, naming each rule that failed: the interval
     holds 0, the gain is below the minimum effect, and (for a gain) a window that is not faster
     and a balance that is worse.
"""

from __future__ import annotations

import math
from typing import Any

from ..base.errors import EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED
from .evidence import LEVEL, UNBOUNDED

EXIT = {"recommend": 0, "not recommended": 1, "insufficient evidence": 3}


def exit_statuses() -> str:
    """Every exit status of `eplbsim review`, in words: its verdicts' and the ones every
    command shares (`base.errors`)."""
    verdicts = ", ".join(f"{status} {verdict}" for verdict, status in EXIT.items())
    return (f"{verdicts}; {EXIT_INPUT} a usage or input error (or more memory than the machine "
            f"has); {EXIT_INTERNAL} an internal error (a bug in eplbsim: please report it); "
            f"{EXIT_INTERRUPTED} interrupted")
MIN_SCORED_STEPS = 4  # fewer scored steps than this is too little to judge
MIN_EFFECT = 1.0  # % of the baseline's step time: the smallest gain worth a pull request


def number(value: Any) -> str:
    """A number in 4 significant digits, `-` when undefined."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{float(value):.4g}"


def rules(min_effect: float, level: float, kind: str = "dispatch") -> list[str]:
    """The rules of the module doc, as the page states them for a review of a `kind`
    change ("dispatch" or "placement")."""
    m, p = f"{number(min_effect)}%", f"{number(level * 100)}%"
    balance = (" and its GPU imbalance is not worse beyond its own interval" if kind == "dispatch"
               else " (its GPU imbalance is shown beside: a placement for traffic trades it "
                    "for fewer destinations)")
    return [
        "A candidate whose ranks choose different replicas in \"none\" mode, or whose pairs "
        "run on slots holding another expert after a rebalance (--migration: the engine's "
        "updater moved the weights), is not recommended, whatever else holds: it corrupts the "
        "layer's output.",
        f"Fewer than {MIN_SCORED_STEPS} scored steps"
        + (", or no replicated expert carrying load," if kind == "dispatch" else "")
        + " is insufficient evidence.",
        "A candidate whose dispatch buffer overflows (a rank dispatches more tokens a step "
        "than --dispatch-buffer-gib or --dispatch-cap admits) where its baseline's does not is "
        "not recommended.",
        "A rebalance schedule whose stalls outweigh the time it saves is not recommended.",
        "When the measured tables price both runs and their difference has the other sign "
        "from the cost model's, the cost models disagree: insufficient evidence.",
        f"Recommend only when the time difference's {p} interval lies wholly below -{m} (the "
        f"minimum effect) and the candidate is faster on every held-out window{balance}.",
        f"Not recommended when the time difference's interval lies wholly above +{m}.",
        "Anything else is insufficient evidence, naming the rule that failed.",
    ]


def judge(invariance: dict, balance: dict, time: dict, rebalance: dict | None, scored: int,
          mode: str, kind: str = "dispatch",
          buffer: dict | None = None) -> tuple[str, list[str], list[str]]:
    """`(verdict, reasons, headline)`: the verdict by the rules (module doc) for a review of a
    `kind` change ("dispatch" or "placement"), each reason with the numbers behind it, and one
    line per axis (correctness, balance, time; the dispatch buffer's when `buffer`, the
    findings of `measures.buffer_findings`, is given)."""
    headline = [correctness_line(invariance, mode), balance_line(balance), time_line(time)]
    if buffer is not None:
        headline.append(buffer_line(buffer))
    if "mechanism" in time:  # the review's findings hold it
        headline.append(mechanism_line(time, mode))
    if mode == "none" and invariance["observed"] == "variant":
        return "not recommended", [_corruption(invariance)], headline
    moved = invariance.get("moved")
    if moved is not None and moved["first_wrong_step"] is not None:
        return "not recommended", [_wrong_weights(moved)], headline
    if buffer is not None and buffer["candidate"]["overflow_steps"] \
            and not buffer["baseline"]["overflow_steps"]:
        return "not recommended", [_overflows(buffer)], headline
    reasons = []
    if scored < MIN_SCORED_STEPS:
        reasons.append(f"only {scored} scored step(s); at least {MIN_SCORED_STEPS} are needed")
    if kind == "dispatch" and balance["replicated_loaded_pairs"] == 0:
        reasons.append("no replicated expert carries load in the scored steps: the dispatch "
                       "choice cannot matter")
    if reasons:
        return "insufficient evidence", reasons, headline
    if rebalance is not None and rebalance["net_ms"] < 0:
        return "not recommended", [
            f"rebalancing every {rebalance['every']} steps ({rebalance['mode']}) saves "
            f"{number(rebalance['saved_ms_per_step'])} ms a step over {scored} steps but stalls "
            f"{number(rebalance['stall_ms'])} ms: net {number(rebalance['net_ms'])} ms"], headline
    verdict, reasons = _time_verdict(balance, time, kind)
    return verdict, reasons, headline


def _time_verdict(balance: dict, time: dict, kind: str) -> tuple[str, list[str]]:
    """Rule 4 of the module doc."""
    lo, hi = time["interval_pct"]
    m = time["min_effect_pct"]
    said = (f"{_signed(time['difference_pct'])}% a step "
            f"({interval_words(time['interval_pct'], '%')}, "
            f"{number(time['difference_ms'])} ms of the baseline's "
            f"{number(time['baseline']['ms_per_step'])} ms)")
    term = f"{time['decides']['term']} decide the time"
    reasons = []
    disagree = _disagreement(time)
    if disagree:
        reasons.append(disagree)
    if not reasons and lo > m:
        return "not recommended", [f"slower by more than the minimum effect of {number(m)}%: "
                                   f"{said}; {term}"]
    if math.isnan(lo) or lo <= 0 <= hi:
        reasons.append(f"the time difference's interval holds 0: {said}")
    elif not hi < -m:
        reasons.append(f"below the minimum effect of {number(m)}%: {said} does not lie wholly "
                       f"{'below -' if hi < 0 else 'above +'}{number(m)}%")
    if time["difference_ms"] < 0:  # a gain: what else a recommendation needs
        slow = [w for w in time["windows"] if not w["difference_ms"] < 0]
        if slow:
            reasons.append(f"not faster on {len(slow)} of {len(time['windows'])} held-out "
                           f"windows: " + ", ".join(
                               f"steps {w['scored_steps']} {_signed(w['difference_pct'])}%"
                               for w in slow))
        b = balance["difference"]
        if kind == "dispatch" and b["interval"][0] > 0:
            reasons.append(f"its GPU imbalance is worse beyond its interval: "
                           f"{_signed(b['difference'])} ({interval_words(b['interval'])})")
    weighed = _weighed(balance, time)
    if reasons:
        return "insufficient evidence", reasons + weighed
    return "recommend", [f"faster by more than the minimum effect of {number(m)}%: {said}, and "
                         f"faster on all {len(time['windows'])} held-out windows; {term}",
                         *weighed]


def _weighed(balance: dict, time: dict) -> list[str]:
    """The rest of what rule 4 weighed, each piece with the way it points: the point estimate,
    every held-out window, the GPU imbalance and the measured tables."""
    pct = time["difference_pct"]
    lines = [f"weighed: the point estimate leans {_faster(time['difference_ms'])}, "
             f"{_signed(pct)}% a step",
             "weighed: the held-out windows, " + ", ".join(
                 f"steps {w['scored_steps']} {_signed(w['difference_pct'])}% "
                 f"({_faster(w['difference_ms'])})"
                 for w in time["windows"])]
    b = balance["difference"]
    lines.append(f"weighed: GPU imbalance {_signed(b['difference'])} "
                 f"({interval_words(b['interval'])}), {_direction(b['interval'])}")
    if "difference_ms" in time["measured"]:
        lines.append(f"weighed: the measured tables, {_signed(_measured_pct(time['measured']))}%"
                     f" a step ({_faster(time['measured']['difference_ms'])})")
    return lines


def _disagreement(time: dict) -> str | None:
    """Words saying the measured tables and the run's cost model disagree on the sign of the
    difference, or None."""
    measured = time["measured"]
    if "difference_ms" not in measured:
        return None
    ours, theirs = time["difference_ms"], measured["difference_ms"]
    if ours * theirs >= 0:
        return None
    return (f"the cost models disagree: {time['cost']} says {_faster(ours)}, "
            f"{_signed(ours)} ms a step ({_signed(time['difference_pct'])}% of "
            f"{number(time['baseline']['ms_per_step'])} ms); measured says {_faster(theirs)}, "
            f"{_signed(theirs)} ms a step ({_signed(_measured_pct(measured))}% of "
            f"{number(measured['baseline_ms_per_step'])} ms)")


def _measured_pct(measured: dict) -> float:
    """The measured tables' difference in % of the baseline's step time."""
    base = measured["baseline_ms_per_step"]
    return measured["difference_ms"] / base * 100 if base else math.nan


def _wrong_weights(moved: dict) -> str:
    """Rule 1's reason for a run whose rebalances left pairs computed by the wrong expert."""
    what = (f"{number(moved['slot_mismatch'])} of the slots hold another expert than the map "
            f"names after {moved['engine']}'s updater moved them"
            if moved["slot_mismatch"] else
            f"{moved['engine']}'s updater moved every slot right, but pairs are sent to slots "
            f"holding another expert")
    lost = (f" ({moved['lost_experts']} (rebalance, layer, expert) left with no replica)"
            if moved["lost_experts"] else "")
    return (f"the output is wrong from step {moved['first_wrong_step']}: {what}{lost}; it "
            f"corrupts the layer's output")


def _corruption(invariance: dict) -> str:
    """Rule 1's reason: where ranks disagree, and what it costs."""
    ce, late = invariance["counterexample"], invariance.get("replay_disagrees")
    if ce:
        where = (f"step {ce['step']}, layer {ce['layer']}, token {ce['token']}, expert "
                 f"{ce['expert']} of a {ce['rows']}-row batch: ranks chose "
                 f"[{', '.join(map(str, sorted(set(ce['choices'].values()), key=str)))}]")
    elif late:
        where = (f"from step {late['step']}, layer {late['layer']} of the replay"
                 + (", while ranks switched placements at different steps"
                    if late["during_switch"] else ""))
    else:
        where = "the replay"
    return (f"ranks choose different replicas in \"none\" mode ({where}); output error "
            f"{number(invariance['output_rel_error'])}, rank agreement "
            f"{number(invariance['rank_agreement'])}: it corrupts the layer's output")


def _overflows(buffer: dict) -> str:
    """The reason a candidate that overflows its dispatch buffer where its baseline does not is
    not recommended."""
    c, b = buffer["candidate"], buffer["baseline"]
    return (f"its dispatch buffer overflows in {c['overflow_steps']} of {buffer['steps']} "
            f"scored steps (a rank dispatches up to {c['peak_tokens']} tokens, over the cap of "
            f"{c['cap']} its {c['slots']} physical slots leave), where the baseline's "
            f"(cap {b['cap']}, {b['slots']} slots) never does")


def buffer_line(buffer: dict) -> str:
    """The headline's dispatch-buffer line."""
    def side(s: dict) -> str:
        return (f"cap {s['cap']} tokens a rank ({s['slots']} slots), busiest rank "
                f"{s['peak_tokens']}, {s['overflow_steps']} overflowing step(s)")
    c, b = buffer["candidate"], buffer["baseline"]
    if c == b:
        return f"Dispatch buffer: both sides {side(c)} of {buffer['steps']}."
    return f"Dispatch buffer: candidate {side(c)}; baseline {side(b)}; of {buffer['steps']}."


def correctness_line(invariance: dict, mode: str) -> str:
    """The headline's correctness line."""
    moved = invariance.get("moved")
    if moved is not None and moved["first_wrong_step"] is not None:
        return (f"Correctness: pairs run on slots holding another expert from step "
                f"{moved['first_wrong_step']} (weights moved by {moved['engine']}'s updater; "
                f"slot mismatch {number(moved['slot_mismatch'])}).")
    if mode != "none":
        return "Correctness: not at stake in a2a (each token is dispatched once, by its owner)."
    claimed = f"claimed class: {invariance['claimed']}"
    if invariance["observed"] == "variant":
        return (f"Correctness: ranks choose different replicas; {claimed}; output error "
                f"{number(invariance['output_rel_error'])}.")
    return (f"Correctness: ranks agree in {invariance['searched']} batches searched and in the "
            f"scored replay; {claimed}; output error {number(invariance['output_rel_error'])}.")


def balance_line(balance: dict) -> str:
    """The headline's balance line: GPU imbalance, candidate against baseline, the difference
    with its interval, and what it says."""
    b = balance["difference"]
    word = "" if b["interval"] is None else f": {_direction(b['interval'])}"
    cand, base = balance["candidate"], balance["baseline"]
    traffic = (f" Fan-out {number(cand['fanout_gpus'])} GPUs a token and layer against "
               f"{number(base['fanout_gpus'])}." if cand.get("fanout_gpus") is not None else "")
    return (f"Balance: GPU imbalance {number(cand['gpu_imbalance'])} against "
            f"{number(base['gpu_imbalance'])}, {_signed(b['difference'])} "
            f"({interval_words(b['interval'])}){word}.{traffic}")


def time_line(time: dict) -> str:
    """The headline's time line: the difference in % with its interval, the minimum effect,
    the held-out windows, and the measured tables' difference when they priced both."""
    faster = sum(w["difference_ms"] < 0 for w in time["windows"])
    line = (f"Time ({time['cost']}): {_signed(time['difference_pct'])}% a step "
            f"({interval_words(time['interval_pct'], '%')}); minimum effect "
            f"{number(time['min_effect_pct'])}%; faster on {faster} of {len(time['windows'])} "
            f"held-out windows")
    if "difference_ms" in time["measured"]:
        line += f"; measured: {_signed(_measured_pct(time['measured']))}%"
    return line + "."


def mechanism_line(time: dict, mode: str) -> str:
    """The headline's line saying, in the cost model's terms, what moves the time: the compute
    or the communication, and for compute whether the slowest GPU reads more or fewer experts'
    weights, computes more or fewer pairs, and carries more or less than its even share. A
    term the two runs price alike says so in words (in `mode` "none" the communication is
    every token's, whatever the dispatch)."""
    m = time["mechanism"]
    c, b = m["candidate"], m["baseline"]

    def term(name: str, ms: float) -> str:
        if ms:
            return f"{name} {_signed(ms)} ms a step"
        why = (" (in \"none\" mode every rank receives every token, whatever the dispatch)"
               if name == "communication" and mode == "none" else "")
        return f"{name} unchanged{why}"
    moved = f"{term('compute', m['compute_ms'])}, {term('communication', m['comm_ms'])}" + (
        f": the {m['moved']} moves it" if m["compute_ms"] or m["comm_ms"] else
        ": nothing moves it")

    def way(key: str, noun: str) -> str:
        ours, theirs = c[key], b[key]
        word = "more" if ours > theirs else "fewer" if ours < theirs else "as many"
        return f"{word} {noun} ({number(ours)} against {number(theirs)})"
    return (f"Mechanism: {moved}. The slowest GPU of a step and layer reads the weights of "
            f"{way('active', 'experts')}, computes {way('pairs', 'pairs')}, and carries "
            f"{number(c['share'])} of an even share against {number(b['share'])}.")


def rests_on_line(time: dict, trace_layers: int, model_layers: int, steps: dict,
                  recovery: str | None = None) -> str:
    """The headline's line saying what the verdict rests on: which cost model priced it (and
    whether the measured tables could), how many logged layers stand in for the model's, and
    which steps were scored and placed on (`steps`: `scored_steps` and `placed_steps`, in
    the log's own numbers, `traces.steps.span_words`), and after dead ranks the `recovery`
    that served the survivors."""
    measured = time["measured"]
    priced = (f"priced by {time['cost']} and the measured tables"
              if "difference_ms" in measured else
              f"priced by {time['cost']} alone (the measured tables do not price this run: "
              f"{measured.get('unavailable', 'not asked')})")
    layers = (f"{trace_layers} logged layer{'' if trace_layers == 1 else 's'} stand"
              f"{'s' if trace_layers == 1 else ''} in for the model's {model_layers} MoE layers")
    return (f"Rests on: {priced}; {layers} ({time['model']}); scored on the held-out steps "
            f"{steps['scored_steps']}, each policy on "
            + ("" if recovery is None else f"recovery {recovery} on the survivors of ")
            + f"the placement solved from steps {steps['placed_steps']}.")


def _faster(difference: float) -> str:
    return "faster" if difference < 0 else "slower" if difference > 0 else "no different"


def _signed(value: float | None) -> str:
    """A number with its sign: `+0.012`, `-3.1`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = number(value)
    return text if text.startswith("-") else f"+{text}"


def interval_words(bounds: list[float] | None, unit: str = "") -> str:
    """`95% interval -0.2% to +0.1%`-style words for `bounds` `[lo, hi]`; for None (one scored
    step, `evidence.bounds`) that it cannot be bounded."""
    if bounds is None:
        return UNBOUNDED
    lo, hi = bounds
    return f"{number(LEVEL * 100)}% interval {_signed(lo)}{unit} to {_signed(hi)}{unit}"


def _direction(bounds: list[float]) -> str:
    """Which way a difference in GPU imbalance points, beyond its interval `bounds`."""
    lo, hi = bounds
    return "better" if hi < 0 else "worse" if lo > 0 else "no difference beyond its interval"


__all__ = ["EXIT", "MIN_EFFECT", "exit_statuses", "mechanism_line", "rests_on_line", "MIN_SCORED_STEPS", "balance_line", "correctness_line",
           "interval_words", "judge", "number", "rules", "time_line"]
