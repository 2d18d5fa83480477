"""vllm#51562 in real CUDA vLLM (0.26 and 0.34 on the H200) for every GDN family, compiled and eager, and MTP.

Each family's tiny seeded checkpoint runs the README scenario three times,
each in a fresh engine: R3 alone (isolated), then R3 on R1's recycled slot
next to R2 with the plugin installed but not configured (pass off), and with
GDNStatePass configured (pass on); R2's reference is the same steps with R3 on
a never-used slot (clean). Modes:

    default   vLLM's CUDA default (VLLM_COMPILE, FULL_AND_PIECEWISE): the
              op guard (in the guarded ops) owns the groups
    eager     enforce_eager=True (no graph): the step guard zeroes fresh
              slots when the metadata is built
    mtp1/2    Qwen3-Next and Qwen3.5 with their MTP drafter and
              num_speculative_tokens 1 / 2, default mode

Where the engine's own builder sends the fresh row to its prefill path and pass
off already equals the isolated run (vllm#51565, 0.31+; read from what the
engine reports, ``vllm_engines.vllm_reroutes_fresh_rows``), the pass must stand
down instead: no build it acts on, no slot zeroed, R3 bitwise as with pass off.

A family vLLM 0.26 cannot run is recorded with the engine's exact error
(``GPU_LIMITS`` must name it, so the table stays true). Cases start together,
``GDN_PASS_GPU_PARALLEL`` at a time; ``GDN_PASS_GPU_CASES=qwen3_next/*,*/eager``
picks a subset (fnmatch patterns). ``GDN_PASS_GPU_RESULTS=DIR`` keeps the
results as JSON; the coverage cells go to ``GDN_PASS_COVERAGE_FILE``.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not importable (see ../shared/gpu-vllm)")

from harness.coverage import record  # noqa: E402
from gdn_pass.checker.demo import compare  # noqa: E402
from harness.families import FAMILY_ENGINE_ARGS, kind_for_vllm  # noqa: E402
from harness.fuzz import mtp_blocks  # noqa: E402
from harness.tiny_checkpoints import CHECKPOINTS, write_checkpoint  # noqa: E402
from vllm_engines import LOGPROB_TOL, scenario, vllm_reroutes_fresh_rows  # noqa: E402

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "interns2_mobius", "olmo_hybrid", "kimi_linear",
            "bailing_moe_v3")
MODES = {  # mode: (coverage label, scenario arguments)
    "default": ("vLLM defaults (FULL_AND_PIECEWISE)", ()),
    "eager": ("enforce_eager", ("--eager",)),
}
MTP = {  # checkpoint kind with a drafter: the target family's name in the table
    "qwen3_next_mtp": "qwen3_next",
    "qwen3_5_mtp": "qwen3_5",
}
SPEC_MODES = {"mtp1": 1, "mtp2": 2}

# kind/mode -> substring of the error vLLM 0.26 raises on the H200 (from a run).
GPU_LIMITS: dict[str, str] = {}

PARALLEL = int(os.environ.get("GDN_PASS_GPU_PARALLEL", "12"))
PATTERNS = [p for p in os.environ.get("GDN_PASS_GPU_CASES", "*").split(",") if p]


# family -> the checkpoint kind this vLLM can load for it (None: it has no such model)
KINDS = {family: kind_for_vllm(family, vllm.__version__) for family in FAMILIES}


def _all_cases() -> list[tuple[str, str]]:
    cases = [(kind, mode) for kind in FAMILIES for mode in MODES]
    cases += [(kind, mode) for kind in MTP for mode in SPEC_MODES]
    return [c for c in cases if c[0] in CHECKPOINTS]


def _kind(family: str) -> str | None:
    return KINDS.get(family, family)


CASES = [c for c in _all_cases() if any(fnmatch.fnmatch(f"{c[0]}/{c[1]}", p) for p in PATTERNS)]


def _arguments(kind: str, mode: str) -> list[str]:
    args = list(FAMILY_ENGINE_ARGS.get(kind, ()))
    if mode in SPEC_MODES:
        spec = {"method": "mtp", "num_speculative_tokens": SPEC_MODES[mode]}
        args += ["--engine-arg", f"speculative_config={json.dumps(spec)}"]
        # Room for exactly R1 and R2 on every release: R1's blocks are the only free ones when R3
        # arrives, and R3 runs beside R2 (with the scenarios' 9 blocks, one request at a time).
        args += ["--engine-arg", f"num_gpu_blocks_override={mtp_blocks(SPEC_MODES[mode], 2)}"]
    else:
        args += list(MODES[mode][1])
    return args


def _chain(jobs: list[tuple], workdir: Path) -> dict:
    """Run jobs one after the other on one compile cache (the first compiles cold)."""
    cache = workdir / f"cache_{jobs[0][0]}"
    env = {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    results = {}
    for name, scen, guard, model, wd, args in jobs:
        _progress(f"{name}: started")
        results[name] = result = scenario(name, scen, guard, model, wd, (), env_extra=env, extra=args)
        _progress(f"{name}: {result.get('error', 'done')} after {result.get('wall_s')} s")
    return results


_STARTED = time.time()


def _progress(line: str) -> None:
    """Each engine as it starts and ends, in ``$GDN_PASS_GPU_RESULTS/gpu_vllm_families_progress.log``:
    a group its time limit stops says which engines had run, and for how long (the module's
    results are written only when every engine has ended)."""
    out = os.environ.get("GDN_PASS_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "gpu_vllm_families_progress.log", "a") as log:
            log.write(f"[{time.time() - _STARTED:5.0f} s] {line}\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("gpu_families")
    kinds = {_kind(k) for k, _ in CASES} - {None}
    models = {kind: write_checkpoint(kind, workdir / f"tiny_{kind}", seed=0) for kind in kinds}
    chains = []
    for family, mode in CASES:
        kind = _kind(family)
        if kind is None:
            continue

        def job(variant, scen, guard, family=family, kind=kind, mode=mode):
            return (f"{family}__{mode}__{variant}", scen, guard, models[kind], workdir,
                    _arguments(kind, mode))
        # Isolated and pass off compile the same graphs (the pass is not
        # configured in either): the second starts on the first's compile
        # cache. Pass on compiles cold in caches of its own, so the pass runs.
        chains.append([job("isolated", "isolated", "off"), job("off", "poisoned", "off"),
                       job("clean", "clean", "off")])
        chains.append([job("on", "poisoned", "on")])
    chains.sort(key=lambda c: -len(c))  # the longer chains first
    results = {}
    with ThreadPoolExecutor(max(1, min(PARALLEL, len(chains)))) as pool:
        for done in [pool.submit(_chain, chain, workdir) for chain in chains]:
            results.update(done.result())
    out = os.environ.get("GDN_PASS_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        slim = {k: {f: v for f, v in r.items() if f != "log_tail"} | (
            {"log_tail": r["log_tail"][-1500:]} if "log_tail" in r else {}) for k, r in results.items()}
        (Path(out) / "gpu_vllm_families.json").write_text(json.dumps(
            {"vllm": vllm.__version__, "cases": [f"{k}/{m}" for k, m in CASES], "runs": slim}, indent=1))
    return results


def _label(kind: str, mode: str) -> tuple[str, str]:
    if mode in SPEC_MODES:
        return MTP[kind], f"MTP speculative, {SPEC_MODES[mode]} token(s)"
    return kind, MODES[mode][0]


@pytest.mark.parametrize("kind, mode", CASES, ids=[f"{k}/{m}" for k, m in CASES])
def test_family_reproduced_and_fixed(runs, kind, mode):
    family, label = _label(kind, mode)
    if _kind(kind) is None:
        error = f"vLLM {vllm.__version__} has no {family} model (its architecture is not registered)"
        record(family, "any mode", status="unsupported", error=error)
        pytest.skip(error)
    case = {v: runs[f"{kind}__{mode}__{v}"] for v in ("isolated", "off", "on", "clean")}
    failed = {v: r for v, r in case.items() if "error" in r}
    limit = GPU_LIMITS.get(f"{kind}/{mode}")
    if failed:
        error = next(r.get("engine_error") or r["error"] for r in failed.values())
        record(family, label, status="unsupported", error=error, failed=sorted(failed))
        if limit and limit in error:
            pytest.skip(f"vLLM {vllm.__version__} cannot run {kind}/{mode}: {error}")
        if "No module named 'flashinfer'" in error and importlib.util.find_spec("flashinfer") is None:
            # vLLM 0.34's Qwen3.5 layers import FlashInfer's norms on CUDA; the H200 stack has no FlashInfer
            pytest.skip(f"{kind}/{mode} needs FlashInfer on vLLM {vllm.__version__}, not installed here: {error}")
        pytest.fail(f"{kind}/{mode}: {sorted(failed)} failed: {error}\n"
                    + next(iter(failed.values()))["log_tail"][-3000:])
    assert limit is None, f"{kind}/{mode} is in GPU_LIMITS ({limit!r}) but ran: update the table"
    iso, off, on = (case[v]["requests"]["R3"] for v in ("isolated", "off", "on"))
    off_vs, on_vs = compare(iso, off), compare(iso, on)
    # R2's reference: the same steps with R3 on a never-used slot (no stale
    # state anywhere). Pass off can differ from it too: the stale read of R3
    # leaked into R2 on Kimi-Linear in CUDA-graph mode (vLLM 0.26, H200).
    r2 = compare(case["clean"]["requests"]["R2"], case["on"]["requests"]["R2"])
    r2_off = compare(case["clean"]["requests"]["R2"], case["off"]["requests"]["R2"])
    owners = sorted(set(case["on"]["step_guard"]["owners"].values()))
    fixed = on_vs["same_tokens"] and on_vs["max_logprob_diff"] <= LOGPROB_TOL
    # With MTP: R3 alone's tokens, and bit for bit what a never-used slot gives in the same steps (below)
    fixed_as_clean = mode.startswith("mtp") and on_vs["same_tokens"] and on == case["clean"]["requests"]["R3"]
    # R3 on R1's recycled slot (pass off) against R3 on a never-used one (clean), bit for bit:
    # where they are equal, nothing stale was read, whatever R3 alone gives.
    stale_read = case["clean"]["requests"]["R3"] != off
    vllm_fixed = vllm_reroutes_fresh_rows(case["off"]) and (
        (off_vs["same_tokens"] and off_vs["max_logprob_diff"] <= LOGPROB_TOL) or not stale_read)
    record(family, label, status="e2e", reproduced=not off_vs["same_tokens"],
           fixed=fixed or fixed_as_clean,
           r2_unchanged=r2["same_tokens"], fresh_decode_steps=case["off"]["fresh_decode_steps"],
           r3_isolated=iso["tokens"], r3_off=off["tokens"], r3_on=on["tokens"], guard=owners,
           max_logprob_diff=on_vs["max_logprob_diff"], checkpoint=_kind(kind),
           r2_pass_off_unchanged=r2_off["same_tokens"], vllm_fixed=vllm_fixed, stale_read=stale_read,
           r3_on_equals_clean=fixed_as_clean)
    assert case["off"]["plugin_hook_installed"]
    assert case["off"]["fresh_beside_decode_steps"] > 0, "the scenario did not schedule R3 next to R2"
    # With MTP, where vLLM reroutes fresh rows (0.31+), the pass still acts, at metadata build only, for a
    # new one-token request the scheduler pads with placeholder drafts (support.Decision.padded_only):
    # vLLM's own prefill path keeps the placeholder in R3's state (vLLM 0.34, H100: R3 beside R2 wrong).
    padded_only = mode.startswith("mtp") and vllm_reroutes_fresh_rows(case["off"])
    if vllm_fixed and not padded_only:  # vLLM's own reroute holds: the pass stands down, changing nothing
        assert "gdn" in case["on"]["stood_down"] and case["on"]["hook_acting_builds"] == 0, case["on"]
        assert case["on"]["step_guard"]["steps_zeroed"] == 0, case["on"]["step_guard"]
        # What the pass claims here is that it changes nothing: every request, bit for bit, against pass off.
        assert case["on"]["requests"] == case["off"]["requests"], (compare(off, on), r2)
        if not r2["same_tokens"]:
            # R2 beside R3 on a recycled slot vs on a never-used one, in engines where vLLM handles the
            # fresh row itself and the pass did nothing: vLLM's own behaviour, reported, not judged here
            # (vLLM 0.34, H200: olmo_hybrid, bailing_moe_v3, kimi_linear; gpu_vllm_families_034.md).
            warnings.warn(f"{kind}/{mode}: R2 differs from its clean-slot run with the pass off and on alike: {r2}")
        if not fixed:
            # R3 beside R2 differs from R3 alone on a never-used slot too, pass off and on alike:
            # vLLM's own, not a stale read (vLLM 0.34, H100: Qwen3-Next MTP; gpu_vllm_families_034.md)
            warnings.warn(f"{kind}/{mode}: R3 beside R2 differs from its run alone on a never-used slot too "
                          f"(no stale read: vLLM's own), with the pass off and on alike: {on_vs}")
        return
    # With MTP, R3 beside R2 runs another kernel path than R3 alone (the decode or speculative path, and the
    # prefill path): the same tokens, logprobs as near as the two kernels' numerics. Where vLLM reroutes, the
    # pass acts for a padded R3 only (vLLM 0.34, H100: 0.075, where the MTP fuzz's matching requests drift up
    # to 0.087 from their runs alone; fuzz_scheduling_gpu_034.md). Elsewhere, pass on must give R3 exactly
    # what a never-used slot gives in the same steps (clean), bit for bit (vLLM 0.26, H100: 0.077 and 0.053
    # apart from R3 alone, on = clean; gpu_vllm_families.md).
    if not fixed and (fixed_as_clean or (padded_only and on_vs["same_tokens"])):
        warnings.warn(f"{kind}/{mode}: R3 has its isolated run's tokens, logprobs {on_vs['max_logprob_diff']:.3g} "
                      "apart (R3 beside R2 on another kernel path than alone"
                      + (", as on a never-used slot, bit for bit)" if fixed_as_clean else ")"))
    else:
        assert fixed, on_vs
    assert r2["same_tokens"] and r2["max_logprob_diff"] <= LOGPROB_TOL, r2
    if vllm_reroutes_fresh_rows(case["off"]):  # rerouted by vLLM, yet pass off diverged: the pass must act
        assert "gdn" not in case["on"]["stood_down"] and case["on"]["hook_acting_builds"] > 0, case["on"]
    else:
        assert case["off"]["fresh_decode_steps"] > 0, "the scenario did not schedule a fresh row as a decode"
    assert not off_vs["same_tokens"], f"pass off matched the isolated run: {off['tokens']}"
    expected_owner = ["step"] if mode == "eager" or padded_only else ["op"]
    assert owners == expected_owner, case["on"]["step_guard"]
