"""GDN's builder, ``GDNAttentionMetadataBuilder`` (``vllm/v1/attention/backends/gdn_attn.py``).

Models: Qwen3-Next, Qwen3.5, OLMo-hybrid, InternS2-Mobius, Bailing-MoE-v3,
Kimi-Linear, and their MTP variants. State per layer: conv state(s) then a
recurrent ``[HV, K, V]``, read by the GDN/KDA core ops (``compat.CORE_OPS``;
Kimi-Linear's KDA reads in Python, 0.27+), where a compiled graph lets the
op guard zero a fresh row inside the guarded op; the step guard zeroes at
metadata build otherwise.

Release facts (read in vLLM's source; the engine-start checks decide, not
these): 0.26-0.30 call a fresh one-token row a decode when every row of the
step has one token (vllm#51562); 0.31 routes rows still prefilling to the
prefill path (vllm#51565), except that its V1 runner may replay a FULL decode
graph on such a step (``support.reroute_holds``). With MTP its split goes by
draft counts: a row of 1 + k tokens without drafts (a prompt's last chunk) is
a prefill, on which the V1 runner may replay its speculative FULL graph
(``draftless_steps``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gdn_pass.metadata import MetadataError
from gdn_pass.vllm import compat
from gdn_pass.vllm.builders.state_builder import StateBuilder
from gdn_pass.vllm.rows import DecodeRows, HostRows, fitting_decode_rows, scheduler_rows, slot_count_error

__all__ = ["ENTRY", "METADATA_FIELDS", "gdn_decode_rows", "gdn_rows"]

# What ``gdn_rows`` reads of ``GDNAttentionMetadata`` (checked at engine start); Kimi-K3's builder
# makes the same metadata.
METADATA_FIELDS = ("non_spec_state_indices_tensor", "spec_sequence_masks", "num_decodes")


@functools.cache
def _decode_fields_exist() -> bool:
    """Do this release's metadata classes have every field ``gdn_decode_rows`` reads? (Asked once.)"""
    from vllm.v1.attention import backend
    from vllm.v1.attention.backends import gdn_attn

    needed = {"non_spec_state_indices_tensor", "non_spec_query_start_loc", "spec_sequence_masks", "num_decodes"}
    return (needed <= compat.fields_of(gdn_attn.GDNAttentionMetadata)
            and "seq_lens" in compat.fields_of(backend.CommonAttentionMetadata))


def gdn_decode_rows(common, metadata) -> DecodeRows | None:
    """GDN: the step's ``DecodeRows``, or None where they cannot say which rows are new.

    ``slots`` is ``non_spec_state_indices_tensor``, ``query_start_loc`` its
    ``non_spec_query_start_loc``. None on steps with speculative rows (their
    fresh rows need the host's view, ``gdn_rows``), on releases without
    these fields, and on a step whose tensors are shorter than its decode
    rows: the caller then stages the rows itself. Runs at every build, so it
    checks only what can change from step to step (a few attribute reads, ~1 us).
    """
    if metadata.spec_sequence_masks is not None or not _decode_fields_exist():
        return None
    return fitting_decode_rows(metadata.non_spec_state_indices_tensor, metadata.non_spec_query_start_loc,
                    getattr(common, "seq_lens", None), metadata.num_decodes)


def _without_padding_rows(spec_slots: torch.Tensor, spec: np.ndarray, query_lens: np.ndarray,
                          non_spec_slots) -> torch.Tensor:
    """``spec_slots`` without a FULL graph's padding rows. On a padded step where every row
    speculates, vLLM's builder (0.26-0.33) keeps a row of speculative slots per row of the
    padded batch (``num_reqs``, padding included), filled with the null block after the real
    rows; the padding rows have no tokens and no drafts, so they are not speculative rows
    here. Those trailing rows only are dropped: any other surplus is left for the row count
    check to refuse."""
    num_spec = int(np.count_nonzero(spec))
    if (spec_slots.shape[0] == spec.size > num_spec and non_spec_slots is None and spec[:num_spec].all()
            and not np.count_nonzero(query_lens[num_spec:])):
        return spec_slots[:num_spec]
    return spec_slots


