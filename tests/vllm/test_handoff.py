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


def _decode_handoffs(groups: int, *, own_seq_lens_for: int | None = None, own_starts: bool = False):
    """``groups`` op-guard hand-offs of one step, each with its group's slots and (fake) table;
    group ``own_seq_lens_for`` reads sequence lengths of its own (equal values, another tensor);
    with ``own_starts`` every group has its own copy of the query offsets."""
    import torch

    from gdn_pass.vllm.rows import DecodeRows

    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor([9, 1, 4], dtype=torch.int32)
    made = []
    for g in range(groups):
        own = g == own_seq_lens_for
        decode = DecodeRows(slots=torch.tensor([1, 2, 3], dtype=torch.int32) + g,
                            query_start_loc=starts.clone() if own_starts else starts,
                            seq_lens=seq_lens.clone() if own else seq_lens, num_rows=3)
        made.append(StepHandoff(StagedRowMetadata(8), host_fresh=1, table=SimpleNamespace(group=g), decode=decode))
    return made


def _record_launches(monkeypatch, *, joint_raises: bool = False) -> list:
    launches = []

    def joint(tables, slots, starts, seq_lens, num_rows, max_rows):
        if joint_raises:
            raise RuntimeError("no such kernel")
        launches.append(("joint", [t.group for t in tables], [s.tolist() for s in slots], num_rows, max_rows))
        return 1

    def one(table, slots, starts, seq_lens, num_rows, max_rows):
        launches.append(("one", table.group))

    monkeypatch.setattr(handoff, "zero_new_rows_groups", joint)
    monkeypatch.setattr(handoff, "zero_new_rows_all", one)
    monkeypatch.setattr(handoff, "_joint_launch", [True])
    return launches


def test_a_steps_joined_groups_are_zeroed_in_one_launch(monkeypatch):
    """The builds of one step join one ``JointZeroing``; its zeroing is one launch over every
    group's table, each with its own slots, and marks every hand-off done."""
    launches = _record_launches(monkeypatch)
    monkeypatch.setattr(handoff, "_joining", [lambda: None])
    step = object()
    made = [handoff.join(step, h) for h in _decode_handoffs(3)]
    joint = made[0].joint
    assert all(h.joint is joint for h in made) and joint.handoffs == made
    before = handoff.joint_activity()
    assert joint.zero() == 1
    after = handoff.joint_activity()
    assert {k: after[k] - before[k] for k in after} == {"steps": 1, "groups": 3, "launches": 1}
    assert launches == [("joint", [0, 1, 2], [[1, 2, 3], [2, 3, 4], [3, 4, 5]], 3, 8)]
    assert joint.done and all(h.zeroed_by_op for h in made)
    later = handoff.join(object(), _decode_handoffs(1)[0])  # the next step: a joint of its own
    assert later.joint is not joint and later.joint.handoffs == [later]


def test_a_group_with_sequence_lengths_of_its_own_gets_a_launch_of_its_own(monkeypatch):
    """The scheduler's ``seq_lens`` is one tensor for every group of a step: a group with another
    one is not known to read the step's rows, and is zeroed alone."""
    launches = _record_launches(monkeypatch)
    joint = handoff.JointZeroing(object(), _decode_handoffs(3, own_seq_lens_for=1))
    assert joint.zero() == 2
    assert launches == [("joint", [0, 2], [[1, 2, 3], [3, 4, 5]], 3, 8), ("one", 1)]


def test_groups_with_copies_of_the_query_offsets_still_share_one_launch(monkeypatch):
    """Where FULL CUDA graphs can replay, vLLM's GDN builder copies a decode step's query offsets
    into a buffer of its own, one per group (vLLM 0.26 on an H100: one launch per group in every
    FULL-capable mode). The values are the step's: the groups still share one launch."""
    launches = _record_launches(monkeypatch)
    assert handoff.JointZeroing(object(), _decode_handoffs(3, own_starts=True)).zero() == 1
    assert launches == [("joint", [0, 1, 2], [[1, 2, 3], [2, 3, 4], [3, 4, 5]], 3, 8)]


def test_a_joint_launch_that_raises_falls_back_to_a_launch_per_group(monkeypatch, caplog):
    """The joint launch runs inside the step: an error there (a kernel this Triton cannot compile)
    must not reach vLLM. Every group is zeroed by a launch of its own, then and from then on."""
    import logging

    launches = _record_launches(monkeypatch, joint_raises=True)
    with caplog.at_level(logging.WARNING, logger="gdn_pass"):
        assert handoff.JointZeroing(object(), _decode_handoffs(3)).zero() == 3
    assert launches == [("one", 0), ("one", 1), ("one", 2)]
    assert "zeroing group by group from now on" in caplog.text
    assert handoff._joint_launch == [False]
    launches.clear()
    handoff.JointZeroing(object(), _decode_handoffs(2)).zero()
    assert launches == [("one", 0), ("one", 1)]


def test_the_joint_of_a_step_lives_only_as_long_as_its_hand_offs(monkeypatch):
    """The hook keeps the step being joined by a weak reference: once vLLM drops the step's
    metadata (and with it the hand-offs), nothing of gdn-pass holds the groups' tables (and so
    the engine's caches)."""
    import gc

    monkeypatch.setattr(handoff, "_joining", [lambda: None])
    made = [handoff.join("step", h) for h in _decode_handoffs(2)]
    assert handoff._joining[0]() is made[0].joint
    del made
    gc.collect()
    assert handoff._joining[0]() is None
