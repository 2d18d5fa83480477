"""The autotuned kernels of vLLM's GDN chunk prefill, and a choice among their configurations that
does not depend on timing.

vLLM runs GatedDeltaNet prefills through its copy of flash-linear-attention
(``vllm/third_party/flash_linear_attention/ops``), whose chunk kernels are
``@triton.autotune``'d: each engine times their configurations once, during
its start-up warm-up, and keeps the fastest for every later prefill. Engines
started together on one GPU time them under one another's load and can keep
different configurations, which could sum in a different order
(``benchmarks/fla_autotune_bits.py`` measures whether they do, with the
kernels found here; on the H200 at the fuzz's dims none did,
``benchmarks/results/fla_autotune_bits_gpu.md``).
"""

from __future__ import annotations

import importlib

__all__ = ["FLA_MODULES", "FLA_OPS", "autotuned_kernels", "find_autotuner", "vllm_fla_kernels"]

FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
# the modules whose kernels GDN's chunk prefill calls (and its in-kernel L2 norm)
FLA_MODULES = ("cumsum", "chunk_scaled_dot_kkt", "solve_tril", "wy_fast", "chunk_delta_h", "chunk_o", "l2norm")


def find_autotuner(kernel):
    """The ``Autotuner`` inside ``kernel`` (under ``@triton.heuristics`` wrappers too), or None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(8):
        if kernel is None or isinstance(kernel, Autotuner):
            return kernel
        kernel = getattr(kernel, "fn", None)
    return None


def autotuned_kernels(modules) -> dict[str, object]:
    """``module.kernel`` -> its ``Autotuner``, for every autotuned kernel the modules hold (each once)."""
    found, seen = {}, set()
    for module in modules:
        for name, value in vars(module).items():
            tuner = find_autotuner(value)
            if tuner is not None and id(tuner) not in seen:  # a kernel imported elsewhere: once
                seen.add(id(tuner))
                found[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = tuner
    return found


def vllm_fla_kernels() -> dict[str, object]:
    """The autotuned kernels of vLLM's flash-linear-attention copy (empty where this vLLM has none)."""
    modules = []
    for name in FLA_MODULES:
        try:
            modules.append(importlib.import_module(f"{FLA_OPS}.{name}"))
        except ImportError:
            continue
    return autotuned_kernels(modules)
