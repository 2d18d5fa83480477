"""harness.fuzz_judge: how the fuzz judges one request against its reference (no engine).

Hand-written results: what counts as a match, a near tie (a differing token
where the reference's top two were within NEAR_TIE_TOL) and a mismatch, and
how a preempted request is compared with its resume references, and which
requests the pass changed without acting on them.
"""

import json

import pytest

from harness.fuzz import FuzzRequest
from harness.fuzz_judge import (DRIFT_TOL, NEAR_TIE_TOL, classify, classify_resumed, engine_drift,
                                first_token_mismatch, footprint_problem, host_noise, largest_shift,
                                perturbed_by_pass)


def result(tokens, logprobs, tops=None, **extra):
    tops = tops or [[[t, lp], [t + 1, lp - 1.0]] for t, lp in zip(tokens, logprobs)]
    return dict(tokens=tokens, logprobs=logprobs, top=tops, **extra)


REF = result([5, 6, 7, 8], [-1.0, -2.0, -0.5, -1.5],
             tops=[[[5, -1.0], [9, -3.0]], [[6, -2.0], [4, -2.0 - NEAR_TIE_TOL / 2]],
                   [[7, -0.5], [3, -0.9]], [[8, -1.5], [2, -4.0]]])


def test_same_tokens_and_logprobs_match():
    assert classify(REF, result([5, 6, 7, 8], [-1.0, -2.0, -0.5, -1.5], finished=True), 4)[0] == "match"


def test_first_token_far_from_a_tie_is_a_mismatch():
    kind, why = classify(REF, result([9, 6, 7, 8], [-1.2, -2.0, -0.5, -1.5], finished=True), 4)
    assert kind == "mismatch" and "token #0" in why


def test_token_at_a_near_tie_is_a_near_tie_and_the_rest_is_not_compared():
    got = result([5, 4, 1, 1], [-1.0, -2.0, -9.0, -9.0], finished=True)
    assert classify(REF, got, 4)[0] == "near_tie"


def test_token_outside_the_references_top_is_a_mismatch():
    assert classify(REF, result([5, 6, 99, 8], [-1.0, -2.0, -0.5, -1.5], finished=True), 4)[0] == "mismatch"


@pytest.mark.parametrize("drift, kind", [(DRIFT_TOL * 0.9, "match"), (DRIFT_TOL * 1.1, "mismatch")])
def test_logprob_drift_of_matching_tokens(drift, kind):
    got = result([5, 6, 7, 8], [-1.0, -2.0 + drift, -0.5, -1.5], finished=True)
    assert classify(REF, got, 4)[0] == kind


def test_lengths_must_be_what_was_asked_unless_aborted():
    assert classify(REF, result([5, 6, 7], [-1.0, -2.0, -0.5], finished=True), 4)[0] == "mismatch"
    assert classify(REF, result([5, 6, 7], [-1.0, -2.0, -0.5], finished=True), 3)[0] == "match"
    assert classify(REF, result([5, 6], [-1.0, -2.0], finished=False, aborted=True), 4)[0] == "match"
    assert classify(REF, result([5, 6], [-1.0, -2.0], finished=False), 4)[0] == "mismatch"


def test_rejections_must_agree():
    rejected = dict(rejected="VLLMValidationError: too long")
    assert classify(rejected, dict(rejected="VLLMValidationError: too long"), 1)[0] == "match"
    assert classify(rejected, result([5], [-1.0], finished=True), 1)[0] == "mismatch"
    assert classify(REF, rejected, 4)[0] == "mismatch"


def test_preempted_request_is_compared_with_its_recompute_after_the_resume_point():
    prompt = (1, 2)
    r = FuzzRequest("q0", 0, prompt, 4, "long_output")
    # vLLM recomputed prompt + [5, 6] and went on with 70, 71 (the resume reference's text)
    resumed = result([70, 71], [-0.3, -0.4])
    reference = {json.dumps(list(prompt)): REF, json.dumps([1, 2, 5, 6]): resumed}
    got = result([5, 6, 70, 71], [-1.0, -2.0, -0.3, -0.4], finished=True)
    assert classify_resumed(reference, r, got, [2]) == ("match", None)
    assert classify(REF, got, 4)[0] == "mismatch"  # against the prompt alone it differs
    stale = result([5, 6, 80, 71], [-1.0, -2.0, -0.3, -0.4], finished=True)
    kind, why = classify_resumed(reference, r, stale, [2])
    assert kind == "mismatch" and why.startswith("after resume at #2")
    assert classify_resumed({json.dumps(list(prompt)): REF}, r, got, [2])[0] == "mismatch"  # no reference


