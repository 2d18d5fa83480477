"""How the scheduling fuzz judges one request against its reference.

    classify(reference, got, max_tokens)  -> ("match" | "near_tie" | "mismatch", why)

A differing greedy token is a mismatch unless the reference's own logprob of
the stream's token is within NEAR_TIE_TOL of its chosen one (a near tie:
batch-shape numerics can flip such a choice, a clear one they cannot); the
tokens after a near tie continue another text and are not compared. Matching
tokens whose logprobs differ by more than DRIFT_TOL are a mismatch.

Which reference: a request is judged by what vLLM computes for it on fresh
state. Its first tokens by its prompt run alone or, for a one-token prompt
that vLLM ran through its prefill kernels, by that prompt on the same path
(``base_key``). After each preemption vLLM recomputes the prompt and the
tokens so far as a prefill; the tokens after that resume point are judged by
exactly that prefix run alone (``classify_resumed``).
"""

from __future__ import annotations

import json
import re
from typing import Protocol


class FuzzRequest(Protocol):
    """What the judge reads of a stream's request (``harness.fuzz.FuzzRequest`` has it)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int | None

__all__ = ["NEAR_TIE_TOL", "DRIFT_TOL", "PREFILL_PATH", "prefill_path_key", "classify", "classify_resumed",
           "resumed_drift", "base_key", "resume_points", "one_token_paths", "padded_first_steps", "fresh_reads",
           "fresh_reads_other_builders", "logprob_drift", "perturbed_by_pass", "largest_shift", "first_token_mismatch",
           "engine_drift", "footprint_problem", "host_noise"]

NEAR_TIE_TOL = 0.1  # a differing token where the reference's top two were closer is a near tie
# Matching tokens whose logprobs differ by more than this are a mismatch. The
# largest kernel drift seen (a one-token prompt's first step run by the
# chunked-prefill kernel next to a chunk vs the decode kernel alone, bf16 CPU
# op, small-state checkpoint) is 0.105, identical with the pass off and on.
DRIFT_TOL = 0.15
PREFILL_PATH = "prefill-path:"  # reference key prefix: a one-token prompt on the prefill kernels


def prefill_path_key(prompt) -> str:
    """Reference key of a one-token prompt run through vLLM's prefill path (see run_reference)."""
    return PREFILL_PATH + json.dumps(list(prompt))


def logprob_drift(reference: dict, got: dict) -> float:
    return max((abs(a - b) for a, b in zip(got["logprobs"], reference["logprobs"])), default=0.0)


def classify(reference: dict, got: dict, max_tokens: int | None) -> tuple[str, str | None]:
    """``("match" | "near_tie" | "mismatch", why)`` of a stream result against its reference.

    A token that differs where the reference's own logprob of the stream's
    token is within NEAR_TIE_TOL of its chosen one is a near tie: batch-shape
    numerics, not state. A rejection must be the same rejection.
    """
    if "rejected" in reference or "rejected" in got:
        same = ("rejected" in reference) == ("rejected" in got)
        return ("match", None) if same else (
            "mismatch", f"rejected {'by the stream' if 'rejected' in got else 'by the reference'}: "
                        f"{got.get('rejected') or reference.get('rejected')}")
    n = len(got["tokens"])
    for i, (a, b) in enumerate(zip(got["tokens"], reference["tokens"])):
        if abs(got["logprobs"][i] - reference["logprobs"][i]) > DRIFT_TOL and a == b:
            return "mismatch", f"logprob diff {abs(got['logprobs'][i] - reference['logprobs'][i]):.2e} at #{i}"
        if a != b:
            ref_top = dict((int(t), lp) for t, lp in reference["top"][i])
            gap = reference["logprobs"][i] - ref_top[a] if a in ref_top else float("inf")
            why = f"token #{i}: {a} instead of {b} (reference gap {gap:.3f})"
            return ("near_tie" if gap <= NEAR_TIE_TOL else "mismatch"), why
    if got.get("aborted"):
        return ("match", None) if n <= len(reference["tokens"]) else ("mismatch", f"{n} tokens")
    # the reference ran with at least this max_tokens; max_model_len may have cut both
    expected = min(len(reference["tokens"]), max_tokens or len(reference["tokens"]))
    if not got.get("finished") or n != expected:
        return "mismatch", f"{'finished' if got.get('finished') else 'stopped'} with {n} tokens, not {expected}"
    return "match", None


