"""Deferred builds: where the op guard owns a group on CUDA, in an engine that replays FULL CUDA
graphs, a build only attaches the builder's deferred hand-off, and the step's first guarded op
makes the step's rows, for every group at once; a replayed step reads no row on the host.

The scenario of ``test_step_guard`` (real GDN builders, wrapped by the metadata hook, over poisoned
caches in the static forward context), one step later: the first build of each builder decides its
owner, and from the next step on its builds are deferred. Each case checks on poisoned caches that
the new row's slot is zeroed exactly once and nothing else, and what the host did or did not read.
Deferral needs a CUDA cache table: the cases run on the CUDA path (Triton's interpreter, a table of
the CPU caches, one launch for every group); on CPU, where every step runs its guarded ops, every
build is checked as before.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import vllm.forward_context
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import handoff, metadata_hook, op_guard, rows
from gdn_pass.vllm.builders.state_builder import StateBuilder
from gdn_pass.vllm.handoff import ATTR, handoff_of
from gdn_pass.vllm.step_guard import Owner

from cuda_zeroing import on_the_cuda_path, run_module_on_the_cuda_path
from test_metadata_hook import bug_step, common_metadata
from test_step_guard import FRESH_SLOT, NUM_SLOTS, caches_of, engine, guarded, warm_up, zero_calls  # noqa: F401

GROUPS = [[f"model.layers.{3 * g + i}.linear_attn" for i in range(3)] for g in range(3)]

needs_a_table = pytest.mark.skipif(not on_the_cuda_path(), reason="deferral needs a CUDA cache table: CPU "
                                   "engines run every step's guarded ops and check each build (the last test)")


KEEPS_DECODES = ("this release's GDN builder reroutes fresh rows itself (0.31+): where gdn-pass acts on it, "
                 "it keeps one-token steps on the decode path, and such builds are never deferred "
                 "(metadata_hook._why_not_deferred)")


def skip_where_builds_keep_decodes(built) -> None:
    if any(metadata_hook.state_of(builder).keeps_decodes for builder, _ in built):
        pytest.skip(KEEPS_DECODES)


def three_groups(monkeypatch, full_graphs: bool = True, deferring: bool = True):
    """Three configured builders (one per group of three poisoned layers) whose owner, the op
    guard, was decided at a first step; the layers, poisoned again. ``deferring``: the case needs
    builds that can be deferred (skipped where this release's cannot)."""
    built = [engine(monkeypatch, compiled=True, layer_names=names, full_graphs=full_graphs) for names in GROUPS]
    if deferring:
        skip_where_builds_keep_decodes(built)
    layers = {name: layer for _, group_layers in built for name, layer in group_layers.items()}
    warm_up(monkeypatch, layers, covered=list(layers))
    forward(monkeypatch, layers, build_step(built))  # the owners' first builds: never deferred
    for builder, _ in built:
        assert metadata_hook.state_of(builder).owner is Owner.OP
    poison(layers)
    return built, layers


def build_step(built, step=None) -> dict:
    """One step's builds, group after group (group g's rows on blocks 3+g, 4+g, 5+g): layer -> metadata."""
    step = bug_step() if step is None else step
    metadata = {}
    for g, (builder, group_layers) in enumerate(built):
        common = dataclasses.replace(step, block_table_tensor=step.block_table_tensor + g)
        built_metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
        metadata.update({name: built_metadata for name in group_layers})
    return metadata


def forward(monkeypatch, layers, metadata, covered=None):
    context = SimpleNamespace(no_compile_layers=layers, attn_metadata=metadata)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for name in layers if covered is None else covered:
        op_guard.zero_fresh_state(name)


def poison(layers):
    for layer in layers.values():
        layer.kv_cache[0].fill_(float("nan"))
        layer.kv_cache[1].fill_(6.0)


def deferred(metadata) -> bool:
    """Whether the hand-off on ``metadata`` is still a deferred build's (read without resolving it)."""
    attached = getattr(metadata, ATTR, None)
    return attached is not None and attached.resolve is not None


def no_rows_read(monkeypatch, built):
    """Fail where the hook reads a step's rows (its step check, or any row of its own)."""
    entry = metadata_hook.state_of(built[0][0]).entry
    monkeypatch.setattr(metadata_hook, "has_new_rows", lambda common: pytest.fail("the step's rows read at build"))
    monkeypatch.setitem(entry.__dict__, "rows", lambda *a: pytest.fail("the step's rows read at build"))


def assert_new_rows_zeroed(layers):
    for g, names in enumerate(GROUPS):
        for name in names:
            for cache in layers[name].kv_cache:
                assert cache[FRESH_SLOT + g].eq(0).all(), f"group {g}'s new row's slot not zeroed"
                others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT + g]
                assert (cache[others].isnan() | cache[others].eq(6.0)).all(), f"group {g}: another slot changed"