def test_pass_on_stream_equal_to_pass_off_perturbs_nothing():
    off = {"q0": result([5, 6], [-1.0, -2.0]), "q1": dict(rejected="too long")}
    assert perturbed_by_pass(off, json.loads(json.dumps(off)), acted_on=set()) == {}


def test_a_logprob_changed_in_a_row_the_guard_never_touched_is_perturbed():
    # a live row whose state the guard damaged slightly: same tokens, logprobs off from #2 on
    off = {"q0": result([5, 6, 7, 8], [-1.0, -2.0, -0.5, -1.5]), "q1": result([3], [-0.25])}
    on = {"q0": result([5, 6, 7, 8], [-1.0, -2.0, -0.5 + 2 ** -10, -1.49]), "q1": result([3], [-0.25])}
    assert perturbed_by_pass(off, on, acted_on=set()) == {"q0": 2}


def test_largest_shift_is_over_untouched_rows_and_the_tokens_both_runs_chose():
    off = {"q0": result([5, 6, 7], [-1.0, -2.0, -0.5]), "q1": result([3, 4], [-0.25, -1.0]),
           "q2": result([8], [-4.0])}
    on = {"q0": result([5, 6, 9], [-1.0, -2.03125, -9.0]),  # after the differing token: not compared
          "q1": result([3, 4], [-0.25, -1.0078125]), "q2": result([8], [-1.0])}  # q2: acted on
    assert largest_shift(off, on, acted_on={"q2"}) == 0.03125
    assert largest_shift(off, json.loads(json.dumps(off)), acted_on=set()) == 0.0


def test_a_changed_token_is_perturbed_at_its_position():
    off = {"q0": result([5, 6, 7], [-1.0, -2.0, -0.5])}
    on = {"q0": result([5, 9, 7], [-1.0, -2.0, -0.5])}
    assert perturbed_by_pass(off, on, acted_on=set()) == {"q0": 1}


def test_rows_the_guard_acted_on_may_change():
    off = {"q0": result([5, 6], [-1.0, -2.0]), "q1": result([4], [-3.0])}
    on = {"q0": result([7, 6], [-0.5, -2.0]), "q1": result([4], [-3.0])}
    assert perturbed_by_pass(off, on, acted_on={"q0"}) == {}
    assert perturbed_by_pass(off, on, acted_on=set()) == {"q0": 0}


def test_first_token_mismatch_is_the_stale_read_signature():
    assert first_token_mismatch(REF, result([9, 6, 7, 8], [-3.0, -2.0, -0.5, -1.5]))
    assert first_token_mismatch(REF, result([5, 6], [-1.0 - 2 * DRIFT_TOL, -2.0]))
    # a later divergence, a near tie and a rejection are not
    assert not first_token_mismatch(REF, result([5, 6, 3, 1], [-1.0, -2.0, -0.9, -1.0]))
    assert not first_token_mismatch(REF, result([5, 4], [-1.0, -2.05]))
    assert not first_token_mismatch(dict(rejected="too long"), result([5], [-1.0]))


def footprint(perturbed, shift, repeat=None, on_repeat=None):
    summary = dict(perturbed_by_pass=perturbed, largest_shift_by_pass=shift, footprint_baseline="off+harness_zeroing")
    if repeat is not None:
        summary["baseline_repeat"] = dict(perturbed=repeat[0], largest_shift=repeat[1])
    if on_repeat is not None:  # the pass-on stream again: what it moved against the baseline
        summary["engine_drift"] = engine_drift(perturbed, on_repeat)
    return summary


def test_no_request_moved_is_no_footprint():
    assert footprint_problem(footprint({}, 0.0)) is None and host_noise(footprint({}, 0.0)) is None


def test_a_move_the_baseline_does_not_repeat_is_the_passs():
    problem = footprint_problem(footprint({"q3": 0}, 0.01, repeat=({}, 0.0)))
    assert problem and "must leave alone" in problem


def test_a_move_without_a_second_baseline_run_is_not_excused():
    assert "not run again" in footprint_problem(footprint({"q3": 0}, 0.01))


