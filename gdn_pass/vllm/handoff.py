"""What the metadata hook hands the guards for one step: one object, under one attribute.

The metadata hook (``metadata_hook``) runs when vLLM builds a step's metadata
for a group of recurrent-state layers; the guards that zero the fresh rows'
slots run later (the op guard, ``op_guard``, inside each guarded op at
forward time) or right away (the step guard, ``step_guard``, at the build).
Everything the hook computed for the step travels as one ``StepHandoff``,
attached to the metadata object vLLM hands every layer of the group::

    metadata = build(...)                                  # vLLM
    attach(metadata, StepHandoff(rows, host_fresh, ...))   # metadata_hook
    ...
    handoff = handoff_of(metadata)                         # op_guard, in each guarded op

The metadata object is new for every step, so is its hand-off. Both guards
zero through it (``StepHandoff.zero``): one launch over the group's cache
table, or cache by cache; the fresh rows from vLLM's device tensors or from
the staged rows. The three-way choice is made here only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from gdn_pass.kernels.zero_rows import CacheTable, zero_new_rows_all, zero_rows, zero_rows_all
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm.rows import DecodeRows

__all__ = ["ATTR", "StepHandoff", "attach", "handoff_of", "new_decode_rows"]

# The one attribute of vLLM's metadata object that gdn-pass sets.
ATTR = "gdn_pass_handoff"


@dataclasses.dataclass(eq=False, slots=True)
class StepHandoff:
    """One step's rows to zero for one builder's group of layers, as the metadata hook left them.

    ``rows``: the builder's persistent ``StagedRowMetadata``, refreshed in
    place for this step with the rows to zero (``fresh``) and their slots
    (``state_slot``); not refreshed where ``decode`` is set.

    ``host_fresh``: the host's count of rows to zero. With 0 an op guard
    launches nothing outside CUDA-graph capture (inside, it launches anyway,
    so that the replayed graph zeroes later steps' rows). None: not counted,
    zero whatever ``rows`` has staged.

    ``table``: the ``CacheTable`` of every layer of the group (CUDA only), so
    that the first guarded op of the step zeroes them all in one launch.

    ``decode``: the step's ``rows.DecodeRows`` where the zeroing launch
    finds the fresh rows in vLLM's own tensors (CUDA, no speculative rows);
    ``rows`` is then not staged for the step. None otherwise.

    ``zeroed_at_build``: the step guard owns the group and has zeroed its
    fresh slots at this build (or found none): the op guards do nothing.

    ``zeroed_by_op``: set by the first op guard of the step that zeroed the
    whole ``table``, so that the group's other guarded ops skip.

    ``in_capture``: set on a builder's hand-off of the steps without a new row
    (``host_fresh == 0``), shared by all of them: an op guard that must launch
    anyway (inside a FULL CUDA graph's capture) asks it for the step's own
    hand-off, ``in_capture(metadata)``, and zeroes through that one. None on a
    step's own hand-off.
    """

    rows: StagedRowMetadata
    host_fresh: int | None = None
    table: CacheTable | None = None
    decode: DecodeRows | None = None
    zeroed_at_build: bool = False
    zeroed_by_op: bool = False
    in_capture: Callable[[object], StepHandoff] | None = None

    def zero(self, caches, *, whole_table: bool) -> int:
        """Zero this step's fresh slots; the launches made. Both guards zero through here.

        ``whole_table``: one launch over the group's ``table`` (every cache of
        every layer); else cache by cache of ``caches``. The fresh rows come
        from vLLM's own tensors where the hook left them there (``decode``,
        no host sync, capturable), else from the staged ``rows``.
        """
        rows, decode = self.rows, self.decode
        if whole_table:
            if decode is not None:
                zero_new_rows_all(self.table, decode.slots, decode.query_start_loc, decode.seq_lens,
                                  decode.num_rows, rows.max_rows)
            else:
                zero_rows_all(self.table, rows.state_slot, rows.fresh_rows())
            return 1
        slots, fresh = (rows.state_slot, rows.fresh_rows()) if decode is None else new_decode_rows(decode)
        for cache in caches:
            zero_rows(cache, slots, fresh)
        return len(caches)


def new_decode_rows(decode: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' slots and which of them are new, as device tensors (no sync, capturable)."""
    n = decode.num_rows
    starts = decode.query_start_loc
    query_lens = starts[1 : n + 1] - starts[:n]
    # zero_rows reads the slots densely; vLLM's are a column of the block table outside FULL graphs.
    return decode.slots[:n].contiguous(), (query_lens > 0) & (decode.seq_lens[:n] == query_lens)


def attach(metadata, handoff: StepHandoff):
    """Hand ``handoff`` to the guards on vLLM's step ``metadata``; return ``metadata``."""
    setattr(metadata, ATTR, handoff)
    return metadata


def handoff_of(metadata) -> StepHandoff | None:
    """The hand-off the metadata hook attached to ``metadata``; None where it attached none
    (pass not configured, plugin not installed, or the builder's entry stood down)."""
    return getattr(metadata, ATTR, None)
