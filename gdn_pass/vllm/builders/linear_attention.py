"""vLLM's linear-attention builder, ``LinearAttentionMetadataBuilder`` (``vllm/v1/attention/backends/linear_attn.py``).

MiniMax-Text-01's linear-attention layer (no model of 0.26-0.34 registers
it), and the base of Bailing's builder (``bailing_linear``), whose rows are
these too. State per layer: one Lightning ``[H, D, D]``, read inside
``vllm::linear_attention``: the op guard zeroes it in that op's guarded twin
where the engine compiles (``compat.CORE_OPS``, family ``lightning``), the
step guard at build elsewhere.

Release facts (0.26-0.34, the same split): the builder counts short extends
as decodes (``split_decodes_and_prefills`` with threshold 1), and vLLM's own
``clear_linear_attention_cache_for_new_sequences`` zeroes prefill rows only.
"""

from __future__ import annotations

import numpy as np
import torch

from gdn_pass.vllm.builders.state_builder import StateBuilder
from gdn_pass.vllm.rows import DecodeRows, HostRows, fitting_decode_rows, scheduler_rows, slot_count_error

__all__ = ["ENTRY", "linear_decode_rows", "linear_rows"]


def linear_decode_rows(common, metadata) -> DecodeRows | None:
    """Lightning linear attention: the step's ``DecodeRows``, or None where they cannot say.

    ``slots``: ``state_indices_tensor_d`` (Bailing: ``[rows, 1 + k]`` with
    speculative decoding, else ``[rows]``), or ``state_indices_tensor``
    (``LinearAttentionMetadata``); ``query_start_loc`` / ``seq_lens``: the
    metadata's own, the scheduler's. The builder puts its decodes first, so a
    fresh decode row is one of the first ``num_decodes`` whose tokens are all
    new, speculative rows included (a fresh prompt of ``1 + k`` tokens).
    """
    slots = getattr(metadata, "state_indices_tensor_d", None)
    if slots is None:
        slots = metadata.state_indices_tensor
    return fitting_decode_rows(slots, metadata.query_start_loc, metadata.seq_lens, metadata.num_decodes)


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
    step = scheduler_rows(common)
    query_lens, computed = step.query_lens, step.computed
    decodes = min(int(metadata.num_decodes), query_lens.size)
    to_zero = step.new[:decodes]
    slots = getattr(metadata, "state_indices_tensor_d", None)
    if slots is None:  # LinearAttentionMetadata: one slot per row, decodes first
        slots = metadata.state_indices_tensor
    if slots.shape[0] < decodes:
        raise slot_count_error("linear-attention", slots.shape[0], decodes)
    slots = slots[:decodes]
    fresh = step.new_among_first(decodes)
    if slots.dim() == 2:
        width = slots.shape[1]
        to_zero = np.repeat(to_zero, width)
        query_lens, computed = np.repeat(query_lens[:decodes], width), np.repeat(computed[:decodes], width)
        return HostRows(query_lens, computed, [slots.reshape(-1)], (0, 0), to_zero, fresh * width)
    return HostRows(query_lens[:decodes], computed[:decodes], [slots], (0, 0), to_zero, fresh)


ENTRY = StateBuilder(
    key="minimax_linear", module="v1.attention.backends.linear_attn", class_name="LinearAttentionMetadataBuilder",
    models="MiniMax-Text-01's linear-attention layer (no model of 0.26-0.33 registers it)",
    state="Lightning state [H, D, D]", read_by="vllm::linear_attention (linear_decode_forward_triton)",
    rows=linear_rows, guards=("op", "step"), op_families=("lightning",), metadata_class="LinearAttentionMetadata",
    metadata_fields=("num_decodes", "state_indices_tensor", "query_start_loc", "seq_lens"),
    state_layout="square", architectures=(), device_rows=linear_decode_rows)
