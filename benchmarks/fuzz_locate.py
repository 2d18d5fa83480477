"""Where did the pass change a row it never acted on? Map each such request to its step.

For a fuzz run recorded with ``--trace-detail`` (each step's rows on rank 0:
request ids, tokens computed before the step, query lengths, state slots),
this finds, for every request in ``perturbed_by_pass``, the window of steps
in which the state behind its first changed token could have changed (from
the step that sampled the token before it, or its first step, to the step that
sampled it), and the fresh rows the guard zeroed in that window, with their
slots next to the request's own. Slots are the traced GDN group's; vLLM's
hybrid allocator gives every group's layers views of the same block pool, so
a block id names memory that other groups' layers (attention KV included)
alias too.

A request's row in a step with ``computed`` tokens before it and ``query``
tokens in it samples output token ``computed + query - len(prompt)`` (the
prefill's last chunk samples token #0).

    python benchmarks/fuzz_locate.py --workdir /tmp/fz_x --config bad_input_under_load [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fuzz_judge import fresh_reads, perturbed_by_pass  # noqa: E402


def _rid(engine_id: str) -> str:
    return re.sub(r"-[0-9a-f]{8}$", "", engine_id)


def sampling_step(details: list[dict], rid: str, prompt_len: int, token: int) -> int | None:
    """Index of the step that sampled output token ``token`` of ``rid`` (its first run)."""
    for i, step in enumerate(details):
        for engine_id, computed, query in zip(step["req_ids"], step["computed"], step["query_lens"]):
            if _rid(engine_id) == rid and computed + query - prompt_len == token:
                return i
    return None


def first_step(details: list[dict], rid: str) -> int | None:
    return next((i for i, step in enumerate(details) if any(_rid(r) == rid for r in step["req_ids"])), None)


def rows_of(step: dict) -> list[dict]:
    n = len(step["query_lens"])
    slots = step["slots"] + [None] * (n - len(step["slots"]))
    return [dict(rid=_rid(r), computed=c, query=q, slot=s, fresh=c == 0 and q > 0)
            for r, c, q, s in zip(step["req_ids"], step["computed"], step["query_lens"], slots)]


def window(details: list[dict], rid: str, prompt_len: int, token: int) -> tuple[int, int] | None:
    """The steps in which the state behind ``token`` could have changed: from the step that
    sampled the token before it (or the request's first step) to the one that sampled it."""
    end = sampling_step(details, rid, prompt_len, token)
    start = sampling_step(details, rid, prompt_len, token - 1) if token > 0 else first_step(details, rid)
    return None if end is None or start is None else (start, end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="requests to print in full")
    args = ap.parse_args()
    wd = Path(args.workdir)
    runs = {g: json.loads((wd / f"stream_{args.config}_s{args.seed}_{g}.json").read_text()) for g in ("off", "on")}
    spec = json.loads((wd / f"stream_{args.config}_s{args.seed}_on.spec.json").read_text())
    prompts = {r["rid"]: len(r["prompt"]) for r in spec["stream"]}
    details = runs["on"].get("step_details")
    if not details:
        sys.exit("no step details: run the fuzz with --trace-detail")
    perturbed = perturbed_by_pass(runs["off"]["results"], runs["on"]["results"], set(fresh_reads(runs["on"])))
    summary: Counter = Counter()
    for k, (rid, token) in enumerate(sorted(perturbed.items(), key=lambda kv: int(kv[0][1:]))):
        span = window(details, rid, prompts[rid], token)
        if span is None:
            summary["step not found"] += 1
            continue
        own_slots, fresh, own_fresh = set(), [], False
        for i in range(span[0], span[1] + 1):
            for row in rows_of(details[i]):
                if row["rid"] == rid:
                    own_slots.add(row["slot"])
                    own_fresh |= row["fresh"]
                elif row["fresh"]:
                    fresh.append(dict(row, step=i))
        fresh_slots = {f["slot"] for f in fresh if f["slot"] is not None}
        own = {s for s in own_slots if s is not None}
        summary["perturbed"] += 1
        summary["its own first step in the window"] += own_fresh
        summary["another fresh row zeroed in the window"] += bool(fresh)
        summary["another fresh row on its slot"] += bool(fresh_slots & own)
        summary["another fresh row on a neighbouring slot (+-1)"] += bool(
            {s + d for s in own for d in (-1, 1)} & fresh_slots)
        if k < args.show:
            print(json.dumps(dict(rid=rid, first_changed_token=token, steps=span, own_slots=sorted(own),
                                  own_first_step_in_window=own_fresh, other_fresh_rows=fresh[:8])))
    print(json.dumps(dict(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
