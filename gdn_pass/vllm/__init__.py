"""vLLM integration: the pass as an InductorPass, the metadata hook, the plugin.

    from gdn_pass.vllm import GDNStatePass
    LLM(..., compilation_config={"inductor_compile_config":
            {"post_grad_custom_post_pass": GDNStatePass()}})
"""

from __future__ import annotations

__all__ = ["GDNStatePass", "install"]


def install() -> None:
    """Install the per-row metadata hook in this process (idempotent)."""
    from gdn_pass.vllm import metadata_hook

    metadata_hook.install()


def __getattr__(name):
    # Lazy: importing vLLM is slow and must not happen at plugin discovery.
    if name == "GDNStatePass":
        from gdn_pass.vllm.gdn_state_pass import GDNStatePass

        return GDNStatePass
    raise AttributeError(name)
