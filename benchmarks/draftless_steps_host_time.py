"""Host time of ``gdn_pass.vllm.draftless_steps`` per step: the V1 runner's graph choice with and without it.

vLLM's own ``GPUModelRunner._determine_batch_execution_and_padding`` (this
process's vLLM) chooses each step's CUDA graph with a real
``CudagraphDispatcher`` of ``FULL_AND_PIECEWISE`` graphs, for an engine with
one speculative token whose GDN builder asked gdn-pass to keep draftless
``1 + k``-token steps off the FULL graph. Before each choice the runner's
``_prepare_inputs`` runs as gdn-pass wraps it (vLLM's own body replaced by a
no-op: it needs a whole input batch, and gdn-pass adds only its entry). Per
step, medians over alternating blocks in one run:

    with_us / without_us  prepare + choice through gdn-pass's wrappers / vLLM's
                          functions called directly, same runner, ABBA blocks
    added_us              with_us - without_us: what the change costs a step

Steps:

    speculating B      B rows of 1 + k tokens, each with k drafts (an MTP engine's usual step;
                       the uniform shape, so the drafts are looked at)
    mixed B            B - 1 one-token rows and one of 1 + k tokens, no drafts (not the uniform
                       shape: one shape check; B = 1: one one-token row)
    prompt chunk B     B - 1 speculating rows and a draftless chunk of 1 + k tokens (the
                       step it keeps off the FULL graph)

    python benchmarks/draftless_steps_host_time.py [--batches 1 8 64 256] [--repeat 2000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 1  # speculative tokens


class _Builder:
    """What ``keep_off_full_graphs`` reads of a speculating GDN builder with FULL graphs."""

    use_spec_decode = True
    use_full_cuda_graph = True


def make_runner(max_rows: int):
    """A V1 runner with the state its graph choice reads, of an engine whose GDN builder asked
    for draftless steps to be kept off FULL graphs; and vLLM's two functions as installed."""
    from vllm.config import CompilationConfig, SchedulerConfig, VllmConfig

    from gdn_pass.vllm import VllmGDNStatePass, draftless_steps, support
    from harness.v1_runner import graph_choosing_runner, runner_class, with_cuda_graphs

    cls = runner_class()
    # vLLM's _prepare_inputs needs a whole input batch: a no-op in its place, wrapped as vLLM's is
    setattr(cls, draftless_steps._PREPARE, lambda self, scheduler_output, num_scheduled_tokens: None)
    vllm_prepare, vllm_choose = getattr(cls, draftless_steps._PREPARE), getattr(cls, draftless_steps._CHOOSE)
    config = VllmConfig(
        compilation_config=CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()}),
        scheduler_config=SchedulerConfig(max_num_seqs=max_rows, max_num_batched_tokens=(1 + K) * max_rows,
                                         max_model_len=4 * max_rows, is_encoder_decoder=False))
    with_cuda_graphs(config, "FULL_AND_PIECEWISE", [1, 2, 4] + list(range(8, (1 + K) * max_rows + 1, 8)))
    builder = _Builder()  # GDN's, as it asks at start
    support.runs_v2_model_runner = lambda vllm_config: False  # this benchmark's runner is the V1 one
    draftless_steps.keep_off_full_graphs(builder, config)
    assert builder in draftless_steps._BUILDERS, "draftless_steps did not apply (see the warning above)"
    runner = graph_choosing_runner(config, [builder], speculative_tokens=K, draft_rows=max_rows)
    return runner, builder, vllm_prepare, vllm_choose


def cases(batch: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lens, drafts per row, -1: none)."""
    width = 1 + K
    return {f"speculating {batch}": ([width] * batch, [K] * batch),
            # (B = 1: one one-token row)
            f"mixed {batch}": ([1] * max(batch - 1, 1) + [width] * (batch > 1), [-1] * batch),
            f"prompt chunk {batch}": ([width] * batch, [K] * (batch - 1) + [-1])}


def time_steps(runner, prepare, choose, query_lens, drafts, repeat: int) -> float:
    """us per step: ``prepare`` then ``choose`` as ``execute_model`` calls them (by keyword)."""
    qlens = np.array(query_lens)
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={r: [0] * d for r, d in enumerate(drafts) if d > 0})
    kwargs = dict(num_tokens=int(qlens.sum()), num_reqs=len(qlens), num_scheduled_tokens_np=qlens,
                  max_num_scheduled_tokens=int(qlens.max()), use_cascade_attn=False)
    start = time.perf_counter_ns()
    for _ in range(repeat):
        prepare(runner, scheduled, qlens)
        choose(runner, **kwargs)
    return (time.perf_counter_ns() - start) / repeat / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=2000, help="steps per block")
    ap.add_argument("--blocks", type=int, default=15, help="blocks per variant, alternating")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import vllm

    from gdn_pass.vllm import draftless_steps

    runner, _builder, vllm_prepare, vllm_choose = make_runner(max(args.batches))
    cls = type(runner)
    wrapped = (getattr(cls, draftless_steps._PREPARE), getattr(cls, draftless_steps._CHOOSE))
    assert getattr(wrapped[1], draftless_steps._MARK, False), "the graph choice is not wrapped"
    rows = []
    for batch in args.batches:
        for name, (query_lens, drafts) in cases(batch).items():
            np.copyto(runner.num_decode_draft_tokens.np[:batch], drafts)  # what _prepare_inputs writes
            kept = draftless_steps.activity()["steps"]
            samples = {"with": [], "without": []}
            for block in range(2 * args.blocks):
                variant = ("with", "without")[(block + block // 2) % 2]  # ABBA order
                pair = wrapped if variant == "with" else (vllm_prepare, vllm_choose)
                samples[variant].append(time_steps(runner, *pair, query_lens, drafts, args.repeat))
            kept_off = draftless_steps.activity()["steps"] > kept
            with_us, without_us = (statistics.median(samples[v]) for v in ("with", "without"))
            rows.append(dict(case=name, with_us=round(with_us, 2), without_us=round(without_us, 2),
                             added_us=round(with_us - without_us, 2),
                             spread_us=round(statistics.pstdev(samples["without"]), 2), kept_off_full_graph=kept_off))
            print(f"{name:18s} with {with_us:7.2f} us, without {without_us:7.2f} us: added {with_us - without_us:+6.2f} us "
                  f"(spread {rows[-1]['spread_us']:.2f} us){'  [kept off the FULL graph]' if kept_off else ''}",
                  flush=True)
    meta = dict(vllm=vllm.__version__, torch=torch.__version__, host=platform.processor() or platform.machine(),
                repeat=args.repeat, blocks=args.blocks, speculative_tokens=K)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "draftless_steps_host_time.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
