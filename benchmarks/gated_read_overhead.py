"""Cost of gating graph-visible state reads, on a Qwen3-Next-shaped GDN decode step.

Both example layers (torch-native recurrence, flash-linear-attention's fused
recurrent kernel). Variants of one compiled decode step, each captured
in a CUDA graph and timed by replay, interleaved round by round:

    unguarded     compiled without the pass (reads stale state: wrong, the floor)
    masked        GDNStatePass, masked-load lowering (fresh rows load nothing)
    where         GDNStatePass, where-after-gather fallback
    zero_first    unguarded step preceded by an eager zeroing of fresh slots

    python benchmarks/gated_read_overhead.py [--out DIR]

Prints a table of medians and ratios to ``unguarded`` measured in one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_graph_timing import capture, replay_ms  # noqa: E402
from gdn_pass.checker.gdn_runner import GDNRunner, make_batch  # noqa: E402
from gdn_pass.checker.torch_gdn import QWEN3_NEXT_SHAPE, TorchGDNLayer  # noqa: E402

NUM_SLOTS = 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--models", default="torch,fla")
    args = ap.parse_args()

    results = []
    for recurrence in args.models.split(","):
        layer = TorchGDNLayer(QWEN3_NEXT_SHAPE, seed=0, recurrence=recurrence).cuda()
        results += bench_model(layer, recurrence, args)
    write_results(results, args)


def state_floor_ms(batch: int) -> float:
    """Reading and writing every row's conv and recurrent state once at 4.3 TB/s."""
    s = QWEN3_NEXT_SHAPE
    row_bytes = 4 * (s.num_v_heads * s.head_k_dim * s.head_v_dim + s.conv_dim * (s.conv_kernel - 1))
    return 2 * batch * row_bytes / 4.3e12 * 1e3


def launches(runner, hidden, slots) -> int:
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        _, code = run_and_get_code(runner.step_fn, hidden, runner.conv, runner.ssm, slots)
    return "\n".join(code).count(".run(")


def bench_model(layer, recurrence, args) -> list[dict]:
    results = []
    for B in (int(b) for b in args.batches.split(",")):
        torch._dynamo.reset()
        runners = {
            name: GDNRunner(layer, num_slots=NUM_SLOTS, max_batch=B, device="cuda", guard=guard,
                            masked_load=masked)
            for name, guard, masked in (("unguarded", False, True), ("masked", True, True), ("where", True, False))
        }
        for fresh_fraction in (0.0, 0.5, 1.0):
            num_fresh = int(round(B * fresh_fraction))
            rows = [(1 + 3 * i, 0 if i < num_fresh else 10) for i in range(B)]
            batch = make_batch(rows, pad_to=B, chunk=1, hidden=QWEN3_NEXT_SHAPE.hidden, pad_slot_id=-1)
            hidden, slots = batch.hidden.cuda(), batch.slots.cuda()
            fresh_slots = slots[:num_fresh].clone()
            graphs = {}
            if fresh_fraction == 0.0:
                kernels = {name: launches(r, hidden, slots) for name, r in runners.items()}
            for name, runner in runners.items():
                runner.stage(batch)
                step = lambda h, s, r=runner: r.step_fn(h, r.conv, r.ssm, s)  # noqa: E731
                graphs[name] = capture(step, hidden, slots)
            unguarded = runners["unguarded"]

            def zero_then_step(h, s, r=unguarded):
                for cache in (r.conv, r.ssm):
                    cache.index_fill_(0, fresh_slots, 0)
                return r.step_fn(h, r.conv, r.ssm, s)

            graphs["zero_first"] = capture(zero_then_step, hidden, slots)
            times = {name: [] for name in graphs}
            for _ in range(args.rounds):  # interleaved: A B C D A B C D ...
                for name, graph in graphs.items():
                    times[name].append(replay_ms(graph, args.iters))
            med = {name: statistics.median(t) for name, t in times.items()}
            row = dict(model=recurrence, batch=B, fresh_fraction=fresh_fraction, median_ms=med,
                       ratio_to_unguarded={n: med[n] / med["unguarded"] for n in med},
                       state_floor_ms=state_floor_ms(B), kernel_launches=kernels)
            results.append(row)
            print(f"{recurrence} B={B:4d} fresh={fresh_fraction:.1f} launches={kernels} " + "  ".join(
                f"{n}={med[n]:.4f}ms(x{row['ratio_to_unguarded'][n]:.3f})" for n in med), flush=True)
        del runners
    return results


def write_results(results, args) -> None:
    state_bytes = QWEN3_NEXT_SHAPE.num_v_heads * QWEN3_NEXT_SHAPE.head_k_dim * QWEN3_NEXT_SHAPE.head_v_dim * 4
    meta = dict(
        command="python benchmarks/gated_read_overhead.py " + " ".join(sys.argv[1:]),
        device=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=__import__("triton").__version__, python=platform.python_version(),
        shape=QWEN3_NEXT_SHAPE.__dict__, num_slots=NUM_SLOTS, state_dtype="float32",
        state_bytes_per_row=state_bytes, rounds=args.rounds, iters_per_round=args.iters,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gated_read_overhead.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [
        "# Gated state read overhead (GDN decode step, CUDA-graph replay)", "",
        f"`{meta['command']}` on {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}.",
        f"Qwen3-Next shape (HK=16, HV=32, K=V=128, hidden 2048), fp32 state, {NUM_SLOTS} slots, "
        "decode (one token per row); "
        f"median of {args.rounds} interleaved rounds x {args.iters} replays.", "",
        "Launches: Triton kernel launches per step (unguarded / masked / where).",
        "Floor: every row's conv + recurrent state read and written once at 4.3 TB/s.", "",
        "| model | B | fresh rows | floor ms | unguarded ms | masked | where | zero_first | launches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m, q, k = r["median_ms"], r["ratio_to_unguarded"], r["kernel_launches"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['fresh_fraction']:.0%} | {r['state_floor_ms']:.4f} | "
                     f"{m['unguarded']:.4f} | x{q['masked']:.3f} | x{q['where']:.3f} | "
                     f"x{q['zero_first']:.3f} | {k['unguarded']}/{k['masked']}/{k['where']} |")
    (out / "gated_read_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