def assert_checked_at_build_and_zeroed(monkeypatch, built, layers, step=None) -> None:
    """One step's builds, none deferred: each counts the step's new row at build (one per group),
    and the forward then zeroes every group's new-row slot and nothing else."""
    metadata = build_step(built, step)
    assert not any(deferred(md) for md in metadata.values()), "a build deferred"
    assert all(handoff_of(md).host_fresh == 1 for md in metadata.values())
    forward(monkeypatch, layers, metadata)
    assert_new_rows_zeroed(layers)


@needs_a_table
def test_builds_read_no_rows_and_the_first_guarded_op_zeroes_every_group(monkeypatch, guarded, zero_calls):
    built, layers = three_groups(monkeypatch)
    joint_launches = []
    if on_the_cuda_path():
        original = handoff.zero_new_rows_groups
        monkeypatch.setattr(handoff, "zero_new_rows_groups",
                            lambda tables, *a: joint_launches.append(len(tables)) or original(tables, *a))
    zero_calls.clear()
    with monkeypatch.context() as during_builds:
        no_rows_read(during_builds, built)
        metadata = build_step(built)
    assert all(deferred(md) for md in metadata.values())
    forward(monkeypatch, layers, metadata, covered=GROUPS[0][:1])  # the step's first guarded op
    assert not any(deferred(md) for md in metadata.values()), "a group's deferred build left unresolved"
    forward(monkeypatch, layers, metadata, covered=[name for name in layers if name != GROUPS[0][0]])  # the rest
    assert_new_rows_zeroed(layers)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "a cache zeroed twice or never"
    if on_the_cuda_path():
        assert joint_launches == [3], "not one launch for the step's three groups"


@needs_a_table
def test_inference_host_tensors_still_give_the_step_one_launch(monkeypatch, guarded, zero_calls):
    """vLLM 0.34's V2 runner makes its host tensors under ``inference_mode``: they keep no version
    counter, so each build gets the step's rows of its own (``rows.scheduler_rows``) and no build
    can tell that another's step is its own. The deferred builds the step's first guarded op
    resolves are one step's all the same: one launch for the three groups (at 7a3255f, one per
    group: 5 launches a step for 12-layer Bailing on the H100, ``hook_host_time.md``)."""
    monkeypatch.setattr(rows, "_inference_host", [False])
    built, layers = three_groups(monkeypatch)
    joint_launches = []
    original = handoff.zero_new_rows_groups
    monkeypatch.setattr(handoff, "zero_new_rows_groups",
                        lambda tables, *a: joint_launches.append(len(tables)) or original(tables, *a))
    with torch.inference_mode():
        step = bug_step()
    assert step.query_start_loc_cpu.is_inference()
    zero_calls.clear()
    metadata = build_step(built, step)
    assert all(deferred(md) for md in metadata.values())
    row_reads = []
    real_computed = rows.num_computed_tokens
    with monkeypatch.context() as during_forward:
        # The step's rows are made once for its three groups (rows.one_step), and no builder's own
        # rows at all: the launch finds the new rows in vLLM's tensors (_resolve_on_device).
        during_forward.setattr(rows, "num_computed_tokens", lambda *a: row_reads.append(1) or real_computed(*a))
        during_forward.setattr(StateBuilder, "stage_step", lambda *a, **k: pytest.fail("the builder's own rows read"))
        forward(monkeypatch, layers, metadata)
    assert len(row_reads) == 1, f"the step's rows read {len(row_reads)} times for three groups"
    assert_new_rows_zeroed(layers)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "a cache zeroed twice or never"
    assert joint_launches == [3], "not one launch for the step's three groups"


@needs_a_table
@pytest.mark.parametrize("pad_to", [None, 8], ids=["unpadded", "full_graph_padding"])
def test_a_step_with_several_new_rows_counts_them_from_the_steps_rows(monkeypatch, guarded, zero_calls, pad_to):
    """Three new rows among five decodes (and a FULL graph's padding rows, no token, length 0): each
    group's hand-off counts the three (the reference: the test's own computed counts), and the
    forward zeroes their slots in every group, and no other slot."""
    built, layers = three_groups(monkeypatch)
    computed = [0, 9, 0, 30, 0]
    blocks = [1, 2, 3, 4, 5]
    common = common_metadata(computed, [1] * 5, pad_to=pad_to)
    table = blocks + [0] * (common.num_reqs - len(blocks))
    step = dataclasses.replace(common, block_table_tensor=torch.tensor([[b] for b in table], dtype=torch.int32))
    zero_calls.clear()
    metadata = build_step(built, step)
    assert all(deferred(md) for md in metadata.values())
    forward(monkeypatch, layers, metadata)
    expected_fresh = sum(c == 0 for c in computed)
    assert [handoff_of(md).host_fresh for md in metadata.values()] == [expected_fresh] * len(metadata)
    new_blocks = [b for b, c in zip(blocks, computed) if c == 0]
    for g, names in enumerate(GROUPS):
        zeroed_slots = [b + g for b in new_blocks]
        for name in names:
            for cache in layers[name].kv_cache:
                assert cache[zeroed_slots].eq(0).all(), f"group {g}: a new row's slot not zeroed"
                others = [s for s in range(NUM_SLOTS) if s not in zeroed_slots]
                assert (cache[others].isnan() | cache[others].eq(6.0)).all(), f"group {g}: another slot changed"


