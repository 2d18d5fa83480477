"""End-to-end demonstration: vllm#51562 in real vLLM, and gdn-pass fixing it.

Writes a tiny seeded Qwen3-Next checkpoint, then runs three engines (each in
its own process):

    isolated          R3 alone in a fresh engine (the reference)
    poisoned, pass off   R3 admitted on R1's recycled state slot, next to R2
    poisoned, pass on    the same, with GDNStatePass in the compilation config

and prints R3's tokens and logprobs for each, and whether R2 changed.

    python -m gdn_pass.checker.demo [--workdir artifacts/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gdn_pass.checker.checkpoints import write_checkpoint

RUNS = {  # name: (scenario, guard)
    "isolated": ("isolated", "off"),
    "pass_off": ("poisoned", "off"),
    "pass_on": ("poisoned", "on"),
}
LOGPROB_TOL = 1e-4


def run_scenario(
    scenario: str,
    guard: str,
    model: Path,
    workdir: Path,
    *,
    name: str | None = None,
    python: str = sys.executable,
    eager: bool = False,
    extra_args: tuple[str, ...] = (),
) -> dict:
    """Run one scenario in a fresh engine process; returns its result (plus log path)."""
    name = name or f"{scenario}_{guard}"
    workdir.mkdir(parents=True, exist_ok=True)
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [python, "-m", "gdn_pass.vllm.checker.scenarios", scenario, "--model", str(model),
           "--guard", guard, "--out", str(out), "--report-dir", str(workdir / f"reports_{name}")]
    if eager:
        cmd.append("--eager")
    cmd.extend(extra_args)
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"scenario {name} failed (exit {proc.returncode}); log {log}:\n{tail}")
    result = json.loads(out.read_text())
    result["log"] = str(log)
    result["report_dir"] = str(workdir / f"reports_{name}")
    return result


def compare(reference: dict, candidate: dict) -> dict:
    """Tokens identical and logprobs within LOGPROB_TOL?"""
    same_tokens = reference["tokens"] == candidate["tokens"]
    diffs = [abs(a - b) for a, b in zip(reference["logprobs"], candidate["logprobs"])]
    first = next((i for i, (a, b) in enumerate(zip(reference["tokens"], candidate["tokens"])) if a != b), None)
    return dict(
        same_tokens=same_tokens,
        max_logprob_diff=max(diffs) if same_tokens else None,
        matches=same_tokens and max(diffs) <= LOGPROB_TOL,
        first_diverging_token=first,
    )


def run_demo(
    workdir: Path,
    *,
    model: Path | None = None,
    kind: str = "qwen3_next",
    python: str = sys.executable,
    progress=print,
    extra_args: tuple[str, ...] = (),
    trigger: str = "poisoned",
) -> dict:
    """The three engines for one checkpoint ``kind`` (``gdn_pass.checker.checkpoints.CHECKPOINTS``, and what the test harness registers).

    Returns ``{"results": {run: its scenario result}, "summary": {...}}``, also
    written to ``workdir / "demo.json"``.

    ``trigger`` is the scenario of the pass-off / pass-on runs ("poisoned", or
    "recycled" where R3 runs alone after R1, as speculative decoding needs);
    ``extra_args`` go to every engine, the isolated one included.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = write_checkpoint(kind, workdir / f"tiny_{kind}", seed=0)
        progress(f"wrote tiny {kind} checkpoint to {model}")
    results = {}
    for name in RUNS:
        start = time.time()
        progress(f"running {name} (fresh vLLM engine, {'eager' if '--eager' in extra_args else 'compiled'}) ...")
        scenario, guard = RUNS[name]
        scenario = trigger if scenario == "poisoned" else scenario
        results[name] = run_scenario(scenario, guard, model, workdir, name=name, python=python,
                                     extra_args=extra_args)
        progress(f"  done in {time.time() - start:.0f}s")
    iso = results["isolated"]["requests"]["R3"]
    summary = {
        "r3_pass_off_vs_isolated": compare(iso, results["pass_off"]["requests"]["R3"]),
        "r3_pass_on_vs_isolated": compare(iso, results["pass_on"]["requests"]["R3"]),
    }
    if "R2" in results["pass_off"]["requests"]:
        summary["r2_pass_on_vs_pass_off"] = compare(
            results["pass_off"]["requests"]["R2"], results["pass_on"]["requests"]["R2"]
        )
    demo = dict(results=results, summary=summary)
    (workdir / "demo.json").write_text(json.dumps(demo, indent=1))
    return demo


def format_table(demo: dict) -> str:
    res, summ = demo["results"], demo["summary"]
    rows = [("scenario", "R3 tokens", "R3 logprobs", "vs isolated")]
    verdict = {
        "isolated": "reference",
        "pass_off": "DIVERGES" if not summ["r3_pass_off_vs_isolated"]["matches"] else "matches",
        "pass_on": "matches" if summ["r3_pass_on_vs_isolated"]["matches"] else "DIVERGES",
    }
    for name in RUNS:
        r3 = res[name]["requests"]["R3"]
        rows.append((
            {"isolated": "isolated", "pass_off": "poisoned, pass off", "pass_on": "poisoned, pass on"}[name],
            " ".join(map(str, r3["tokens"])),
            " ".join(f"{x:.4f}" for x in r3["logprobs"][:4]) + " ...",
            verdict[name],
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    r2 = summ.get("r2_pass_on_vs_pass_off")
    lines.append("")
    if r2 is not None:
        lines.append(
            f"R2 (already decoding) with vs without the pass: "
            f"{'identical' if r2['same_tokens'] and r2['max_logprob_diff'] == 0 else 'CHANGED'} "
            f"(max logprob diff {r2['max_logprob_diff']})"
        )
    on = summ["r3_pass_on_vs_isolated"]
    lines.append(f"R3 pass on vs isolated: max logprob diff {on['max_logprob_diff']} (tolerance {LOGPROB_TOL})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gdn-pass demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="artifacts/demo")
    ap.add_argument("--kind", default="qwen3_next", help="tiny checkpoint kind (model family)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra vLLM engine argument for every engine, e.g. on vLLM 0.26 without "
                         "FlashInfer: additional_config='{\"gdn_prefill_backend\": \"triton\"}'")
    args = ap.parse_args(argv)
    demo = run_demo(Path(args.workdir), kind=args.kind,
                    extra_args=tuple(a for item in args.engine_arg for a in ("--engine-arg", item)))
    print()
    print(format_table(demo))
    reports = list(Path(args.workdir, "reports_pass_on").glob("report_*.txt"))
    if reports:
        print()
        print(reports[0].read_text().rstrip())
    s = demo["summary"]
    r2 = s.get("r2_pass_on_vs_pass_off", {"same_tokens": True})
    ok = (not s["r3_pass_off_vs_isolated"]["matches"] and s["r3_pass_on_vs_isolated"]["matches"]
          and r2["same_tokens"])
    print()
    print("RESULT:", "bug reproduced without the pass, fixed with it" if ok else "UNEXPECTED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