def _per_request(run: dict, field: str) -> dict[str, str]:
    """A rank-0 trace field keyed by the caller's request ids (vLLM 0.30 suffixes its own)."""
    traces = run.get("traces") or [{}]
    return {re.sub(r"-[0-9a-f]{8}$", "", rid): path for rid, path in traces[0].get(field, {}).items()}


def one_token_paths(run: dict) -> dict[str, str]:
    """Fresh one-token requests -> "prefill" if their step had prefills, else "decode"."""
    return _per_request(run, "one_token_paths")


def padded_first_steps(run: dict, prompt_lens: dict[str, int]) -> dict[str, int]:
    """Requests whose first step ran more tokens than their prompt has -> that step's tokens.

    With speculative decoding vLLM's scheduler (0.27-0.34) pads a new one-token
    request admitted beside a running one to ``1 + k`` tokens with placeholder
    drafts; on 0.34's V2 runner GDN's prefill path then keeps the placeholders
    in the request's state (``docs/fuzz.md``, Speculative decoding). Read from
    the rank-0 trace's ``schedule`` (per request, each step as (tokens computed
    before, its tokens, ...)); a request without a first step there is left out.
    """
    padded = {}
    for rid, steps in _per_request(run, "schedule").items():
        first = next((step for step in steps if step[0] == 0), None)
        if first is not None and rid in prompt_lens and first[1] > prompt_lens[rid]:
            padded[rid] = first[1]
    return padded


def fresh_reads(run: dict) -> dict[str, str]:
    """Requests the builder ran fresh on a path that reads their slot -> "decode" | "spec"."""
    return _per_request(run, "fresh_reads")


def fresh_reads_other_builders(run: dict) -> dict[str, str]:
    """The same from the step's other builders (other KV-cache groups, an MTP drafter's)."""
    return _per_request(run, "fresh_reads_other_builders")


def spec_prompt_rows(run: dict) -> dict[str, str]:
    """Requests that ran prompt tokens on the speculative decode path (``step_trace.spec_prompt_rows``)."""
    return _per_request(run, "spec_prompt_rows")


def counts_supplied_rows(run: dict) -> dict[str, str]:
    """Requests with a row on the speculative path because gdn-pass passed the builder the V2 runner's
    accepted counts (``step_trace.counts_supplied_rows``): every speculating request there."""
    return _per_request(run, "counts_supplied_rows")


def kept_off_full_graph_rows(run: dict) -> dict[str, str]:
    """Requests of steps gdn-pass kept off the speculative FULL graph (``gdn_pass.vllm.draftless_steps``):
    a prompt chunk of 1 + k tokens without drafts, and the other rows of its step."""
    return _per_request(run, "kept_off_full_graph_rows")


def full_graph_prefill_rows(run: dict) -> dict[str, str]:
    """Requests of steps whose FULL decode graph replayed on a build with prefills."""
    return _per_request(run, "full_graph_prefill_rows")


def schedule_moved(base: dict, on: dict, perturbed: dict[str, int], prompt_lens: dict[str, int]) -> dict[str, int]:
    """Of ``perturbed`` (rid -> first moved output position), the requests whose batches differed
    between the two streams before that token was sampled.

    ``base`` / ``on``: the two streams' raw runs (their traces' ``schedule``:
    per request, each step it ran in as (tokens computed before, its tokens,
    the step's tokens, the step's rows, the CUDA-graph mode)); ``prompt_lens``:
    rid -> prompt length. Output token ``i`` is sampled in a step that starts
    with fewer than ``prompt_len + i`` tokens computed, so those steps are the
    ones compared. Where a fix changes the schedule (with MTP a repaired
    request accepts other drafts, finishes in another step, and the batches
    after it hold other rows), a request moved by the batch it ran in is not a
    bit-for-bit footprint of the pass; it is judged by its run alone instead. A
    request the pass itself damaged at token ``i`` keeps its batches up to
    there, so it stays in the footprint.
    """
    base_steps, on_steps = _per_request(base, "schedule"), _per_request(on, "schedule")
    moved = {}
    for rid, i in perturbed.items():
        limit = prompt_lens[rid] + i
        a = [list(e) for e in base_steps.get(rid, []) if e[0] < limit]
        b = [list(e) for e in on_steps.get(rid, []) if e[0] < limit]
        if a != b:
            moved[rid] = i
    return moved


