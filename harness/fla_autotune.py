"""The autotuned kernels of vLLM's GDN chunk prefill, and a choice among their configurations that
does not depend on timing.

vLLM runs GatedDeltaNet prefills through its copy of flash-linear-attention
(``vllm/third_party/flash_linear_attention/ops``), whose chunk kernels are
``@triton.autotune``'d: each engine times their configurations once, during
its start-up warm-up, and keeps the fastest for every later prefill. Engines
started together on one GPU time them under one another's load and can keep
different configurations, which could sum in a different order
(``benchmarks/fla_autotune_bits.py`` measures whether they do; on the H200
at the fuzz's dims none did, ``benchmarks/results/fla_autotune_bits_gpu.md``). The fuzz's
engines are compared bit for bit, so where they must agree they can choose
by order instead (``choose_by_order``): the first configuration of each
kernel that compiles and runs, in every engine alike.
"""

from __future__ import annotations

import importlib

__all__ = ["FLA_MODULES", "FLA_OPS", "autotuned_kernels", "choose_by_order", "find_autotuner", "vllm_fla_kernels"]

FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
# the modules whose kernels GDN's chunk prefill calls (and its in-kernel L2 norm)
FLA_MODULES = ("cumsum", "chunk_scaled_dot_kkt", "solve_tril", "wy_fast", "chunk_delta_h", "chunk_o", "l2norm")
_ORDER_MARK = "_gdn_pass_fuzz_by_order"


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


def choose_by_order(tuners: dict[str, object]) -> list[str]:
    """Make each tuner keep the first of its configurations that compiles and runs, not the fastest.

    The tuner still tries every configuration (one that fails to compile or
    runs out of resources times as infinite), but every one that ran ranks by
    its place in the tuner's list, so engines choose alike whatever the load.
    Idempotent; returns the names changed now.
    """
    changed = []
    for name, tuner in tuners.items():
        if getattr(tuner, _ORDER_MARK, False):
            continue
        timed = tuner._bench
        order = {id(config): i for i, config in enumerate(tuner.configs)}

        def by_order(*args, config, _timed=timed, _order=order, **meta):
            timings = _timed(*args, config=config, **meta)
            if any(t == float("inf") for t in timings):
                return timings
            return [float(_order.get(id(config), len(_order)))] * len(timings)

        tuner._bench = by_order
        setattr(tuner, _ORDER_MARK, True)
        tuner.cache.clear()
        changed.append(name)
    return changed
