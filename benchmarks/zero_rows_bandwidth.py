"""The group zeroing launch on CUDA: this grid against the previous one, per count of fresh rows.

One launch zeroes the fresh rows' slots in every cache of a GDN layer group
(``gdn_pass.kernels.zero_rows.zero_rows_all``). Caches at Qwen3-Next-80B's
dimensions, three GDN layers (one vLLM group): conv state [8192, 3] bf16 and
recurrent state [32, 128, 128] (``--ssm-dtype``), 1024 slots; rows staged as
the metadata hook stages them (``stage_fresh``, capacity ``--max-rows``).
Both launches are captured in CUDA graphs and timed by replay, interleaved
in rounds (median of rounds):

    now        a fixed grid, two programs per SM, sharing every fresh slot's
               64 KiB chunks (gdn-pass from this change on)
    previous   one program per (row, cache, slice), slices chosen so the grid
               stays near 264 programs: at 256 rows one program per fresh slot
               (gdn-pass up to 32ffbb8; kept here for the comparison only)

    python benchmarks/zero_rows_bandwidth.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_graph_timing import capture, replay_ms  # noqa: E402
from gdn_pass.metadata import StagedRowMetadata  # noqa: E402
from gdn_pass.kernels.zero_rows import CacheTable, zero_rows_all  # noqa: E402

LAYERS, HV, K, V, CONV_DIM, SLOTS = 3, 32, 128, 128, 8192, 1024


def _previous_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def previous_zero_fresh_rows_all(table_ptr, slot_ptr, fresh_ptr, slices, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cache = tl.program_id(1)
        part = tl.program_id(2)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if tl.load(fresh_ptr + row).to(tl.int1) & (slot >= 0):
            base = tl.load(table_ptr + cache * 3).to(tl.pointer_type(tl.int32))
            stride = tl.load(table_ptr + cache * 3 + 1)
            numel = tl.load(table_ptr + cache * 3 + 2)
            per_slice = (numel + slices - 1) // slices
            start = part * per_slice
            end = tl.minimum(start + per_slice, numel)
            zeros = tl.zeros([BLOCK], dtype=tl.int32)
            for offset in range(start, end, BLOCK):
                offs = offset + tl.arange(0, BLOCK)
                tl.store(base + slot * stride + offs, zeros, mask=offs < end)

    kernel = previous_zero_fresh_rows_all

    def launch(table: CacheTable, slot: torch.Tensor, fresh: torch.Tensor) -> None:
        rows, caches = slot.numel(), table.table.shape[0]
        slices = max(1, min(16, 264 // max(rows * caches, 1), (table.max_slot_words + 1023) // 1024))
        kernel[(rows, caches, slices)](table.table, slot, fresh, slices, BLOCK=1024)

    return launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--fresh", type=int, nargs="+", default=[0, 1, 4, 32, 128])
    ap.add_argument("--ssm-dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    previous = _previous_kernel()
    results = []
    for dtype in args.ssm_dtype:
        caches = []
        for _ in range(LAYERS):
            caches.append(torch.randn(SLOTS, 3, CONV_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2))
            caches.append(torch.randn(SLOTS, HV, K, V, device="cuda", dtype=getattr(torch, dtype)))
        table = CacheTable.build(caches)
        slot_bytes = sum(c[0].numel() * c.element_size() for c in caches)
        for fresh in args.fresh:
            rng = random.Random(fresh)
            rows = StagedRowMetadata(args.max_rows, device="cuda", pad_slot_ids=(-1, 0))
            to_zero = np.zeros(args.max_rows, dtype=bool)
            to_zero[rng.sample(range(args.max_rows), fresh)] = True
            slots = torch.tensor(rng.sample(range(1, SLOTS), args.max_rows), device="cuda")
            rows.stage_fresh(fresh_rows=to_zero, state_slots=slots)
            graphs = {"now": capture(zero_rows_all, table, rows.state_slot, rows.fresh_rows()),
                      "previous": capture(previous, table, rows.state_slot, rows.fresh_rows())}
            times = {name: [] for name in graphs}
            for r in range(args.rounds):
                for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
                    times[name].append(replay_ms(graphs[name], args.iters) * 1e3)
            now, before = statistics.median(times["now"]), statistics.median(times["previous"])
            written = fresh * slot_bytes
            results.append(dict(ssm_dtype=dtype, max_rows=args.max_rows, fresh=fresh, bytes_zeroed=written,
                                now_us=round(now, 2), previous_us=round(before, 2),
                                now_over_previous=round(now / before, 3),
                                now_gb_per_s=round(written / now / 1e3, 1) if fresh else None,
                                samples={k: [round(t, 2) for t in v] for k, v in times.items()}))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "samples"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python benchmarks/zero_rows_bandwidth.py " + " ".join(sys.argv[1:]),
                device=torch.cuda.get_device_name(), torch=torch.__version__, results=results)
    (out / "zero_rows_bandwidth.json").write_text(json.dumps(meta, indent=1))
    lines = ["# Group zeroing launch: this grid against the previous one", "",
             f"Command: `{meta['command']}` on {meta['device']} (torch {meta['torch']}). One launch zeroes "
             f"the fresh rows' slots of {LAYERS} GDN layers (conv [8192, 3] bf16 + recurrent [32, 128, 128]); "
             "captured, timed by replay, median of interleaved rounds.", "",
             "| recurrent dtype | fresh rows of max_rows | MB zeroed | now us | previous us | now / previous | now GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['ssm_dtype']} | {r['fresh']} of {r['max_rows']} | {r['bytes_zeroed'] / 1e6:.1f} "
                     f"| {r['now_us']} | {r['previous_us']} | x{r['now_over_previous']} | {r['now_gb_per_s'] or '-'} |")
    (out / "zero_rows_bandwidth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