def first_difference(a: list, b: list) -> int:
    """The first position where two token lists differ (the shorter one's length where one is the
    other's start)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _row_slots(d: dict) -> list[list[int] | None]:
    """Each row's state slots in one traced step (``step_trace`` detail): a speculative row's
    slot columns, another row's one slot. GDN packs its speculative rows' columns
    (``spec_slots``) and its other rows' slots (``slots``) each in batch order; the Lightning
    builders give every row a slot (``slots``) and their decodes, which come first, the
    speculative columns (``slots_d``)."""
    def as_list(value):
        return None if value is None else list(value) if isinstance(value, list) else [value]

    paths, slots, gdn = d.get("paths") or [], d.get("slots") or [], "spec_slots" in d
    columns = (d.get("spec_slots") if gdn else d.get("slots_d")) or []
    out, spec_k, other_k = [], 0, 0
    for row in range(len(d["query_lens"])):
        if row < len(paths) and paths[row] == "spec":
            out.append(as_list(columns[spec_k]) if spec_k < len(columns) else None)
            spec_k += 1
            continue
        index = other_k if gdn else row
        other_k += 1
        out.append(as_list(slots[index]) if index < len(slots) else None)
    return out


def mismatch_trail(reference: dict, got: dict, details: list | None, rid: str, prompt_len: int) -> dict:
    """What a mismatched request's tokens rest on, up to its first differing token ``i``.

    ``logprobs``: the stream's and the reference's logprob of each token up to
    ``i`` (a drift that grows token by token reads as accumulated numerics; a
    jump at ``i``, as something its last step read); ``top``: both sides' best
    two candidates at ``i``; ``steps`` (where the stream kept its step details,
    ``step_trace.StepTrace.gdn_trace_start(detail=True)``): each step the request
    ran in before token ``i`` was sampled, its row as the traced builder split
    it (tokens computed before, its tokens, kernel path, slot, speculative slot
    columns and accepted count) and the step's batch (query lengths, mode).
    """
    a, b = reference.get("tokens", []), got.get("tokens", [])
    i = first_difference(a, b)
    trail = dict(first_mismatch=i,
                 logprobs=dict(stream=[round(x, 4) for x in got.get("logprobs", [])[: i + 1]],
                               reference=[round(x, 4) for x in reference.get("logprobs", [])[: i + 1]]),
                 top=dict(stream=got["top"][i][:2] if i < len(got.get("top") or ()) else [],
                          reference=reference["top"][i][:2] if i < len(reference.get("top") or ()) else []))
    if details is None:
        return trail
    steps = []
    for n, d in enumerate(details):
        if not d:
            continue
        ids = [re.sub(r"-[0-9a-f]{8}$", "", x) for x in d["req_ids"]]
        if rid not in ids:
            continue
        row = ids.index(rid)
        if row >= len(d["query_lens"]) or d["query_lens"][row] == 0 or d["computed"][row] >= prompt_len + i:
            continue
        slots = _row_slots(d)
        entry = dict(step=n, computed=d["computed"][row], tokens=d["query_lens"][row],
                     path=(d.get("paths") or [None] * (row + 1))[row], slots=slots[row],
                     batch=d["query_lens"], mode=(d.get("dispatch") or {}).get("mode"))
        if entry["path"] == "spec":
            k = sum(p == "spec" for p in d["paths"][:row])  # speculative rows are packed in batch order
            if k < len(d.get("num_accepted") or ()):
                entry["num_accepted"] = d["num_accepted"][k]
        # another row of the step on one of this row's slots: two requests' states in one place
        mine = set(slots[row] or ())
        entry["shares_slots_with"] = [ids[j] for j, other in enumerate(slots)
                                      if j != row and d["query_lens"][j] > 0 and mine & set(other or ())]
        steps.append(entry)
    trail["steps"] = steps
    return trail


def mismatched_past(run: dict, ids, position: int) -> set[str]:
    """Of ``ids``, the requests of one judged stream (``summary["runs"][guard]``) whose first token
    differing from their reference comes after output token ``position``, as their kept
    ``mismatched_outputs`` say (a request whose output was not kept is not among them)."""
    kept = run.get("mismatched_outputs", {})
    return {rid for rid in ids
            if rid in kept and first_difference(kept[rid]["reference"], kept[rid]["stream"]) > position}


def same_mismatch_in_every_stream(summary: dict, guards) -> set[str]:
    """The requests that every one of ``guards``' streams (``summary["runs"]``) gets wrong in the
    very same way: the same output tokens, and the same logprobs, exactly, through the first
    token that differs from their reference (each stream's kept ``mismatched_outputs``). Where
    pass off, pass on and a clean engine all give one output, the pass changed nothing of it and
    no stale read made it: the difference from the run alone is vLLM's own."""
    kept = [summary["runs"][g].get("mismatched_outputs", {}) for g in guards]
    if not kept:
        return set()

    def output(outputs: dict, rid: str):
        got = outputs[rid]
        return got["stream"], got.get("trail", {}).get("logprobs", {}).get("stream")

    common = set(kept[0]).intersection(*kept[1:])
    # without the logprobs (a summary kept without trails) the tokens alone do not show it
    return {rid for rid in common if output(kept[0], rid)[1] is not None
            and all(output(k, rid) == output(kept[0], rid) for k in kept[1:])}


def base_key(r: FuzzRequest, paths: dict[str, str]) -> str:
    """The reference a request's first tokens are judged by: its prompt alone, or, for a
    one-token prompt that vLLM ran through its prefill kernels, the same on that path."""
    if len(r.prompt) == 1 and paths.get(r.rid) == "prefill":
        return prefill_path_key(r.prompt)
    return json.dumps(list(r.prompt))


def resume_points(run: dict, rid: str) -> list[int]:
    """Output-token counts at which vLLM resumed the request by recomputing (0 excluded)."""
    return sorted({k for k in run.get("preempted_at", {}).get(rid, []) if k > 0})


def _segment(result: dict, a: int, b: int | None) -> dict:
    return dict(tokens=result["tokens"][a:b], logprobs=result["logprobs"][a:b], top=result["top"][a:b],
                aborted=True)  # compared as a prefix of its reference


def classify_resumed(reference: dict, r: FuzzRequest, got: dict, resumed: list[int],
                      first_key: str | None = None):
    """``classify``, where the tokens after each resume point are compared with
    the prompt + tokens so far run alone (vLLM's recompute) instead."""
    ref = reference.get(first_key or json.dumps(list(r.prompt)))
    if ref is None:
        return "mismatch", f"no reference {first_key}"
    if not resumed or "tokens" not in got:
        return classify(ref, got, r.max_tokens)
    bounds = [0] + resumed + [None]
    worst = ("match", None)
    for a, b in zip(bounds, bounds[1:]):
        seg_ref = ref if a == 0 else reference.get(json.dumps(list(r.prompt) + got["tokens"][:a]))
        if seg_ref is None:
            return "mismatch", f"no resume reference at token #{a}"
        kind, why = classify(seg_ref, _segment(got, 0 if a == 0 else a, b), None)
        if kind == "mismatch":
            return kind, (f"after resume at #{a}: " if a else "") + why
        if kind == "near_tie" and worst[0] == "match":
            # the next segment's reference is built from the stream's own
            # tokens, so it stays comparable after a near tie here
            worst = (kind, (f"after resume at #{a}: " if a else "") + why)
    total = len(got["tokens"])
    expected = min(len(ref["tokens"]), r.max_tokens or len(ref["tokens"]))
    if not got.get("aborted") and (not got.get("finished") or total != expected):
        return "mismatch", f"stopped with {total} tokens, not {expected}"
    return worst


def first_token_mismatch(reference: dict, got: dict) -> bool:
    """Is the first token of the request's first run a mismatch? The stale-read signature:
    a fresh row's first step reads its recycled slot, so its very first token goes wrong."""
    if "rejected" in reference or not got.get("tokens"):
        return False
    return classify(reference, _segment(got, 0, 1), None)[0] == "mismatch"


def resumed_drift(reference: dict, r: FuzzRequest, got: dict, resumed: list[int], first_key: str) -> float:
    """Largest logprob drift of a matching request, each segment against its own reference."""
    if "tokens" not in got:
        return 0.0
    bounds = [0] + resumed + [None]
    keys = [first_key] + [json.dumps(list(r.prompt) + got["tokens"][:a]) for a in resumed]
    return max(logprob_drift(reference[k], _segment(got, a, b)) for k, (a, b) in zip(keys, zip(bounds, bounds[1:])))


def perturbed_by_pass(off: dict[str, dict], on: dict[str, dict], acted_on: set[str]) -> dict[str, int]:
    """Requests the pass changed although its guard never acted on them: rid -> first position.

    ``off`` / ``on``: the two streams' results by request id (same stream,
    same schedule); ``acted_on``: the requests the guard acts on (those the
    builder ran fresh on a decode or speculative path, ``fresh_reads``). Every other request must come out of the
    pass-on stream exactly as out of the pass-off one: its logprobs are
    compared bit for bit over the tokens both share. A guard that damages a
    live row's state (zeroes it, or zeroes a neighbour's slot) shows up here
    even when the damage is too small to change a token or to pass DRIFT_TOL.
    Where the engine's own numerics depend on the other rows of a batch (the
    fixed rows' new tokens change those rows), this counts that too: read it
    next to the same count between two pass-off streams.
    """
    perturbed = {}
    for rid, a in off.items():
        b = on.get(rid)
        if rid in acted_on or b is None or "tokens" not in a or "tokens" not in b:
            continue
        for i, (ta, tb, la, lb) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])):
            if la != lb or ta != tb:
                perturbed[rid] = i
                break
    return perturbed


