"""The step guard: fresh slots zeroed at metadata build where no op guard covers the group.

A real GDN builder, wrapped by the metadata hook, serves three layers whose
poisoned caches sit in the static forward context. Each case says which guard
owns the group (eager engine, compiled with every layer behind a guarded op,
compiled with a layer no guarded op reaches) and checks, on poisoned caches, that
every fresh slot is zeroed exactly once per step, by exactly one guard, and
nothing else is touched. Every case runs again on the CUDA path (one launch per
group, or per step where the op guard owns several groups; the fresh rows found in
vLLM's device tensors), in Triton's interpreter.
"""

from types import SimpleNamespace

import pytest
import torch

import vllm.forward_context
from gdn_pass.vllm import metadata_hook, op_guard, step_guard
from gdn_pass.vllm.handoff import handoff_of
from gdn_pass.vllm.step_guard import Owner

from cuda_zeroing import on_the_cuda_path, run_module_on_the_cuda_path, take_the_cuda_path, zeroing_guard
from test_metadata_hook import bug_step, common_metadata

LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]
NUM_SLOTS = 8
FRESH_SLOT = 4  # bug_step(): rows on blocks 3, 4, 5; row 1 is brand new


def poisoned_layer(prefix):
    conv = torch.full((NUM_SLOTS, 3, 8), float("nan"), dtype=torch.bfloat16)
    ssm = torch.full((NUM_SLOTS, 2, 4, 4), 6.0)
    return SimpleNamespace(prefix=prefix, kv_cache=[conv, ssm])


@pytest.fixture
def guarded(monkeypatch):
    """A fresh registry of layers whose guarded op ran, in this test only."""
    registry: set[str] = set()
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", registry)
    return registry


@pytest.fixture
def zero_calls(monkeypatch):
    """Every zeroing call, from either guard: (who, cache address). On the CUDA path (the
    interpreter run, ``tests/vllm/cuda_zeroing.py``) each cache one device-row launch covers."""
    calls = []
    if on_the_cuda_path():
        take_the_cuda_path(monkeypatch, calls)
        return calls
    from gdn_pass.vllm import handoff

    who = zeroing_guard(monkeypatch)
    original = handoff.zero_rows

    def counted(cache, slot, fresh):
        calls.append((who[0], cache.data_ptr()))
        return original(cache, slot, fresh)

    monkeypatch.setattr(handoff, "zero_rows", counted)
    return calls


def engine(monkeypatch, *, compiled: bool, new_layer=poisoned_layer, layer_names=LAYERS, full_graphs: bool = False):
    """A configured GDN builder over poisoned layers, and the layers. On releases where vLLM
    reroutes fresh rows itself (0.31+) the GDN entry stands down on CPU; the guards are tested as
    in an engine where it acts (vLLM's V1 runner with FULL CUDA graphs, ``support.reroute_holds``).
    ``full_graphs``: the builder made as where FULL CUDA graphs can replay (it then copies a
    decode step's rows into persistent buffers of its own)."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import VllmGDNStatePass, metadata_hook, support
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    monkeypatch.setattr(support, "reroute_holds", lambda vllm_config: None)

    monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend",
                        lambda cfg: ("triton", "triton"), raising=False)
    metadata_hook.install()
    cc = CompilationConfig(mode=3 if compiled else 0,
                           inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()})
    config = VllmConfig(compilation_config=cc, additional_config={"gdn_prefill_backend": "triton"})
    if full_graphs:  # set after VllmConfig, which turns CUDA graphs off on a CPU platform
        from vllm.config import CUDAGraphMode

        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    layers = {name: new_layer(name) for name in layer_names}
    config.compilation_config.static_forward_context.update(layers)
    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))
    builder = GDNAttentionMetadataBuilder(spec, list(layer_names), config, torch.device("cpu"))
    return builder, layers


def forward(monkeypatch, layers, metadata, covered):
    """The model's forward: a guarded op runs for each layer in ``covered``."""
    context = SimpleNamespace(no_compile_layers=layers, attn_metadata={n: metadata for n in layers})
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for name in covered:
        op_guard.zero_fresh_state(name)


