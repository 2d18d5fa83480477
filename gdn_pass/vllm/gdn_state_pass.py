"""VllmGDNStatePass: the core's GDNStatePass as a vLLM InductorPass (the form vLLM's compilation config accepts).

The same pass as the core's ``gdn_pass.state_pass.GDNStatePass`` (the rewrite,
its options and its report), with vLLM's ``InductorPass`` interface mixed in:
vLLM's compilation config takes only such passes, and hashes them by ``uuid()``.
It also installs the metadata hook when it runs and adds the vLLM release to
its options.
"""

from __future__ import annotations

from gdn_pass import state_pass
from gdn_pass.vllm import compat
from gdn_pass.vllm.configured import PASS_HOOKS, SERVE_PASS, configured_pass
from gdn_pass.vllm.plugin import install

__all__ = ["PASS_HOOKS", "SERVE_PASS", "VllmGDNStatePass", "configured_pass"]


class VllmGDNStatePass(state_pass.GDNStatePass, compat.inductor_pass_base()):
    """Enable the fix with::

        LLM(..., compilation_config={"inductor_compile_config":
                {"post_grad_custom_post_pass": VllmGDNStatePass()}})

    (``"joint_custom_post_pass"`` works too and compiles faster). The object is
    pickled to worker processes; ``uuid()`` covers its options and the source
    of everything that decides the rewrite.
    """

    def options(self) -> dict:
        # Whether the core ops become guarded ops depends on the release (an entry that
        # vLLM fixed stands down): a compiled graph is only valid for it.
        return {**super().options(), "vllm": compat.vllm_version()}

    def __call__(self, graph):
        # In-process engines may not have loaded plugins yet; installing is idempotent.
        install(by_the_pass=True)
        super().__call__(graph)


# This class's earlier name, so that configs and pickles naming
# ``gdn_pass.vllm.gdn_state_pass.GDNStatePass`` still load. A binding, not a class: the one
# class of that name is the core's.
GDNStatePass = VllmGDNStatePass
