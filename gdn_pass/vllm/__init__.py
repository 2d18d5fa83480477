"""vLLM integration: the pass as an InductorPass, the metadata hook, the plugin.

    from gdn_pass.vllm import GDNStatePass
    LLM(..., compilation_config={"inductor_compile_config":
            {"post_grad_custom_post_pass": GDNStatePass()}})
"""

from __future__ import annotations

__all__ = ["GDNStatePass", "install"]


def install() -> None:
    """Install gdn-pass's vLLM hooks in this process (idempotent): the per-row
    metadata hook, and the guard for GDN core ops that piecewise compilation
    splits out of the compiled graphs."""
    from gdn_pass.vllm import guarded_ops, metadata_hook, piecewise

    guarded_ops.define_on_lookup()
    metadata_hook.install()
    piecewise.install()


def __getattr__(name):
    # Lazy: importing vLLM is slow and must not happen at plugin discovery.
    if name == "GDNStatePass":
        from gdn_pass.vllm.gdn_state_pass import GDNStatePass

        return GDNStatePass
    raise AttributeError(name)
