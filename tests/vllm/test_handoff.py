"""The metadata hook hands the guards one StepHandoff, under one attribute of vLLM's metadata."""

from types import SimpleNamespace

import pytest

from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import handoff, metadata_hook, step_guard
from gdn_pass.vllm.handoff import StepHandoff, attach, handoff_of

from test_metadata_hook import bug_step, new_builder, vllm_config


def test_attach_and_read_back():
    metadata = SimpleNamespace()
    assert handoff_of(metadata) is None
    step = StepHandoff(StagedRowMetadata(4), host_fresh=1)
    assert attach(metadata, step) is metadata
    assert handoff_of(metadata) is step
    assert vars(metadata) == {handoff.ATTR: step}


@pytest.mark.parametrize("op_guard_owns", [False, True])
def test_the_hook_sets_one_attribute_on_vllms_metadata(monkeypatch, op_guard_owns):
    """Whichever guard owns the group, the built metadata differs from vLLM's own by the hand-off only."""
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    builder = new_builder(vllm_config(configured=True), like_0_26=False, monkeypatch=monkeypatch)
    if op_guard_owns:
        monkeypatch.setattr(metadata_hook.state_of(builder), "owner", step_guard.Owner.OP)
    metadata = builder.build(0, bug_step())
    plain = builder.build.__wrapped__(builder, 0, bug_step())
    assert set(vars(metadata)) - set(vars(plain)) == {handoff.ATTR}
    step = handoff_of(metadata)
    assert (step.host_fresh, step.zeroed_at_build, step.zeroed_by_op) == (1, not op_guard_owns, False)
    assert step.rows.fresh_slots().tolist() == [4] and step.table is None and step.decode is None


def _caches(slots: int = 6):
    import torch

    return [torch.arange(1, slots + 1, dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 3).contiguous() * k
            for k in (1.0, 10.0)]


def _zeroed_slots(caches) -> list[list[int]]:
    return [[s for s in range(c.shape[0]) if not c[s].any()] for c in caches]


def test_zero_cache_by_cache_from_the_staged_rows():
    """Both guards zero through ``StepHandoff.zero``: without a table, each cache in turn, the
    slots of the staged fresh rows and no other (the reference: the slots the host staged)."""
    import torch

    rows = StagedRowMetadata(8, pad_slot_ids=(-1,))
    rows.stage(num_computed_tokens=torch.tensor([5, 0, 0, 3]), query_lens=torch.tensor([1, 1, 0, 1]),
               state_slots=torch.tensor([1, 4, 2, 3]))  # row 2 has no token: not fresh
    caches = _caches()
    assert StepHandoff(rows, host_fresh=1).zero(caches, whole_table=False) == 2
    assert _zeroed_slots(caches) == [[4], [4]]


def test_zero_cache_by_cache_from_vllms_decode_rows():
    """Where the hand-off carries vLLM's decode rows, the new ones are found in them (a row whose
    sequence length equals its query length), not in the staged rows."""
    import torch

    from gdn_pass.vllm.rows import DecodeRows

    rows = StagedRowMetadata(8, pad_slot_ids=(-1,))  # nothing staged
    decode = DecodeRows(slots=torch.tensor([3, 5, 1, 2], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
                        seq_lens=torch.tensor([9, 1, 1, 4], dtype=torch.int32), num_rows=3)  # row 3: not a decode
    caches = _caches()
    assert StepHandoff(rows, host_fresh=1, decode=decode).zero(caches, whole_table=False) == 2
    assert _zeroed_slots(caches) == [[1, 5], [1, 5]]
