"""Every vLLM recurrent-state metadata builder gdn-pass guards: one registry, one entry each.

A builder turns the scheduler's rows into the metadata its layers' state
kernels read. The bug class (vllm#51562) lives in the builder: it calls a
brand-new short request a decode, and the decode kernels then read the
request's recycled state slot. Each entry says where that happens and how
the hook recognises and guards it:

==============  =========================================  ==================  ========================  ============
entry           builder (module under ``vllm/``)           state it owns       read by                   rerouted by
                                                           (``layer.kv_cache``)                          vLLM from (fact;
                                                                                                         not a gate)
==============  =========================================  ==================  ========================  ============
gdn             ``GDNAttentionMetadataBuilder``            conv + recurrent    ``compat.CORE_OPS``;      0.31
                (``v1/attention/backends/gdn_attn``)                           Kimi-Linear's KDA reads
                                                                               in Python (0.27+)
kimi_k3_kda     ``KimiK3KDAMetadataBuilder``               conv + recurrent    Kimi-K3's KDA layer       0.31 (its
                (``models/kimi_k3/nvidia/kda_metadata``)                                                 first)
bailing_linear  ``BailingLinearAttentionMetadataBuilder``  Lightning state     ``vllm::linear_attention``  never
                (``v1/attention/backends/linear_attn``)    ``[H, D, D]``       (decode / spec kernels)
minimax_linear  ``LinearAttentionMetadataBuilder``         Lightning state     ``vllm::linear_attention``  never
                (``v1/attention/backends/linear_attn``)
==============  =========================================  ==================  ========================  ============

``rows`` is the entry's way of recognising a fresh row in its metadata
(made in the builder's file, on ``gdn_pass.vllm.rows``); ``guards`` says which guard may zero it: the op
guard, inside the guarded ops the pass swaps in for the core ops of a
compiled graph (``op``), and the step guard, at metadata build (``step``,
every mode, eager included). Whether an entry acts, stands down (its
builder already keeps fresh rows off the decode path: one start-up line, no
per-step work) or refuses is decided at engine start from the installed
builder itself (``support.decide``), not from the table's release column.
**Adding a builder is one file in this folder and one line in ``REGISTRY``**:
the file holds everything about it (the class it hooks, its metadata fields,
how its rows are read on the host and found on the device, its state
layout, its release facts) and makes its ``ENTRY``; ``bailing_linear.py`` is
the smallest example (a subclass of ``linear_attention.py``'s builder that
reuses its rows).
The plugin imports only the attention-backend modules vLLM imports anyway;
Kimi-K3's builder (``eager=False``) is hooked when vLLM first makes one.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import functools
import sys

from gdn_pass.vllm.builders import bailing_linear, gdn, kimi_k3_kda, linear_attention
from gdn_pass.vllm.builders.state_builder import HOOK_MARK, StateBuilder, unhooked_build

__all__ = ["GDN", "HOOK_MARK", "REGISTRY", "StateBuilder", "entry_of", "installed", "reading", "registered_base",
           "unhooked_build"]

# The registry: one line per builder, each entry made in the builder's own file.
REGISTRY: tuple[StateBuilder, ...] = (
    gdn.ENTRY,
    kimi_k3_kda.ENTRY,
    bailing_linear.ENTRY,
    linear_attention.ENTRY,
)


GDN = gdn.ENTRY  # the builder of every GDN/KDA layer behind compat.CORE_OPS


def reading(family: str) -> tuple[StateBuilder, ...]:
    """The entries whose layers the core ops of ``family`` (``compat.CoreOp.family``) read."""
    return tuple(entry for entry in REGISTRY if family in entry.op_families)


def installed() -> list[tuple[StateBuilder, type]]:
    """The entries whose builder class this vLLM has, with the class.

    A lazy entry (``eager=False``) counts only once vLLM has imported its module.
    """
    found = []
    for entry in REGISTRY:
        if entry.eager:
            cls = entry.builder_class()
        else:
            cls = getattr(sys.modules.get(f"vllm.{entry.module}"), entry.class_name, None)
        if cls is not None:
            found.append((entry, cls))
    return found


_BY_NAME = {(f"vllm.{entry.module}", entry.class_name): entry for entry in REGISTRY}


def registered_base(cls: type) -> tuple[StateBuilder, type] | None:
    """The registered class nearest to ``cls`` in its MRO, with its entry; None if there is none.

    A builder that subclasses another registered one (Bailing's linear builder
    subclasses MiniMax's, Kimi-K3's subclasses GDN's) belongs to its own entry
    only, so the base class's hook stands aside for it. Matched by module and
    name: nothing is imported.
    """
    for base in cls.__mro__:
        entry = _BY_NAME.get((base.__module__, base.__qualname__))
        if entry is not None:
            return entry, base
    return None


@functools.cache
def entry_of(cls: type) -> StateBuilder | None:
    """The entry of ``cls`` (``registered_base``)."""
    found = registered_base(cls)
    return None if found is None else found[0]
