"""One figure of the cost of the fix, from the recorded benchmark results.

Left: vLLM step latency on CPU relative to the unguarded 0.30 engine, for the
pass and for vLLM 0.31's upstream fix (vllm_step_latency.json). Right: the
op-level guard's time as a share of a 36-layer flash-linear-attention decode
step on the H200, per layer and in one launch per step (step_guard_overhead.json).

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
    right.set_title("op-level guard on H200")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = results / "cost_of_the_fix.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
