"""Seeded scheduling fuzz for vllm#51562 on a real vLLM engine.

A seeded stream mixes one-token prompts, short prompts, long prompts that a
small token budget splits into chunks, prompts that share a prefix (prefix
caching), random ``max_tokens`` (early finishes recycle state slots), and
arrivals between steps; a small KV cache makes the scheduler preempt. Every
request's greedy tokens and logprobs are compared with the same prompt run
alone on fresh state.

    reference : one engine runs each prompt alone; before each, every state
                and KV cache is zeroed and the prefix cache reset, which is
                what a fresh engine holds (checked against a fresh engine in
                tests/vllm/test_fuzz.py). Results are cached by prompt.
    stream    : the stream in one engine, pass off or on.

What counts as a mismatch: a different greedy token, or a logprob off by
more than LOGPROB_TOL. The tolerance is not zero because a fresh row is not
always run by the same kernel: alone, a one-token prompt takes the decode
kernel; next to a prefill it takes the chunked-prefill kernel, and the two
differ by a few 1e-2 in logprob in bfloat16 (vLLM's CPU GDN op is bf16 only).
Chunk boundaries are held equal (see _COMMON_ENGINE). A stale state changes
the first token in most cases; the summary also reports the largest logprob
drift among requests that matched.

    python -m gdn_pass.examples.fuzz --model DIR --seed 0 --requests 40 --workdir artifacts/fuzz
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["FuzzRequest", "make_stream", "fuzz", "ENGINE_CONFIGS", "CONFIG_CHECKPOINT"]

LOGPROB_TOL = 0.1
_PREEMPT_BLOCKS = 24

# Engine settings per fuzz configuration (on top of vllm_scenarios.make_llm's).
ENGINE_CONFIGS: dict[str, dict] = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    # 128-token blocks (CONFIG_CHECKPOINT), prompts of up to 300 tokens that
    # share long prefixes, and a pool too small for the requests in flight:
    # prefix-cache hits in "align" mode and preemptions both happen.
    "preempt_prefix_hits": dict(enable_prefix_caching=True, max_model_len=512,
                                num_gpu_blocks_override=_PREEMPT_BLOCKS),
}
# The checkpoint kind each configuration runs (tiny_checkpoints), and its stream shape.
CONFIG_CHECKPOINT: dict[str, str] = {"preempt_prefix_hits": "qwen3_next_small_state"}
CONFIG_STREAM: dict[str, dict] = {
    "preempt_prefix_hits": dict(long_len=(130, 300), max_prompt=400, long_prefixes=True,
                                weights=(0.3, 0.1, 0.15, 0.25, 0.2)),
}
_COMMON_ENGINE = dict(
    max_num_seqs=8,
    # Long prompts run in chunks of exactly 8 tokens: 8 rows x 8 always fit
    # the budget, so chunk boundaries are the same alone and in the stream.
    max_num_batched_tokens=64,
    long_prefill_token_threshold=8,
    enable_chunked_prefill=True,
    max_model_len=128,
    num_gpu_blocks_override=8,  # few blocks: slots recycle at once, and requests get preempted
)


@dataclass(frozen=True)
class FuzzRequest:
    rid: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    kind: str


def make_stream(seed: int, num_requests: int, *, long_len: tuple[int, int] = (20, 90),
                max_prompt: int = 100, long_prefixes: bool = False,
                weights: tuple[float, ...] = (0.35, 0.15, 0.15, 0.1, 0.25)) -> list[FuzzRequest]:
    """A seeded request stream; one-token prompts are the bug's trigger and come often.

    ``long_len``: token range of "long" prompts; ``max_prompt``: prompts are cut
    there; ``long_prefixes``: shared prefixes are taken from earlier long
    prompts (long enough to fill cache blocks, the last three, which the
    prefix cache still holds) rather than from any prompt; ``weights``: of the
    kinds one_token, short, long, shared_prefix, long_output.
    """
    rng = random.Random(seed)
    stream, step, earlier, earlier_long = [], 0, [], []
    for i in range(num_requests):
        step += rng.choice([0, 0, 1, 1, 2, 3, 5])
        kind = rng.choices(["one_token", "short", "long", "shared_prefix", "long_output"],
                           list(weights))[0]
        max_tokens = rng.randint(1, 16)
        if kind == "one_token":
            prompt = [rng.randrange(3, 1000)]
        elif kind == "long_output":  # grows into new blocks while decoding: preemption
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(40, 90)
        elif kind == "short":
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(2, 8))]
        elif kind == "long":
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(*long_len))]
            earlier_long.append(prompt)
        else:
            pool = (earlier_long[-3:] or earlier) if long_prefixes else earlier
            base = rng.choice(pool) if pool else [5] * 20
            prompt = list(base) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 6))]
        earlier.append(prompt)
        stream.append(FuzzRequest(f"q{i}", step, tuple(prompt[:max_prompt]), max_tokens, kind))
    return stream


# --------------------------------------------------------------- engine side


def _params(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)


def _finished(out) -> dict:
    c = out.outputs[0]
    return dict(tokens=list(c.token_ids),
                logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                # vLLM's own count of prompt tokens served from the prefix cache
                cached_tokens=getattr(out, "num_cached_tokens", None) or 0)


def _zero_all_caches(llm) -> None:
    """Every layer's KV / conv / recurrent cache to zero: a fresh engine's state."""
    import torch

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context

    def zero(x):
        if isinstance(x, torch.Tensor):
            x.zero_()
        elif isinstance(x, (list, tuple)):
            for item in x:
                zero(item)

    for layer in context.values():
        zero(getattr(layer, "kv_cache", None))


def run_reference(llm, prompts: dict[tuple[int, ...], int]) -> dict:
    """Each prompt alone on zeroed state; ``prompts`` maps prompt -> max_tokens."""
    engine, results = llm.llm_engine, {}
    for prompt, max_tokens in prompts.items():
        llm.reset_prefix_cache()
        _zero_all_caches(llm)
        engine.add_request("ref", {"prompt_token_ids": list(prompt)}, _params(max_tokens))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[json.dumps(list(prompt))] = _finished(out)
    return results


def run_stream(llm, stream: list[FuzzRequest], recorder) -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    original = Scheduler._preempt_request

    def preempt(self, request, *args, **kwargs):
        # vLLM 0.30 suffixes the caller's id inside the engine ("q7-1a2b3c4d")
        preempted.append(re.sub(r"-[0-9a-f]{8}$", "", request.request_id))
        return original(self, request, *args, **kwargs)

    Scheduler._preempt_request = preempt
    engine, results, pending, step = llm.llm_engine, {}, list(stream), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            engine.add_request(r.rid, {"prompt_token_ids": list(r.prompt)}, _params(r.max_tokens))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = _finished(out)
        step += 1
        if step > 50 * len(stream) + 200:
            raise RuntimeError(f"fuzz stream did not finish in {step} steps: {len(results)} of "
                               f"{len(stream)} requests done, {len(preempted)} preemptions")
    Scheduler._preempt_request = original
    return dict(results=results, steps=step, preemptions=len(preempted),
                preempted_requests=len(set(preempted)), preempted_ids=sorted(set(preempted)),
                prefix_cache_hits=sum(r["cached_tokens"] > 0 for r in results.values()),
                fresh_decode_steps=len(recorder.fresh_decode_steps()))


def _engine_main(args) -> None:
    from gdn_pass.examples.vllm_scenarios import StepRecorder, make_llm

    spec = json.loads(Path(args.spec).read_text())
    recorder = StepRecorder()
    llm = make_llm(spec["model"], guard=spec["guard"], report_dir=spec.get("report_dir"),
                   **{**_COMMON_ENGINE, **ENGINE_CONFIGS[spec["config"]]})
    start = time.time()
    if spec["role"] == "reference":
        prompts = {tuple(json.loads(p)): n for p, n in spec["prompts"].items()}
        out = dict(results=run_reference(llm, prompts))
    else:
        stream = [FuzzRequest(**{**r, "prompt": tuple(r["prompt"])}) for r in spec["stream"]]
        out = run_stream(llm, stream, recorder)
    out["run_s"] = round(time.time() - start, 1)
    Path(args.out).write_text(json.dumps(out))


# --------------------------------------------------------------- driver side


def _run_engine(spec: dict, workdir: Path, name: str, python: str) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out, log = workdir / f"{name}.spec.json", workdir / f"{name}.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(log, "w") as f:
        proc = subprocess.run([python, "-m", "gdn_pass.examples.fuzz", "--engine", "--spec",
                               str(spec_path), "--out", str(out)], env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"fuzz engine {name} failed (exit {proc.returncode}); log {log}:\n"
                           + log.read_text()[-3000:])
    return json.loads(out.read_text())


def _logprob_drift(reference: dict, got: dict) -> float:
    return max(abs(a - b) for a, b in zip(got["logprobs"], reference["logprobs"]))


def _mismatch(reference: dict, got: dict) -> str | None:
    n = len(got["tokens"])
    if got["tokens"] != reference["tokens"][:n]:
        first = next(i for i, (a, b) in enumerate(zip(got["tokens"], reference["tokens"])) if a != b)
        return f"token #{first}: {got['tokens'][first]} instead of {reference['tokens'][first]}"
    diff = _logprob_drift(reference, got)
    return f"logprob diff {diff:.2e}" if diff > LOGPROB_TOL else None


def fuzz(model: Path, workdir: Path, *, seed: int, num_requests: int, config: str,
         guards=("off", "on"), python: str = sys.executable, progress=print) -> dict:
    """Run one seeded stream with the pass off and on; compare each request with its reference."""
    workdir.mkdir(parents=True, exist_ok=True)
    stream = make_stream(seed, num_requests, **CONFIG_STREAM.get(config, {}))
    cache_path = workdir / f"reference_{config}.json"
    reference = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    wanted: dict[str, int] = {}
    for r in stream:
        key = json.dumps(list(r.prompt))
        have = len(reference.get(key, {}).get("tokens", []))
        if have < r.max_tokens:
            wanted[key] = max(wanted.get(key, 0), r.max_tokens)
    start = time.time()
    if wanted:
        progress(f"reference: {len(wanted)} prompt(s) alone on zeroed state ...")
        spec = dict(role="reference", model=str(model), guard=False, config=config, prompts=wanted)
        reference.update(_run_engine(spec, workdir, f"reference_{config}_s{seed}", python)["results"])
        cache_path.write_text(json.dumps(reference))
    summary = dict(seed=seed, config=config, requests=num_requests,
                   one_token_requests=sum(r.kind == "one_token" for r in stream), runs={})
    for guard in guards:
        progress(f"stream seed={seed} config={config} pass {guard} ...")
        spec = dict(role="stream", model=str(model), guard=guard == "on", config=config,
                    stream=[asdict(r) for r in stream],
                    report_dir=str(workdir / f"reports_{config}_s{seed}_{guard}"))
        run = _run_engine(spec, workdir, f"stream_{config}_s{seed}_{guard}", python)
        # A preempted request is recomputed from zero state by vLLM as a
        # prefill of its prompt and output so far: other kernels than the
        # decode steps of its reference, so bf16 numerics (and late greedy
        # tokens) may drift with or without the pass. Those are counted apart.
        preempted = set(run.get("preempted_ids", ()))
        mismatches, drift, preempted_mismatches = {}, 0.0, {}
        for r in stream:
            ref, got = reference[json.dumps(list(r.prompt))], run["results"][r.rid]
            why = _mismatch(ref, got)
            if why and r.rid in preempted:
                preempted_mismatches[r.rid] = f"{r.kind}: {why}"
            elif why:
                mismatches[r.rid] = f"{r.kind}: {why}"
            else:
                drift = max(drift, _logprob_drift(ref, got))
        summary["runs"][guard] = dict(
            mismatches=len(mismatches), examples=dict(list(mismatches.items())[:5]),
            max_logprob_drift_of_matches=round(drift, 4),
            steps=run["steps"], fresh_decode_steps=run["fresh_decode_steps"],
            preemptions=run["preemptions"], preempted_requests=run.get("preempted_requests"),
            prefix_cache_hits=run.get("prefix_cache_hits"), run_s=run["run_s"],
            mismatches_of_preempted=len(preempted_mismatches),
            preempted_examples=dict(list(preempted_mismatches.items())[:5]),
            mismatched_ids=sorted(mismatches), preempted_mismatched_ids=sorted(preempted_mismatches))
    summary["wall_s"] = round(time.time() - start, 1)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    ap.add_argument("--model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--config", choices=sorted(ENGINE_CONFIGS), default="prefix_caching")
    ap.add_argument("--workdir", default="artifacts/fuzz")
    args = ap.parse_args()
    if args.engine:
        _engine_main(args)
        return 0
    summary = fuzz(Path(args.model), Path(args.workdir), seed=args.seed,
                   num_requests=args.requests, config=args.config)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
