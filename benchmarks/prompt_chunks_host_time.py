"""Host time of the prompt-chunk repair (``gdn_pass.vllm.prompt_chunks``) per Lightning build, with MTP.

A real ``BailingLinearAttentionMetadataBuilder`` (this process's vLLM), made
as for an engine with one speculative token and GDNStatePass configured,
builds each step through gdn-pass's hook. Reported per build, medians over
blocks in one run:

    repair_us            the repair's own calls as the hook makes them (reading the
                         step's inputs, ``call_kwargs``, ``keep_state_in_first_column``)
    with_us / without_us the whole hooked build with the repair attached and
                         detached (``BuilderState.prompt_chunks`` set / None), in
                         ABBA blocks: context; on a shared host its spread is far
                         larger than ``repair_us``

Steps:

    speculating B        B rows of 1 + k tokens, each with its draft and accepted
                         counts (the common step of an MTP engine)
    one-token B          B one-token rows, no draft in the step (no accepted counts)
    prompt chunk B       B - 1 speculating rows and one prompt chunk of 1 + k
                         tokens (the rows the repair changes)

    python benchmarks/prompt_chunks_host_time.py [--batches 1 8 64 256] [--repeat 400] [--out DIR]

``repair_us`` is what the repair costs the host per build of each Lightning
group; vLLM's runner builds once per group and step.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 1  # speculative tokens
LAYERS = ["model.layers.0.attention", "model.layers.1.attention"]


def make_builder(max_rows: int):
    from vllm.config import CompilationConfig, CUDAGraphMode, SchedulerConfig, VllmConfig
    from vllm.v1.attention.backends.linear_attn import BailingLinearAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import VllmGDNStatePass, metadata_hook, step_guard

    # An engine with one speculative token (a speculative_config needs a model to load).
    VllmConfig.num_speculative_tokens = property(lambda self: K)
    step_guard._GUARDED_LAYERS.clear()  # no compiled graph: the step guard owns the group
    metadata_hook.install()
    config = VllmConfig(
        compilation_config=CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()}),
        scheduler_config=SchedulerConfig(max_num_seqs=max_rows, max_num_batched_tokens=4 * max_rows,
                                         max_model_len=4 * max_rows, is_encoder_decoder=False))
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in LAYERS:
        state = torch.zeros(2 * max_rows * (1 + K) + 2, 4, 16, 16, device=device)
        config.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=(state,))
    spec = MambaSpec(block_size=16, shapes=((4, 16, 16),), dtypes=(torch.float32,))
    builder = BailingLinearAttentionMetadataBuilder(spec, LAYERS, config, device)
    builder.reorder_batch_threshold = 1 + K  # what a speculative_config would make it
    return builder, device


def common(computed: list[int], qlens: list[int], device):
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(computed, dtype=torch.int32) + torch.tensor(qlens, dtype=torch.int32)
    n = len(qlens)
    blocks = torch.arange(1, 1 + n * (1 + K), dtype=torch.int32).view(n, 1 + K)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device), num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=blocks.to(device), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens.clone())


def cases(batch: int, device) -> dict[str, tuple]:
    width = 1 + K
    ones = torch.ones(batch, dtype=torch.int32, device=device)
    drafts = torch.full((batch,), K, dtype=torch.int32)
    spec = (common([40] * batch, [width] * batch, device), dict(num_accepted_tokens=ones,
                                                                num_decode_draft_tokens_cpu=drafts))
    one_token = (common([40] * batch, [1] * batch, device), {})
    chunk_drafts = drafts.clone()
    chunk_drafts[-1] = -1
    chunk = (common([40] * (batch - 1) + [16], [width] * batch, device),
             dict(num_accepted_tokens=ones, num_decode_draft_tokens_cpu=chunk_drafts))
    return {f"speculating {batch}": spec, f"one-token {batch}": one_token, f"prompt chunk {batch}": chunk}


def time_repair(builder, repair, step, kwargs, repeat: int) -> float:
    """The repair's calls as ``metadata_hook``'s build makes them, on one built metadata."""
    from gdn_pass.vllm import compat

    build = type(builder).build.__wrapped__
    metadata = build(builder, 0, step, **repair.call_kwargs(step, kwargs))
    start = time.perf_counter_ns()
    for _ in range(repeat):
        common, drafts = compat.step_inputs(build, builder, (0, step), kwargs)
        repair.call_kwargs(common, kwargs)
        repair.keep_state_in_first_column(builder, common, drafts, metadata)
    if step.query_start_loc.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / repeat / 1e3


def time_builds(builder, step, kwargs, repeat: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(repeat):
        builder.build(0, step, **kwargs)
    if step.query_start_loc.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - start) / repeat / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=400, help="builds per block")
    ap.add_argument("--blocks", type=int, default=15, help="blocks per variant, alternating")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import vllm

    from gdn_pass.vllm.metadata_hook import state_of

    builder, device = make_builder(max(args.batches))
    builder.build(0, *cases(1, device)["speculating 1"][:1])  # the first build settles the guard
    guard = state_of(builder)
    repair = guard.prompt_chunks
    assert repair is not None, "the repair is not attached: is this vLLM's V1 runner?"
    rows = []
    for batch in args.batches:
        for name, (step, kwargs) in cases(batch, device).items():
            samples = {"with": [], "without": [], "repair": []}
            for block in range(2 * args.blocks):
                variant = ("with", "without")[(block + block // 2) % 2]  # ABBA order
                guard.prompt_chunks = repair if variant == "with" else None
                samples[variant].append(time_builds(builder, step, kwargs, args.repeat))
                if variant == "with":
                    samples["repair"].append(time_repair(builder, repair, step, kwargs, args.repeat))
            guard.prompt_chunks = repair
            with_us, without_us, repair_us = (statistics.median(samples[v]) for v in ("with", "without", "repair"))
            rows.append(dict(case=name, repair_us=round(repair_us, 2), with_us=round(with_us, 2),
                             without_us=round(without_us, 2),
                             build_spread_us=round(statistics.pstdev(samples["without"]), 2)))
            print(f"{name:18s} repair {repair_us:7.2f} us   hooked build: with {with_us:8.2f} us, "
                  f"without {without_us:8.2f} us (spread {rows[-1]['build_spread_us']:.1f} us)", flush=True)
    meta = dict(vllm=vllm.__version__, torch=torch.__version__, device=str(device), host=platform.processor() or
                platform.machine(), repeat=args.repeat, blocks=args.blocks,
                repaired_rows=repair.rows_repaired, staged_steps=repair.steps_staged)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prompt_chunks_host_time.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
