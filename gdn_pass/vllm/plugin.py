"""vLLM ``general_plugins`` entry point: runs in every vLLM process.

It installs the per-row metadata hook and the piecewise-split guard (which
acts only when GDNStatePass is configured), nothing else. It does not add
GDNStatePass to the compilation config on its own: a pass that rewrites the
compiled graph and changes cache keys should be asked for where the engine is
configured, so the one line in ``compilation_config`` stays the single switch.

Importing it imports ``gdn_pass.vllm``, which registers the adapter's ops with
the core pass (``gdn_pass.vllm.registration``).
"""

from __future__ import annotations

__all__ = ["install", "register"]


def install(*, by_the_pass: bool = False) -> None:
    """Install gdn-pass's vLLM hooks in this process (idempotent): the per-row
    metadata hook, and the guard for GDN core ops that piecewise compilation
    splits out of the compiled graphs.

    ``by_the_pass``: asked by the configured pass as Inductor runs it, which in a
    process that did not load the entry point is after vLLM split the graph
    (``piecewise.installed_after_a_split``)."""
    from gdn_pass.vllm import guarded_ops, metadata_hook, piecewise

    guarded_ops.define_on_lookup()
    metadata_hook.install()
    piecewise.install(by_the_pass=by_the_pass)


def register() -> None:
    install()
