"""vLLM ``general_plugins`` entry point: runs in every vLLM process.

It installs the per-row metadata hook and the piecewise-split guard (which
acts only when GDNStatePass is configured), nothing else. It does not add
GDNStatePass to the compilation config on its own: a pass that rewrites the
compiled graph and changes cache keys should be asked for where the engine is
configured, so the one line in ``compilation_config`` stays the single switch.
"""

from __future__ import annotations


def register() -> None:
    from gdn_pass.vllm import install

    install()