def largest_shift(off: dict[str, dict], on: dict[str, dict], acted_on: set[str]) -> float:
    """Largest |logprob difference| between two runs of one stream, over the requests
    outside ``acted_on`` and the leading tokens each run chose alike.

    Next to ``perturbed_by_pass`` (which requests moved at all), how far they
    moved: what two pass-off runs of one stream give is the host's own
    run-to-run noise, the yardstick where it is not zero.
    """
    shift = 0.0
    for rid, a in off.items():
        b = on.get(rid)
        if rid in acted_on or b is None or "tokens" not in a or "tokens" not in b:
            continue
        for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
            if ta != tb:
                break
            shift = max(shift, abs(la - lb))
    return shift


def engine_drift(perturbed: dict[str, int], on_repeat: dict[str, int]) -> dict[str, int]:
    """Of the requests the pass-on stream moved (``perturbed``: rid -> first position), those a second
    pass-on engine gave exactly as the baseline did (not in ``on_repeat``, that engine's moves).

    A footprint of the pass is its code acting on a request: the same stream
    and schedule in another engine with the same configuration repeat it. A
    move that the same configuration does not repeat is the engine's own:
    vLLM's compiled kernels can differ from one engine to the next (on the
    H200 one engine of five, pass on or off, computed a few prefills
    differently, the same requests each time).
    """
    return {rid: pos for rid, pos in perturbed.items() if rid not in on_repeat}


