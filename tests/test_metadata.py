"""StagedRowMetadata: per-row freshness and padding, in persistent buffers.

Expected values come from row descriptions written out by hand (what kind of
row each one is), not from the code under test.
"""

import random

import pytest
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata

# kind: (num_computed_tokens, query_len, slot) -> (has_initial_state, valid)
ROW_KINDS = {
    "fresh_prefill": ((0, 8, 5), (False, True)),
    "fresh_one_token": ((0, 1, 6), (False, True)),  # the bug's row
    "decode": ((12, 1, 7), (True, True)),
    "continued_chunk": ((64, 32, 8), (True, True)),
    "one_token_continued_chunk": ((64, 1, 9), (True, True)),
    "pad_zero_query": ((0, 0, 3), (False, False)),
    "pad_slot_minus_one": ((0, 1, -1), (False, False)),
    "pad_slot_null_block": ((0, 1, 0), (False, False)),
}


def stage(rows: StagedRowMetadata, kinds: list[str]) -> None:
    computed, qlens, slots = zip(*(ROW_KINDS[k][0] for k in kinds)) if kinds else ((), (), ())
    rows.stage(
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        query_lens=torch.tensor(qlens, dtype=torch.int32),
        state_slots=torch.tensor(slots, dtype=torch.int32),
    )


def expected(kinds: list[str], max_rows: int):
    has_init = [ROW_KINDS[k][1][0] for k in kinds] + [False] * (max_rows - len(kinds))
    valid = [ROW_KINDS[k][1][1] for k in kinds] + [False] * (max_rows - len(kinds))
    return torch.tensor(has_init), torch.tensor(valid)


@pytest.mark.parametrize("kind", sorted(ROW_KINDS))
def test_each_row_kind(kind):
    rows = StagedRowMetadata(4, pad_slot_ids=(-1, 0))
    stage(rows, [kind])
    has_init, valid = expected([kind], 4)
    assert torch.equal(rows.has_initial_state, has_init)
    assert torch.equal(rows.valid, valid)
    fresh = kind.startswith("fresh")
    assert rows.fresh_slots().tolist() == ([ROW_KINDS[kind][0][2]] if fresh else [])


def test_null_block_is_live_when_not_a_sentinel():
    # Older vLLM pads with -1 only; slot 0 is then a real slot.
    rows = StagedRowMetadata(2, pad_slot_ids=(-1,))
    stage(rows, ["pad_slot_null_block"])
    assert rows.valid.tolist() == [True, False]
    assert rows.fresh_slots().tolist() == [0]


def test_padding_rows_never_name_a_live_slot():
    rows = StagedRowMetadata(6, pad_slot_ids=(-1, 0))
    stage(rows, ["pad_zero_query", "decode", "pad_slot_minus_one"])
    assert rows.state_slot.tolist() == [-1, 7, -1, -1, -1, -1]


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_every_size_storage_fixed(seed):
    max_rows = 16
    rows = StagedRowMetadata(max_rows, pad_slot_ids=(-1, 0))
    storage = {
        name: getattr(rows, name).untyped_storage().data_ptr()
        for name in ("has_initial_state", "valid", "state_slot", "reads_state", "fresh")
    }
    rng = random.Random(seed)
    for n in list(range(0, max_rows + 1)) + [rng.randint(0, max_rows) for _ in range(20)]:
        kinds = [rng.choice(sorted(ROW_KINDS)) for _ in range(n)]
        stage(rows, kinds)
        has_init, valid = expected(kinds, max_rows)
        assert torch.equal(rows.has_initial_state, has_init), kinds
        assert torch.equal(rows.valid, valid), kinds
        assert rows.num_rows == n
        fresh = [ROW_KINDS[k][0][2] for k in kinds if k.startswith("fresh")]
        assert rows.fresh_slots().tolist() == fresh
        for name, ptr in storage.items():
            assert getattr(rows, name).untyped_storage().data_ptr() == ptr, name


def test_too_many_rows():
    rows = StagedRowMetadata(2)
    with pytest.raises(MetadataError, match="exceeds the staged capacity of 2"):
        stage(rows, ["decode"] * 3)


def test_rows_disagree():
    rows = StagedRowMetadata(4)
    with pytest.raises(MetadataError, match="disagree on the number of rows"):
        rows.stage(
            num_computed_tokens=torch.zeros(2, dtype=torch.int64),
            query_lens=torch.ones(3, dtype=torch.int64),
            state_slots=torch.ones(2, dtype=torch.int64),
        )


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(2, dtype=torch.float32), "integer tensor"),
        (torch.zeros(2, 1, dtype=torch.int64), "1-D"),
        ([0, 0], "must be a tensor"),
    ],
)
def test_bad_inputs(bad, match):
    rows = StagedRowMetadata(4)
    with pytest.raises(MetadataError, match=match):
        rows.stage(
            num_computed_tokens=bad,
            query_lens=torch.ones(2, dtype=torch.int64),
            state_slots=torch.ones(2, dtype=torch.int64),
        )


