"""The op guard: zero the state slots of fresh rows inside a guarded op, before vLLM's core op reads them.

Runs eagerly inside the guarded op (``gdn_pass::guarded_<op>``, see
``guarded_ops``) that the pass swaps in for a vLLM GDN/KDA core op, where vLLM's own
kernels run: it finds the layer and the step's metadata through vLLM's
forward context, exactly as the original op finds its caches, and on the
metadata what the metadata hook computed for the step
(``handoff.handoff_of``: the staged rows, the host's count, ...).

    fresh = rows.fresh                    # staged by the metadata hook: the rows to zero
    for cache in layer.kv_cache:          # conv state, recurrent state, ...
        cache[rows.state_slot[fresh]] = 0     # on CUDA: sync-free Triton, capturable

    # CUDA steps without speculative rows: nothing staged, vLLM's own tensors say it
    fresh[r] = r < num_decodes and 0 < query_len[r] == seq_lens[r]
    slot[r]  = metadata.non_spec_state_indices_tensor[r]

A step whose metadata says no row is fresh (the host's count) launches
nothing, except inside CUDA-graph capture. Where the hook deferred the
step's builds (``handoff.StepHandoff.resolve``), the first guarded op of the
step makes their rows, for every group at once, before anything else. On
CUDA the first guarded op of a step zeroes the fresh slots of every GDN layer
that shares its metadata, in one launch; the others skip. Where the step's
new rows are vLLM's decode rows, that launch covers every group the hook joined
(``handoff.JointZeroing``): one launch per step, not per group. Where the
step guard owns the group (``step_guard``), the slots were zeroed at build
time and the op guard does nothing.
"""

from __future__ import annotations

import torch

from gdn_pass.vllm.handoff import ATTR, attach, handoff_of, note_staged_capture, resolve_deferred
from gdn_pass.vllm.step_guard import note_guarded_layer
from gdn_pass.vllm.support import stood_down

__all__ = ["GuardError", "zero_fresh_state"]


class GuardError(RuntimeError):
    pass


# vllm.forward_context, imported at the first call (importing this module imports no vLLM); an
# import statement in the function would run again on every call of every guarded op.
_vllm_forward_context = None
# Whether this torch has CUDA, asked once (every call of a step without fresh rows asks _capturing).
_has_cuda: list[bool] = []


def zero_fresh_state(layer_name: str, family: str = "gdn") -> None:
    global _vllm_forward_context

    note_guarded_layer(layer_name)  # first in vLLM's profiling / warm-up forward
    forward_context = _vllm_forward_context
    if forward_context is None:
        from vllm import forward_context

        _vllm_forward_context = forward_context
    context = forward_context.get_forward_context()
    all_metadata = context.attn_metadata
    if all_metadata is None:  # profiling / dummy run: the op itself does nothing
        return
    if isinstance(all_metadata, list):  # micro-batches: the step guard zeroed each at its build
        name = getattr(context.no_compile_layers[layer_name], "prefix", layer_name)
        for part in all_metadata:
            metadata = part.get(name)
            handoff = None if metadata is None else handoff_of(metadata)
            if not (metadata is None or (handoff is None and _stood_down(family))
                    or (handoff is not None and handoff.zeroed_at_build)):
                raise GuardError(
                    f"gdn-pass: micro-batched metadata of {layer_name} was not zeroed at build "
                    "(the step guard owns every group of a micro-batched engine from its first "
                    "build); disable dual-batch overlap or remove VllmGDNStatePass from the config")
        return
    # The name the op is called with is the layer's prefix, the metadata's key: the layer itself
    # is looked up only where that misses or something is to be zeroed (most calls: neither).
    layer = None
    metadata = all_metadata.get(layer_name)
    if metadata is None:
        layer = context.no_compile_layers[layer_name]
        metadata = all_metadata.get(getattr(layer, "prefix", layer_name))
        if metadata is None:
            return
    handoff = getattr(metadata, ATTR, None)
    if handoff is not None and handoff.resolve is not None:
        # A deferred build: the step's first guarded op makes its rows, for all the step's groups.
        handoff = resolve_deferred(metadata, capturing=_capturing())
    if handoff is None:
        if _stood_down(family):  # vLLM fixed the layer's builder here: the guarded op is the original
            return
        raise GuardError(
            f"no staged gdn-pass rows on {type(metadata).__name__} of {layer_name}: the "
            "metadata hook stages rows only in engines whose compilation_config names "
            "VllmGDNStatePass (inductor_compile_config or inductor_passes) and only where "
            "gdn-pass is installed (its vllm.general_plugins entry point, or "
            "gdn_pass.vllm.install() before the engine starts)"
        )
    if handoff.zeroed_at_build:  # the step guard owns this group
        return
    if handoff.host_fresh == 0 and not _capturing():
        return
    if layer is None:
        layer = context.no_compile_layers[layer_name]
    if handoff.in_capture is not None:  # the builder's shared hand-off: this step gets its own
        handoff = handoff.in_capture(metadata)
        attach(metadata, handoff)  # the group's other guarded ops find it done
    if handoff.decode is None and _capturing():
        note_staged_capture()  # the graph's replays read the staged rows: every build must stage them
    table = handoff.table
    if table is not None and layer.kv_cache[0].data_ptr() in table.addresses:
        # One launch zeroes every GDN layer of this metadata's group (of every group the
        # step's hand-offs joined, outside capture); the other layers find it done (the
        # hand-off is per step).
        if not handoff.zeroed_by_op:
            joint = handoff.joint
            if joint is not None and not joint.done and not _capturing():
                joint.zero()
            else:
                handoff.zero(layer.kv_cache, whole_table=True)
                handoff.zeroed_by_op = True
        return
    handoff.zero(layer.kv_cache, whole_table=False)


def _stood_down(family: str) -> bool:
    """Whether every builder of the layers ``family``'s ops read (``builders.reading``) stood down."""
    keys = _FAMILY_KEYS.get(family)
    if keys is None:
        from gdn_pass.vllm import builders

        keys = _FAMILY_KEYS[family] = tuple(entry.key for entry in builders.reading(family))
    down = stood_down()
    return bool(keys) and all(key in down for key in keys)


_FAMILY_KEYS: dict[str, tuple[str, ...]] = {}


def _capturing() -> bool:
    if not _has_cuda:
        _has_cuda.append(torch.cuda.is_available())
    return _has_cuda[0] and torch.cuda.is_current_stream_capturing()
