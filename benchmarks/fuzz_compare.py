"""Compare saved fuzz streams with each other, bit for bit: is a difference the pass's or the engine's?

``perturbed_by_pass`` compares one pass-off stream with one pass-on stream.
Whether what differs is the pass's doing needs a control: two streams that
should agree (two pass-off runs of the same stream, or a pass-on run whose
guard writes nothing: ``GDN_FUZZ_MUTATION=skip_zeroing``). This prints, for
every pair of the streams given, the requests the guard never acted on whose
tokens or logprobs differ at all, and for each stream those that differ from
the prompt run alone (the reference), with the first differing token.

    python benchmarks/fuzz_compare.py --config bad_input_under_load --requests 1000 \\
        --reference /tmp/fz_a/reference_bad_input_under_load.json \\
        off_a=/tmp/fz_a/stream_bad_input_under_load_s0_off.json \\
        off_b=/tmp/fz_b/stream_bad_input_under_load_s0_off.json ...

The requests acted on are the ``fresh_reads`` of every stream given (the same
stream and engine settings give the same ones).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fuzz import CONFIG_STREAM, engine_settings, make_stream  # noqa: E402
from harness.fuzz_judge import fresh_reads, perturbed_by_pass  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", help="reference_<config>.json of the prompts run alone")
    ap.add_argument("streams", nargs="+", metavar="LABEL=STREAM_JSON")
    args = ap.parse_args()
    stream = make_stream(args.seed, args.requests, max_model_len=engine_settings(args.config)["max_model_len"],
                         **CONFIG_STREAM.get(args.config, {}))
    runs = {}
    for item in args.streams:
        label, _, path = item.partition("=")
        runs[label] = json.loads(Path(path).read_text())
    acted = set().union(*(fresh_reads(run) for run in runs.values()))
    out: dict = dict(acted_on=len(acted), pairs={}, from_reference={})
    for a, b in itertools.combinations(runs, 2):
        differ = perturbed_by_pass(runs[a]["results"], runs[b]["results"], acted)
        out["pairs"][f"{a} vs {b}"] = dict(sorted(differ.items(), key=lambda kv: int(kv[0][1:])))
    if args.reference:
        reference = json.loads(Path(args.reference).read_text())
        # each request's reference under its own id, compared by the same bit-for-bit rule
        alone = {r.rid: reference[key] for r in stream if (key := json.dumps(list(r.prompt))) in reference}
        for label, run in runs.items():
            out["from_reference"][label] = perturbed_by_pass(alone, run["results"], acted)
    print(json.dumps(out))
    for pair, differ in out["pairs"].items():
        print(f"{pair}: {len(differ)} request(s) the guard never acted on differ", file=sys.stderr)
    for label, differ in out["from_reference"].items():
        print(f"{label} vs the prompts run alone: {len(differ)} such request(s) differ", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
