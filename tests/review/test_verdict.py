"""`eplbsim.review.verdict`: each rule on findings made by hand, in the order the rules are tried, and
the headline's one line per axis."""

import pytest

from eplbsim.review.verdict import MIN_SCORED_STEPS, judge, rules


def findings(pct=(-3.0, -4.0, -2.0), windows=(-3.0, -3.0), balance=(-0.01, -0.02, 0.0),
             measured=None, observed="invariant (none found)", loaded=100):
    """`(invariance, balance, time)` of a review: the time difference in % with its interval,
    each window's %, the GPU imbalance difference with its interval, the measured tables'
    difference in ms (None: not priced)."""
    base_ms = 10.0
    invariance = {"observed": observed, "claimed": "invariant", "searched": 9,
                  "counterexample": None, "output_rel_error": 0.0, "rank_agreement": 1.0}
    bal = {"candidate": {"gpu_imbalance": 1.1 + balance[0]}, "baseline": {"gpu_imbalance": 1.1},
           "difference": {"difference": balance[0], "interval": list(balance[1:])},
           "replicated_loaded_pairs": loaded}
    time = {"cost": "roofline", "difference_pct": pct[0], "interval_pct": list(pct[1:]),
            "difference_ms": pct[0] / 100 * base_ms, "min_effect_pct": 1.0,
            "candidate": {"ms_per_step": base_ms * (1 + pct[0] / 100)},
            "baseline": {"ms_per_step": base_ms}, "decides": {"term": "weight reads"},
            "windows": [{"scored_on": [i, i + 1], "scored_steps": str(i),
                         "difference_ms": w / 100 * base_ms,
                         "difference_pct": w} for i, w in enumerate(windows)],
            "measured": {"unavailable": "no table"} if measured is None else {
                "difference_ms": measured, "candidate_ms_per_step": 20.0 + measured,
                "baseline_ms_per_step": 20.0}}
    return invariance, bal, time


def verdict_of(*args, rebalance=None, scored=8, mode="none", **kwargs):
    return judge(*findings(*args, **kwargs), rebalance, scored, mode)


def test_faster_beyond_the_minimum_effect_everywhere_is_recommended():
    verdict, reasons, headline = verdict_of()
    assert verdict == "recommend" and "faster on all 2 held-out windows" in reasons[0]
    assert [line.split(":")[0] for line in headline] == ["Correctness", "Balance",
                                                         "Time (roofline)"]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(pct=(-0.001, -0.0012, -0.0008)), "below the minimum effect of 1%"),
    (dict(pct=(-3.0, -6.0, 0.5)), "interval holds 0"),
    (dict(pct=(-2.0, -3.0, -0.5)), "below the minimum effect"),
    (dict(windows=(-5.0, 1.0)), "not faster on 1 of 2 held-out windows"),
    (dict(balance=(0.05, 0.01, 0.09)), "GPU imbalance is worse beyond its interval"),
    (dict(measured=0.4), "the cost models disagree: roofline says faster"),
    (dict(pct=(3.0, 2.0, 4.0), measured=-0.4), "measured says faster"),
])
def test_anything_short_of_the_rules_is_insufficient_evidence_saying_why(kwargs, fragment):
    verdict, reasons, _ = verdict_of(**kwargs)
    assert verdict == "insufficient evidence"
    assert any(fragment in r for r in reasons), reasons


def test_slower_beyond_the_minimum_effect_is_not_recommended_unless_the_models_disagree():
    assert verdict_of(pct=(3.0, 2.0, 4.0))[0] == "not recommended"
    assert verdict_of(pct=(3.0, 2.0, 4.0), measured=0.2)[0] == "not recommended"
    assert verdict_of(pct=(0.5, 0.2, 0.8))[0] == "insufficient evidence"


def test_corruption_and_missing_evidence_come_first():
    verdict, reasons, headline = verdict_of(observed="variant", measured=0.4)
    assert verdict == "not recommended" and "corrupts" in reasons[0]
    assert headline[0].startswith("Correctness: ranks choose different replicas")
    assert verdict_of(mode="a2a", observed="variant")[0] == "recommend"  # exact in a2a
    verdict, reasons, _ = verdict_of(scored=MIN_SCORED_STEPS - 1, loaded=0)
    assert verdict == "insufficient evidence" and len(reasons) == 2
    stalls = {"net_ms": -5.0, "every": 2, "mode": "sync", "saved_ms_per_step": 0.1,
              "stall_ms": 6.0}
    verdict, reasons, headline = verdict_of(rebalance=stalls)
    assert verdict == "not recommended" and "stalls 6 ms" in reasons[0] and len(headline) == 3


def test_the_page_states_the_rules_with_the_minimum_effect():
    stated = rules(2.5, 0.95)
    assert len(stated) == 8 and "-2.5%" in stated[5] and "+2.5%" in stated[6]
    assert "95% interval" in stated[5] and "dispatch buffer overflows" in stated[2]


def _buffer(cand_over, base_over, cand_slots=448, base_slots=384):
    def side(over, slots):
        cap = {448: 1843, 384: 2150}[slots]  # DeepSeek-V4.1-Flash, EP16, 32 GiB
        return {"cap": cap, "peak_tokens": cap + 8 if over else cap - 8,
                "overflow_steps": over, "slots": slots}
    return {"candidate": side(cand_over, cand_slots), "baseline": side(base_over, base_slots),
            "steps": 8}


def test_a_candidate_overflowing_where_its_baseline_does_not_is_not_recommended():
    verdict, reasons, headline = judge(*findings(), None, 8, "a2a", buffer=_buffer(3, 0))
    assert verdict == "not recommended"
    assert "overflows in 3 of 8" in reasons[0] and "cap of 1843" in reasons[0]
    assert headline[3].startswith("Dispatch buffer: candidate cap 1843")


@pytest.mark.parametrize("cand, base", [(0, 0), (3, 3), (0, 2)])
def test_a_buffer_both_sides_share_does_not_decide(cand, base):
    verdict, _, headline = judge(*findings(), None, 8, "a2a", buffer=_buffer(cand, base))
    assert verdict == "recommend" and headline[3].startswith("Dispatch buffer")
    same = judge(*findings(), None, 8, "a2a", buffer=_buffer(cand, cand, 448, 448))[2]
    assert same[3].startswith("Dispatch buffer: both sides")
