"""Judge a fuzz run again from its saved streams, without engines, and split the mismatches.

A fuzz workdir keeps each stream's raw results (``stream_<config>_s<seed>_<off|on>.json``)
and the references (``reference_<config>.json``). This prints, per pass setting:

- mismatches at the first token of a request's own first run (the stale-read
  signature: a fresh row's first step reads its recycled slot) and later ones
  (after the first token, or after a resume point);
- ``perturbed_by_pass``: requests the guard never acted on whose pass-on
  logprobs differ at all from pass-off ones. ``--acted-on all-short`` counts
  every prompt of at most two tokens as acted on, for traces recorded before
  ``fresh_reads`` existed (one-token prompts, and two-token prompts that MTP
  pads into speculative rows).

    python benchmarks/fuzz_rejudge.py --workdir /tmp/fz_x --config preempt_prefix_hits --requests 400
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fuzz import CONFIG_STREAM, engine_settings, make_stream  # noqa: E402
from harness.fuzz_judge import (base_key, classify_resumed, first_token_mismatch,  # noqa: E402
                                          fresh_reads, one_token_paths, perturbed_by_pass, resume_points)


def split_mismatches(reference: dict, stream, run: dict) -> Counter:
    paths, counts = one_token_paths(run), Counter()
    for r in stream:
        got = run["results"].get(r.rid)
        if got is None:
            counts["no output"] += 1
            continue
        key = base_key(r, paths)
        kind, _ = classify_resumed(reference, r, got, resume_points(run, r.rid), key)
        if kind == "mismatch":
            counts["first token" if first_token_mismatch(reference.get(key, {}), got) else "later"] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--acted-on", choices=["trace", "all-short"], default="trace")
    args = ap.parse_args()
    wd = Path(args.workdir)
    reference = json.loads((wd / f"reference_{args.config}.json").read_text())
    stream = make_stream(args.seed, args.requests, max_model_len=engine_settings(args.config)["max_model_len"],
                         **CONFIG_STREAM.get(args.config, {}))
    runs = {g: json.loads((wd / f"stream_{args.config}_s{args.seed}_{g}.json").read_text()) for g in ("off", "on")}
    out = {g: dict(split_mismatches(reference, stream, run)) for g, run in runs.items()}
    if args.acted_on == "trace":
        acted = set(fresh_reads(runs["on"]))
    else:
        acted = {r.rid for r in stream if len(r.prompt) <= 2}
    perturbed = perturbed_by_pass(runs["off"]["results"], runs["on"]["results"], acted)
    out["acted_on"] = len(acted)
    out["perturbed_by_pass"] = dict(sorted(perturbed.items(), key=lambda kv: int(kv[0][1:])))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