@pytest.mark.parametrize("shift, ok", [(DRIFT_TOL / 2, True), (DRIFT_TOL * 2, False)])
def test_on_a_host_that_does_not_repeat_itself_moves_are_judged_by_drift_tol(shift, ok):
    summary = footprint({"q3": 0}, shift, repeat=({"q7": 2}, 0.02))
    assert (footprint_problem(summary) is None) is ok
    assert "does not reproduce" in host_noise(summary)


def test_a_move_a_second_pass_on_engine_does_not_repeat_is_the_engines_drift():
    # H200, vLLM 0.26: one of two pass-on engines moved q50 (0.033); the other gave it as the baseline
    summary = footprint({"q50": 0}, 0.0332, repeat=({}, 0.0), on_repeat={})
    assert summary["engine_drift"] == {"q50": 0}
    assert footprint_problem(summary) is None
    assert "engine drift, not the pass" in host_noise(summary)


def test_a_move_the_second_pass_on_engine_repeats_is_the_passs():
    problem = footprint_problem(footprint({"q50": 0}, 0.0332, repeat=({}, 0.0), on_repeat={"q50": 0}))
    assert problem and "must leave alone" in problem and "['q50']" in problem


def test_only_the_moves_the_second_pass_on_engine_gave_as_the_baseline_are_excused():
    summary = footprint({"q3": 0, "q5": 1}, 0.01, repeat=({}, 0.0), on_repeat={"q5": 1, "q9": 0})
    assert summary["engine_drift"] == {"q3": 0}
    problem = footprint_problem(summary)
    assert problem and "must leave alone" in problem and "['q5']" in problem
    assert host_noise(summary) is None


def test_a_large_move_is_not_excused_as_drift_even_when_not_repeated():
    # a guard that zeroed a live slot on some runs only would look like this: not the engine's drift
    problem = footprint_problem(footprint({"q3": 0}, DRIFT_TOL * 2, repeat=({}, 0.0), on_repeat={}))
    assert problem and "did not repeat" in problem


# --------------------------------------------------------------- the footprint's baseline
# ``fuzz.fuzz`` over recorded engine outputs (``_run_engines`` replaced: no engine runs):
# which stream is the footprint's baseline, and which requests it leaves out.

def _stream_outputs(stream, reference, changed=None, fresh=None, schedule=None):
    """A stream engine's output: every request as its reference gives it (``changed``: rid ->
    a logprob shift at position 0), and a trace naming ``fresh`` rid -> path (``schedule``: the
    trace's rid -> steps, see ``fuzz_judge.schedule_moved``)."""
    results = {}
    for r in stream:
        ref = reference[json.dumps(list(r.prompt))]
        lps = list(ref["logprobs"])
        lps[0] += (changed or {}).get(r.rid, 0.0)
        results[r.rid] = dict(ref, logprobs=lps, cached_tokens=0, finished=True)
    trace = dict(steps=1, rows={}, fresh_decode_steps=1,
                 fresh_reads={f"{rid}-0000abcd": path for rid, path in (fresh or {}).items()},
                 schedule={f"{rid}-0000abcd": steps for rid, steps in (schedule or {}).items()})
    return dict(results=results, steps=1, preemptions=0, preempted_requests=0, preempted_ids=[],
                preempted_at={}, prefix_cache_hits=0, traces=[trace], fresh_decode_steps=1, run_s=0.0)


def _judge(tmp_path, monkeypatch, guards, streams, **fuzz_args):
    """``fuzz.fuzz`` on 6 requests of seed 0, the engines' outputs given by ``streams(stream, ref)``."""
    from harness import fuzz as fz

    config = "prefix_caching"
    stream = fz.make_stream(0, 6, max_model_len=fz.engine_settings(config)["max_model_len"],
                            **fz.CONFIG_STREAM.get(config, {}))
    reference = {}
    for i, r in enumerate(stream):
        n = r.max_tokens or 3
        reference[json.dumps(list(r.prompt))] = dict(
            result([11 + i + k for k in range(n)], [-1.0 - i / 10] * n), max_tokens=r.max_tokens)
    (tmp_path / f"reference_{config}.json").write_text(json.dumps(reference))
    outputs = streams(stream, reference)
    seen = fuzz_args.pop("seen", [])  # (engine name, its spec, its environment) of every engine started

    def run_engines(jobs, workdir, python, parallel, engine_env):
        seen.extend((name, spec, engine_env(name)) for spec, name in jobs)
        return {name: outputs[name.split("_s0_", 1)[1]] for _spec, name in jobs}

    monkeypatch.setattr(fz, "_run_engines", run_engines)
    return stream, fz.fuzz(tmp_path / "model", tmp_path, seed=0, num_requests=6, config=config, guards=guards,
                           **fuzz_args)