def warm_up(monkeypatch, layers, covered):
    """vLLM's profiling / warm-up forward: no metadata, the op guards only note their layer."""
    context = SimpleNamespace(no_compile_layers=layers, attn_metadata=None)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for name in covered:
        op_guard.zero_fresh_state(name)


def assert_only_fresh_slot_zeroed(layers):
    for layer in layers.values():
        for cache in layer.kv_cache:
            assert cache[FRESH_SLOT].eq(0).all()
            others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT]
            assert (cache[others].isnan() | cache[others].eq(6.0)).all(), "a non-fresh slot changed"


def caches_of(layers):
    return sorted(t.data_ptr() for layer in layers.values() for t in layer.kv_cache)


def test_eager_engine_zeroes_at_build_once_per_cache(monkeypatch, guarded, zero_calls):
    builder, layers = engine(monkeypatch, compiled=False)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    assert metadata_hook.state_of(builder).owner is Owner.STEP
    assert handoff_of(metadata).zeroed_at_build
    assert_only_fresh_slot_zeroed(layers)  # before any layer runs
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers)
    assert {who for who, _ in zero_calls} == {"step"}


def test_compiled_engine_with_every_layer_behind_a_guarded_op_leaves_it_to_the_op_guard(
        monkeypatch, guarded, zero_calls):
    builder, layers = engine(monkeypatch, compiled=True)
    warm_up(monkeypatch, layers, covered=LAYERS)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    assert metadata_hook.state_of(builder).owner is Owner.OP
    assert not zero_calls, "the step guard acted although the op guard owns the group"
    assert layers[LAYERS[0]].kv_cache[1][FRESH_SLOT].eq(6.0).all()
    forward(monkeypatch, layers, metadata, covered=LAYERS)
    assert_only_fresh_slot_zeroed(layers)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers)
    assert {who for who, _ in zero_calls} == {"op"}


@pytest.mark.parametrize("full_graphs", [False, True], ids=["piecewise", "full_graphs"])
def test_compiled_engine_zeroes_every_group_of_a_step_in_one_launch(monkeypatch, guarded, zero_calls, full_graphs):
    """A 48-layer Qwen3-Next has three groups of GDN layers, one builder each, built one after
    another for every step (a shallow copy of the step's metadata with the group's own block
    table) before the forward. On the CUDA path the first guarded op of the step zeroes the new
    row's slot of every group (each group's own block) in one launch; the other ops skip. Also
    where FULL graphs can replay and each builder copies the step's query offsets into a buffer
    of its own (vLLM's default mode on CUDA)."""
    import dataclasses

    from gdn_pass.vllm import handoff

    groups = [[f"model.layers.{3 * g + i}.linear_attn" for i in range(3)] for g in range(3)]
    built = [engine(monkeypatch, compiled=True, layer_names=names, full_graphs=full_graphs) for names in groups]
    layers = {name: layer for _, group_layers in built for name, layer in group_layers.items()}
    warm_up(monkeypatch, layers, covered=list(layers))
    joint_launches = []
    if on_the_cuda_path():
        original = handoff.zero_new_rows_groups
        monkeypatch.setattr(handoff, "zero_new_rows_groups",
                            lambda tables, *a: joint_launches.append(len(tables)) or original(tables, *a))
    step = bug_step()
    metadata = {}
    for g, (builder, group_layers) in enumerate(built):  # group g's rows own blocks 3+g, 4+g, 5+g
        common = dataclasses.replace(step, block_table_tensor=step.block_table_tensor + g)
        built_metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
        assert metadata_hook.state_of(builder).owner is Owner.OP
        # the builder's own offsets where FULL graphs can replay, the step's otherwise
        own_starts = built_metadata.non_spec_query_start_loc.data_ptr() != common.query_start_loc.data_ptr()
        assert own_starts == full_graphs, (full_graphs, builder.use_full_cuda_graph)
        metadata.update({name: built_metadata for name in group_layers})
    assert not zero_calls, "zeroed before the forward although the op guard owns every group"
    context = SimpleNamespace(no_compile_layers=layers, attn_metadata=metadata)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for name in layers:
        op_guard.zero_fresh_state(name)
    for g, (_, group_layers) in enumerate(built):
        for layer in group_layers.values():
            for cache in layer.kv_cache:
                assert cache[FRESH_SLOT + g].eq(0).all(), f"group {g}'s new row's slot not zeroed"
                others = [s for s in range(NUM_SLOTS) if s != FRESH_SLOT + g]
                assert (cache[others].isnan() | cache[others].eq(6.0)).all(), f"group {g}: another slot changed"
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "a cache zeroed twice or never"
    assert {who for who, _ in zero_calls} == {"op"}
    if on_the_cuda_path():
        assert joint_launches == [3], "not one launch for the step's three groups"


