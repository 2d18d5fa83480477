"""What vLLM needs to load a model in the checker's engine processes, applied before it starts.

Workarounds for the installed vLLM, not part of the fix: the checker
(``gdn_pass.vllm.checker.scenarios``, behind ``gdn-pass check`` / ``demo``) runs
models the user names, and these let the releases the project supports load
them.

- ``allow_import_without_torchvision``: vLLM's Qwen3.5 model module imports
  transformers' Qwen2-VL image processor, which imports torchvision even for
  text-only models; where torchvision is missing (PyPI has only CUDA builds of
  it, which cannot load next to a CPU torch) the PIL twin of that module
  serves the import.
- ``fix_fused_conv1d_weight_loader``: vLLM 0.26-0.30 cannot load the q/k/v
  short convolutions of any OLMo-hybrid checkpoint (vllm PR #55858, open);
  the loaders fall back to the shard id vLLM's mapper tagged on the tensor.
- ``prepare_engine_process``: applies what a model folder needs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import json
import sys
from pathlib import Path

__all__ = ["allow_import_without_torchvision", "fix_fused_conv1d_weight_loader", "prepare_engine_process"]


_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilImageProcessorAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the torchvision Qwen2-VL image-processor module to its PIL twin."""

    def find_spec(self, name, path=None, target=None):
        if name != _TV_MODULE:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(_PIL_MODULE)

    def exec_module(self, module):
        pass  # already executed by import_module


def allow_import_without_torchvision() -> bool:
    """Let vLLM's Qwen3.5 module import where torchvision is missing; True if installed.

    Does nothing when torchvision is importable (the real module is then
    used) or when the alias is already in place. Only the import is
    redirected: text-only Qwen3.5 never runs the image processor.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if any(isinstance(f, _PilImageProcessorAlias) for f in sys.meta_path):
        return True
    sys.meta_path.insert(0, _PilImageProcessorAlias())
    return True


_FIXED = "_gdn_pass_reads_tagged_shard_id"


def _reads_tagged_shard_id(make_loader) -> bool:
    """Whether the fused-conv loader ``make_loader`` builds finds a shard id the mapper tagged."""
    import torch

    param = torch.zeros(4, 1, 2)
    weight = torch.ones(2, 1, 2)
    weight.shard_id = 1  # as WeightsMapper.apply tags a mapped tensor
    try:
        make_loader([2, 2], 1, 0)(param, weight)  # AutoWeightsLoader's call: no shard id
    except TypeError:
        return False
    return bool(param[:2].eq(0).all() and param[2:].eq(1).all())


def fix_fused_conv1d_weight_loader() -> bool:
    """Let vLLM load OLMo-hybrid's q/k/v short convolutions (vllm PR #55858); True if it patched.

    Wraps ``olmo_gdn_linear_attn._make_fused_conv1d_weight_loader`` so that the
    loaders it makes fall back to the shard id ``WeightsMapper`` tagged on the
    tensor when the caller passes none. Call it in the process that builds
    the model (the engine core: vLLM's default in-process engine, or a
    ``vllm.general_plugins`` hook for spawned workers) before the engine
    starts; the layer looks the factory up when it is built. Does nothing
    where vLLM has no OLMo-hybrid layer or already reads the tag.
    """
    try:
        from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as mod
    except ImportError:
        return False
    make_loader = getattr(mod, "_make_fused_conv1d_weight_loader", None)
    if make_loader is None or getattr(make_loader, _FIXED, False) or _reads_tagged_shard_id(make_loader):
        return False

    def make_fixed_loader(dims, tp_size, tp_rank):
        load = make_loader(dims, tp_size, tp_rank)

        def weight_loader(param, loaded_weight, loaded_shard_id=None):
            if loaded_shard_id is None:
                loaded_shard_id = getattr(loaded_weight, "shard_id", None)
            return load(param, loaded_weight, loaded_shard_id)

        return weight_loader

    setattr(make_fixed_loader, _FIXED, True)
    mod._make_fused_conv1d_weight_loader = make_fixed_loader
    return True


def prepare_engine_process(model: str) -> list[str]:
    """Fix what the installed vLLM needs to load the checkpoint in ``model``; the fixes applied.

    Call it in the process that builds the model, before the engine starts.
    Today: OLMo-hybrid's fused short-convolution loader (vllm PR #55858, see
    ``fix_fused_conv1d_weight_loader``), which no vLLM up to 0.30 can load otherwise.
    """
    architectures = json.loads((Path(model) / "config.json").read_text()).get("architectures", [])
    applied = []
    if "OlmoHybridForCausalLM" in architectures:
        if fix_fused_conv1d_weight_loader():
            applied.append("olmo_hybrid fused conv1d loader (vllm#55858)")
    return applied