def test_a_clean_pass_off_engine_is_the_baseline_where_it_ran(tmp_path, monkeypatch):
    from harness import fuzz as fz

    def streams(stream, ref):
        first, fixed = stream[0].rid, stream[1].rid
        # pass off: the first request moved by what the warm-up left in a slot; a
        # clean pass-off engine and pass on agree on it
        return {"off": _stream_outputs(stream, ref, changed={first: 0.05, fixed: 3.0}, fresh={fixed: "decode"}),
                "on": _stream_outputs(stream, ref, fresh={fixed: "decode"}),
                fz.CLEAN_OFF: _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"})}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on", fz.CLEAN_OFF), streams)
    assert s["footprint_baseline"] == fz.CLEAN_OFF
    assert s["acted_on"] == [stream[1].rid]
    assert s["perturbed_by_pass"] == {} and footprint_problem(s) is None
    # against the warm pass-off engine the first request moved
    stream, s = _judge(tmp_path, monkeypatch, ("off", "on"), streams)
    assert s["footprint_baseline"] == "off" and s["perturbed_by_pass"] == {stream[0].rid: 0}


def test_a_mismatch_keeps_both_sides_tokens_for_a_third_engine(tmp_path, monkeypatch):
    """benchmarks/transformers_arbiter.py reads them: the prompt, the stream's and the reference's tokens."""
    def streams(stream, ref):
        off = _stream_outputs(stream, ref)
        wrong = off["results"][stream[1].rid]
        wrong["tokens"] = [wrong["tokens"][0] + 500] + wrong["tokens"][1:]  # far from the reference's top two
        return {"off": off, "on": _stream_outputs(stream, ref)}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on"), streams)
    moved = stream[1]
    reference = json.loads((tmp_path / "reference_prefix_caching.json").read_text())[json.dumps(list(moved.prompt))]
    kept = s["runs"]["off"]["mismatched_outputs"]
    assert list(kept) == s["runs"]["off"]["mismatched_ids"] == [moved.rid]
    assert kept[moved.rid]["prompt"] == list(moved.prompt)
    assert kept[moved.rid]["reference"] == reference["tokens"]
    assert kept[moved.rid]["stream"] == [reference["tokens"][0] + 500] + reference["tokens"][1:]
    assert s["runs"]["on"]["mismatched_outputs"] == {}


@pytest.mark.parametrize("stale_in_baseline", [True, False])
def test_a_request_the_baseline_read_stale_is_judged_by_its_isolated_run(tmp_path, monkeypatch, stale_in_baseline):
    def streams(stream, ref):
        moved = stream[2].rid
        # the baseline ran `moved` fresh on a decode path (stale); pass on, on another
        # schedule, ran it on the prefill path: its reference's output, no guard acting
        return {"off": _stream_outputs(stream, ref, changed={moved: 2.0},
                                       fresh={moved: "decode"} if stale_in_baseline else {}),
                "on": _stream_outputs(stream, ref)}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on"), streams)
    moved = stream[2].rid
    assert s["acted_on"] == [] and moved not in s["runs"]["on"]["mismatched_ids"]
    if stale_in_baseline:
        assert s["stale_in_baseline"] == [moved] and s["perturbed_by_pass"] == {}
    else:  # a move the baseline does not explain is the pass's
        assert s["stale_in_baseline"] == [] and s["perturbed_by_pass"] == {moved: 0}