def test_compiled_engine_with_a_layer_no_guarded_op_reaches_is_guarded_at_build(
        monkeypatch, guarded, zero_calls):
    """Kimi-Linear's layout in vLLM 0.27+: one layer reads its state in plain Python."""
    builder, layers = engine(monkeypatch, compiled=True)
    warm_up(monkeypatch, layers, covered=LAYERS[:2])
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    assert metadata_hook.state_of(builder).owner is Owner.STEP
    forward(monkeypatch, layers, metadata, covered=LAYERS[:2])  # the op guards find it done
    assert_only_fresh_slot_zeroed(layers)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "a slot zeroed twice or never"
    assert {who for who, _ in zero_calls} == {"step"}


@pytest.mark.parametrize("by_the_pass", [True, False])
def test_a_split_engine_without_the_plugin_says_why_the_step_guard_owns_it(
        monkeypatch, guarded, zero_calls, caplog, by_the_pass):
    """An engine that split its graph before the plugin's hooks were installed (its entry point not
    loaded; the pass installed them from inside a compile, ``test_piecewise``) calls the split-out
    ops unguarded: no guarded op runs, so the step guard owns every group and zeroes at build, and
    the first build says why, with what to do. Where the hooks came first, a layer no guarded op
    reached is a layout (Kimi-Linear's): no warning."""
    from vllm.config import CompilationMode

    from gdn_pass.vllm import piecewise

    monkeypatch.setattr(piecewise, "_AFTER_A_SPLIT", [by_the_pass])
    monkeypatch.setattr(metadata_hook, "_warned", set())
    builder, layers = engine(monkeypatch, compiled=True)
    cc = metadata_hook.state_of(builder).context.vllm_config.compilation_config
    cc.mode, cc.splitting_ops = CompilationMode.VLLM_COMPILE, ["vllm::gdn_attention_core"]  # piecewise
    warm_up(monkeypatch, layers, covered=[])  # the split-out ops: unguarded, nothing noted
    with caplog.at_level("WARNING", logger="gdn_pass"):
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    assert metadata_hook.state_of(builder).owner is Owner.STEP
    said = [r.getMessage() for r in caplog.records if "was not loaded before this engine split" in r.getMessage()]
    assert len(said) == by_the_pass and all("VLLM_PLUGINS" in m and "step guard" in m for m in said)
    forward(monkeypatch, layers, metadata, covered=[])
    assert_only_fresh_slot_zeroed(layers)
    assert {who for who, _ in zero_calls} == {"step"}


def test_step_without_fresh_rows_launches_nothing(monkeypatch, guarded, zero_calls):
    builder, layers = engine(monkeypatch, compiled=False)
    decodes = common_metadata([9, 4, 30], [1, 1, 1])
    import dataclasses

    decodes = dataclasses.replace(decodes, block_table_tensor=torch.tensor([[3], [4], [5]], dtype=torch.int32))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=decodes)
    assert handoff_of(metadata).zeroed_at_build
    assert not zero_calls
    assert layers[LAYERS[0]].kv_cache[1].eq(6.0).all()


