"""vLLM's V1 model runner, made without a model: the state its CUDA-graph choice reads.

``GPUModelRunner._determine_batch_execution_and_padding`` (vLLM 0.26-0.33)
chooses a step's graph from the step's shape with the runner's
``CudagraphDispatcher``. This makes a runner that holds just what that
choice and ``gdn_pass.vllm.draftless_steps`` read, with a real dispatcher of
the config's graphs, so the installed vLLM's own choice can run on CPU
(tests/vllm/test_draftless_steps.py, benchmarks/draftless_steps_host_time.py).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np

from gdn_pass.vllm import draftless_steps

__all__ = ["runner_class", "with_cuda_graphs", "graph_choosing_runner"]


def runner_class():
    """vLLM's V1 runner class, as installed."""
    module, name = draftless_steps.RUNNER
    return getattr(importlib.import_module(module), name)


def with_cuda_graphs(config, mode: str, capture_sizes: list[int]):
    """``config`` with the CUDA graphs VllmConfig sets up on CUDA (the CPU platform turns them off)."""
    from vllm.config import CompilationMode, CUDAGraphMode

    c = config.compilation_config
    c.cudagraph_mode, c.mode = getattr(CUDAGraphMode, mode), CompilationMode.VLLM_COMPILE
    c.splitting_ops = list(c._attention_ops)
    c.cudagraph_capture_sizes, c.max_cudagraph_capture_size = list(capture_sizes), max(capture_sizes)
    return config


def graph_choosing_runner(config, builders=(), *, speculative_tokens: int, draft_rows: int):
    """A V1 runner of ``config`` running ``builders``, its draft counts a past speculative step's
    (``draft_rows`` rows, each ``speculative_tokens`` drafts)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    width = 1 + speculative_tokens
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(config.compilation_config.cudagraph_mode, width)
    runner = object.__new__(runner_class())
    runner.__dict__.update(
        vllm_config=config, compilation_config=config.compilation_config, parallel_config=config.parallel_config,
        model_config=SimpleNamespace(is_encoder_decoder=False), uniform_decode_query_len=width,
        input_batch=SimpleNamespace(lora_id_to_lora_request={}), cudagraph_dispatcher=dispatcher,
        attn_groups=[[SimpleNamespace(metadata_builders=list(builders))]],
        num_decode_draft_tokens=SimpleNamespace(np=np.full(draft_rows, speculative_tokens, dtype=np.int32)))
    return runner
