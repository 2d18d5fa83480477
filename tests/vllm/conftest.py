import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[vllm])")

import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402

from gdn_pass.examples.tiny_checkpoints import write_checkpoint  # noqa: E402

# Every engine compiles from scratch so that the pass really runs (and writes
# its report) in each: a cache hit would reuse a graph the pass saw earlier.
# Engines are subprocesses and inherit the environment (read there at import);
# in this process the config is already loaded, so it is switched off directly.
# The variables are set after torch's import on purpose: TORCHINDUCTOR_FX_GRAPH_CACHE
# would otherwise force the cache off even where a test turns it on explicitly.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


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
def demo(engine_dir, qwen3_next_checkpoint) -> dict:
    """The README demonstration's three engines, run once per session."""
    from gdn_pass.examples.demo import run_demo

    return run_demo(engine_dir / "demo", model=qwen3_next_checkpoint, python=sys.executable,
                    progress=lambda msg: None)
