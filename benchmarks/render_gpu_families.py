"""Render a recorded GPU family run (``tests/gpu/test_vllm_families.py``) as Markdown.

    python benchmarks/render_gpu_families.py benchmarks/results/gpu_vllm_families.json \
        --command "..." > benchmarks/results/gpu_vllm_families.md

One row per family x mode: R3's 8 greedy tokens alone (isolated), on a
recycled slot without the pass and with it, R2 with vs without the pass,
which guard owned the GDN groups, the fresh-decode steps, or the engine's
error where vLLM could not run the case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _tokens(run: dict) -> str:
    return " ".join(str(t) for t in run["requests"]["R3"]["tokens"])


def render(data: dict, command: str | None = None) -> str:
    runs = data["runs"]
    lines = [f"# vllm#51562 per GDN family on the GPU (vLLM {data['vllm']})", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += ["| case | R3 isolated | R3 pass off | R3 pass on | on vs isolated | R2 on vs clean | "
              "guard | fresh-decode steps | engine start s (iso / off / on) |",
              "|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for case in data["cases"]:
        kind, mode = case.split("/")
        if f"{kind}__{mode}__on" not in runs:
            lines.append(f"| {case} | this vLLM has no such model | | | | | | | |")
            continue
        iso, off, on = (runs[f"{kind}__{mode}__{v}"] for v in ("isolated", "off", "on"))
        failed = [(v, r) for v, r in (("isolated", iso), ("off", off), ("on", on)) if "error" in r]
        if failed:
            error = failed[0][1].get("engine_error") or failed[0][1]["error"]
            errors.append(f"- `{case}` ({', '.join(v for v, _ in failed)}): `{error}`")
            lines.append(f"| {case} | vLLM could not run it [{len(errors)}] | | | | | | | |")
            continue
        r3_iso, r3_on = iso["requests"]["R3"], on["requests"]["R3"]
        same = r3_iso["tokens"] == r3_on["tokens"]
        diff = max(abs(a - b) for a, b in zip(r3_iso["logprobs"], r3_on["logprobs"])) if same else None
        ref = runs.get(f"{kind}__{mode}__clean", off)  # R2 next to R3 on a never-used slot
        r2_same = ref["requests"]["R2"]["tokens"] == on["requests"]["R2"]["tokens"]
        r2_diff = max(abs(a - b) for a, b in zip(ref["requests"]["R2"]["logprobs"],
                                                 on["requests"]["R2"]["logprobs"])) if r2_same else None
        r2_off = "" if ref is off else (
            "" if ref["requests"]["R2"]["tokens"] == off["requests"]["R2"]["tokens"] else " (pass off: R2 DIFFERS)")
        owners = ",".join(sorted(set(on["step_guard"]["owners"].values()))) or "-"
        lines.append(
            f"| {case} | {_tokens(iso)} | {_tokens(off)}"
            f"{' (diverges)' if off['requests']['R3']['tokens'] != r3_iso['tokens'] else ' (same!)'} | "
            f"{_tokens(on)} | {'same, logprob diff %.4f' % diff if same else 'DIFFERS'} | "
            f"{'same, diff %.4f' % r2_diff if r2_same else 'DIFFERS'}{r2_off} | {owners} | "
            f"{off['fresh_decode_steps']} | "
            f"{iso.get('engine_start_s')} / {off.get('engine_start_s')} / {on.get('engine_start_s')} |")
    if errors:
        lines += ["", "Engine errors:", ""] + errors
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+", help="gpu_vllm_families.json file(s), merged")
    ap.add_argument("--command", default=None)
    args = ap.parse_args()
    data = {"vllm": None, "cases": [], "runs": {}}
    for path in args.results:
        part = json.loads(path.read_text())
        data["vllm"] = part["vllm"]
        data["cases"] += [c for c in part["cases"] if c not in data["cases"]]
        data["runs"].update(part["runs"])
    sys.stdout.write(render(data, args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
