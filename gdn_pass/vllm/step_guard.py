"""The step guard: zero fresh rows' state when a step's metadata is built, for reads no op guard covers.

gdn-pass has two guards, each zeroing the slots of a step's fresh rows before
vLLM's kernels read them:

- the **op guard** (``op_guard``), inside each guarded op
  (``gdn_pass::guarded_<op>``, ``guarded_ops``) that the pass swaps in for a
  GDN/KDA core op of a compiled graph, at forward time;
- the **step guard** (this module), in the metadata hook right after the
  step's metadata is built.

The op guard needs a compiled graph whose core ops the pass can swap. Some
engines have none:

- ``enforce_eager=True`` or compilation mode NONE (the bug report's own
  reproduction; Kimi-Linear's architecture forces it in vLLM 0.27+);
- layers whose state read sits behind no op at all (Kimi-Linear's KDA in
  vLLM 0.27+ reads its caches in plain Python).

For those, the metadata hook zeroes the fresh rows' slots of every layer of
the builder's group right after ``build()``, on the host thread that enqueues
the step, before the model's forward is launched::

    metadata = build(...)                     # vLLM
    rows.stage_fresh(...) / stage_no_fresh()  # metadata_hook: the rows to zero, their slots
                                              # (CUDA: nothing, where vLLM's tensors say them)
    if owner(group) is STEP and any fresh row (known on the host):
        for cache in every layer's kv_cache:  # conv + recurrent, ...
            cache[slot[fresh]] = 0            # CUDA: one sync-free launch for the group
    attach(metadata, StepHandoff(rows, ..., zeroed_at_build=True))  # the op guards, if any, skip

Which guard owns a group is decided once per builder, at its first ``build``,
and never changes (a CUDA graph captured under one owner must be replayed
under the same one):

- ``Owner.OP``, the op guard, when the engine compiles and every layer of the
  group has already run through a guarded op (the op guard notes its layer
  the first time it runs, which is in vLLM's profiling or warm-up forward,
  before any step);
- ``Owner.STEP``, the step guard, otherwise, including every eager engine
  and every micro-batched one (dual-batch overlap: one metadata dict per
  micro-batch reaches the ops, each zeroed at its own build).

So a slot is zeroed once per step, by exactly one of the two, and a layer no
guarded op reached is never left to the op guard. The step guard is correct in
every CUDA-graph mode too: it runs on the stream before the replay, which
reads the zeroed slot.
"""

from __future__ import annotations

import enum

import torch

from gdn_pass.vllm.handoff import StepHandoff

__all__ = ["Owner", "activity", "decide_owner", "guarded_layers", "note_guarded_layer", "zero_group"]

# Layers whose guarded op has run in this process (the op guard notes them).
_GUARDED_LAYERS: set[str] = set()
# What the step guard did in this process, for reports and tests: the owner
# decided per group (keyed by the group's first layer), builds that zeroed
# something, and launches (CUDA) or per-cache zeroings (CPU) they made.
_ACTIVITY = {"owners": {}, "steps_zeroed": 0, "zeroings": 0}


class Owner(enum.Enum):
    """Which guard zeroes a group's fresh slots (its value is what ``activity()`` reports)."""

    OP = "op"  # the op guard, in the guarded ops of the compiled model
    STEP = "step"  # the step guard, at metadata build


def note_guarded_layer(layer_name: str) -> None:
    """Record that the guarded op of ``layer_name`` runs in this process."""
    _GUARDED_LAYERS.add(layer_name)


def guarded_layers() -> frozenset[str]:
    return frozenset(_GUARDED_LAYERS)


def decide_owner(layer_names, *, compiled: bool) -> Owner:
    """OP only if the engine compiles and a guarded op has run for every layer."""
    owner = Owner.STEP
    if compiled and layer_names and all(name in _GUARDED_LAYERS for name in layer_names):
        owner = Owner.OP
    if layer_names:
        _ACTIVITY["owners"][layer_names[0]] = owner.value
    return owner


def activity() -> dict:
    """``{"owners": {first layer: "op"|"step"}, "steps_zeroed": n, "zeroings": n}``."""
    return {"owners": dict(_ACTIVITY["owners"]), "steps_zeroed": _ACTIVITY["steps_zeroed"],
            "zeroings": _ACTIVITY["zeroings"]}


def zero_group(layer_caches: list[torch.Tensor], handoff: StepHandoff) -> int:
    """Zero the hand-off's fresh rows' slots in every cache of the group; return the launches made.

    ``handoff.host_fresh`` is the scheduler's count of fresh rows, known on
    the host: with none, nothing is launched. On CUDA with a cache table
    (``handoff.table``) it is one launch (every slot column of a speculative
    row included), which finds the fresh rows in vLLM's tensors where the hand-off
    carries them (``handoff.decode``) and reads the staged rows otherwise;
    without a table, one per cache (CPU: ``index_fill_`` of the host-selected
    slots).
    """
    if handoff.host_fresh == 0 or not layer_caches:
        return 0
    _ACTIVITY["steps_zeroed"] += 1
    launches = handoff.zero(layer_caches, whole_table=handoff.table is not None)
    _ACTIVITY["zeroings"] += launches
    return launches