@pytest.mark.parametrize("damaged", [False, True])
def test_a_request_that_reads_what_the_caches_held_before_the_stream_is_not_the_passs(
        tmp_path, monkeypatch, damaged):
    """Against the clean pass-off engine, a request moved only by the residue in a cache no guard
    touches (pass on equal to pass off bit for bit) is left out of the footprint; one the pass
    moved away from both baselines is the pass's."""
    from harness import fuzz as fz

    def streams(stream, ref):
        residue, fixed = stream[3].rid, stream[1].rid
        on_changed = {residue: 0.125} if damaged else {}
        return {"off": _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"}),
                "on": _stream_outputs(stream, ref, changed=on_changed, fresh={fixed: "decode"}),
                fz.CLEAN_OFF: _stream_outputs(stream, ref, changed={residue: 0.03125, fixed: 3.0},
                                              fresh={fixed: "decode"})}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on", fz.CLEAN_OFF), streams)
    residue = stream[3].rid
    assert s["footprint_baseline"] == fz.CLEAN_OFF and s["acted_on"] == [stream[1].rid]
    if damaged:
        assert s["perturbed_by_pass"] == {residue: 0} and s["moved_by_residue"] == []
        assert s["largest_shift_by_pass"] == 0.125 - 0.03125
        assert "1 request(s) moved" in footprint_problem(s)
    else:
        assert s["perturbed_by_pass"] == {} and s["moved_by_residue"] == [residue]
        assert s["largest_shift_by_pass"] == 0.0 and footprint_problem(s) is None


@pytest.mark.parametrize("batch", ["same", "other-before", "other-after"])
def test_a_request_moved_with_the_batches_the_fix_changed_is_judged_by_its_isolated_run(
        tmp_path, monkeypatch, batch):
    """With MTP a repaired request accepts other drafts and the batches after it change: a request
    that ran in another batch before its moved token is judged by its run alone (a near tie
    there); one whose batches were the same up to that token, or differed only after it, stays
    the pass's footprint."""
    def streams(stream, ref):
        moved, fixed = stream[3], stream[1].rid
        p = len(moved.prompt)
        # (tokens computed before, its tokens, the step's tokens, the step's rows, graph mode)
        base = [[0, p, p + 2, 2, "PIECEWISE"], [p, 1, 2, 2, "FULL"]]
        steps = {"same": base,
                 # its prefill ran beside another row: the batch before its first token changed
                 "other-before": [[0, p, p + 3, 2, "PIECEWISE"], [p, 1, 2, 2, "FULL"]],
                 # only the step after its first token changed
                 "other-after": [base[0], [p, 1, 3, 3, "FULL"]]}[batch]
        return {"off": _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"},
                                       schedule={moved.rid: base}),
                "on": _stream_outputs(stream, ref, changed={moved.rid: 0.02}, fresh={fixed: "decode"},
                                      schedule={moved.rid: steps})}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on"), streams)
    moved = stream[3].rid
    if batch == "other-before":
        assert s["moved_with_schedule"] == {moved: 0} and s["perturbed_by_pass"] == {}
        assert footprint_problem(s) is None
    else:
        assert s["moved_with_schedule"] == {} and s["perturbed_by_pass"] == {moved: 0}
        assert footprint_problem(s) is not None


@pytest.mark.parametrize("acted_on", [False, True], ids=["not-acted-on", "acted-on"])
@pytest.mark.parametrize("repeated", [False, True])
def test_the_fuzz_runs_pass_on_again_where_it_moved_a_request(tmp_path, monkeypatch, repeated, acted_on):
    """Where pass on moved a request against the harness's fix, the fix and pass on run once more: a
    move the second pass-on engine does not repeat is the engine's drift (the check passes), one it
    repeats bit for bit is the pass's, on a request the guard acted on too (against the harness's
    fix every request is compared)."""
    from harness import fuzz as fz

    def streams(stream, ref):
        moved, fixed = stream[1 if acted_on else 3].rid, stream[1].rid
        fix = _stream_outputs(stream, ref, fresh={fixed: "decode"})
        on = _stream_outputs(stream, ref, changed={moved: 0.03125}, fresh={fixed: "decode"})
        return {"off": _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"}),
                "on": on, fz.HARNESS_FIX: fix, f"{fz.HARNESS_FIX}_again": fix,
                "on_again": on if repeated else fix}

    seen = []
    stream, s = _judge(tmp_path, monkeypatch, ("off", "on", fz.HARNESS_FIX), streams,
                       repeat_baseline_if_perturbed=True, seen=seen, engine_env=lambda name: {"CACHE": name})
    moved = stream[1 if acted_on else 3].rid
    # new engines in new compile caches: a kernel configuration one engine picked can differ there
    assert {name: env["CACHE"] for name, _spec, env in seen if name.endswith("_again")} == {
        name: name for name in (f"stream_prefix_caching_s0_{fz.HARNESS_FIX}_again", "stream_prefix_caching_s0_on_again")}
    assert s["pass_on_repeat_guard"] == "on" and s["repeat_compile_caches"] == "new"
    assert s["footprint_baseline"] == fz.HARNESS_FIX and s["perturbed_by_pass"] == {moved: 0}
    assert s["baseline_repeat"] == dict(perturbed={}, largest_shift=0.0)
    if repeated:
        assert s["pass_on_repeat"]["perturbed"] == {moved: 0} and s["engine_drift"] == {}
        assert "must leave alone" in footprint_problem(s)
    else:
        assert s["pass_on_repeat"] == dict(perturbed={}, largest_shift=0.0) and s["engine_drift"] == {moved: 0}
        assert footprint_problem(s) is None and "engine drift" in host_noise(s)