def test_zero_start_rows_are_never_fresh():
    # a fresh one-token row on a decode path (reads its slot: zero it), a fresh
    # prefill (its kernels start from zero state: leave it), a decode, padding
    kinds = ["fresh_one_token", "fresh_prefill", "decode", "pad_slot_minus_one"]
    rows = StagedRowMetadata(6, pad_slot_ids=(-1, 0))
    computed, qlens, slots = zip(*(ROW_KINDS[k][0] for k in kinds))
    rows.stage(num_computed_tokens=torch.tensor(computed), query_lens=torch.tensor(qlens),
               state_slots=torch.tensor(slots), zero_start_rows=(1, 2))
    has_init, valid = expected(kinds, 6)
    assert torch.equal(rows.has_initial_state, has_init) and torch.equal(rows.valid, valid)
    assert rows.reads_state.tolist() == [False, False, True, False, False, False]
    assert rows.fresh_slots().tolist() == [6]
    # without zero_start_rows every fresh row is zeroed (the conservative default)
    rows.stage(num_computed_tokens=torch.tensor(computed), query_lens=torch.tensor(qlens),
               state_slots=torch.tensor(slots))
    assert rows.fresh_slots().tolist() == [6, 5]


@pytest.mark.parametrize("bad", [(2, 1), (-1, 2), (0, 4)])
def test_zero_start_rows_outside_the_batch_is_an_error(bad):
    rows = StagedRowMetadata(4)
    with pytest.raises(MetadataError, match="is not a run of the 3 staged rows"):
        rows.stage(num_computed_tokens=torch.zeros(3, dtype=torch.int64),
                   query_lens=torch.ones(3, dtype=torch.int64),
                   state_slots=torch.ones(3, dtype=torch.int64), zero_start_rows=bad)


def test_stage_no_fresh_clears_fresh_rows_of_the_last_step_and_leaves_the_rest():
    rows = StagedRowMetadata(4, pad_slot_ids=(-1, 0))
    stage(rows, ["fresh_one_token", "decode"])
    assert rows.fresh_slots().numel() == 1
    slots_before = rows.state_slot.clone()
    rows.stage_no_fresh(3)
    # A stale fresh flag would zero a continuing request's state in the next replay.
    assert not rows.graph_buffers()["fresh"].any()
    assert rows.num_rows == 3
    assert torch.equal(rows.state_slot, slots_before)  # documented: only fresh is staged
    rows.stage_no_fresh(2)  # nothing left to clear
    assert not rows.fresh.any() and rows.num_rows == 2
    stage(rows, ["decode", "fresh_one_token"])  # a full stage after it stages every buffer
    assert rows.fresh.tolist() == [False, True, False, False]


def test_stage_no_fresh_beyond_capacity():
    with pytest.raises(MetadataError, match="capacity of 2"):
        StagedRowMetadata(2).stage_no_fresh(3)


def test_stage_fresh_stages_the_given_rows_and_slots_only():
    import numpy as np

    rows = StagedRowMetadata(4, pad_slot_ids=(-1, 0))
    stage(rows, ["decode", "decode", "fresh_one_token"])
    has_init_before = rows.has_initial_state.clone()
    rows.stage_fresh(fresh_rows=np.array([True, False]), state_slots=torch.tensor([9, 11], dtype=torch.int32))
    assert rows.fresh.tolist() == [True, False, False, False]  # the last step's row 2, past n, is cleared
    assert rows.fresh_slots().tolist() == [9] and rows.num_rows == 2
    assert torch.equal(rows.has_initial_state, has_init_before)  # documented: only fresh and the slots
    rows.stage_no_fresh(2)  # fresh rows were staged: the next step without any clears them
    assert not rows.fresh.any()


@pytest.mark.parametrize("fresh_rows, slots, match", [
    ([True, False], [1, 2], "numpy bool"),
    (None, [1, 2, 3], "fresh_rows has 2 rows"),
    (None, [1.0, 2.0], "integer"),
])
def test_stage_fresh_bad_inputs(fresh_rows, slots, match):
    import numpy as np

    flags = np.array([True, False]) if fresh_rows is None else fresh_rows
    with pytest.raises(MetadataError, match=match):
        StagedRowMetadata(4).stage_fresh(fresh_rows=flags, state_slots=torch.tensor(slots))
