"""Full CUDA-graph replay with staged metadata: the poison oracle after every replay.

One graph is captured per batch size; every replay runs a different real
batch size, different fresh rows and recycled slots, padded to the captured
size, with the metadata restaged in place. Both example layers: the
torch-native recurrence and flash-linear-attention's kernels.
"""

import random

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import gdn_pass
from gdn_pass.checker.gdn_runner import GDNRunner, make_batch
from gdn_pass.checker.poison_oracle import check_result, poison_caches
from gdn_pass.checker.torch_gdn import GDNShape, TorchGDNLayer
from tests.marker_caches import assert_only_slots_changed, behind_a_marker

SHAPE = GDNShape(hidden=256, num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
NUM_SLOTS = 1024
CAPTURE_SIZES = (1, 8, 64, 256)
REPLAYS = 50


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 64
    yield
    torch._dynamo.reset()


@pytest.fixture
def same_reduction_configs():
    """History rows are compared bit for bit with a separately compiled unguarded graph. Inductor
    picks among a reduction kernel's configs by timing them at its first launch, so the two graphs
    can sum in different orders (H200, a094925-98a43c2: 1.1e-8 on outputs, 1.2e-7 on states, the
    same figures in every process of one machine, whose autotuning cache they share). Its
    deterministic mode picks without timing."""
    if not hasattr(torch._inductor.config, "deterministic"):
        yield
        return
    with torch._inductor.config.patch(deterministic=True):
        yield


def layer_for(recurrence):
    if recurrence == "fla":
        pytest.importorskip("fla", reason="flash-linear-attention (fla-core) is not installed")
    return TorchGDNLayer(SHAPE, seed=3, recurrence=recurrence).cuda()


@pytest.mark.parametrize(
    "recurrence, pad_slot_id, scratch_slot",
    [("torch", -1, True), ("torch", 0, True), ("torch", -1, False), ("fla", -1, True)],
)
def test_replay_poison_oracle(recurrence, pad_slot_id, scratch_slot, same_reduction_configs):
    layer = layer_for(recurrence)
    runner = GDNRunner(layer, num_slots=NUM_SLOTS, max_batch=max(CAPTURE_SIZES),
                       pad_slot_id=pad_slot_id, device="cuda", scratch_slot=scratch_slot)
    unguarded = torch.compile(layer, dynamic=False)
    # Without a scratch slot, padding writes are folded onto the first real row
    # through two reductions, which changes how Inductor splits the step into
    # Triton kernels; history rows then differ from the unguarded graph by
    # rounding (seen: up to 1.2e-7 on states of magnitude ~1). With a scratch
    # slot the kernels are the unguarded ones and history rows are bitwise equal.
    history_atol = 0.0 if scratch_slot else 1e-6
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    live: list[tuple[int, int]] = []  # (slot, computed tokens) of running requests
    stats = dict(replays=0, fresh=0, history=0, padding=0)
    for size in CAPTURE_SIZES:
        runner.capture(size)
        for _ in range(REPLAYS):
            real = rng.randint(1, size)
            rng.shuffle(live)
            keep = live[: rng.randint(0, min(real, len(live)))]
            for slot, _ in live[len(keep):]:
                runner.pool.free(slot)  # finished: the slot is recycled, not zeroed
            rows = [(s, c) for s, c in keep] + [(runner.pool.alloc(), 0) for _ in range(real - len(keep))]
            batch = make_batch(rows, pad_to=size, chunk=1, hidden=SHAPE.hidden,
                               pad_slot_id=pad_slot_id, generator=gen)
            poison_caches((runner.conv, runner.ssm), batch, generator=gen)
            before = (runner.conv.clone(), runner.ssm.clone())
            out = runner.replay(batch).clone()
            errors = check_result(out, (runner.conv, runner.ssm), unguarded, layer, before, batch,
                                  scratch_slot=runner.rows.scratch_slot, history_atol=history_atol)
            assert not errors, (size, real, errors[:5])
            live = [(s, c + 1) for s, c in rows]
            stats["replays"] += 1
            stats["fresh"] += len(batch.fresh)
            stats["history"] += len(batch.history)
            stats["padding"] += size - real
    print(f"{recurrence} pad={pad_slot_id}: {stats}")
    assert stats["fresh"] and stats["history"] and stats["padding"]


class _WithCaches(torch.nn.Module):
    """The layer with its caches as buffers: static inputs for cudagraph trees."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.conv, self.ssm = (torch.nn.Buffer(c) for c in layer.new_caches(NUM_SLOTS, device="cuda"))

    def forward(self, hidden, slots):
        return self.layer(hidden, self.conv, self.ssm, slots)


@pytest.mark.parametrize("scratch_slot", [False, True], ids=["fold", "scratch"])
def test_capture_reads_and_writes_no_row_outside_the_caches(scratch_slot):
    """A capture compiles, warms up and records a batch of padding alone (sentinel -1). Each cache
    here is a view one row into a larger buffer whose first row holds a marker: a load through the
    sentinel left unwrapped reads it (elsewhere in memory, at times an illegal memory access), and
    its write-back lands it in a slot. Before b533816 the fold (no scratch slot) did both."""
    runner = GDNRunner(layer_for("torch"), num_slots=NUM_SLOTS, max_batch=max(CAPTURE_SIZES),
                       pad_slot_id=-1, device="cuda", scratch_slot=scratch_slot)
    caches = behind_a_marker(runner, ("conv", "ssm"), torch.Generator(device="cuda").manual_seed(5))
    for size in (1, 8):
        runner.capture(size)
    torch.cuda.synchronize()
    assert_only_slots_changed(caches, [runner.rows.scratch_slot])


def test_reduce_overhead_mode(same_reduction_configs):
    layer = layer_for("torch")
    model = _WithCaches(layer)
    rows = gdn_pass.StagedRowMetadata(8, device="cuda", pad_slot_ids=(-1,), scratch_slot=0)
    # mode="reduce-overhead" is these options; torch refuses mode and options together.
    compiled = torch.compile(model, dynamic=False, options={
        "triton.cudagraphs": True, "post_grad_custom_post_pass": gdn_pass.GDNStatePass(rows)})
    # The reference is the same module compiled the same way, without the pass. History rows
    # are held to 1e-6, not bit for bit: on the H200 (790932e, deterministic mode) they
    # differ from this reference by 7.5e-9 on outputs and 1.2e-7 on states, the figures the
    # layer compiled alone gave too, so the pass's rewrite changes how this graph's kernels
    # sum (the poison tests' graphs with a scratch slot stay bitwise equal). A missing guard
    # fails on the fresh rows (poisoned state) and on slots no real row owns, both exact.
    reference = _WithCaches(layer)
    compiled_reference = torch.compile(reference, dynamic=False, options={"triton.cudagraphs": True})

    def unguarded(hidden, conv, ssm, slots):  # check_result's form: caches as arguments, updated in place
        reference.conv.copy_(conv)
        reference.ssm.copy_(ssm)
        out = compiled_reference(hidden, slots).clone()
        conv.copy_(reference.conv)
        ssm.copy_(reference.ssm)
        return out

    gen = torch.Generator().manual_seed(0)
    torch._dynamo.utils.counters.clear()
    for step in range(6):
        batch = make_batch([(10 + step, 0), (200, 3 + step), (300 + step, 0)], pad_to=8, chunk=1,
                           hidden=SHAPE.hidden, pad_slot_id=-1, generator=gen)
        poison_caches((model.conv, model.ssm), batch, generator=gen)
        before = (model.conv.clone(), model.ssm.clone())
        rows.stage(num_computed_tokens=batch.num_computed_tokens, query_lens=batch.query_lens,
                   state_slots=batch.slots)
        with torch.no_grad():
            out = compiled(batch.hidden.cuda(), batch.slots.cuda()).clone()
        errors = check_result(out, (model.conv, model.ssm), unguarded, layer, before, batch, scratch_slot=0,
                              history_atol=1e-6)
        assert not errors, (step, errors[:5])
    assert not torch._dynamo.utils.counters["inductor"].get("cudagraph_skips"), dict(
        torch._dynamo.utils.counters["inductor"])


@pytest.mark.parametrize("recurrence", ["torch", "fla"])
def test_gate_inside_generated_triton_kernels(recurrence):
    layer = layer_for(recurrence)
    guarded = GDNRunner(layer, num_slots=NUM_SLOTS, max_batch=64, device="cuda")
    unguarded = GDNRunner(layer, num_slots=NUM_SLOTS, max_batch=64, device="cuda", guard=False)
    batch = make_batch([(3, 0), (5, 4)], pad_to=64, chunk=1, hidden=SHAPE.hidden, pad_slot_id=-1)
    guarded.stage(batch)
    args = (batch.hidden.cuda(), guarded.conv, guarded.ssm, batch.slots.cuda())
    with torch.no_grad():
        _, g_code = run_and_get_code(guarded.step_fn, *args)
        _, u_code = run_and_get_code(unguarded.step_fn, *args)
    g_code, u_code = "\n".join(g_code), "\n".join(u_code)
    launches = lambda code: code.count(".run(")  # noqa: E731
    assert launches(g_code) == launches(u_code) > 0, (launches(g_code), launches(u_code))
    assert "_gdn_pass_reads_state" in g_code
    report = gdn_pass.reports()[-1]
    guarded_reads = [r for r in report.reads if r.action == "guarded_gather"]
    assert len(guarded_reads) == 2, report.to_text()
    assert all("masked load" in r.reason for r in guarded_reads)
