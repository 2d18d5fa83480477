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

__all__ = ["install", "installed_by_the_pass", "register"]


def install(*, by_the_pass: bool = False) -> None:
    """Install gdn-pass's vLLM hooks in this process (idempotent): the per-row
    metadata hook, and the guard for GDN core ops that piecewise compilation
    splits out of the compiled graphs.

    ``by_the_pass``: asked by the configured pass as Inductor runs it, which in a
    process that did not load the entry point is after vLLM split the graph
    (``installed_by_the_pass``)."""
    from gdn_pass.vllm import guarded_ops, metadata_hook, piecewise

    guarded_ops.define_on_lookup()
    metadata_hook.install()
    if piecewise.install() and by_the_pass:
        _BY_THE_PASS[0] = True


# Whether the pass, not the entry point (or a caller of ``install``), first installed the split guard.
_BY_THE_PASS = [False]


def installed_by_the_pass() -> bool:
    """Whether this process's split guard was installed by the pass from inside a compile: vLLM
    then split the engine's first graph without it, and the state ops split out of it run
    unguarded (their groups fall to the step guard, ``metadata_hook._decide_owner``)."""
    return _BY_THE_PASS[0]


def register() -> None:
    install()