@pytest.mark.parametrize("baseline_again_lands", ["as-pass-on", "elsewhere"])
def test_a_baseline_engine_that_moves_the_same_requests_is_compared_with_the_pass_on_engine(
        tmp_path, monkeypatch, baseline_again_lands):
    """The H200's preemption stream at 2380667: the first pass-on engine moved a request against the
    harness's fix, the second pass-on engine gave it as the fix, and the fix's second engine moved it
    too. Where that engine gave it exactly as the first pass-on engine, the summary and the warning
    say so (an engine without the pass computing the pass-on output); the progress log names the
    moved request before the reruns (a time limit can stop them)."""
    from harness import fuzz as fz

    def streams(stream, ref):
        moved, fixed = stream[3].rid, stream[1].rid
        fix = _stream_outputs(stream, ref, fresh={fixed: "decode"})
        on = _stream_outputs(stream, ref, changed={moved: 0.03125}, fresh={fixed: "decode"})
        shift = 0.03125 if baseline_again_lands == "as-pass-on" else 0.0625
        return {"off": _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"}),
                "on": on, fz.HARNESS_FIX: fix,
                f"{fz.HARNESS_FIX}_again": _stream_outputs(stream, ref, changed={moved: shift},
                                                           fresh={fixed: "decode"}),
                "on_again": fix}

    log = []
    stream, s = _judge(tmp_path, monkeypatch, ("off", "on", fz.HARNESS_FIX), streams,
                       repeat_baseline_if_perturbed=True, progress=log.append)
    moved = stream[3].rid
    assert any(f"pass on moved 1 request(s) against {fz.HARNESS_FIX} ({moved} #0;" in line for line in log)
    assert s["perturbed_by_pass"] == {moved: 0} and s["engine_drift"] == {moved: 0}
    assert s["baseline_repeat"]["perturbed"] == {moved: 0}
    assert footprint_problem(s) is None  # within DRIFT_TOL on a host that does not repeat itself
    if baseline_again_lands == "as-pass-on":
        assert s["pass_on_vs_baseline_again"] == dict(perturbed={}, largest_shift=0.0)
        assert f"gave 1 of them ({moved}) exactly as the first pass-on engine" in host_noise(s)
    else:
        assert s["pass_on_vs_baseline_again"] == dict(perturbed={moved: 0}, largest_shift=0.03125)
        assert "exactly as the first pass-on engine" not in host_noise(s)


@pytest.mark.parametrize("residue", [True, False], ids=["start-up-residue", "the-pass"])
def test_against_a_clean_baseline_pass_on_runs_again_on_caches_zeroed_after_start_up(tmp_path, monkeypatch, residue):
    """H100, vLLM 0.34, GDN mtp, the pass standing down: pass on moved q33 #11 against both pass-off
    engines, and again in a second engine with the same kernels. Against CLEAN_OFF, the pass-on
    stream runs again on zeroed caches: a move made by what its start-up left in the caches does not
    survive that (the engine's, the check passes); a move of the pass does (the check fails)."""
    from harness import fuzz as fz

    def streams(stream, ref):
        moved, fixed = stream[3].rid, stream[1].rid
        clean = _stream_outputs(stream, ref, changed={fixed: 3.0}, fresh={fixed: "decode"})
        on = _stream_outputs(stream, ref, changed={moved: 0.03125}, fresh={fixed: "decode"})
        return {"off": clean, "on": on, fz.CLEAN_OFF: clean, f"{fz.CLEAN_OFF}_again": clean,
                f"on+{fz.CLEAN_OFF.partition('+')[2]}_again": clean if residue else on}

    seen = []
    stream, s = _judge(tmp_path, monkeypatch, ("off", "on", fz.CLEAN_OFF), streams,
                       repeat_baseline_if_perturbed=True, seen=seen, engine_env=lambda name: {"CACHE": name})
    moved = stream[3].rid
    again = {name.split("_s0_", 1)[1]: (spec, env) for name, spec, env in seen if name.endswith("_again")}
    base_again, base_env = again[f"{fz.CLEAN_OFF}_again"]
    assert base_again["guard"] is False and base_again["mutation"] == "zeroed_at_start"
    on_again, on_env = again["on+zeroed_at_start_again"]
    assert on_again["guard"] is True and on_again["mutation"] == "zeroed_at_start"
    # each in its first engine's compile cache: the same kernels, only the start-up residue gone
    assert base_env == {"CACHE": f"stream_prefix_caching_s0_{fz.CLEAN_OFF}"}
    assert on_env == {"CACHE": "stream_prefix_caching_s0_on"}
    assert s["pass_on_repeat_guard"] == "on+zeroed_at_start" and s["repeat_compile_caches"] == "the first engines'"
    assert s["footprint_baseline"] == fz.CLEAN_OFF and s["perturbed_by_pass"] == {moved: 0}
    if residue:
        assert s["engine_drift"] == {moved: 0} and footprint_problem(s) is None
        assert "second pass-on engine (on+zeroed_at_start)" in host_noise(s)
    else:
        assert s["engine_drift"] == {} and "must leave alone" in footprint_problem(s)


