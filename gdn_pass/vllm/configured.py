"""Where a vLLM engine is given GDNStatePass, and finding it there.

The hooks ask this: the metadata hook when a state builder is made, the
piecewise guard when vLLM splits a graph; both act only where the pass is
configured. They recognise it by the core class (``gdn_pass.state_pass``),
as the ``InductorPass`` that vLLM runs, and not by the vLLM class
(``gdn_state_pass.VllmGDNStatePass``): that one installs these hooks when it
runs, so it sits above them. The ready-made pass that ``SERVE_PASS`` names
is published here by ``gdn_pass.vllm.serve``, the module vLLM imports to
resolve the name.
"""

from __future__ import annotations

from typing import Any

from gdn_pass import state_pass
from gdn_pass.vllm import compat

__all__ = ["PASS_HOOKS", "SERVE_PASS", "configured_pass", "publish"]

# Inductor config keys the pass may be given under. The joint-graph hook runs
# before Inductor's post-grad FakeTensorUpdater snapshots the graph, so the
# rewrite does not make it re-propagate fake tensors downstream of every
# rewritten node: compile time x1.00-1.02 instead of x1.04-1.07
# (benchmarks/results/compile_time.md).
PASS_HOOKS = ("post_grad_custom_post_pass", "joint_custom_post_pass")

# Qualified name of a ready-made pass, for compilation_config["inductor_passes"]
# (the JSON form `vllm serve --compilation-config` takes); see gdn_pass.vllm.serve.
SERVE_PASS = "gdn_pass.vllm.serve.GDN_STATE_PASS"

_BY_NAME: dict[str, Any] = {}


def publish(name: str, gdn_state_pass) -> None:
    """Let ``configured_pass`` find ``gdn_state_pass`` where a config still holds ``name``."""
    _BY_NAME[name] = gdn_state_pass


def configured_pass(compilation_config):
    """The ``gdn_pass.vllm.VllmGDNStatePass`` in a vLLM compilation config,
    under any supported hook, or None.

    ``inductor_passes`` entries (objects, or qualified names such as
    ``SERVE_PASS``) have already been resolved into ``inductor_compile_config``
    by vLLM's config post-init (importing ``gdn_pass.vllm.serve`` for
    ``SERVE_PASS``); a name not yet resolved is looked up among the published ones.
    """
    inductor = getattr(compilation_config, "inductor_compile_config", None) or {}
    by_name = getattr(compilation_config, "inductor_passes", None) or {}
    for hook in PASS_HOOKS:
        candidate = inductor.get(hook, by_name.get(hook))
        if isinstance(candidate, str):
            candidate = _BY_NAME.get(candidate)
        if isinstance(candidate, state_pass.GDNStatePass) and isinstance(candidate, compat.inductor_pass_base()):
            return candidate
    return None
