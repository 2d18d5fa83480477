"""zero_fresh_state on poisoned caches: fresh slots zeroed, nothing else touched."""

from types import SimpleNamespace

import pytest
import torch

import vllm.forward_context
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm.handoff import StepHandoff, attach
from gdn_pass.vllm.op_guard import GuardError, zero_fresh_state

NUM_SLOTS = 10


def poisoned_layer():
    conv = torch.full((NUM_SLOTS, 3, 8), float("nan"), dtype=torch.bfloat16)
    ssm = torch.full((NUM_SLOTS, 2, 4, 4), 6.0)
    return SimpleNamespace(prefix="model.layers.0.linear_attn", kv_cache=(conv, ssm))


def install_context(monkeypatch, layer, metadata):
    context = SimpleNamespace(
        no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata}
    )
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)


@pytest.mark.parametrize("sentinel", [-1, 0])
def test_only_fresh_slots_are_zeroed(monkeypatch, sentinel):
    layer = poisoned_layer()
    before = [t.clone() for t in layer.kv_cache]
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    # decode on 3, fresh on 5, padding (sentinel), fresh prefill on 9, padding (zero query)
    rows.stage(
        num_computed_tokens=torch.tensor([7, 0, 0, 0, 0]),
        query_lens=torch.tensor([1, 1, 1, 4, 0]),
        state_slots=torch.tensor([3, 5, sentinel, 9, 2]),
    )
    install_context(monkeypatch, layer, attach(SimpleNamespace(), StepHandoff(rows)))
    zero_fresh_state(layer.prefix)
    for cache, old in zip(layer.kv_cache, before):
        assert torch.equal(cache[[5, 9]], torch.zeros_like(cache[[5, 9]]))
        untouched = [s for s in range(NUM_SLOTS) if s not in (5, 9)]
        assert torch.equal(cache[untouched].isnan(), old[untouched].isnan())
        assert torch.equal(cache[untouched].nan_to_num(), old[untouched].nan_to_num())


def test_missing_hook_is_a_clear_error(monkeypatch):
    from gdn_pass.vllm import support

    # An earlier test of this process may have stood the GDN entry down (vLLM 0.31+ on CPU).
    monkeypatch.setattr(support, "_STOOD_DOWN", set())
    layer = poisoned_layer()
    install_context(monkeypatch, layer, SimpleNamespace())
    with pytest.raises(GuardError, match="metadata hook stages rows only in engines whose compilation_config names"):
        zero_fresh_state(layer.prefix)


def test_profiling_run_without_metadata_is_a_no_op(monkeypatch):
    layer = poisoned_layer()
    context = SimpleNamespace(no_compile_layers={layer.prefix: layer}, attn_metadata=None)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    zero_fresh_state(layer.prefix)
    assert layer.kv_cache[1].eq(6.0).all()


def test_first_guarded_layer_of_a_step_zeroes_the_whole_group_once(monkeypatch):
    """With a cache table (CUDA), one launch per step covers every layer that
    shares the metadata; the table kernel itself is tested in tests/gpu."""
    from gdn_pass.vllm import handoff

    layers = [poisoned_layer() for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.prefix = f"model.layers.{i}.linear_attn"
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.tensor([0]), query_lens=torch.tensor([1]),
               state_slots=torch.tensor([5]))
    table = SimpleNamespace(addresses=frozenset(t.data_ptr() for layer in layers[:2] for t in layer.kv_cache))
    calls = []
    monkeypatch.setattr(handoff, "zero_rows_all", lambda *args: calls.append(args))
    metadata = attach(SimpleNamespace(), StepHandoff(rows, table=table))
    context = SimpleNamespace(no_compile_layers={layer.prefix: layer for layer in layers},
                              attn_metadata={layer.prefix: metadata for layer in layers})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    zero_fresh_state(layers[0].prefix)
    zero_fresh_state(layers[1].prefix)
    assert len(calls) == 1 and calls[0][0] is table
    # A layer whose caches are not in the table is zeroed on its own.
    zero_fresh_state(layers[2].prefix)
    assert len(calls) == 1
    assert layers[2].kv_cache[1][5].eq(0).all() and layers[0].kv_cache[1][5].eq(6.0).all()


@pytest.mark.parametrize("capturing", [False, True])
def test_step_the_host_knows_has_no_fresh_row_launches_nothing_outside_capture(monkeypatch, capturing):
    """The metadata hook attaches its host count of fresh rows. With none, an eager
    op guard leaves the caches alone (here even with a fresh flag left set, to see it);
    inside CUDA-graph capture it still zeroes, so the replayed graph covers later steps."""
    from gdn_pass.vllm import op_guard

    layer = poisoned_layer()
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    rows.stage(num_computed_tokens=torch.tensor([0]), query_lens=torch.tensor([1]),
               state_slots=torch.tensor([5]))
    install_context(monkeypatch, layer, attach(SimpleNamespace(), StepHandoff(rows, host_fresh=0)))
    monkeypatch.setattr(op_guard, "_capturing", lambda: capturing)
    zero_fresh_state(layer.prefix)
    assert layer.kv_cache[1][5].eq(0.0 if capturing else 6.0).all()


def test_in_capture_a_shared_hand_off_gives_the_step_its_own(monkeypatch):
    """A builder's hand-off of steps without a new row is one object for all of them. Inside a
    FULL graph's capture the op guard zeroes through the step's own hand-off (``in_capture``),
    attached for the group's other layers, so the shared one is never marked as zeroed: a later
    step's guards would otherwise skip."""
    from gdn_pass.vllm import handoff, op_guard

    layers = [poisoned_layer() for _ in range(2)]
    for i, layer in enumerate(layers):
        layer.prefix = f"model.layers.{i}.linear_attn"
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    table = SimpleNamespace(addresses=frozenset(t.data_ptr() for layer in layers for t in layer.kv_cache))
    made, calls = [], []
    shared = StepHandoff(rows, host_fresh=0, in_capture=lambda md: made.append(md) or StepHandoff(rows, 0, table))
    monkeypatch.setattr(handoff, "zero_rows_all", lambda *args: calls.append(args))
    monkeypatch.setattr(op_guard, "_capturing", lambda: True)
    metadata = attach(SimpleNamespace(), shared)
    context = SimpleNamespace(no_compile_layers={layer.prefix: layer for layer in layers},
                              attn_metadata={layer.prefix: metadata for layer in layers})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for layer in layers:
        zero_fresh_state(layer.prefix)
    own = metadata.gdn_pass_handoff
    assert made == [metadata] and own is not shared and own.zeroed_by_op
    assert len(calls) == 1 and calls[0][0] is table  # one launch for the group, in the capture
    assert not shared.zeroed_by_op and shared.decode is None


def test_a_fresh_row_naming_the_padding_slot_writes_nothing(monkeypatch):
    """``stage_fresh`` takes the host's rows as they are; a fresh row whose slot is
    -1 (vLLM's PAD_SLOT_ID) must not zero the last slot (``cache[-1]``) on CPU."""
    import numpy as np

    layer = poisoned_layer()
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))
    rows.stage_fresh(fresh_rows=np.array([True, True]), state_slots=torch.tensor([-1, 4]))
    install_context(monkeypatch, layer, attach(SimpleNamespace(), StepHandoff(rows)))
    zero_fresh_state(layer.prefix)
    ssm = layer.kv_cache[1]
    assert ssm[4].eq(0).all()
    assert ssm[NUM_SLOTS - 1].eq(6.0).all()


def test_steps_without_speculative_rows_read_the_new_rows_from_vllms_tensors(monkeypatch):
    """With ``rows.DecodeRows`` attached (CUDA steps without speculative rows) the
    staged rows are not read: the group launch gets vLLM's own tensors, and a layer
    outside the table zeroes exactly the new decode rows (``seq_len == query_len``)
    of the first ``num_rows``, its slots a column of a block table."""
    from gdn_pass.vllm import handoff
    from gdn_pass.vllm.rows import DecodeRows

    grouped, alone = poisoned_layer(), poisoned_layer()
    alone.prefix = "model.layers.1.linear_attn"
    rows = StagedRowMetadata(8, pad_slot_ids=(-1, 0))  # never staged: its fresh flags are all False
    # rows: restored decode on 3, new decode on 5, new decode on PAD_SLOT_ID, new prefill on 9
    # (past num_rows), padding on 2
    block_table = torch.tensor([[3, 1], [5, 1], [-1, 1], [9, 1], [2, 1]], dtype=torch.int32)
    decode = DecodeRows(slots=block_table[:, 0], query_start_loc=torch.tensor([0, 1, 2, 3, 7, 7], dtype=torch.int32),
                        seq_lens=torch.tensor([8, 1, 1, 4, 0], dtype=torch.int32), num_rows=3)
    table = SimpleNamespace(addresses=frozenset(t.data_ptr() for t in grouped.kv_cache))
    calls = []
    monkeypatch.setattr(handoff, "zero_new_rows_all", lambda *args: calls.append(args))
    monkeypatch.setattr(handoff, "zero_rows_all", lambda *args: pytest.fail("staged rows read"))
    metadata = attach(SimpleNamespace(), StepHandoff(rows, host_fresh=1, table=table, decode=decode))
    context = SimpleNamespace(no_compile_layers={grouped.prefix: grouped, alone.prefix: alone},
                              attn_metadata={grouped.prefix: metadata, alone.prefix: metadata})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    zero_fresh_state(grouped.prefix)
    assert len(calls) == 1
    assert calls[0][1:] == (decode.slots, decode.query_start_loc, decode.seq_lens, 3, 8)
    zero_fresh_state(alone.prefix)
    for cache in alone.kv_cache:
        assert cache[5].nan_to_num(1.0).eq(0).all()
        untouched = [s for s in range(NUM_SLOTS) if s != 5]
        assert not cache[untouched].nan_to_num(1.0).eq(0).any()