def test_a_first_step_longer_than_the_prompt_is_a_padded_one():
    """vLLM's scheduler pads a new one-token request beside a running one with placeholder drafts."""
    from harness.fuzz_judge import padded_first_steps

    run = {"traces": [{"schedule": {
        "q1-0000abcd": [[0, 2, 5, 3, "PIECEWISE"], [1, 2, 6, 3, "FULL"]],  # 1 prompt token + 1 placeholder
        "q2-0000abcd": [[0, 1, 1, 1, "PIECEWISE"], [1, 2, 2, 1, "FULL"]],  # admitted alone: not padded
        "q3-0000abcd": [[0, 8, 9, 2, "PIECEWISE"], [8, 2, 4, 2, "PIECEWISE"]],  # a 10-token prompt in chunks
        "q4-0000abcd": [[4, 3, 3, 1, "FULL"]],  # no first step in the trace (resumed): left out
    }}]}
    prompt_lens = {"q1": 1, "q2": 1, "q3": 10, "q4": 1}
    assert padded_first_steps(run, prompt_lens) == {"q1": 2}
    assert padded_first_steps({"traces": []}, prompt_lens) == {}


def test_the_summary_names_the_requests_whose_first_step_was_padded(tmp_path, monkeypatch):
    def streams(stream, ref):
        one = stream[0].rid
        padded = {one: [[0, len(stream[0].prompt) + 1, 4, 2, "PIECEWISE"]]}
        return {"off": _stream_outputs(stream, ref, schedule=padded), "on": _stream_outputs(stream, ref)}

    stream, s = _judge(tmp_path, monkeypatch, ("off", "on"), streams)
    assert s["runs"]["off"]["padded_first_steps"] == {stream[0].rid: len(stream[0].prompt) + 1}
    assert s["runs"]["on"]["padded_first_steps"] == {}


