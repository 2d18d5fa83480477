"""benchmarks/fuzz_engine_drift.py's comparison: which engine pairs differ, over which requests (no engine).

Hand-made engine outputs of one stream: one pass-on engine with a drifted request, a request the
guard acted on (read stale by pass off), the rest identical everywhere.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fuzz_engine_drift import compare  # noqa: E402


def engine(shift=None, fresh=()):
    """Four requests of two tokens; ``shift``: rid -> (position, logprob change); ``fresh``: the
    requests this engine's trace says a builder ran fresh on a slot-reading path."""
    results = {}
    for rid in ("q1", "q2", "q3", "q4"):
        logprobs = [-1.0, -2.0]
        position, change = (shift or {}).get(rid, (0, 0.0))
        logprobs[position] += change
        results[rid] = dict(tokens=[5, 6], logprobs=logprobs, top=[], finished=True)
    trace = dict(fresh_reads={f"{rid}-0000abcd": "decode" for rid in fresh})
    return dict(results=results, traces=[trace])


def test_one_engines_drift_shows_in_its_pairs_only_and_acted_on_requests_are_left_out_against_pass_off():
    runs = {
        "on_a": engine(shift={"q3": (1, 0.03125)}, fresh=["q2"]),  # the odd engine
        "on_b": engine(fresh=["q2"]),
        "fix_a": engine(fresh=["q2"]),  # zeroed by the harness: q2 as with the pass
        "off": engine(shift={"q2": (0, 2.0)}),  # the bug: q2 read its stale slot (its trace silent)
    }
    found = compare(runs)
    assert found["acted_on"] == ["q2"]
    moved = {pair: result["moved"] for pair, result in found["pairs"].items()}
    assert moved == {"on_a vs on_b": {"q3": 1}, "on_a vs fix_a": {"q3": 1}, "on_a vs off": {"q3": 1},
                     "on_b vs fix_a": {}, "on_b vs off": {}, "fix_a vs off": {}}
    assert found["pairs"]["on_a vs on_b"]["largest_shift"] == 0.03125
    assert found["pairs"]["on_b vs off"]["largest_shift"] == 0.0


def test_a_request_only_pass_off_read_stale_is_left_out_against_that_engine_only():
    # the clean pass-off engine read q4 stale where no pass-on engine acted: left out of its pairs
    runs = {"on_a": engine(), "clean": engine(shift={"q4": (0, 1.0)}, fresh=["q4"]), "on_b": engine()}
    moved = {pair: result["moved"] for pair, result in compare(runs)["pairs"].items()}
    assert moved == {"on_a vs clean": {}, "on_a vs on_b": {}, "clean vs on_b": {}}


def test_engines_that_fix_the_bug_are_compared_on_the_requests_they_fixed_too():
    # a pass-on engine that zeroed q2 differently from the harness's fix: a difference, not left out
    runs = {"on_a": engine(shift={"q2": (0, 0.25)}, fresh=["q2"]), "fix_a": engine(fresh=["q2"])}
    assert compare(runs)["pairs"]["on_a vs fix_a"]["moved"] == {"q2": 0}


def test_inductor_deterministic_engines_are_judged_as_their_guard_says():
    # on_det acted on q2 (pass off read it stale): left out against off_det only; on_det's own drift
    # on q3 shows against every engine
    runs = {"on_det": engine(shift={"q3": (1, 0.5)}, fresh=["q2"]), "off_det": engine(shift={"q2": (0, 2.0)}),
            "on_a": engine(fresh=["q2"])}
    found = compare(runs)
    assert found["acted_on"] == ["q2"]
    moved = {pair: result["moved"] for pair, result in found["pairs"].items()}
    assert moved == {"on_det vs off_det": {"q3": 1}, "on_det vs on_a": {"q3": 1}, "off_det vs on_a": {}}