@needs_a_table
def test_the_wrapper_of_builds_own_parameters_defers_by_itself(monkeypatch, guarded, zero_calls):
    """A deferred build is the whole of a replayed step's host work: the wrapper with ``build``'s own
    parameters defers it without the generic wrapper or ``_guard_step`` (the cases above and below
    check that what it does is right)."""
    built, layers = three_groups(monkeypatch)
    with monkeypatch.context() as during_builds:
        during_builds.setattr(metadata_hook, "_guard_step", lambda *a: pytest.fail("_guard_step called"))
        metadata = build_step(built)
    assert all(deferred(md) for md in metadata.values())


@needs_a_table
def test_a_step_whose_forward_runs_no_guarded_op_reads_no_rows(monkeypatch, guarded, zero_calls):
    """A FULL CUDA graph's replay runs no guarded op's Python: such steps cost the host their builds'
    wrappers only, and leave nothing behind for the next step."""
    built, layers = three_groups(monkeypatch)
    zero_calls.clear()
    with monkeypatch.context() as during_builds:
        no_rows_read(during_builds, built)
        for _ in range(3):
            replayed = build_step(built)
        assert len(handoff._deferred) == len(built), "builds of earlier steps still noted"
    assert not zero_calls
    metadata = build_step(built)  # the next step runs its guarded ops: its rows, not a replayed step's
    forward(monkeypatch, layers, metadata)
    assert_new_rows_zeroed(layers)
    assert all(deferred(md) for md in replayed.values()), "a replayed step's rows were made"


@needs_a_table
def test_a_step_without_new_rows_launches_nothing(monkeypatch, guarded, zero_calls):
    built, layers = three_groups(monkeypatch)
    zero_calls.clear()
    decodes = dataclasses.replace(common_metadata([9, 2, 30], [1, 1, 1]),
                                  block_table_tensor=torch.tensor([[3], [4], [5]], dtype=torch.int32))
    metadata = build_step(built, decodes)
    assert all(deferred(md) for md in metadata.values())
    forward(monkeypatch, layers, metadata)
    assert not zero_calls
    assert all(handoff_of(md).host_fresh == 0 for md in metadata.values())


@needs_a_table
def test_a_deferred_build_resolved_inside_a_capture_stages_nothing(monkeypatch, guarded, zero_calls):
    """Inside a FULL CUDA graph's capture the launch is recorded, not run, and a copy to the staged
    buffers would be recorded too: the deferred builds resolve to the capture's hand-off, which reads
    vLLM's own tensors, and the builds after it stay deferred."""
    built, layers = three_groups(monkeypatch)
    metadata = build_step(built)
    assert all(deferred(md) for md in metadata.values())
    with monkeypatch.context() as capture:
        capture.setattr(op_guard, "_capturing", lambda: True)
        capture.setattr(StagedRowMetadata, "stage_fresh", lambda *a, **k: pytest.fail("rows staged inside a capture"))
        capture.setattr(StagedRowMetadata, "stage_no_fresh", lambda *a, **k: pytest.fail("rows staged inside a capture"))
        forward(monkeypatch, layers, metadata)
    for md in metadata.values():
        attached = getattr(md, ATTR)
        assert attached.resolve is None and attached.decode is not None, "not the capture's hand-off"
    assert not handoff.captured_staged_rows()
    assert all(deferred(md) for md in build_step(built).values())


@needs_a_table
def test_a_deferred_build_after_vllm_binds_new_caches_captures_the_new_ones(monkeypatch, guarded, zero_calls):
    """vLLM binds each layer's caches anew after its profiling run: a deferred build reads no row,
    but makes the group's table again, outside the capture, so that a capture resolving the build
    zeroes the caches the model reads, not the ones it dropped."""
    built, layers = three_groups(monkeypatch)
    dropped = {name: layer.kv_cache for name, layer in layers.items()}
    for layer in layers.values():
        layer.kv_cache = [cache.clone() for cache in layer.kv_cache]
    poison(layers)
    metadata = build_step(built)
    assert all(deferred(md) for md in metadata.values())
    with monkeypatch.context() as capture:
        capture.setattr(op_guard, "_capturing", lambda: True)
        forward(monkeypatch, layers, metadata)
    assert_new_rows_zeroed(layers)
    assert not any(cache.eq(0).any() for caches in dropped.values() for cache in caches), "a dropped cache zeroed"


