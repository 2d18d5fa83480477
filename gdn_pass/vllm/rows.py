"""One step's rows to zero, as the host knows them, for each kind of state builder.

Each function reads one builder's metadata and the scheduler's
``CommonAttentionMetadata`` (never a device value) and returns ``HostRows``:
the slots the builder's decode kernels read, and which of them belong to a
brand-new row (no token computed before this step) that those kernels would
read as if it had history::

    fresh[i] = num_computed_tokens[i] == 0 and query_len[i] > 0 and row i runs a decode path

``gdn_rows`` reads ``GDNAttentionMetadata`` (0.26-0.33), ``linear_rows``
``LinearAttentionMetadata`` / ``BailingLinearAttentionMetadata`` (0.26-0.33).
The registry (``builders``) says which builder uses which.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.vllm import compat

__all__ = ["HostRows", "gdn_rows", "linear_rows"]


@dataclasses.dataclass
class HostRows:
    """One step's rows in staged order, as the host knows them (no device read).

    ``query_lens`` / ``computed``: ``[n]`` numpy integers; ``slot_parts``: the
    builder's device slot tensors, concatenated in the same order;
    ``zero_start_rows``: the builder's prefill run; ``to_zero``: ``[n]`` bool,
    the rows whose slots the guards must zero (fresh, and on a path whose
    kernels read the slot); ``fresh``: their count.
    """

    query_lens: np.ndarray
    computed: np.ndarray
    slot_parts: list[torch.Tensor]
    zero_start_rows: tuple[int, int]
    to_zero: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def fresh(self) -> int:
        return int(np.count_nonzero(self.to_zero))

    def _slots(self) -> torch.Tensor:
        parts = self.slot_parts
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        return parts[0] if len(parts) == 1 else torch.cat([s.to(parts[0].dtype) for s in parts])

    def stage(self, rows: StagedRowMetadata) -> None:
        """Every buffer (``StagedRowMetadata.stage``)."""
        rows.stage(num_computed_tokens=torch.from_numpy(self.computed), query_lens=torch.from_numpy(self.query_lens),
                   state_slots=self._slots(), zero_start_rows=self.zero_start_rows if self.slot_parts else None)

    def stage_fresh(self, rows: StagedRowMetadata) -> None:
        """Only what the guards read: ``fresh`` and the slots (``StagedRowMetadata.stage_fresh``)."""
        rows.stage_fresh(fresh_rows=self.to_zero, state_slots=self._slots())


def _query_lens_and_computed(common) -> tuple[np.ndarray, np.ndarray]:
    num_reqs = common.num_reqs
    # numpy on views of vLLM's host tensors: a torch op on a few dozen CPU
    # elements costs several microseconds of dispatch, numpy's about one.
    starts = common.query_start_loc_cpu.numpy()
    query_lens = starts[1 : num_reqs + 1] - starts[:num_reqs]
    return query_lens, compat.num_computed_tokens(common, query_lens)


def gdn_rows(common, metadata, draft_counts: torch.Tensor | None = None) -> HostRows:
    """GDN: the non-speculative rows in the order of ``non_spec_state_indices_tensor``
    (the builder's decodes first, then its prefills), then the speculative rows
    with column 0 of ``spec_state_indices_tensor`` (a request's first step has
    one accepted token). Only decodes and speculative rows can be fresh: the
    prefill kernels start a row without initial state from zero themselves."""
    num_reqs = common.num_reqs
    query_lens, computed = _query_lens_and_computed(common)
    non_spec_slots = metadata.non_spec_state_indices_tensor
    spec_slots = getattr(metadata, "spec_state_indices_tensor", None)
    num_decodes = int(metadata.num_decodes)
    if metadata.spec_sequence_masks is None and non_spec_slots is not None:
        # Most steps: one part, the builder's decodes (the only rows to zero) first.
        if query_lens.size != non_spec_slots.numel():
            raise _slot_count_error("GDN", non_spec_slots.numel(), query_lens.size)
        decodes = min(num_decodes, num_reqs)
        to_zero = (computed == 0) & (query_lens > 0)
        to_zero[decodes:] = False
        return HostRows(query_lens, computed, [non_spec_slots], (decodes, num_reqs), to_zero)
    if metadata.spec_sequence_masks is None:
        parts = [(query_lens, computed, non_spec_slots)]
    else:
        if draft_counts is not None:
            spec = draft_counts[:num_reqs].cpu().numpy() >= 0
        else:  # a device-to-host copy; vLLM 0.26-0.33 always pass the host counts
            spec = metadata.spec_sequence_masks[:num_reqs].cpu().numpy()
        parts = [(query_lens[~spec], computed[~spec], non_spec_slots),
                 (query_lens[spec], computed[spec], None if spec_slots is None else spec_slots[:, 0])]
    lens, done, slots = [], [], []
    for part_lens, part_done, part_slots in parts:
        if part_slots is None:
            if np.count_nonzero(part_lens > 0):
                raise MetadataError(
                    f"GDN metadata has no state slots for {part_lens.size} scheduler rows "
                    f"(vLLM {compat.vllm_version()}); this builder layout is not supported by gdn-pass")
            continue
        if part_lens.size != part_slots.numel():
            raise _slot_count_error("GDN", part_slots.numel(), part_lens.size)
        lens.append(part_lens)
        done.append(part_done)
        slots.append(part_slots)
    if not slots:
        empty = np.zeros(0, dtype=np.int64)
        return HostRows(empty, empty, [], (0, 0), np.zeros(0, dtype=np.bool_))
    non_spec_rows = lens[0].size if non_spec_slots is not None else 0
    prefills = (min(num_decodes, non_spec_rows), non_spec_rows)
    query_lens = lens[0] if len(lens) == 1 else np.concatenate(lens)
    computed = done[0] if len(done) == 1 else np.concatenate(done)
    to_zero = (computed == 0) & (query_lens > 0)
    to_zero[prefills[0]:prefills[1]] = False
    return HostRows(query_lens, computed, slots, prefills, to_zero)


def linear_rows(common, metadata, draft_counts: torch.Tensor | None = None) -> HostRows:
    """Lightning linear attention: the builder's decodes, the first ``num_decodes`` rows.

    Their kernels read the slot unconditionally: ``linear_decode_forward_triton``
    reads ``state_indices_tensor_d[i]`` (or ``state_indices_tensor[i]``), and
    with speculative decoding ``bailing_linear_attention_decode_spec`` reads
    column ``num_accepted_tokens[i] - 1`` of the row of ``state_indices_tensor_d``
    (``[rows, 1 + k]``) and writes the others. vLLM's own clearing
    (``clear_linear_attention_cache_for_new_sequences``) covers prefill rows
    only. So a fresh decode row has every slot of its row staged: all of them
    are its own blocks, and the kernels overwrite the ones they do not read.
    Rows appear once per column (``[rows * (1 + k)]``), in row order.
    """
    query_lens, computed = _query_lens_and_computed(common)
    decodes = min(int(metadata.num_decodes), query_lens.size)
    to_zero = (computed[:decodes] == 0) & (query_lens[:decodes] > 0)
    slots = getattr(metadata, "state_indices_tensor_d", None)
    if slots is None:  # LinearAttentionMetadata: one slot per row, decodes first
        slots = metadata.state_indices_tensor
    if slots.shape[0] < decodes:
        raise _slot_count_error("linear-attention", slots.shape[0], decodes)
    slots = slots[:decodes]
    if slots.dim() == 2:
        width = slots.shape[1]
        to_zero = np.repeat(to_zero, width)
        query_lens, computed = np.repeat(query_lens[:decodes], width), np.repeat(computed[:decodes], width)
        slots = slots.reshape(-1)
    else:
        query_lens, computed = query_lens[:decodes], computed[:decodes]
    return HostRows(query_lens, computed, [slots], (0, 0), to_zero)


def _slot_count_error(kind: str, slots: int, rows: int) -> MetadataError:
    return MetadataError(
        f"{kind} metadata has {slots} state slots for {rows} scheduler rows "
        f"(vLLM {compat.vllm_version()}); this builder layout is not supported by gdn-pass")
