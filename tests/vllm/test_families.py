"""vllm#51562 end to end, for every GDN model family of the bug report.

Each family's tiny seeded checkpoint runs the README scenario (isolated,
poisoned pass off, poisoned pass on) on vLLM's CPU backend, compiled. Where
the CPU backend cannot run a family, the engine's exact error is the skip
reason, and only that error is accepted: a family that starts working, or
fails differently, fails this test so the coverage table stays true.
"""

import re
import sys

import pytest

import gdn_pass
from gdn_pass.checker.demo import LOGPROB_TOL, run_demo
from harness.families import CPU_LIMITS, E2E_FAMILIES, FAMILY_ENGINE_ARGS
from harness.coverage import record

pytestmark = pytest.mark.slow


def _engine_error(log_tail: str, limit: str) -> str | None:
    """The exception line of a failed engine's log that carries ``limit``, with
    the detail line after it (pydantic puts the reason on its own line)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in log_tail.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", lines[i]):
            error = re.sub(r"\s*\[type=.*", "", " / ".join(lines[i : i + 2]))
            if limit in error:
                return error
    return None


@pytest.mark.parametrize("kind", E2E_FAMILIES)
def test_family_bug_reproduced_and_fixed(kind, engine_dir, request):
    limits = CPU_LIMITS.get(kind, ())
    try:
        if kind == "qwen3_next":  # the README demo's engines: run once per session
            demo = request.getfixturevalue("demo")
        else:
            demo = run_demo(engine_dir / f"family_{kind}", kind=kind, python=sys.executable,
                            progress=lambda msg: None, extra_args=FAMILY_ENGINE_ARGS.get(kind, ()))
    except RuntimeError as exc:
        error = next(filter(None, (_engine_error(str(exc), limit) for limit in limits)), None)
        if error is not None:
            record(kind, "CPU compiled, vLLM defaults", status="cpu_unsupported", error=error)
            pytest.skip(f"vLLM CPU cannot run {kind}: {error}")
        raise
    assert not limits, f"{kind} is listed in CPU_LIMITS ({limits!r}) but ran: update the table"
    s = demo["summary"]
    fresh = demo["results"]["pass_off"]["fresh_decode_steps"]
    reports = gdn_pass.load_reports(demo["results"]["pass_on"]["report_dir"])
    guarded = sorted({r["op"] for rep in reports for r in rep["reads"] if r["action"] == "guarded_op"})
    record(
        kind,
        "CPU compiled, vLLM defaults",
        status="e2e",
        reproduced=not s["r3_pass_off_vs_isolated"]["matches"],
        fixed=s["r3_pass_on_vs_isolated"]["matches"],
        r2_unchanged=s["r2_pass_on_vs_pass_off"]["same_tokens"],
        fresh_decode_steps=fresh,
        guarded_ops=guarded,
    )
    assert fresh > 0, "the scenario never admitted a fresh row as a decode"
    assert guarded, "the pass guarded nothing in the engine"
    assert not s["r3_pass_off_vs_isolated"]["matches"], "without the pass R3 must read stale state"
    on = s["r3_pass_on_vs_isolated"]
    assert on["same_tokens"] and on["max_logprob_diff"] <= LOGPROB_TOL, on
    assert s["r2_pass_on_vs_pass_off"]["same_tokens"], s["r2_pass_on_vs_pass_off"]
