"""The op guard per layer vs one launch per step for all GDN layers (CUDA).

L GDN layers with Qwen3-Next shapes (HK=16, HV=32, K=V=128; conv state
[8192, 3] bf16, recurrent state [32, 128, 128] fp32), captured in CUDA graphs
and timed by replay, interleaved:

    step       L x flash-linear-attention's fused recurrent decode on gathered
               state, written back (a stand-in for vLLM's GDN decode layers)
    per_layer  gdn_pass.kernels.zero_rows on each layer's conv and recurrent cache
               (2L launches: the guard as each guarded op ran it before)
    one_launch gdn_pass.kernels.zero_rows_all on all 2L caches (what the first
               guarded op of a step now runs; the other layers skip)

    python benchmarks/step_guard_overhead.py [--layers 36] [--slots 128] [--out DIR]
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
from gdn_pass.kernels.zero_rows import CacheTable, zero_rows, zero_rows_all  # noqa: E402

HK, HV, K, V, CONV_DIM = 16, 32, 128, 128, 8192
CASES = ((1, 0), (1, 1), (32, 0), (32, 1), (32, 16), (256, 0), (256, 1), (256, 128))


def main():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)  # Qwen3-Next-80B: 36 of 48 layers are GDN
    ap.add_argument("--slots", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    L, S = args.layers, args.slots
    convs = [torch.randn(S, CONV_DIM, 3, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
    ssms = [torch.randn(S, HV, K, V, device="cuda") for _ in range(L)]
    table = CacheTable.build([t for pair in zip(convs, ssms) for t in pair])
    assert table is not None
    results = []
    for B, num_fresh in CASES:
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
            for ssm in ssms:
                _, final = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=ssm[slots],
                                                            output_final_state=True)
                ssm[slots] = final

        def per_layer():
            fresh = rows.fresh_rows()
            for conv, ssm in zip(convs, ssms):
                zero_rows(conv, rows.state_slot, fresh)
                zero_rows(ssm, rows.state_slot, fresh)

        def one_launch():
            zero_rows_all(table, rows.state_slot, rows.fresh_rows())

        graphs = {"step": capture(step), "per_layer": capture(per_layer), "one_launch": capture(one_launch)}
        times = {n: [] for n in graphs}
        for _ in range(args.rounds):
            for n, gr in graphs.items():
                times[n].append(replay_ms(gr, 20))
        med = {n: statistics.median(t) for n, t in times.items()}
        row = dict(batch=B, fresh_rows=num_fresh, step_ms=med["step"], per_layer_ms=med["per_layer"],
                   one_launch_ms=med["one_launch"], per_layer_over_step=med["per_layer"] / med["step"],
                   one_launch_over_step=med["one_launch"] / med["step"])
        results.append(row)
        print(f"B={B:4d} fresh={num_fresh:3d} step={med['step']:.3f}ms per_layer={med['per_layer']:.4f}ms "
              f"({row['per_layer_over_step']:.2%}) one_launch={med['one_launch']:.4f}ms "
              f"({row['one_launch_over_step']:.2%})", flush=True)
    meta = dict(command=f"python benchmarks/step_guard_overhead.py --layers {L} --slots {S}",
                device=torch.cuda.get_device_name(), torch=torch.__version__, layers=L, slots_per_layer=S)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_guard_overhead.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [f"# Op guard: per layer vs one launch per step ({L} GDN layers, {torch.cuda.get_device_name()})",
             "", f"`{meta['command']}`; CUDA-graph replay, medians of {args.rounds} interleaved rounds.", "",
             "| B | fresh rows | step (L layers) | per-layer guard | share | one launch | share |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['batch']} | {r['fresh_rows']} | {r['step_ms']:.3f} ms | {r['per_layer_ms'] * 1e3:.1f} us "
                     f"| {r['per_layer_over_step']:.2%} | {r['one_launch_ms'] * 1e3:.1f} us | {r['one_launch_over_step']:.2%} |")
    (out / "step_guard_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
