"""Rows derived from vLLM's CommonAttentionMetadata, not from the builder's split."""

from types import SimpleNamespace

import pytest
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.vllm import compat, metadata_hook
from vllm.v1.attention.backend import CommonAttentionMetadata


def common_metadata(computed, qlens, *, with_cpu_seq_lens=True, pad_to=None):
    computed, qlens = list(computed), list(qlens)
    if pad_to is not None:  # full-graph padding: zero-length rows at the tail
        computed += [0] * (pad_to - len(computed))
        qlens += [0] * (pad_to - len(qlens))
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(computed, dtype=torch.int32) + torch.tensor(qlens, dtype=torch.int32)
    n = len(qlens)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(n, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone() if with_cpu_seq_lens else None,
    )


def gdn_metadata(slots, spec_mask=None):
    return SimpleNamespace(
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
        spec_sequence_masks=None if spec_mask is None else torch.tensor(spec_mask),
    )


@pytest.mark.parametrize("with_cpu_seq_lens", [True, False])
def test_fresh_one_token_row_among_decodes(with_cpu_seq_lens):
    # The bug's step: every row has one token; row 1 is brand new on slot 4.
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([9, 0, 30], [1, 1, 1], with_cpu_seq_lens=with_cpu_seq_lens)
    metadata_hook.stage_rows(rows, common, gdn_metadata([3, 4, 5]))
    assert rows.has_initial_state[:3].tolist() == [True, False, True]
    assert rows.valid[:3].tolist() == [True, True, True]
    assert rows.fresh_slots().tolist() == [4]


def test_mixed_batch_with_padding_sentinels():
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    # decode, continued chunk, one-token continued chunk, fresh prefill, 2 padding rows
    common = common_metadata([5, 64, 64, 0], [1, 32, 1, 7], pad_to=6)
    sentinel = compat.pad_slot_ids()[-1]
    metadata_hook.stage_rows(rows, common, gdn_metadata([3, 4, 5, 6, sentinel, sentinel]))
    assert rows.valid.tolist() == [True] * 4 + [False] * 4
    assert rows.has_initial_state[:4].tolist() == [True, True, True, False]
    assert rows.fresh_slots().tolist() == [6]


def test_speculative_rows_are_not_staged():
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([5, 0, 40], [3, 1, 3])
    # rows 0 and 2 are spec decodes; only row 1 is in non_spec_state_indices
    metadata_hook.stage_rows(rows, common, gdn_metadata([9], spec_mask=[True, False, True]))
    assert rows.num_rows == 1
    assert rows.fresh_slots().tolist() == [9]


def test_row_count_mismatch_is_an_error():
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    with pytest.raises(MetadataError, match="state slots for 2 scheduler rows"):
        metadata_hook.stage_rows(rows, common_metadata([1, 2], [1, 1]), gdn_metadata([3, 4, 5]))


def test_pad_slot_ids_of_this_vllm():
    from vllm.v1.attention.backends import utils

    ids = compat.pad_slot_ids()
    assert utils.PAD_SLOT_ID in ids
    if hasattr(utils, "NULL_BLOCK_ID"):
        assert utils.NULL_BLOCK_ID in ids


def test_install_is_idempotent():
    metadata_hook.install()
    assert metadata_hook.is_installed()
    assert metadata_hook.install() is False