def footprint_problem(summary: dict) -> str | None:
    """Why the pass-on stream of a ``fuzz`` summary fails its footprint check, or None: it passes.

    The pass-on stream must equal the footprint baseline bit for bit. The
    baseline is the harness's own fix where it ran (every request: with the
    fresh slots zeroed either way, every row computes the same, whatever the
    host's numerics do with a batch), else pass off, on an engine whose caches
    were zeroed after start-up where that ran (``fuzz.CLEAN_OFF``): the requests
    the guard did not act on and the baseline did not run fresh on a slot-reading
    path (on hosts whose numerics depend on the other rows of a batch, the fixed
    rows' new tokens move them too). Where the pass moved a request, the
    fuzz ran the baseline and the pass-on stream once more, each in a new engine
    (``repeat_baseline_if_perturbed``; against ``CLEAN_OFF`` the pass-on one on caches zeroed
    after start-up too, ``summary["pass_on_repeat_guard"]``):

    - every moved request came out of the second pass-on engine exactly as the
      baseline gave it (``engine_drift``) and none moved by more than
      ``DRIFT_TOL``: the engine's own drift, the check passes (``host_noise`` says so);
    - else, if the baseline repeated itself bit for bit, a move the pass-on
      configuration repeats is the pass's doing and this fails;
    - if the host moved requests between two runs of the baseline too, bit for
      bit is out of reach there, and the pass's moves must stay within
      ``DRIFT_TOL``.
    """
    perturbed = summary["perturbed_by_pass"]
    if not perturbed:
        return None
    repeat = summary.get("baseline_repeat")
    shift = summary["largest_shift_by_pass"]
    detail = (f"pass on vs {summary['footprint_baseline']}: {len(perturbed)} request(s) moved, first "
              f"positions {perturbed}, largest |logprob shift| {shift:.3g}")
    if repeat is None:
        return detail + "; the baseline was not run again, so the host's own noise cannot be told apart"
    detail += (f"; that baseline twice: {len(repeat['perturbed'])} moved, largest "
               f"{repeat['largest_shift']:.3g}")
    drift = summary.get("engine_drift")
    if drift is not None:
        repeated = sorted(set(perturbed) - set(drift), key=lambda rid: int(rid[1:]))
        detail += f"; pass on again: {len(repeated)} of them moved again {repeated}"
        if not repeated:
            if shift <= DRIFT_TOL:
                return None
            return (f"a move beyond DRIFT_TOL={DRIFT_TOL} that a second pass-on engine did not repeat "
                    f"(a guard acting on some runs only?): " + detail)
    if not repeat["perturbed"]:
        return "the pass changed logprobs it must leave alone (" + detail + ")"
    if shift > DRIFT_TOL:
        return f"beyond DRIFT_TOL={DRIFT_TOL} on a host that does not repeat itself: " + detail
    return None


