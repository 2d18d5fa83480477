"""Zero fresh rows' state when a step's GDN metadata is built: the guard for reads no graph holds.

The graph guard (guarded twins of the core ops, ``guarded_ops``) needs a
compiled graph whose GDN/KDA core ops it can swap. Some engines have none:

- ``enforce_eager=True`` or compilation mode NONE (the bug report's own
  reproduction; Kimi-Linear's architecture forces it in vLLM 0.27+);
- layers whose state read sits behind no op at all (Kimi-Linear's KDA in
  vLLM 0.27+ reads its caches in plain Python).

For those, the metadata hook zeroes the fresh rows' slots of every layer of
the builder's group right after ``build()``, on the host thread that enqueues
the step, before the model's forward is launched::

    metadata = build(...)                     # vLLM
    rows.stage_fresh(...) / stage_no_fresh()  # metadata_hook: the rows to zero, their slots
    if owner(group) is STEP and any fresh row (known on the host):
        for cache in every layer's kv_cache:  # conv + recurrent, ...
            cache[slot[fresh]] = 0            # CUDA: one sync-free launch for the group
    attach(metadata, StepHandoff(rows, ..., zeroed_at_build=True))  # the twins, if any, skip

Who owns a group is decided once per builder, at its first ``build``, and
never changes (a CUDA graph captured under one owner must be replayed under
the same one):

- the GRAPH guard, when the engine compiles and every layer of the group has
  already run through a guarded twin (twins note their layer the first time
  they run, which is in vLLM's profiling or warm-up forward, before any step);
- the STEP guard otherwise, including every eager engine.

So a slot is zeroed once per step, by exactly one of the two, and a layer no
twin reached is never left to the graph guard. The step guard is correct in
every CUDA-graph mode too: it runs on the stream before the replay, which
reads the zeroed slot.
"""

from __future__ import annotations

import enum

import torch

from gdn_pass.vllm.handoff import StepHandoff
from gdn_pass.vllm.zero_rows import zero_rows, zero_rows_all

__all__ = ["Owner", "activity", "decide_owner", "note_stand_down", "note_twin_layer",
           "stood_down", "twin_layers", "zero_group"]

_TWIN_LAYERS: set[str] = set()
# Registry entries (``builders``) that stood down in this process: vLLM fixed their builder.
_STOOD_DOWN: set[str] = set()
# What the step guard did in this process, for reports and tests: the owner
# decided per group (keyed by the group's first layer), builds that zeroed
# something, and launches (CUDA) or per-cache zeroings (CPU) they made.
_ACTIVITY = {"owners": {}, "steps_zeroed": 0, "zeroings": 0}


class Owner(enum.Enum):
    GRAPH = "graph"  # guarded twins inside the compiled model zero the slots
    STEP = "step"  # the metadata hook zeroes them at build time


def note_twin_layer(layer_name: str) -> None:
    """Record that a guarded twin runs for ``layer_name`` in this process."""
    _TWIN_LAYERS.add(layer_name)


def note_stand_down(entry_key: str) -> None:
    """Record that the registry entry ``entry_key`` stands down in this process (no rows staged)."""
    _STOOD_DOWN.add(entry_key)


def stood_down() -> frozenset[str]:
    return frozenset(_STOOD_DOWN)


def twin_layers() -> frozenset[str]:
    return frozenset(_TWIN_LAYERS)


def decide_owner(layer_names, *, compiled: bool) -> Owner:
    """GRAPH only if the engine compiles and a twin has run for every layer."""
    owner = Owner.STEP
    if compiled and layer_names and all(name in _TWIN_LAYERS for name in layer_names):
        owner = Owner.GRAPH
    if layer_names:
        _ACTIVITY["owners"][layer_names[0]] = owner.value
    return owner


def activity() -> dict:
    """``{"owners": {first layer: "graph"|"step"}, "steps_zeroed": n, "zeroings": n}``."""
    return {"owners": dict(_ACTIVITY["owners"]), "steps_zeroed": _ACTIVITY["steps_zeroed"],
            "zeroings": _ACTIVITY["zeroings"]}


def zero_group(layer_caches: list[torch.Tensor], handoff: StepHandoff) -> int:
    """Zero the hand-off's fresh rows' slots in every cache of the group; return the launches made.

    ``handoff.host_fresh`` is the scheduler's count of fresh rows, known on
    the host: with none, nothing is launched. On CUDA with a cache table
    (``handoff.table``) it is one launch; otherwise one per cache (CPU:
    ``index_fill_`` of the host-selected slots).
    """
    if handoff.host_fresh == 0 or not layer_caches:
        return 0
    rows, table = handoff.rows, handoff.table
    fresh = rows.fresh_rows()
    _ACTIVITY["steps_zeroed"] += 1
    if table is not None:
        zero_rows_all(table, rows.state_slot, fresh)
        launches = 1
    else:
        for cache in layer_caches:
            zero_rows(cache, rows.state_slot, fresh)
        launches = len(layer_caches)
    _ACTIVITY["zeroings"] += launches
    return launches
