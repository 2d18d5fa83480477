"""GDNStatePass as a vLLM InductorPass (the form vLLM's compilation config accepts)."""

from __future__ import annotations

from gdn_pass.state_pass import GDNStatePass as _TorchGDNStatePass
from gdn_pass.vllm import compat

__all__ = ["GDNStatePass"]


class GDNStatePass(_TorchGDNStatePass, compat.inductor_pass_base()):
    """Enable the fix with::

        LLM(..., compilation_config={"inductor_compile_config":
                {"post_grad_custom_post_pass": GDNStatePass()}})

    The object is pickled to worker processes; ``uuid()`` covers its options
    and the source of everything that decides the rewrite.
    """

    def __call__(self, graph):
        from gdn_pass.vllm import install

        # In-process engines may not have loaded plugins yet; installing is idempotent.
        install()
        super().__call__(graph)
