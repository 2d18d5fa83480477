"""Cost of the vLLM op guard (sync-free zeroing of fresh rows' slots) on CUDA.

Per GDN layer, Qwen3-Next shapes (HK=16, HV=32, K=V=128; conv state
[8192, 3] bf16, recurrent state [32, 128, 128] fp32; 1024 slots), both
captured in CUDA graphs and timed by replay, interleaved:

    step   flash-linear-attention's fused recurrent decode on gathered state,
           written back (a stand-in for vLLM's GDN decode of one layer)
    guard  gdn_pass.kernels.zero_rows on the conv and recurrent caches

    python benchmarks/op_guard_overhead.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_graph_timing import capture, replay_ms  # noqa: E402
from gdn_pass.metadata import StagedRowMetadata  # noqa: E402
from gdn_pass.kernels.zero_rows import zero_rows  # noqa: E402

HK, HV, K, V, CONV_DIM, SLOTS = 16, 32, 128, 128, 8192, 1024


def main():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    conv = torch.randn(SLOTS, CONV_DIM, 3, device="cuda", dtype=torch.bfloat16)
    ssm = torch.randn(SLOTS, HV, K, V, device="cuda")
    rows_out = []
    for B, num_fresh in ((1, 0), (1, 1), (32, 0), (32, 1), (32, 16), (256, 0), (256, 1), (256, 128)):
        rows = StagedRowMetadata(B, device="cuda", pad_slot_ids=(-1, 0))
        slots = torch.arange(1, B + 1, device="cuda")
        rows.stage(num_computed_tokens=torch.tensor([0 if i < num_fresh else 5 for i in range(B)]),
                   query_lens=torch.ones(B, dtype=torch.int64), state_slots=slots.cpu())
        q = torch.nn.functional.normalize(torch.randn(B, 1, HV, K, device="cuda"), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, 1, HV, K, device="cuda"), dim=-1)
        v = torch.randn(B, 1, HV, V, device="cuda")
        g = -torch.rand(B, 1, HV, device="cuda")
        beta = torch.rand(B, 1, HV, device="cuda")

        def step():
            o, final = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=ssm[slots],
                                                         output_final_state=True)
            ssm[slots] = final

        def guard():
            fresh = rows.fresh_rows()
            zero_rows(conv, rows.state_slot, fresh)
            zero_rows(ssm, rows.state_slot, fresh)

        graphs = {"step": capture(step), "guard": capture(guard)}
        times = {n: [] for n in graphs}
        for _ in range(9):
            for n, gr in graphs.items():
                times[n].append(replay_ms(gr, 100))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = dict(batch=B, fresh_rows=num_fresh, step_ms=med["step"], guard_ms=med["guard"],
                   guard_over_step=med["guard"] / med["step"])
        rows_out.append(row)
        print(f"B={B:4d} fresh={num_fresh:3d} step={med['step']:.4f}ms guard={med['guard']:.4f}ms ratio={row['guard_over_step']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command="python benchmarks/op_guard_overhead.py", device=torch.cuda.get_device_name(),
                torch=torch.__version__)
    (out / "op_guard_overhead.json").write_text(json.dumps(dict(meta=meta, results=rows_out), indent=1))


if __name__ == "__main__":
    main()
