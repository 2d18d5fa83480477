"""The figures of the cost of the fix, from the recorded benchmark results.

``cost_of_the_fix.png``. Left: vLLM step latency on CPU relative to the
unguarded 0.30 engine, for the pass and for vLLM 0.31's upstream fix
(vllm_step_latency.json). Right: the op guard's time as a share of a
36-layer flash-linear-attention decode step on the H200, per layer and in one
launch per step (step_guard_overhead.json).

``engine_cost.png``: inside a real vLLM 0.26 engine on the H200 (Qwen3-Next-80B
layer dimensions, 12 layers): wall time per step relative to the unguarded
engine, per batch size and count of fresh rows, for gdn-pass and the one-line
alternative, with each round's range (engine_cost_gpu.json).

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


_ENGINE_VARIANTS = (("gdn-pass", "gdn-pass"), ("alternative", "one-line alternative"))


def plot_engine_cost(results: Path, plt) -> Path:
    """engine_cost_gpu.json's wall-time ratios per B and fresh rows, with each round's range."""
    steps = json.loads((results / "engine_cost_gpu.json").read_text())
    fig, ax = plt.subplots(figsize=(10, 4.2))
    rows = steps["rows"]
    labels = [r["case"].replace(" fresh=", "\n") + " fresh" for r in rows]
    xs = range(len(labels))
    width = 0.38
    for i, (variant, label) in enumerate(_ENGINE_VARIANTS):
        # per-round ratios; a table parsed from a run's printout keeps only their lowest and highest
        ratios = [[t / u for t, u in zip(r["samples"][variant], r["samples"]["unguarded"])] if "samples" in r
                  else r["round_ranges"][variant] for r in rows]
        mid = [r[f"{variant}_ratio"] for r in rows]
        ax.bar([x + (i - 0.5) * width for x in xs], mid, width, label=label,
               yerr=[[m - min(rs) for m, rs in zip(mid, ratios)], [max(rs) - m for m, rs in zip(mid, ratios)]],
               capsize=2, error_kw=dict(lw=0.7))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.02, color="red", ls="--", lw=0.8, label="+2% (target with fresh rows)")
    ax.set_yscale("log")
    ax.set_yticks([0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8],
                  ["0.7", "0.8", "0.9", "1", "1.1", "1.25", "1.5", "2", "3", "4", "6", "8"])
    ax.minorticks_off()
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("wall time per step / unguarded")
    ax.set_title(f"vLLM {steps['vllm']}, H200, {steps['layers']} layers at Qwen3-Next-80B dims, "
                 f"two engines on one GPU ({steps['rounds']} rounds; bars: median, whiskers: each round's "
                 "lowest and highest ratio)", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = results / "engine_cost.png"
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    main()
