"""The figures of the cost of the fix, from the recorded benchmark results.

``cost_of_the_fix.png``. Left: vLLM step latency on CPU relative to the
unguarded 0.30 engine, for the pass and for vLLM 0.31's upstream fix
(vllm_step_latency.json). Right: the op guard's time as a share of a
36-layer flash-linear-attention decode step on the H200, per layer and in one
launch per step (step_guard_overhead.json).

``engine_cost.png``: inside a real vLLM 0.26 engine on the H200 (Qwen3-Next-80B
layer dimensions, 12 layers). Left: wall time per step relative to the
unguarded engine, per batch size and count of fresh rows, for gdn-pass and the
one-line alternative, and the stream's tokens/s in the title
(engine_cost_gpu_run4.json + engine_cost_gpu_stream_run4.json: the run on the
larger host). Right: GPU kernel time per step under torch.profiler, the same
ratio (engine_cost_gpu_run5.json, engine_cost_gpu_run6.json).

    pip install matplotlib; python benchmarks/plot_results.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Path(args.results)
    latency = json.loads((results / "vllm_step_latency.json").read_text())
    guard = json.loads((results / "step_guard_overhead.json").read_text())["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))

    labels, pass_ratio, fix_ratio = [], [], []
    for kind, engines in latency.items():
        if kind == "meta":
            continue
        for fresh, floor in engines["0.30 off"].items():
            labels.append(f"{kind.replace('qwen3_next', 'q3n')}\n{fresh} fresh")
            pass_ratio.append(engines["0.30 on"][fresh] / floor)
            fix_ratio.append(engines["0.31"][fresh] / floor)
    xs = range(len(labels))
    left.bar([x - 0.2 for x in xs], pass_ratio, 0.4, label="0.30 + gdn-pass")
    left.bar([x + 0.2 for x in xs], fix_ratio, 0.4, label="0.31 (upstream fix)")
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xticks(list(xs), labels, fontsize=7)
    left.set_ylabel("step time / unguarded 0.30")
    left.set_title("vLLM step latency, CPU (4 decodes + k fresh rows)")
    left.legend(fontsize=8)

    for label, key, fresh in (("per layer, no fresh row", "per_layer_over_step", 0),
                              ("one launch, no fresh row", "one_launch_over_step", 0),
                              ("per layer, 1 fresh row", "per_layer_over_step", 1),
                              ("one launch, 1 fresh row", "one_launch_over_step", 1)):
        rows = sorted((r for r in guard if r["fresh_rows"] == fresh), key=lambda r: r["batch"])
        right.plot([r["batch"] for r in rows], [100 * r[key] for r in rows],
                   "o-" if "one" in label else "s--", label=label)
    right.axhline(2.0, color="red", ls="--", lw=0.8, label="2% target")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch (decode rows)")
    right.set_ylabel("guard / 36-layer FLA decode step (%)")
    right.set_title("op guard on H200")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = results / "cost_of_the_fix.png"
    fig.savefig(out, dpi=120)
    print(out)
    print(plot_engine_cost(results, plt))


_ENGINE_VARIANTS = (("gdn-pass", "gdn-pass"), ("alternative", "one-line alternative"),
                    ("fused", "fused (gated decode kernels)"))


def plot_engine_cost(results: Path, plt) -> Path:
    """Run 7's wall-time ratios per B and fresh rows, with its stream; profiled kernel ratios of runs 6 and 7."""
    steps = json.loads((results / "engine_cost_gpu_run7.json").read_text())
    stream = json.loads((results / "engine_cost_gpu_stream_run7.json").read_text())["stream"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw=dict(width_ratios=[2.2, 1]))
    labels = [r["case"].replace(" fresh=", "\n") + " fresh" for r in steps["rows"]]
    xs = range(len(labels))
    width = 0.27
    for i, (variant, label) in enumerate(_ENGINE_VARIANTS):
        left.bar([x + (i - 1) * width for x in xs], [r[f"{variant}_ratio"] for r in steps["rows"]], width,
                 label=label)
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(1.02, color="red", ls="--", lw=0.8, label="+2% (target with fresh rows)")
    left.set_yscale("log")
    left.set_yticks([0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4, 6], ["0.9", "1", "1.1", "1.25", "1.5", "2", "3", "4", "6"])
    left.minorticks_off()
    left.set_xticks(list(xs), labels, fontsize=7)
    left.set_ylabel("wall time per step / unguarded")
    left.set_title(f"vLLM 0.26, H200, 12 layers, three engines on one GPU (run 7, {steps['rounds']} rounds; "
                   f"B <= 8 host-bound, +-4% noise)\nStream ({len(stream['samples']['unguarded'])} rounds): "
                   f"unguarded {stream['unguarded_tokens_per_s']:.0f} tok/s, "
                   + ", ".join(f"{v} x{stream[f'{v}_ratio']:.3f}" for v, _ in _ENGINE_VARIANTS), fontsize=7)
    left.legend(fontsize=8)

    cases = []
    for run in ("engine_cost_gpu_run6.json", "engine_cost_gpu_run7.json"):
        for case, by_variant in json.loads((results / run).read_text()).get("profiles", {}).items():
            base = by_variant["unguarded"]["gpu_kernel_us"]
            name = run.removeprefix("engine_cost_gpu_").removesuffix(".json")
            cases.append((f"{case.replace(' fresh=', chr(10))} fresh\n({name})",
                          [by_variant[v]["gpu_kernel_us"] / base if v in by_variant else float("nan")
                           for v, _ in _ENGINE_VARIANTS]))
    xs = range(len(cases))
    for i, (_, label) in enumerate(_ENGINE_VARIANTS):
        right.bar([x + (i - 1) * width for x in xs], [c[1][i] for c in cases], width, label=label)
    right.axhline(1.0, color="black", lw=0.8)
    right.set_ylim(0.9, 1.45)
    right.set_xticks(list(xs), [c[0] for c in cases], fontsize=7)
    right.set_ylabel("GPU kernel time per step / unguarded")
    right.set_title("kernels only\n(torch.profiler, runs 6 and 7)", fontsize=8)
    right.legend(fontsize=7)
    fig.tight_layout()
    out = results / "engine_cost.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
