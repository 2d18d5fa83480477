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
