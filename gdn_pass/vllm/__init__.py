"""vLLM integration: the pass as an InductorPass, the metadata hook, the plugin.

    from gdn_pass.vllm import GDNStatePass
    LLM(..., compilation_config={"inductor_compile_config":
            {"post_grad_custom_post_pass": GDNStatePass()}})

Importing this package registers vLLM's GDN/KDA core ops, their guards and
the adapter's share of the pass's cache key with the core pass
(``gdn_pass.vllm.registration``); it imports no vLLM.
"""

from __future__ import annotations

from gdn_pass.vllm import registration as _registration  # noqa: F401  (registers the adapter)
from gdn_pass.vllm.plugin import install

__all__ = ["GDNStatePass", "install"]


def __getattr__(name):
    # Lazy: importing vLLM is slow and must not happen at plugin discovery.
    if name == "GDNStatePass":
        from gdn_pass.vllm.gdn_state_pass import GDNStatePass

        return GDNStatePass
    raise AttributeError(name)
