"""GDNStatePass as a vLLM InductorPass (the form vLLM's compilation config accepts)."""

from __future__ import annotations

from gdn_pass.state_pass import GDNStatePass as _TorchGDNStatePass
from gdn_pass.vllm import compat

__all__ = ["GDNStatePass", "PASS_HOOKS", "SERVE_PASS", "configured_pass"]

# Inductor config keys the pass may be given under. The joint-graph hook runs
# before Inductor's post-grad FakeTensorUpdater snapshots the graph, so the
# rewrite does not make it re-propagate fake tensors downstream of every
# rewritten node: compile time x1.00-1.02 instead of x1.04-1.07
# (benchmarks/results/compile_time.md).
PASS_HOOKS = ("post_grad_custom_post_pass", "joint_custom_post_pass")

# Qualified name of a ready-made pass, for compilation_config["inductor_passes"]
# (the JSON form `vllm serve --compilation-config` takes); see gdn_pass.vllm.serve.
SERVE_PASS = "gdn_pass.vllm.serve.GDN_STATE_PASS"


class GDNStatePass(_TorchGDNStatePass, compat.inductor_pass_base()):
    """Enable the fix with::

        LLM(..., compilation_config={"inductor_compile_config":
                {"post_grad_custom_post_pass": GDNStatePass()}})

    (``"joint_custom_post_pass"`` works too and compiles faster). The object is
    pickled to worker processes; ``uuid()`` covers its options and the source
    of everything that decides the rewrite.
    """

    def options(self) -> dict:
        # Whether the core ops get twins depends on the release (an entry that
        # vLLM fixed stands down): a compiled graph is only valid for it.
        return {**super().options(), "vllm": compat.vllm_version()}

    def __call__(self, graph):
        from gdn_pass.vllm import install

        # In-process engines may not have loaded plugins yet; installing is idempotent.
        install()
        super().__call__(graph)


def configured_pass(compilation_config) -> GDNStatePass | None:
    """The GDNStatePass in a vLLM compilation config, under any supported hook.

    ``inductor_passes`` entries (objects, or qualified names such as
    ``SERVE_PASS``) have already been resolved into ``inductor_compile_config``
    by vLLM's config post-init; a name not yet resolved is resolved here.
    """
    inductor = getattr(compilation_config, "inductor_compile_config", None) or {}
    by_name = getattr(compilation_config, "inductor_passes", None) or {}
    for hook in PASS_HOOKS:
        candidate = inductor.get(hook, by_name.get(hook))
        if candidate == SERVE_PASS:
            from gdn_pass.vllm.serve import GDN_STATE_PASS as candidate
        if isinstance(candidate, GDNStatePass):
            return candidate
    return None