def gdn_rows(common, metadata, draft_counts: torch.Tensor | None = None) -> HostRows:
    """GDN: the non-speculative rows in the order of ``non_spec_state_indices_tensor``
    (the builder's decodes first, then its prefills), then the speculative rows
    with column 0 of ``spec_state_indices_tensor`` (a request's first step has
    one accepted token). Only decodes and speculative rows can be fresh: the
    prefill kernels start a row without initial state from zero themselves."""
    num_reqs = common.num_reqs
    step = scheduler_rows(common)
    query_lens, computed = step.query_lens, step.computed
    non_spec_slots = metadata.non_spec_state_indices_tensor
    num_decodes = int(metadata.num_decodes)
    if metadata.spec_sequence_masks is None and non_spec_slots is not None:
        # Most steps: one part, the builder's decodes (the only rows to zero) first.
        if num_reqs != non_spec_slots.shape[0]:
            raise slot_count_error("GDN", non_spec_slots.numel(), query_lens.size)
        decodes = min(num_decodes, num_reqs)
        return HostRows(query_lens, computed, [non_spec_slots], (decodes, num_reqs), step.new,
                        step.new_among_first(decodes))
    spec_slots = getattr(metadata, "spec_state_indices_tensor", None)
    if metadata.spec_sequence_masks is None:
        parts = [(query_lens, computed, non_spec_slots)]
    else:
        if draft_counts is not None:
            spec = draft_counts[:num_reqs].cpu().numpy() >= 0
        else:  # a device-to-host copy; vLLM 0.26-0.33 always pass the host counts
            spec = metadata.spec_sequence_masks[:num_reqs].cpu().numpy()
        if spec_slots is not None:
            spec_slots = _without_padding_rows(spec_slots, spec, query_lens, non_spec_slots)
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
            raise slot_count_error("GDN", part_slots.numel(), part_lens.size)
        lens.append(part_lens)
        done.append(part_done)
        slots.append(part_slots)
    if not slots:
        empty = np.zeros(0, dtype=np.int64)
        return HostRows(empty, empty, [], (0, 0), np.zeros(0, dtype=np.bool_), 0)
    non_spec_rows = lens[0].size if non_spec_slots is not None else 0
    prefills = (min(num_decodes, non_spec_rows), non_spec_rows)
    query_lens = lens[0] if len(lens) == 1 else np.concatenate(lens)
    computed = done[0] if len(done) == 1 else np.concatenate(done)
    return HostRows.counted(query_lens, computed, slots, prefills, (computed == 0) & (query_lens > 0))


ENTRY = StateBuilder(
    key="gdn", module="v1.attention.backends.gdn_attn", class_name="GDNAttentionMetadataBuilder",
    models=("Qwen3-Next, Qwen3.5, OLMo-hybrid, InternS2-Mobius, Bailing-MoE-v3, Kimi-Linear "
            "and their MTP variants"),
    state="conv + recurrent state", read_by="GDN/KDA core ops (compat.CORE_OPS)",
    rows=gdn_rows, guards=("op", "step"), op_families=("gdn", "kda"), metadata_class="GDNAttentionMetadata",
    metadata_fields=METADATA_FIELDS, state_layout="conv + recurrent", device_rows=gdn_decode_rows,
    prefills_draftless_rows=True,
    architectures=("Qwen3NextForCausalLM", "Qwen3NextMTP", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                   "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                   "OlmoHybridForCausalLM", "InternS2MobiusForConditionalGeneration", "BailingMoeV3ForCausalLM",
                   "BailingMoeV3VLForConditionalGeneration", "KimiLinearForCausalLM"))