def test_a_mismatch_s_trail_keeps_the_steps_before_its_first_differing_token():
    """The trail a mismatched request's summary keeps: logprobs up to the first differing token,
    both sides' top two there, and the steps it ran in before that token was sampled, with its
    own speculative slot columns (a speculative row before it in the batch shifts the packing)."""
    from harness.fuzz_judge import mismatch_trail

    ref = result([5, 6, 7, 8], [-1.0, -2.0, -0.5, -1.5])
    got = result([5, 6, 9, 1], [-1.01, -2.02, -0.4, -2.0])
    details = [
        None,  # a step the traced builder did not build (kept as a gap: step numbers stay true)
        # GDN packs speculative rows' columns and the other rows' slots, each in batch order
        dict(req_ids=["q0-0000abcd", "q7-0000abcd", "q3-0000abcd"], query_lens=[2, 5, 2], computed=[7, 0, 0],
             slots=[12], num_decodes=0, num_prefills=1, paths=["spec", "prefill", "spec"],
             dispatch=dict(mode="PIECEWISE"), spec_slots=[[4, 5], [9, 10]], num_accepted=[2, 1]),
        dict(req_ids=["q3-0000abcd", "q8-0000abcd"], query_lens=[2, 1], computed=[2, 0], slots=[9],
             num_decodes=1, num_prefills=0, paths=["spec", "decode"], dispatch=dict(mode="FULL"),
             spec_slots=[[9, 10]], num_accepted=[2]),
        dict(req_ids=["q3-0000abcd"], query_lens=[2], computed=[4], slots=[], num_decodes=0,
             num_prefills=0, paths=["spec"], dispatch=None, spec_slots=[[9, 10]], num_accepted=[1]),
    ]
    trail = mismatch_trail(ref, got, details, "q3", prompt_len=1)
    assert trail["first_mismatch"] == 2
    assert trail["logprobs"] == dict(stream=[-1.01, -2.02, -0.4], reference=[-1.0, -2.0, -0.5])
    assert trail["top"]["stream"] == [[9, -0.4], [10, -1.4]] and trail["top"]["reference"][0] == [7, -0.5]
    # token #2 is sampled in a step that starts with fewer than 1 + 2 tokens computed: steps 1 and 2
    assert [s["step"] for s in trail["steps"]] == [1, 2]
    assert trail["steps"][0] == dict(step=1, computed=0, tokens=2, path="spec", slots=[9, 10], batch=[2, 5, 2],
                                     mode="PIECEWISE", num_accepted=1, shares_slots_with=[])
    # q8, a fresh decode row of the next step, on q3's slot 9: both named
    assert trail["steps"][1]["shares_slots_with"] == ["q8"]
    assert "steps" not in mismatch_trail(ref, got, None, "q3", prompt_len=1)
    # the same tokens: nothing differs, the trail ends where the shorter output does
    assert mismatch_trail(ref, ref, [], "q3", 1)["first_mismatch"] == 4


def test_mismatched_past_names_requests_right_through_a_token():
    """Which mismatched requests first differ after a given output token (the GPU fuzz asks it of
    padded requests: right through token #1, the first read of the state their guarded step wrote)."""
    from harness.fuzz_judge import mismatched_past

    run = {"mismatched_outputs": {
        "q1": dict(prompt=[7], stream=[5, 9, 1], reference=[5, 6, 1]),        # differs at #1
        "q2": dict(prompt=[7], stream=[5, 6, 1, 3], reference=[5, 6, 1, 4]),  # differs at #3
        "q3": dict(prompt=[7], stream=[4], reference=[5]),                    # differs at #0
    }}
    assert mismatched_past(run, {"q1", "q2", "q3", "q4"}, 1) == {"q2"}  # q4: no output kept
    assert mismatched_past(run, {"q1", "q2"}, 0) == {"q1", "q2"}
    assert mismatched_past({}, {"q1"}, 0) == set()


def test_same_mismatch_in_every_stream_asks_for_the_same_tokens_and_logprobs():
    """A request every stream gets wrong alike (pass off, pass on, a clean engine) is vLLM's own
    difference; one whose output or logprobs differ between the streams is not."""
    from harness.fuzz_judge import same_mismatch_in_every_stream

    def kept(stream, logprobs, trail=True):
        out = dict(prompt=[7], stream=stream, reference=[5, 6, 1])
        if trail:
            out["trail"] = dict(first_mismatch=1, logprobs=dict(stream=logprobs, reference=[-1.0, -2.0]))
        return out

    def summary(**runs):
        return {"runs": {g: {"mismatched_outputs": outputs} for g, outputs in runs.items()}}

    alike = kept([5, 9, 1], [-1.0, -2.5])
    s = summary(off={"q1": alike, "q2": alike, "q3": alike, "q4": kept([5, 9], [-1.0, -2.5], trail=False)},
                on={"q1": dict(alike), "q2": kept([5, 9, 2], [-1.0, -2.5]), "q3": kept([5, 9, 1], [-1.0, -2.5001]),
                    "q4": kept([5, 9], [-1.0, -2.5], trail=False)},
                clean={"q1": dict(alike), "q2": alike, "q3": alike})
    # q2: other tokens with the pass; q3: another logprob; q4: no logprobs kept, and not in clean
    assert same_mismatch_in_every_stream(s, ["off", "on", "clean"]) == {"q1"}
    assert same_mismatch_in_every_stream(s, ["off", "on"]) == {"q1"}
    assert same_mismatch_in_every_stream(summary(off={}, on={"q1": alike}), ["off", "on"]) == set()