@needs_a_table
def test_after_a_capture_through_staged_rows_every_build_checks_its_step(monkeypatch, guarded, zero_calls):
    """A FULL CUDA graph whose captured launch reads the staged rows (the entry cannot read the
    step's new rows in vLLM's tensors) replays with whatever the last build staged: the capture
    stages nothing itself, and from it on no build may be deferred."""
    built, layers = three_groups(monkeypatch)
    metadata = build_step(built)
    entry = metadata_hook.state_of(built[0][0]).entry
    staged_launches = []
    with monkeypatch.context() as capture:
        capture.setattr(op_guard, "_capturing", lambda: True)
        capture.setitem(entry.__dict__, "decode_rows", lambda *a: None)
        capture.setattr(handoff, "zero_rows_all", lambda *a: staged_launches.append(a))  # recorded, not run
        # the launch may read the staged rows, but a copy to them would be recorded with it
        capture.setattr(StagedRowMetadata, "stage_fresh", lambda *a, **k: pytest.fail("rows staged inside a capture"))
        forward(monkeypatch, layers, metadata)
    assert staged_launches and handoff.captured_staged_rows()
    poison(layers)
    zero_calls.clear()
    assert_checked_at_build_and_zeroed(monkeypatch, built, layers)


@needs_a_table
def test_a_capture_build_checks_its_step(monkeypatch, guarded, zero_calls):
    """vLLM's builds for a FULL graph's capture (``build_for_cudagraph_capture``, inputs by position)
    happen outside the capture, and the graph then records whatever they staged: checked at build."""
    built, layers = three_groups(monkeypatch)
    for builder, _ in built:
        assert not deferred(builder.build_for_cudagraph_capture(bug_step()))


@needs_a_table
def test_a_step_with_a_prompt_row_checks_its_step_at_build(monkeypatch, guarded, zero_calls):
    """vLLM's runners replay FULL graphs for decode steps only: a step with a prompt row runs its
    guarded ops, and its builds check it as before (deferring would only move the check into them)."""
    built, layers = three_groups(monkeypatch)
    zero_calls.clear()
    step = dataclasses.replace(common_metadata([9, 0, 30, 0], [1, 1, 1, 5]),
                               block_table_tensor=torch.tensor([[3], [4], [5], [6]], dtype=torch.int32))
    assert_checked_at_build_and_zeroed(monkeypatch, built, layers, step)


def test_where_no_full_graph_replays_every_build_checks_its_step(monkeypatch, guarded, zero_calls):
    """Where every step runs its guarded ops, deferring would only add to them: on CPU (no cache
    table), and on CUDA in an engine that captures no FULL graph, each build checks its step, and
    the report says why."""
    monkeypatch.setattr(handoff, "_NOT_DEFERRED", {})
    built, layers = three_groups(monkeypatch, full_graphs=not on_the_cuda_path(), deferring=False)
    zero_calls.clear()
    before = handoff.deferral_activity()
    assert_checked_at_build_and_zeroed(monkeypatch, built, layers)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "a cache zeroed twice or never"
    report = handoff.deferral_activity()
    assert report["deferred_builds"] == before["deferred_builds"]
    key = metadata_hook.state_of(built[0][0]).entry.key
    expected = "captures no FULL CUDA graph" if on_the_cuda_path() else "no CUDA cache table"
    assert expected in report["not_deferred"][key], report["not_deferred"]


@needs_a_table
def test_deferred_builds_are_counted_and_no_reason_is_reported(monkeypatch, guarded, zero_calls):
    """The report an engine run carries (``handoff.deferral_activity``): every deferred build counted,
    no reason against deferral for a group that defers, no capture through staged rows."""
    monkeypatch.setattr(handoff, "_NOT_DEFERRED", {})
    built, layers = three_groups(monkeypatch)
    before = handoff.deferral_activity()
    metadata = build_step(built)
    forward(monkeypatch, layers, metadata)
    report = handoff.deferral_activity()
    assert report["deferred_builds"] - before["deferred_builds"] == len(built)
    assert report["resolved_steps"] - before["resolved_steps"] == 1
    assert report["not_deferred"] == {} and report["staged_capture"] is False


def test_every_case_again_on_the_cuda_zeroing_path(monkeypatch, guarded):
    skip_where_builds_keep_decodes([engine(monkeypatch, compiled=True, layer_names=GROUPS[0], full_graphs=True)])
    run_module_on_the_cuda_path(__file__, "test_every_case_again_on_the_cuda_zeroing_path", expected_passed=14)