def host_noise(summary: dict) -> str | None:
    """Where the footprint check passed short of bit for bit (the engine's own drift, or a host that
    does not reproduce a run), what to warn about; else None."""
    perturbed = summary["perturbed_by_pass"]
    if not perturbed:
        return None
    notes = []
    drift = summary.get("engine_drift")
    if drift and set(drift) == set(perturbed):
        notes.append(f"engine drift, not the pass: pass on vs {summary['footprint_baseline']} moved "
                     f"{len(perturbed)} request(s) {drift} (largest {summary['largest_shift_by_pass']:.3g}), "
                     f"and a second pass-on engine ({summary.get('pass_on_repeat_guard', 'on')}) gave each of "
                     "them exactly as the baseline")
    repeat = summary.get("baseline_repeat", {}).get("perturbed")
    if repeat:
        # the moves the baseline's second engine made too, where it landed as the first pass-on engine did
        split = summary.get("pass_on_vs_baseline_again", {}).get("perturbed")
        alike = [] if split is None else sorted(set(perturbed) & set(repeat) - set(split),
                                               key=lambda rid: int(rid[1:]))
        if alike:
            notes.append(f"the baseline's second engine gave {len(alike)} of them ({', '.join(alike)}) "
                         "exactly as the first pass-on engine: engines split on them with or without the pass")
        notes.append(f"this host does not reproduce a run bit for bit; footprint judged against DRIFT_TOL: "
                     f"pass on vs {summary['footprint_baseline']} moved {len(perturbed)}, "
                     f"largest {summary['largest_shift_by_pass']:.3g}; the baseline twice moved "
                     f"{len(repeat)}")
    return "; ".join(notes) or None
