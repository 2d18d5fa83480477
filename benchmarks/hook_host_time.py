"""Host time gdn-pass's metadata hook adds to one build of vLLM's GDN metadata builder.

A real ``GDNAttentionMetadataBuilder`` (this process's vLLM), configured with
GDNStatePass, on CUDA where there is one. Each case builds the same step with
the hook (``builder.build``) and without it (``builder.build.__wrapped__``,
vLLM's own build), interleaved, and reports the difference per build:

    rows B, fresh k      the step: B one-token rows in vLLM's decode order,
                         k of them brand new (fresh decode rows, to zero)
    vllm_us              vLLM's build alone, median per build
    hook_us              the hook's host time per build (with - without)
    busy_us              (CUDA, fresh steps) one build with the hook enqueued
                         behind a 2 ms GPU sleep: near hook_us + vllm_us when
                         the hook never waits for the stream, near 2000 when
                         it does

On CUDA steps without speculative rows (all of these) the hook stages nothing:
the zeroing launch reads the new rows from vLLM's own tensors
(``compat.decode_rows``). Each fresh case is also timed with that switched off
(``staged``): the hook then copies one host array of flags and the rows' slots
(``StagedRowMetadata.stage_fresh``), as it still does on speculative steps.

    python benchmarks/hook_host_time.py [--batches 1 8 64 256] [--repeat 400] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn", "model.layers.2.linear_attn"]


def make_builder(device: torch.device, num_blocks: int):
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import GDNStatePass, metadata_hook, step_guard

    try:  # the prefill-backend probe reads a model config on CUDA; there is no model here
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

        qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda cfg: ("triton", "triton")
    except ImportError:
        pass
    metadata_hook.install()
    config = VllmConfig(
        compilation_config=CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": GDNStatePass()}),
        additional_config={"gdn_prefill_backend": "triton"})
    config.scheduler_config.max_num_seqs = max(config.scheduler_config.max_num_seqs, num_blocks)
    context = config.compilation_config.static_forward_context
    for name in LAYERS:  # Qwen3-Next's per-layer state shapes, small slot count
        context[name] = SimpleNamespace(kv_cache=[
            torch.zeros(num_blocks, 3, 8192, dtype=torch.bfloat16, device=device),
            torch.zeros(num_blocks, 32, 128, 128, dtype=torch.float32, device=device)])
    # Every layer has a guarded op (the compiled engine's case): the op guard owns the group.
    for name in LAYERS:
        step_guard.note_guarded_layer(name)
    spec = MambaSpec(block_size=16, shapes=((3, 8192), (32, 128, 128)), dtypes=(torch.bfloat16, torch.float32))
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        builder = GDNAttentionMetadataBuilder(spec, LAYERS, config, device)
    return builder


def common_step(batch: int, fresh: int, device: torch.device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    computed = [0] * fresh + [17] * (batch - fresh)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.tensor(computed, dtype=torch.int32) + 1
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        num_reqs=batch, num_actual_tokens=batch, max_query_len=1, max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(1, batch + 1, dtype=torch.int32, device=device).view(-1, 1),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens.clone())


def staged_only(on: bool) -> None:
    """Switch the hook to staging the rows itself (as on speculative steps), or back."""
    from gdn_pass.vllm import compat

    if not hasattr(compat, "_decode_rows_original"):
        compat._decode_rows_original = compat.decode_rows
    compat.decode_rows = (lambda common, metadata: None) if on else compat._decode_rows_original


def time_builds(builder, step, repeat: int, sync) -> tuple[float, float]:
    """Median us per build: (with the hook, vLLM's build alone), interleaved in blocks of 20."""
    hooked, plain = [], []
    original = builder.build.__wrapped__
    for _ in range(repeat // 20):
        for fn, out in ((lambda: builder.build(0, step), hooked), (lambda: original(builder, 0, step), plain)):
            start = time.perf_counter()
            for _ in range(20):
                fn()
            out.append((time.perf_counter() - start) / 20 * 1e6)
        sync()
    return statistics.median(hooked), statistics.median(plain)


def busy_build_us(builder, step) -> float:
    """Host time of one hooked build enqueued behind 2 ms of GPU work."""
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 2e-3)  # kHz -> cycles in 2 ms
    times = []
    for _ in range(5):
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        builder.build(0, step)
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--repeat", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    builder = make_builder(device, num_blocks=max(args.batches) + 2)
    rows = []
    for batch in args.batches:
        for fresh in sorted({0, 1, batch // 2}):
            if fresh > batch:
                continue
            step = common_step(batch, fresh, device)
            for mode in ("vllm tensors", "staged") if cuda and fresh else ("vllm tensors" if cuda else "staged",):
                staged_only(mode == "staged")
                for _ in range(50):  # warm-up: caches, allocator
                    builder.build(0, step)
                sync()
                with_hook, alone = time_builds(builder, step, args.repeat, sync)
                row = dict(batch=batch, fresh=fresh, mode=mode, vllm_us=round(alone, 1),
                           hook_us=round(with_hook - alone, 1))
                if cuda and fresh:
                    row["busy_us"] = round(busy_build_us(builder, step), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
            staged_only(False)
    import vllm

    result = dict(command="python benchmarks/hook_host_time.py " + " ".join(sys.argv[1:]),
                  device=torch.cuda.get_device_name() if cuda else "cpu", vllm=vllm.__version__,
                  torch=torch.__version__, rows=rows)
    table = ["| B | fresh | new rows from | vLLM build us | hook us per build | one build behind 2 ms of GPU work, us |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['fresh']} | {r['mode']} | {r['vllm_us']} | {r['hook_us']} | "
              f"{r.get('busy_us', '')} |" for r in rows]
    print("\n".join(table))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hook_host_time.json").write_text(json.dumps(result, indent=1))
        (args.out / "hook_host_time.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
