"""The Lightning linear-attention bug fixed in a real CUDA vLLM engine (0.26 and 0.34 on the H200): Bailing-MoE-v2.5.

vLLM's ``BailingLinearAttentionMetadataBuilder`` (unfixed in 0.26-0.33) calls
a brand-new one-token request a decode when every row of the step has one
token (with MTP: up to 1 + k tokens); the decode kernel then reads the
request's recycled state slot. Each case runs the README scenario in its own
engine process on a tiny seeded ``BailingMoeV2_5ForCausalLM`` (two Lightning
layers, one MLA layer; ``harness.families.bailing_linear``): R1
runs and finishes, R2 keeps decoding, R3 is admitted next to R2 on R1's
recycled slot. Pass off must diverge from R3 alone in a fresh engine of the
same mode, pass on must equal it, and R2 must be bitwise the same with and
without the pass. Modes: vLLM's CUDA default (FULL_AND_PIECEWISE),
``cudagraph_mode=FULL``, ``enforce_eager=True``, the pass by qualified name
(``vllm serve``'s form), and MTP with one speculative token (R3 of one and of
two tokens). ``GDN_PASS_GPU_RESULTS=DIR`` keeps the per-case results.

The reference is R3 alone in a fresh engine whose caches were zeroed once it
had started (``--zero-state-at-start``). With MTP the reference engine does not
speculate: greedy speculative decoding must give the tokens of plain decoding,
and the reference then depends on no part of vLLM's speculative path (on 0.26
a prompt of 1 + k tokens alone replays the speculative FULL graph on another
step's decode buffers, ``gdn_pass/vllm/prompt_chunks.py``; on the V2 runner,
0.31-0.34, the Lightning builder gets no accepted counts and keeps rejected
drafts in the state, ``gdn_pass/vllm/accepted_counts.py``). R1 and R2 with
MTP are judged against the same scenario without speculation.

Why zeroed at start: a fresh engine's slots are not all zero. vLLM's start-up
runs the model on dummy requests (in 0.34 the V2 runner's kernel warm-up), and
R3 alone is a fresh one-token decode too, so pass off reads what start-up left
in its slot. On 0.34 (H200, 9b9403d) R3 alone gave ``562 34 1003 490 ...`` in
the default and FULL modes, against ``763 719 168 195 262 262 262 262`` in
eager mode, with the pass on in every mode, and in every mode on 0.26.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not importable (see ../shared/gpu-vllm)")

from gdn_pass.checker.demo import compare  # noqa: E402
from harness.families import FAMILY_ENGINE_ARGS  # noqa: E402
from harness.tiny_checkpoints import write_checkpoint  # noqa: E402
from vllm_engines import LOGPROB_TOL, scenario  # noqa: E402

_MTP = ("--engine-arg", 'speculative_config={"method": "mtp", "num_speculative_tokens": 1}')
MODES = {  # mode: (checkpoint kind, compilation-config entries, extra scenario arguments)
    "default": ("bailing_moe_v2_5", [], []),
    "full": ("bailing_moe_v2_5", ["cudagraph_mode=FULL"], []),
    "eager": ("bailing_moe_v2_5", [], ["--eager"]),
    "mtp": ("bailing_moe_v2_5_mtp", [], list(_MTP)),
    "mtp_2_tokens": ("bailing_moe_v2_5_mtp", [], [*_MTP, "--r3-prompt-len", "2"]),
}
SPECULATIVE = {"mtp", "mtp_2_tokens"}
SELECTED_MODES = [m for m in os.environ.get("GDN_PASS_GPU_BAILING_MODES", ",".join(MODES)).split(",") if m]


def without_speculation(extra: list[str]) -> list[str]:
    if extra[:len(_MTP)] == list(_MTP):
        return extra[len(_MTP):]
    assert "speculative_config" not in " ".join(extra), extra
    return extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("gpu_bailing")
    models = {kind: write_checkpoint(kind, workdir / kind, seed=0)
              for kind in {MODES[m][0] for m in SELECTED_MODES}}
    cases = {}
    for mode in SELECTED_MODES:
        kind, compilation, extra = MODES[mode]
        # Every engine starts from zeroed caches: what vLLM's start-up (warm-up, capture) leaves in
        # the slots differs with the pass on (it zeroes fresh warm-up rows) and off, and reaches
        # a first request's speculative columns; with one start state, off and on compare bitwise.
        # the same engine without speculation (MTP's pair of arguments taken out)
        plain = [*FAMILY_ENGINE_ARGS[kind], *without_speculation(extra), "--zero-state-at-start"]
        extra = [*FAMILY_ENGINE_ARGS[kind], *extra, "--zero-state-at-start"]
        cases[f"{mode}_isolated"] = ("isolated", "off", kind, compilation, plain)
        for guard in ("off", "on"):
            cases[f"{mode}_{guard}"] = ("poisoned", guard, kind, compilation, extra)
        if mode in SPECULATIVE:
            cases[f"{mode}_plain"] = ("poisoned", "off", kind, compilation, plain)
    if "mtp" in SELECTED_MODES:  # does an MTP engine with the pass repeat itself?
        kind, compilation, extra = MODES["mtp"]
        cases["mtp_on_again"] = ("poisoned", "on", kind, compilation,
                                 [*FAMILY_ENGINE_ARGS[kind], *extra, "--zero-state-at-start"])
    if "default" in SELECTED_MODES:
        kind, compilation, extra = MODES["default"]
        cases["default_on_by_name"] = ("poisoned", "on", kind, compilation,
                                       [*FAMILY_ENGINE_ARGS[kind], *extra, "--pass-by-name",
                                        "--zero-state-at-start"])
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(scenario, name, sc, guard, models[kind], workdir, compilation, extra=extra)
                   for name, (sc, guard, kind, compilation, extra) in cases.items()}
        results = {name: f.result() for name, f in futures.items()}
    out = os.environ.get("GDN_PASS_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_vllm_bailing.json").write_text(
            json.dumps({"vllm": vllm.__version__, "runs": results}, indent=1))
    return results


def _ok(runs, name) -> dict:
    if name not in runs:
        pytest.skip(f"{name} not selected (GDN_PASS_GPU_BAILING_MODES)")
    result = runs[name]
    assert "error" not in result, f"{name}: {result.get('error')}: {result.get('engine_error')}\n{result.get('log_tail')}"
    return result


def r3(runs, name) -> dict:
    return _ok(runs, name)["requests"]["R3"]


def reference(mode: str) -> str:
    """The run R3 must equal (see the module docstring)."""
    return f"{mode}_isolated"


@pytest.mark.parametrize("mode", list(MODES))
def test_reference_started_from_zeroed_state(runs, mode):
    assert _ok(runs, reference(mode))["zeroed_at_start"] > 0, "the reference engine zeroed no cache"


def v2_runner(result: dict) -> bool:
    return ".gpu.model_runner" in (result["model_runner"] or "")


@pytest.mark.parametrize("mode", list(MODES))
def test_pass_off_reproduces_the_bug(runs, mode):
    off = _ok(runs, f"{mode}_off")
    assert off["plugin_hook_installed"], "the gdn_pass entry point did not load in the engine"
    if not (mode in SPECULATIVE and v2_runner(off)):
        # (on the V2 runner with MTP the builder gets no accepted counts: R3's one token, padded
        # with a placeholder draft, runs on the prefill path, and R3 goes wrong by the drafts
        # that path keeps, gdn_pass/vllm/accepted_counts.py)
        assert off["fresh_decode_steps"] > 0, "the scenario did not schedule a fresh row as a decode"
    assert not compare(r3(runs, reference(mode)), r3(runs, f"{mode}_off"))["same_tokens"], (
        f"{mode}: R3 on a recycled slot matched the isolated run without the pass")


def assert_the_owner_zeroed(result: dict) -> None:
    """The guard that owns the Lightning groups zeroed fresh slots: the step guard at build where
    vLLM runs the model eagerly; in compiled engines the op guard, inside the guarded twins of
    ``vllm::linear_attention`` (one launch a step for every group, ``handoff.JointZeroing``)."""
    owners = set(result["step_guard"]["owners"].values())
    expected = {"step"} if result["name"].startswith("eager") else {"op"}
    assert owners == expected, f"{result['name']}: the groups' owners {result['step_guard']['owners']}"
    if owners == {"step"}:
        assert result["step_guard"]["steps_zeroed"] > 0, "the step guard zeroed no fresh slot"
    else:
        joint = result["joint_zeroing"]
        assert joint["steps"] > 0, f"the op guard zeroed no fresh slot: {joint}"
        assert joint["launches"] == joint["steps"], f"not one launch a step: {joint}"


@pytest.mark.parametrize("mode", list(MODES))
def test_pass_on_matches_isolated(runs, mode):
    on = _ok(runs, f"{mode}_on")
    assert on["fresh_decode_steps"] > 0
    assert_the_owner_zeroed(on)
    diff = compare(r3(runs, reference(mode)), on["requests"]["R3"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_with_history_unchanged_by_the_pass(runs, mode):
    off, on = _ok(runs, f"{mode}_off"), _ok(runs, f"{mode}_on")
    if on["counts_supplied_logged"]:
        pytest.skip("the pass gives the builder the runner's accepted counts (V2 runner): it changes "
                    "every speculating row by design; test_speculation_is_lossless judges them")
    for rid in ("R1", "R2"):
        diff = compare(off["requests"][rid], on["requests"][rid])
        assert diff["same_tokens"] and diff["max_logprob_diff"] == 0.0, (rid, diff)


@pytest.mark.parametrize("mode", sorted(SPECULATIVE))
def test_speculation_is_lossless_with_the_pass(runs, mode):
    """With MTP and the pass, R1 and R2 give the tokens of the same scenario without speculation."""
    on, plain = _ok(runs, f"{mode}_on"), _ok(runs, f"{mode}_plain")
    assert on["model_runner"] == plain["model_runner"]
    if v2_runner(on):
        assert on["counts_supplied_logged"], "the V2 runner's counts were not passed to the Lightning builder"
    for rid in ("R1", "R2"):
        diff = compare(plain["requests"][rid], on["requests"][rid])
        assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, (rid, diff)


def test_pass_by_qualified_name(runs):
    by_name = _ok(runs, "default_on_by_name")
    assert_the_owner_zeroed(by_name)
    diff = compare(r3(runs, "default_isolated"), by_name["requests"]["R3"])
    assert diff["same_tokens"] and diff["max_logprob_diff"] <= LOGPROB_TOL, diff


def test_an_mtp_engine_repeats_itself(runs):
    """Two MTP engines with the pass, one configuration, give every request bit for bit: else a
    difference between pass off and on could be the engine's, not the pass's."""
    on, again = _ok(runs, "mtp_on"), _ok(runs, "mtp_on_again")
    for rid in ("R1", "R2", "R3"):
        diff = compare(on["requests"][rid], again["requests"][rid])
        assert diff["same_tokens"] and diff["max_logprob_diff"] == 0.0, (rid, diff)
