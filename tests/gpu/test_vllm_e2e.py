"""vllm#51562 in a real CUDA vLLM engine (0.26 and 0.34 on the H200), per compilation mode.

Each case runs the README scenario in its own engine process on the tiny
seeded Qwen3-Next: R1 runs and finishes, R2 keeps decoding, R3 (a one-token
prompt) is admitted next to R2 on R1's recycled state slot. Pass on must
equal R3 run alone in a fresh engine, and R2 must be the same with and
without the pass. Every pass-off engine also shows that the installed
plugin, not configured, leaves the engine running.

What pass off must show depends on the engine, read from what it reports
(``vllm_engines.vllm_reroutes_fresh_rows``), not from a version table:

- where vLLM's builder puts the fresh row on the decode path (0.26-0.30),
  pass off must diverge from the isolated run (the bug is there to fix);
- where vLLM's builder reroutes it to the prefill path itself (vllm#51565,
  0.31+) and pass off then equals the isolated run, vLLM's fix holds and
  gdn-pass must stand down: its start-up line, no build it acts on, no
  slot zeroed, and R2 and R3 bitwise the same with the pass as without it;
- where vLLM reroutes but pass off still diverges (a runner that replays a
  FULL decode graph on buffers the builder did not stage), the pass must act
  and fix it (``test_pass_on_matches_isolated``).

The engines of a run start together (each with its own small KV cache, so
vLLM skips memory profiling), then one more pass-on engine starts on the
compile cache the first one wrote. ``GDN_PASS_GPU_RESULTS=DIR`` keeps the
per-case results as JSON (benchmarks/results/gpu_vllm_e2e.*).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not importable (see ../shared/gpu-vllm)")

from gdn_pass.checker.demo import compare  # noqa: E402
from harness.tiny_checkpoints import write_checkpoint  # noqa: E402
from vllm_engines import LOGPROB_TOL, scenario, vllm_reroutes_fresh_rows  # noqa: E402

MODES = {  # mode: compilation-config entries
    "default": [],  # VLLM_COMPILE, FULL_AND_PIECEWISE; GDN core ops are splitting ops
    "full": ["cudagraph_mode=FULL"],
    "no_split": ["splitting_ops=[]"],
    # Only sizes 1 and 4 are captured: R2 + R3 (2 real rows) replay the
    # 4-row graph with 2 padding rows.
    "padded": ["cudagraph_capture_sizes=[1, 4]"],
    # No FULL graph: the fresh row's decode step runs the guarded ops on the host, where the op
    # guard zeroes the tiny model's three GDN groups in one launch (handoff.JointZeroing).
    "piecewise": ["cudagraph_mode=PIECEWISE"],
}
# GDN_PASS_GPU_MODES=default,full runs a subset (a device call lasts 10 minutes).
SELECTED_MODES = [m for m in os.environ.get("GDN_PASS_GPU_MODES", ",".join(MODES)).split(",") if m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    modes = SELECTED_MODES
    workdir = tmp_path_factory.mktemp("gpu_vllm")
    model = write_checkpoint("qwen3_next", workdir / "tiny_qwen3_next", seed=0)
    cases = {}
    for mode in modes:
        compilation = MODES[mode]
        # The reference runs in the same mode: each mode compiles its own
        # kernels, whose bf16 rounding differs (seen: 0.03 between default and
        # splitting_ops=[] in R3's logprobs, same tokens).
        cases[f"{mode}_isolated"] = ("isolated", "off", compilation)
        for guard in ("off", "on"):
            cases[f"{mode}_{guard}"] = ("poisoned", guard, compilation)
    if "default" in modes:  # the form `vllm serve` takes: inductor_passes by qualified name
        cases["default_on_by_name"] = ("poisoned", "on", MODES["default"], ["--pass-by-name"])
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(scenario, name, *case[:2], model, workdir, case[2],
                                     extra=case[3] if len(case) > 3 else ())
                   for name, case in cases.items()}
        results = {name: f.result() for name, f in futures.items()}
    # A second pass-on engine on the compile cache the first default one wrote.
    if "default" in modes:
        cache = workdir / "cache_default_on"
        results["default_on_restart"] = scenario(
            "default_on_restart", "poisoned", "on", model, workdir, MODES["default"],
            env_extra={"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    out = os.environ.get("GDN_PASS_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        summary = {"vllm": vllm.__version__, "runs": {
            k: v for k, v in results.items()}}
        (Path(out) / f"gpu_vllm_e2e_{'_'.join(modes)}.json").write_text(json.dumps(summary, indent=1))
    return results


def _ok(runs, name) -> dict:
    if name not in runs:
        pytest.skip(f"{name} not selected (GDN_PASS_GPU_MODES)")
    result = runs[name]
    assert "error" not in result, f"{name}: {result.get('error')}\n{result.get('log_tail')}"
    return result


def r3(runs, name) -> dict:
    return _ok(runs, name)["requests"]["R3"]


def _vllm_fix_holds(runs, mode) -> bool:
    """vLLM's builder rerouted R3 itself and pass off equals the isolated run (module docstring)."""
    off = _ok(runs, f"{mode}_off")
    diff = compare(r3(runs, f"{mode}_isolated"), off["requests"]["R3"])
    return vllm_reroutes_fresh_rows(off) and diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL


@pytest.mark.parametrize("mode", list(MODES))
def test_pass_off_reproduces_the_bug_or_vllm_fixed_it(runs, mode):
    off = _ok(runs, f"{mode}_off")
    assert off["plugin_hook_installed"], "the gdn_pass entry point did not load in the engine"
    assert off["fresh_beside_decode_steps"] > 0, "the scenario did not schedule R3 next to a decoding R2"
    iso_vs_off = compare(r3(runs, f"{mode}_isolated"), r3(runs, f"{mode}_off"))
    if vllm_reroutes_fresh_rows(off):
        # vLLM's builder sent R3 to its prefill path (vllm#51565). Whether that fix holds
        # (pass off = isolated) decides what the pass must do:
        # test_pass_stands_down_exactly_where_vllm_fixed_the_bug.
        print(f"{mode}: vLLM {off['vllm']} rerouted R3 (runner {off.get('model_runner')}); "
              f"pass off vs isolated: {iso_vs_off}")
    else:
        assert off["fresh_decode_steps"] > 0
        assert not iso_vs_off["same_tokens"], (
            f"{mode}: R3 next to R2 on a recycled slot matched the isolated run without the pass; "
            "the scenario no longer exposes vllm#51562")


@pytest.mark.parametrize("mode", list(MODES))
def test_pass_on_matches_isolated(runs, mode):
    on = _ok(runs, f"{mode}_on")
    if not vllm_reroutes_fresh_rows(_ok(runs, f"{mode}_off")):
        assert on["fresh_decode_steps"] > 0
    diff = compare(r3(runs, f"{mode}_isolated"), on["requests"]["R3"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff


def _assert_acted(result: dict) -> None:
    """The hook acted for the GDN builder in ``result`` (a pass-on run)."""
    assert "gdn" not in result["stood_down"] and result["hook_acting_builds"] > 0, (
        f"{result['name']}: pass off differs from the isolated run, yet the pass did not act: "
        f"stood down {result['stood_down']}, {result['hook_acting_builds']} acting builds")


def _assert_stood_down(result: dict, off: dict) -> None:
    """No per-step work in ``result`` (a pass-on run), and its R2 and R3 bitwise those of ``off``."""
    assert result["stand_down_logged"], f"{result['name']}: no 'standing down' line in the engine's log"
    assert "gdn" in result["stood_down"], result["stood_down"]
    assert result["hook_acting_builds"] == 0, f"{result['name']}: the hook acted on {result['hook_acting_builds']} builds"
    assert result["step_guard"]["steps_zeroed"] == 0, result["step_guard"]
    assert not result["keeps_decodes_logged"]
    for rid in ("R2", "R3"):
        diff = compare(off["requests"][rid], result["requests"][rid])
        assert diff["same_tokens"] and diff["max_logprob_diff"] == 0.0, (result["name"], rid, diff)


@pytest.mark.parametrize("mode", list(MODES))
def test_pass_stands_down_exactly_where_vllm_fixed_the_bug(runs, mode):
    on = _ok(runs, f"{mode}_on")
    if _vllm_fix_holds(runs, mode):
        _assert_stood_down(on, _ok(runs, f"{mode}_off"))
    else:
        _assert_acted(on)


def test_piecewise_zeroes_every_group_of_a_step_in_one_launch(runs):
    """Outside FULL graphs the op guard's first op of a step with a fresh row zeroes all three GDN
    groups of the tiny Qwen3-Next (one layer each) in one launch (``handoff.JointZeroing``); the
    step's exactness is ``test_pass_on_matches_isolated[piecewise]``."""
    if "piecewise" not in SELECTED_MODES:
        pytest.skip("piecewise not among GDN_PASS_GPU_MODES")
    on = _ok(runs, "piecewise_on")
    if _vllm_fix_holds(runs, "piecewise"):
        pytest.skip(f"vLLM {on['vllm']} reroutes fresh rows itself here: the pass stands down")
    joint = on["joint_zeroing"]
    assert set(on["step_guard"]["owners"].values()) == {"op"}, on["step_guard"]
    assert joint["steps"] > 0, f"no joint zeroing in a piecewise engine with fresh rows: {joint}"
    assert joint["launches"] == joint["steps"] and joint["groups"] == 3 * joint["steps"], joint


@pytest.mark.parametrize("mode", list(MODES))
def test_every_step_zeroes_its_groups_in_one_launch(runs, mode):
    """Wherever the op guard zeroed a step's fresh rows outside a replayed graph, every mode: one
    launch for the three groups, also where vLLM's GDN builders copy the step's query offsets
    into buffers of their own (FULL-capable modes; at 5cf1c84 each group got a launch there:
    9 launches for 3 steps, gpu_vllm_e2e.md)."""
    on = _ok(runs, f"{mode}_on")
    if _vllm_fix_holds(runs, mode):
        pytest.skip(f"vLLM {on['vllm']} reroutes fresh rows itself here: the pass stands down")
    joint = on["joint_zeroing"]
    if set(on["step_guard"]["owners"].values()) != {"op"} or not joint["steps"]:
        pytest.skip(f"{mode}: no step's groups were zeroed by the op guard's Python ({joint})")
    assert joint["launches"] == joint["steps"] and joint["groups"] == 3 * joint["steps"], joint


@pytest.mark.parametrize("mode", list(MODES))
def test_r2_unchanged_by_the_pass(runs, mode):
    off, on = _ok(runs, f"{mode}_off"), _ok(runs, f"{mode}_on")
    diff = compare(off["requests"]["R2"], on["requests"]["R2"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] == 0.0, diff


def test_padded_step_replayed_a_larger_graph(runs):
    for guard in ("off", "on"):
        assert _ok(runs, f"padded_{guard}")["padded_steps"] > 0, "no step was padded"


def test_restart_on_the_compile_cache(runs):
    restart = _ok(runs, "default_on_restart")
    assert restart["compile_cache_hit"], "the second engine did not load vLLM's compile cache"
    if _vllm_fix_holds(runs, "default"):
        _assert_stood_down(restart, _ok(runs, "default_off"))
    else:
        _assert_acted(restart)
    diff = compare(r3(runs, "default_isolated"), restart["requests"]["R3"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff


def test_pass_by_qualified_name(runs):
    by_name = _ok(runs, "default_on_by_name")
    assert by_name["pass_reports"] > 0, "the pass named in inductor_passes did not run"
    if _vllm_fix_holds(runs, "default"):
        _assert_stood_down(by_name, _ok(runs, "default_off"))
    else:
        _assert_acted(by_name)
    diff = compare(r3(runs, "default_isolated"), by_name["requests"]["R3"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff
