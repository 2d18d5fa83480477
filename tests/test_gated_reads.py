"""Graph-visible state reads on CPU: the poison oracle over a parametrized grid.

The torch-native GDN layer (examples/torch_gdn.py) is compiled with and
without GDNStatePass; every step is checked against an eager fresh-state
reference (fresh rows), the unguarded graph (rows with history, bitwise) and
the poisoned caches themselves (every slot no real row owns).
"""

import random

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import gdn_pass
from gdn_pass.checker.gdn_runner import GDNRunner, make_batch
from gdn_pass.checker.poison_oracle import check, poison_caches
from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer
from tests.marker_caches import assert_only_slots_changed, behind_a_marker

SMALL = GDNShape(hidden=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)
NUM_SLOTS = 24


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def runners(state_dtype, pad_slot_id, *, masked_load=True, scratch_slot=True):
    layer = TorchGDNLayer(SMALL, seed=1)
    kw = dict(num_slots=NUM_SLOTS, max_batch=8, pad_slot_id=pad_slot_id, state_dtype=state_dtype)
    guarded = GDNRunner(layer, masked_load=masked_load, scratch_slot=scratch_slot, **kw)
    return guarded, GDNRunner(layer, guard=False, **kw)


def random_rows(rng, real, fresh_fraction, pool):
    rows = []
    for _ in range(real):
        fresh = rng.random() < fresh_fraction
        rows.append((pool.alloc(), 0 if fresh else rng.randint(1, 50)))
    return rows


@pytest.mark.parametrize("scratch_slot", [True, False], ids=["scratch", "fold"])
@pytest.mark.parametrize("chunk", [1, 3], ids=["decode", "chunked_prefill"])
@pytest.mark.parametrize("pad_slot_id", [-1, 0], ids=["pad-1", "pad0"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_poison_oracle_grid(state_dtype, pad_slot_id, chunk, scratch_slot):
    guarded, unguarded = runners(state_dtype, pad_slot_id, scratch_slot=scratch_slot)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    checked_fresh = checked_history = 0
    for pad_to in (4, 8):
        for fresh_fraction in (0.0, 0.5, 1.0):
            for num_pad in (0, 2):
                real = pad_to - num_pad
                rows = random_rows(rng, real, fresh_fraction, guarded.pool)
                batch = make_batch(rows, pad_to=pad_to, chunk=chunk, hidden=SMALL.hidden,
                                   pad_slot_id=pad_slot_id, generator=gen)
                caches = (guarded.conv, guarded.ssm)
                poison_caches(caches, batch, generator=gen)
                guarded.stage(batch)
                errors = check(guarded.step_fn, unguarded.step_fn, guarded.layer, caches, batch,
                               scratch_slot=guarded.rows.scratch_slot)
                assert not errors, (pad_to, fresh_fraction, num_pad, errors[:5])
                checked_fresh += len(batch.fresh)
                checked_history += len(batch.history)
                for slot, _ in rows:
                    guarded.pool.free(slot)
    assert checked_fresh > 0 and checked_history > 0
    guarded_reads = [r for r in gdn_pass.reports()[-1].reads if r.action == "guarded_gather"]
    assert len(guarded_reads) == 2
    expected = "scratch slot 0" if scratch_slot else "folded onto the first real row"
    assert all(expected in r.reason for r in guarded_reads)


def test_oracle_fails_without_the_guard():
    """The same oracle run on the unguarded graph must flag fresh rows."""
    guarded, unguarded = runners(torch.float32, -1)
    gen = torch.Generator().manual_seed(1)
    rows = [(guarded.pool.alloc(), 0), (guarded.pool.alloc(), 7)]
    batch = make_batch(rows, pad_to=4, chunk=1, hidden=SMALL.hidden, pad_slot_id=-1, generator=gen)
    caches = (guarded.conv, guarded.ssm)
    poison_caches(caches, batch, generator=gen)
    guarded.stage(batch)
    errors = check(unguarded.step_fn, unguarded.step_fn, guarded.layer, caches, batch)
    assert any("fresh row 0" in e for e in errors)
    # padding rows with sentinel -1 write the last slot without the guard
    assert any(f"slot {NUM_SLOTS - 1} " in e for e in errors)


def test_where_fallback_also_passes_the_oracle():
    guarded, unguarded = runners(torch.float32, -1, masked_load=False)
    gen = torch.Generator().manual_seed(2)
    rows = [(guarded.pool.alloc(), c) for c in (0, 5, 0)]
    batch = make_batch(rows, pad_to=4, chunk=1, hidden=SMALL.hidden, pad_slot_id=-1, generator=gen)
    caches = (guarded.conv, guarded.ssm)
    poison_caches(caches, batch, generator=gen)
    guarded.stage(batch)
    assert check(guarded.step_fn, unguarded.step_fn, guarded.layer, caches, batch, scratch_slot=0) == []
    assert "where after a gather" in gdn_pass.reports()[-1].reads[0].reason


@pytest.mark.parametrize("masked_load", [True, False], ids=["masked_load", "where"])
@pytest.mark.parametrize("scratch_slot", [True, False], ids=["scratch", "fold"])
@pytest.mark.parametrize("pad_slot_id", [-1, 0], ids=["pad-1", "pad0"])
def test_a_batch_of_padding_alone_reads_and_writes_only_slots(pad_slot_id, scratch_slot, masked_load):
    """A batch with no real row (what a CUDA graph's capture and its warm-up run) changes no slot
    but the scratch slot, and reads nothing outside the caches. Each cache is a view one row into
    a larger buffer whose first row holds a marker: a read through the sentinel -1 left unwrapped
    would read it, and a write of it anywhere would show."""
    guarded, _ = runners(torch.float32, pad_slot_id, masked_load=masked_load, scratch_slot=scratch_slot)
    gen = torch.Generator().manual_seed(3)
    caches = behind_a_marker(guarded, ("conv", "ssm"), gen)
    batch = make_batch([], pad_to=4, chunk=1, hidden=SMALL.hidden, pad_slot_id=pad_slot_id, generator=gen)
    guarded.step(batch)
    assert_only_slots_changed(caches, [guarded.rows.scratch_slot])


def kernels(code: str) -> list[str]:
    return [line for line in code.splitlines() if "async_compile.cpp_pybinding" in line]


def test_gate_is_inside_the_existing_kernels():
    # With a scratch slot; without one, folding padding writes onto a real
    # row adds reductions (argmax, any) that Inductor may give kernels of their own.
    guarded, unguarded = runners(torch.float32, -1, scratch_slot=True)
    batch = make_batch([(3, 0), (5, 4)], pad_to=4, chunk=1, hidden=SMALL.hidden, pad_slot_id=-1)
    guarded.stage(batch)
    with torch.no_grad():
        _, (g_code, *_) = run_and_get_code(guarded.step_fn, batch.hidden, guarded.conv, guarded.ssm, batch.slots)
        _, (u_code, *_) = run_and_get_code(unguarded.step_fn, batch.hidden, unguarded.conv, unguarded.ssm, batch.slots)
    assert len(kernels(g_code)) == len(kernels(u_code)) > 0
    # The masked load: the cache is read only under `keep ? load() : 0`.
    assert "_gdn_pass_reads_state" in g_code and "_gdn_pass_valid" in g_code
    assert "? tmp" in g_code and "() : static_cast<decltype(" in g_code
    assert "_gdn_pass" not in u_code


def test_non_state_gathers_are_left_alone():
    class WithGathers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, ids, x, cache, slots):
            emb = self.table[ids]  # parameter gather: never written back
            act = torch.relu(x)[ids]  # gather of an activation
            return emb + act + cache[slots]  # cache read without write-back: not RMW state

    torch.manual_seed(0)
    model = WithGathers()
    args = (torch.tensor([1, 3]), torch.randn(16, 8), torch.randn(4, 8), torch.tensor([0, 2]))
    rows = gdn_pass.StagedRowMetadata(4)
    gdn_pass.clear_reports()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": gdn_pass.GDNStatePass(rows)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args))
    (report,) = gdn_pass.reports()
    assert not report.graph_changed and not report.guarded
    reasons = sorted(r.reason for r in report.reads)
    assert len(reasons) == 3 and all(r.action == "not_state" for r in report.reads)
    assert sum("never written back" in r for r in reasons) == 2
    assert sum("intermediate value" in r for r in reasons) == 1