def test_a_step_without_new_rows_reads_no_rows_and_a_capture_on_it_still_launches(
        monkeypatch, guarded, zero_calls):
    """Most steps have no new row: the hook then reads no row of its own (the entry's ``rows``
    is not called) and hands over ``host_fresh == 0``, so the op guards launch nothing. A FULL
    CUDA graph captured on such a step must still contain the launch, reading the same
    tensors as on any other step (on the CUDA path vLLM's decode rows, found only then), and
    the flags a previous step staged must be clear, or a replay would zero a live slot."""
    import dataclasses

    builder, layers = engine(monkeypatch, compiled=True)
    warm_up(monkeypatch, layers, covered=LAYERS)
    forward(monkeypatch, layers, builder.build(common_prefix_len=0, common_attn_metadata=bug_step()),
            covered=LAYERS)
    assert_only_fresh_slot_zeroed(layers)
    for layer in layers.values():  # the next owners' state, live: nothing may zero it now
        for cache in layer.kv_cache:
            cache.fill_(6.0)
    zero_calls.clear()
    entry = metadata_hook.state_of(builder).entry
    monkeypatch.setitem(entry.__dict__, "rows", lambda *a: pytest.fail("rows read on a step without new rows"))
    decodes = dataclasses.replace(common_metadata([9, 1, 30], [1, 1, 1]),
                                  block_table_tensor=torch.tensor([[3], [4], [5]], dtype=torch.int32))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=decodes)
    assert handoff_of(metadata).host_fresh == 0 and not handoff_of(metadata).zeroed_at_build
    forward(monkeypatch, layers, metadata, covered=LAYERS)
    assert not zero_calls, "a launch on a step the host knows has no fresh row"
    monkeypatch.setattr(op_guard, "_capturing", lambda: True)
    forward(monkeypatch, layers, metadata, covered=LAYERS)
    assert sorted(ptr for who, ptr in zero_calls) == caches_of(layers), "the capture has no launch"
    for layer in layers.values():
        for cache in layer.kv_cache:
            assert cache.eq(6.0).all(), "a live slot zeroed"


def test_owner_is_fixed_at_the_first_build(monkeypatch, guarded, zero_calls):
    """A CUDA graph captured under one owner is replayed under it: no later switch."""
    builder, layers = engine(monkeypatch, compiled=True)
    builder.build(common_prefix_len=0, common_attn_metadata=bug_step())  # no guarded op has run yet
    warm_up(monkeypatch, layers, covered=LAYERS)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    assert metadata_hook.state_of(builder).owner is Owner.STEP
    assert handoff_of(metadata).zeroed_at_build


def test_micro_batched_engine_is_guarded_at_each_build(monkeypatch, guarded, zero_calls):
    """With dual-batch overlap the forward context holds one metadata dict per micro-batch: the
    step guard owns the group although every layer runs through a guarded op, and the op guards
    find each micro-batch zeroed (no error inside the step)."""
    builder, layers = engine(monkeypatch, compiled=True)
    builder.vllm_config.parallel_config.enable_dbo = True
    warm_up(monkeypatch, layers, covered=LAYERS)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    other = builder.build(common_prefix_len=0, common_attn_metadata=common_metadata([7, 9, 30], [1, 1, 1]))
    assert metadata_hook.state_of(builder).owner is Owner.STEP
    assert_only_fresh_slot_zeroed(layers)
    context = SimpleNamespace(no_compile_layers=layers,
                              attn_metadata=[{n: metadata for n in layers}, {n: other for n in layers}])
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    for name in LAYERS:
        op_guard.zero_fresh_state(name)
    assert {who for who, _ in zero_calls} == {"step"}


def test_decide_owner():
    step_guard._GUARDED_LAYERS.add("covered.layer")
    try:
        assert step_guard.decide_owner(["covered.layer"], compiled=True) is Owner.OP
        assert step_guard.decide_owner(["covered.layer"], compiled=False) is Owner.STEP
        assert step_guard.decide_owner(["covered.layer", "python.layer"], compiled=True) is Owner.STEP
        assert step_guard.decide_owner([], compiled=True) is Owner.STEP
    finally:
        step_guard._GUARDED_LAYERS.discard("covered.layer")


@pytest.mark.skipif(on_the_cuda_path(), reason="this is the CUDA path's run")
def test_every_case_again_on_the_cuda_zeroing_path():
    run_module_on_the_cuda_path(__file__, "test_every_case_again_on_the_cuda_zeroing_path", expected_passed=12)
