"""Guard GDN core ops that vLLM's piecewise compilation keeps out of compiled graphs.

In ``VLLM_COMPILE`` mode (vLLM's default on CUDA) the GDN core ops are
splitting ops: vLLM cuts the Dynamo graph at them, compiles the pieces in
between with Inductor, and calls each splitting op from a small stitching
submodule that runs eagerly. No post-grad pass ever sees those ops, so when
GDNStatePass is configured the same target swap is applied to the stitching
submodules, right after vLLM splits the graph::

    before:  submod_1: torch.ops.vllm.qwen_gdn_attention_core(qkv, b, a, out, layer)
    after:   submod_1: torch.ops.gdn_pass.guarded_qwen_gdn_attention_core.default(qkv, b, a, out, layer)

With ``splitting_ops=[]`` or Inductor graph partition the ops stay inside
the compiled graph, and the post-grad pass guards them there.
"""

from __future__ import annotations

import contextvars
import functools

from gdn_pass.vllm.configured import configured_pass

__all__ = ["install", "installed_after_a_split", "is_installed"]

_MARK = "__gdn_pass_wrapped__"
_BACKEND_CONFIG: contextvars.ContextVar = contextvars.ContextVar("gdn_pass_vllm_config", default=None)


def _backends():
    import vllm.compilation.backends as backends

    return backends


def is_installed() -> bool:
    return getattr(getattr(_backends(), "split_graph", None), _MARK, False)


def installed_after_a_split() -> bool:
    """Whether the configured pass installed this guard itself, from inside a compile (the plugin's
    entry point not loaded): vLLM had split that engine's graph without it, and the state ops split
    out of it run unguarded (their groups fall to the step guard, ``metadata_hook._decide_owner``)."""
    return _AFTER_A_SPLIT[0]


_AFTER_A_SPLIT = [False]


def install(*, by_the_pass: bool = False) -> bool:
    """Wrap vLLM's ``split_graph`` and ``VllmBackend.__call__`` (idempotent); True where it wrapped
    them now. ``by_the_pass``: the configured pass asks, as Inductor runs it (``installed_after_a_split``)."""
    backends = _backends()
    if not hasattr(backends, "split_graph") or not hasattr(backends, "VllmBackend"):
        from gdn_pass._logging import logger

        logger.warning(
            "this vLLM has no vllm.compilation.backends.split_graph/VllmBackend: GDN core ops "
            "split out of piecewise-compiled graphs (VLLM_COMPILE) will not be guarded; "
            "use splitting_ops=[] or report the vLLM version")
        return False
    if getattr(backends.split_graph, _MARK, False):
        return False
    original_split = backends.split_graph
    original_call = backends.VllmBackend.__call__

    @functools.wraps(original_call)
    def backend_call(self, graph, example_inputs):
        token = _BACKEND_CONFIG.set(getattr(self, "vllm_config", None))
        try:
            return original_call(self, graph, example_inputs)
        finally:
            _BACKEND_CONFIG.reset(token)

    @functools.wraps(original_split)
    def split_graph(graph, splitting_ops):
        split_gm, items = original_split(graph, splitting_ops)
        gdn_pass = _configured_pass(_BACKEND_CONFIG.get())
        if gdn_pass is not None:
            for item in items:
                if item.is_splitting_graph:
                    gdn_pass(item.graph.graph)
                    item.graph.recompile()
        return split_gm, items

    setattr(split_graph, _MARK, True)
    backends.split_graph = split_graph
    backends.VllmBackend.__call__ = backend_call
    _AFTER_A_SPLIT[0] = by_the_pass
    return True


def _configured_pass(vllm_config):
    if vllm_config is None:
        return None
    return configured_pass(vllm_config.compilation_config)
