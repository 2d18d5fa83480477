"""vLLM integration: the pass as an InductorPass, the metadata hook, the plugin.

    from gdn_pass.vllm import VllmGDNStatePass
    LLM(..., compilation_config={"inductor_compile_config":
            {"post_grad_custom_post_pass": GDNStatePass()}})

Importing this package registers vLLM's GDN/KDA core ops, their guards and
the adapter's share of the pass's cache key with the core pass
(``gdn_pass.vllm.registration``); it imports no vLLM.
"""

from __future__ import annotations

from gdn_pass.vllm import registration as _registration  # noqa: F401  (registers the adapter)
from gdn_pass.vllm.plugin import install

__all__ = ["VllmGDNStatePass", "install"]


def __getattr__(name):
    # Lazy: importing vLLM is slow and must not happen at plugin discovery.
    # ``GDNStatePass``: this class's earlier name here, kept for configs written for it.
    if name in ("VllmGDNStatePass", "GDNStatePass"):
        from gdn_pass.vllm.gdn_state_pass import VllmGDNStatePass

        return VllmGDNStatePass
    raise AttributeError(name)
