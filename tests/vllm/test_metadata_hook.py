"""Rows derived from vLLM's CommonAttentionMetadata, not from the builder's split."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.vllm import builders, compat, metadata_hook
from gdn_pass.vllm import rows as vllm_rows
from gdn_pass.vllm.builders.gdn import gdn_rows
from vllm.v1.attention.backend import CommonAttentionMetadata


def stage_all(rows: StagedRowMetadata, common, metadata, draft_counts=None) -> int:
    """Stage every buffer of ``rows`` for one GDN step (``rows.HostRows.stage``), where the hook
    stages only what its guards read; return the count of rows to zero."""
    step = gdn_rows(common, metadata, draft_counts)
    step.stage(rows)
    return step.fresh


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


def gdn_metadata(slots, spec_mask=None, spec_slots=None, *, num_decodes):
    """``num_decodes``: the builder's decodes, the leading non-speculative rows."""
    return SimpleNamespace(
        num_decodes=num_decodes,
        non_spec_state_indices_tensor=None if slots is None else torch.tensor(slots, dtype=torch.int32),
        spec_sequence_masks=None if spec_mask is None else torch.tensor(spec_mask),
        spec_state_indices_tensor=None if spec_slots is None else torch.tensor(spec_slots, dtype=torch.int32),
    )


@pytest.mark.parametrize("with_cpu_seq_lens", [True, False])
def test_fresh_one_token_row_among_decodes(with_cpu_seq_lens):
    # The bug's step: every row has one token; row 1 is brand new on slot 4.
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([9, 0, 30], [1, 1, 1], with_cpu_seq_lens=with_cpu_seq_lens)
    stage_all(rows, common, gdn_metadata([3, 4, 5], num_decodes=3))
    assert rows.has_initial_state[:3].tolist() == [True, False, True]
    assert rows.valid[:3].tolist() == [True, True, True]
    assert rows.fresh_slots().tolist() == [4]


def test_mixed_batch_with_padding_sentinels():
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    # decode, continued chunk, one-token continued chunk, fresh prefill, 2 padding rows
    common = common_metadata([5, 64, 64, 0], [1, 32, 1, 7], pad_to=6)
    sentinel = compat.pad_slot_ids()[-1]
    fresh = stage_all(rows, common, gdn_metadata([3, 4, 5, 6, sentinel, sentinel], num_decodes=1))
    assert rows.valid.tolist() == [True] * 4 + [False] * 4
    assert rows.has_initial_state[:4].tolist() == [True, True, True, False]
    assert rows.reads_state[:4].tolist() == [True, True, True, False]
    # the fresh row is on the prefill path, whose kernels start it from zero state: nothing to zero
    assert rows.fresh_slots().tolist() == [] and fresh == 0


def test_fresh_one_token_row_ahead_of_a_prefill_is_zeroed_the_fresh_prefill_is_not():
    # vLLM's split counts every leading one-token row as a decode: the new
    # one-token row (slot 7) reads its slot; the new 8-token prompt (slot 9) does not
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([12, 0, 0], [1, 1, 8])
    fresh = stage_all(rows, common, gdn_metadata([3, 7, 9], num_decodes=2))
    assert rows.has_initial_state[:3].tolist() == [True, False, False]
    assert rows.fresh_slots().tolist() == [7] and fresh == 1


@pytest.mark.parametrize("host_counts", [True, False])
def test_speculative_rows_are_staged_with_their_initial_state_slot(host_counts):
    """Rows 0 and 2 speculate (1 + 2 tokens); row 1 is a fresh non-spec row. Each
    spec row reads its initial state from column 0 of its spec slots."""
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([5, 0, 40], [3, 1, 3])
    draft_counts = torch.tensor([2, -1, 2]) if host_counts else None
    # with speculative rows in the step vLLM runs every non-speculative row through
    # its prefill kernels (num_decodes 0), which start a fresh row from zero state
    fresh = stage_all(
        rows, common, gdn_metadata([9], spec_mask=[True, False, True], spec_slots=[[3, 4, 5], [6, 7, 8]],
                                   num_decodes=0),
        draft_counts)
    assert rows.num_rows == 3
    assert rows.state_slot[:3].tolist() == [9, 3, 6]  # non-spec first, then spec column 0
    assert rows.has_initial_state[:3].tolist() == [False, True, True]
    assert rows.fresh_slots().tolist() == []
    assert fresh == 0


def test_fresh_row_padded_into_a_speculative_row_is_fresh():
    """vLLM's scheduler pads a new one-token request admitted next to speculating
    decodes to 1 + k tokens; every row is then a spec row and the builder has no
    non-spec slots at all (vLLM 0.26: the bug under MTP)."""
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([40, 0], [2, 2])  # R2 decoding with 1 draft; R3 brand new, padded
    fresh = stage_all(
        rows, common, gdn_metadata(None, spec_mask=[True, True], spec_slots=[[3, 4], [6, 7]], num_decodes=0),
        torch.tensor([1, 1]))
    assert rows.fresh_slots().tolist() == [6]
    assert rows.has_initial_state[:2].tolist() == [True, False]
    assert fresh == 1


@pytest.mark.parametrize("host_counts", [True, False])
def test_padded_speculative_full_graph_step(host_counts):
    """A FULL graph's padded speculative step (vLLM 0.26-0.33's GDN builder, every row
    speculating): three rows of 1 + 1 tokens padded to the captured batch of four. The
    padding row has no tokens and no drafts, is not a speculative row in the mask, and
    still has a row of ``spec_state_indices_tensor`` (filled with the null block) after
    the real ones; there are no non-speculative slots. Row 1 is new."""
    null = compat.pad_slot_ids()[-1]
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    common = common_metadata([40, 0, 17], [2, 2, 2], pad_to=4)
    draft_counts = torch.tensor([1, 1, 1, -1]) if host_counts else None
    fresh = stage_all(
        rows, common,
        gdn_metadata(None, spec_mask=[True, True, True, False], spec_slots=[[3, 4], [6, 7], [9, 10], [null, null]],
                     num_decodes=0),
        draft_counts)
    assert rows.num_rows == 3
    assert rows.state_slot[:3].tolist() == [3, 6, 9]
    assert rows.has_initial_state[:3].tolist() == [True, False, True]
    assert rows.fresh_slots().tolist() == [6]
    assert fresh == 1


def test_speculative_slots_beyond_padding_rows_are_an_error():
    """More speculative slot rows than the step's speculative and padding rows: not vLLM's layout."""
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    with pytest.raises(MetadataError, match="state slots for 2 scheduler rows"):
        stage_all(rows, common_metadata([40, 0], [2, 2]),
                  gdn_metadata(None, spec_mask=[True, True], spec_slots=[[3, 4], [6, 7], [9, 10]], num_decodes=0),
                  torch.tensor([1, 1]))


def test_row_count_mismatch_is_an_error():
    rows = StagedRowMetadata(8, pad_slot_ids=compat.pad_slot_ids())
    with pytest.raises(MetadataError, match="state slots for 2 scheduler rows"):
        stage_all(rows, common_metadata([1, 2], [1, 1]), gdn_metadata([3, 4, 5], num_decodes=2))


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


def test_a_lazy_builder_imported_after_install_does_not_read_as_a_missing_hook(monkeypatch):
    """Kimi-K3's builder is hooked through GDN's ``__init__`` when first made; on the H200 vLLM 0.34's
    Kimi-Linear engines import its module after the plugin loaded and never make one."""
    import importlib

    metadata_hook.install()
    for entry in builders.REGISTRY:
        if not entry.eager and entry.builder_class() is not None:
            importlib.import_module(f"vllm.{entry.module}")
    lazy = [(e, c) for e, c in builders.installed() if not e.eager]
    if not lazy:
        pytest.skip(f"vLLM {compat.vllm_version()} has no lazily imported builder (Kimi-K3: 0.31+)")
    for _entry, cls in lazy:  # as if imported after install: vLLM's own build, unhooked
        monkeypatch.setattr(cls, "build", builders.unhooked_build(cls))
    assert metadata_hook.is_installed()


# --- the hook in a real GDN builder, on every builder layout --------------------
#
# vLLM 0.26-0.29 build GDNAttentionMetadataBuilder without the base class's
# __init__: no `device`, no `layer_names` attributes. Deleting the two after
# construction gives that layout on any release; on 0.26-0.29 it is the layout.

from gdn_pass.vllm.handoff import handoff_of  # noqa: E402

LAYERS = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]


def vllm_config(*, configured: bool, by_name: bool = False):
    from vllm.config import CompilationConfig, VllmConfig

    from gdn_pass.vllm import VllmGDNStatePass

    if not configured:
        cc = CompilationConfig()
    elif by_name:
        from gdn_pass.vllm.gdn_state_pass import SERVE_PASS

        cc = CompilationConfig(inductor_passes={"post_grad_custom_post_pass": SERVE_PASS})
    else:
        cc = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()})
    return VllmConfig(compilation_config=cc, additional_config={"gdn_prefill_backend": "triton"})


def new_builder(config, *, like_0_26: bool, monkeypatch, acting: bool = True, cls=None):
    """A real GDN builder (or ``cls``, a subclass of it). ``acting``: on releases where vLLM reroutes fresh rows itself (0.31+)
    the GDN entry stands down on CPU; the hook's mechanics are then tested as in an engine where
    it acts (vLLM's V1 runner with FULL CUDA graphs, ``support.reroute_holds``)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if acting:
        from gdn_pass.vllm import support

        monkeypatch.setattr(support, "reroute_holds", lambda vllm_config: None)

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    # The prefill-backend probe reads the model's config on CUDA; there is no model here.
    monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend",
                        lambda cfg: ("triton", "triton"), raising=False)
    metadata_hook.install()
    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    builder = (cls or GDNAttentionMetadataBuilder)(spec, LAYERS, config, torch.device("cpu"))
    if like_0_26:
        for attr in ("device", "layer_names"):
            builder.__dict__.pop(attr, None)
    return builder


def bug_step():
    """Every row has one token; row 1 is brand new: the builder calls it a decode.

    Rows own state blocks 3, 4, 5 (block 0 is vLLM's null block)."""
    import dataclasses

    common = common_metadata([9, 0, 30], [1, 1, 1])
    return dataclasses.replace(common, block_table_tensor=torch.tensor([[3], [4], [5]], dtype=torch.int32))


@pytest.mark.parametrize("like_0_26", [True, False])
@pytest.mark.parametrize("by_keyword", [True, False])
def test_unconfigured_engine_builds_exactly_as_without_the_plugin(monkeypatch, like_0_26, by_keyword):
    builder = new_builder(vllm_config(configured=False), like_0_26=like_0_26, monkeypatch=monkeypatch)
    common = bug_step()
    args, kwargs = ((), dict(common_prefix_len=0, common_attn_metadata=common)) if by_keyword else ((0, common), {})
    metadata = builder.build(*args, **kwargs)
    plain = builder.build.__wrapped__(builder, *args, **kwargs)
    assert handoff_of(metadata) is None
    assert metadata.num_decodes == plain.num_decodes  # vLLM's own classification, untouched
    assert metadata.non_spec_state_indices_tensor.tolist() == plain.non_spec_state_indices_tensor.tolist()


@pytest.mark.parametrize("like_0_26", [True, False])
@pytest.mark.parametrize("by_name", [False, True])
def test_configured_engine_stages_rows_on_every_layout(monkeypatch, like_0_26, by_name):
    builder = new_builder(vllm_config(configured=True, by_name=by_name), like_0_26=like_0_26,
                          monkeypatch=monkeypatch)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=bug_step())  # 0.26's call
    rows = handoff_of(metadata).rows
    assert rows.device == torch.device("cpu")
    assert rows.fresh[:3].tolist() == [False, True, False]
    assert metadata.non_spec_state_indices_tensor.tolist() == [3, 4, 5]
    assert rows.fresh_slots().tolist() == [4]


def test_configured_engine_with_an_unsupported_layout_stops_at_start(monkeypatch):
    import dataclasses

    from vllm.v1.attention.backends import gdn_attn

    @dataclasses.dataclass
    class RenamedMetadata:  # a future layout: the slots field got a new name
        state_indices: torch.Tensor | None = None
        spec_sequence_masks: torch.Tensor | None = None

    monkeypatch.setattr(gdn_attn, "GDNAttentionMetadata", RenamedMetadata)
    with pytest.raises(compat.UnsupportedVLLM) as error:
        new_builder(vllm_config(configured=True), like_0_26=True, monkeypatch=monkeypatch)
    message = str(error.value)
    assert f"vLLM {compat.vllm_version()}" in message
    assert "GDNAttentionMetadata.non_spec_state_indices_tensor" in message
    assert "Remove VllmGDNStatePass" in message
    # The same vLLM without the pass configured starts.
    new_builder(vllm_config(configured=False), like_0_26=True, monkeypatch=monkeypatch)


def test_configured_engine_with_an_unknown_core_op_stops_at_start(monkeypatch):
    real = compat._registered_vllm_ops()
    monkeypatch.setattr(compat, "_registered_vllm_ops", lambda: real + ["vllm::new_gdn_attention_core"])
    with pytest.raises(compat.UnsupportedVLLM, match="vllm::new_gdn_attention_core looks like a GDN/KDA core op"):
        new_builder(vllm_config(configured=True), like_0_26=False, monkeypatch=monkeypatch)
    new_builder(vllm_config(configured=False), like_0_26=False, monkeypatch=monkeypatch)


def test_unconfigured_engine_survives_a_broken_adapter(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("adapter bug")

    for name in ("builder_context", "step_inputs", "wrapped_build"):
        monkeypatch.setattr(compat, name, broken)
    monkeypatch.setattr(vllm_rows, "num_computed_tokens", broken)
    builder = new_builder(vllm_config(configured=False), like_0_26=True, monkeypatch=monkeypatch)
    assert handoff_of(builder.build(0, bug_step())) is None


def test_pass_by_qualified_name_is_vllms_resolved_object():
    import gdn_pass.vllm.serve as serve
    from gdn_pass.vllm.gdn_state_pass import configured_pass

    cc = vllm_config(configured=True, by_name=True).compilation_config
    # vLLM resolved the name itself, as __import__(module).__dict__[name]
    assert cc.inductor_compile_config["post_grad_custom_post_pass"] is serve.GDN_STATE_PASS
    assert configured_pass(cc) is serve.GDN_STATE_PASS


# --- steps in sequence: what the hook keeps between builds ------------------------


def bind_poisoned_caches(config, num_blocks=8):
    """Give every layer fresh caches (as vLLM's bind_kv_cache does), slot s filled with s + 1."""
    caches = []
    for name in LAYERS:
        conv = torch.arange(1, num_blocks + 1, dtype=torch.float32).view(-1, 1, 1).expand(-1, 3, 8)
        ssm = torch.arange(1, num_blocks + 1, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 2, 4, 4)
        config.compilation_config.static_forward_context[name] = SimpleNamespace(
            kv_cache=[conv.contiguous(), ssm.contiguous()])
        caches += config.compilation_config.static_forward_context[name].kv_cache
    return caches


def step_of(computed, qlens, blocks):
    import dataclasses

    return dataclasses.replace(common_metadata(computed, qlens),
                               block_table_tensor=torch.tensor([[b] for b in blocks], dtype=torch.int32))


def zeroed(caches):
    return [sorted(s for s in range(cache.shape[0]) if not cache[s].any()) for cache in caches]


def test_fresh_flags_of_one_step_never_reach_the_next(monkeypatch):
    """A CUDA graph replays whatever ``fresh`` holds: after a step with a fresh row,
    a step without one must leave no flag set, or the replay would zero the state
    the (now restored) request just wrote."""
    from gdn_pass.vllm import step_guard

    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())  # the step guard zeroes, visibly
    config = vllm_config(configured=True)
    caches = bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    metadata = builder.build(0, bug_step())
    rows = handoff_of(metadata).rows
    assert (rows.fresh_slots().tolist(), handoff_of(metadata).host_fresh) == ([4], 1)
    assert zeroed(caches) == [[4]] * 4
    caches = bind_poisoned_caches(config)  # refill: the next step must zero nothing
    metadata = builder.build(0, step_of([10, 1, 31], [1, 1, 1], [3, 4, 5]))  # the same requests, continuing
    assert handoff_of(metadata).rows is rows and handoff_of(metadata).host_fresh == 0
    assert not rows.graph_buffers()["fresh"].any()
    assert zeroed(caches) == [[]] * 4


def test_rebound_caches_are_the_ones_zeroed(monkeypatch):
    """The hook keeps the group's caches between builds; when vLLM binds new ones
    (after profiling, on re-allocation) the fresh slot is zeroed in the new ones."""
    from gdn_pass.vllm import step_guard

    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    config = vllm_config(configured=True)
    old = bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    builder.build(0, step_of([10, 1, 31], [1, 1, 1], [3, 4, 5]))  # nothing fresh
    new = bind_poisoned_caches(config)
    builder.build(0, bug_step())
    assert zeroed(new) == [[4]] * 4
    assert zeroed(old) == [[]] * 4


# --- one step, several groups: the scheduler's rows are computed once ---------------


def test_the_groups_of_one_step_share_its_scheduler_rows():
    """vLLM hands each KV-cache group a shallow copy of the step's metadata: the rows that depend
    on the scheduler alone are computed for the first and reused by the others."""
    import copy

    from gdn_pass.vllm.rows import scheduler_rows

    base = common_metadata([9, 0, 30], [1, 1, 1])
    first = scheduler_rows(copy.copy(base))
    assert scheduler_rows(copy.copy(base)) is first
    assert first.new.tolist() == [False, True, False] and first.new_among_first(3) == 1
    # The runner's next step: new views of the same persistent host buffers.
    qsl, lens = base.query_start_loc_cpu, base.seq_lens_cpu_upper_bound
    later = dataclasses.replace(base, query_start_loc_cpu=qsl[:], seq_lens_cpu_upper_bound=lens[:])
    assert scheduler_rows(later) is not first


@pytest.mark.parametrize("refilled", ["query_start_loc_cpu", "seq_lens_cpu_upper_bound"])
def test_host_tensors_refilled_in_place_are_a_new_step(monkeypatch, refilled):
    """A caller may refill the same host tensors for its next step: the rows follow the new values
    (the tensors' version counters), so a request that is new in the later step is zeroed."""
    from gdn_pass.vllm import step_guard

    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())  # the step guard zeroes, visibly
    config = vllm_config(configured=True)
    caches = bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    blocks = torch.tensor([[3], [4], [5]], dtype=torch.int32)
    if refilled == "query_start_loc_cpu":
        # step 1: row 1 has no token this step (1 computed); step 2: its one token, none computed
        step = dataclasses.replace(common_metadata([9, 1, 30], [1, 0, 1]), block_table_tensor=blocks)
    else:  # step 1: row 1 has 1 token computed; step 2: none
        step = dataclasses.replace(common_metadata([9, 1, 30], [1, 1, 1]), block_table_tensor=blocks)
    builder.build(0, step)
    assert zeroed(caches) == [[]] * 4
    if refilled == "query_start_loc_cpu":
        step.query_start_loc_cpu[:] = torch.tensor([0, 1, 2, 3])
    else:
        step.seq_lens_cpu_upper_bound[1] = 1
    step = dataclasses.replace(step, query_start_loc=step.query_start_loc_cpu.clone(), num_actual_tokens=3,
                               seq_lens=step.seq_lens_cpu_upper_bound.clone())
    metadata = builder.build(0, step)
    assert handoff_of(metadata).host_fresh == 1
    assert zeroed(caches) == [[4]] * 4


@pytest.mark.parametrize("by_keyword", [True, False])
def test_a_step_without_new_rows_leaves_the_decode_rows_to_a_capture(monkeypatch, by_keyword):
    """On a step without a new row the hook reads no row of the builder and attaches the builder's
    one hand-off of such steps (vLLM's runners pass the metadata by keyword: the short path).
    Where the zeroing launch reads vLLM's decode rows (CUDA), they are found only when a guard
    asks (a FULL CUDA graph's capture), from that step's metadata, in a hand-off of the step's
    own; and a rebound group is checked on such a step too."""
    from gdn_pass.vllm import step_guard

    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    config = vllm_config(configured=True)
    bind_poisoned_caches(config)
    tables = []
    monkeypatch.setattr(metadata_hook, "_cache_table",
                        lambda caches, device: tables.append(list(caches)) or SimpleNamespace(caches=caches))
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    entry = metadata_hook.state_of(builder).entry
    found, decode_rows = [], SimpleNamespace(num_rows=3)
    monkeypatch.setitem(entry.__dict__, "device_rows",
                        lambda common, metadata: found.append((common, metadata)) or decode_rows)
    build = ((lambda step: builder.build(common_prefix_len=0, common_attn_metadata=step)) if by_keyword
             else (lambda step: builder.build(0, step)))
    build(step_of([9, 1, 30], [1, 1, 1], [3, 4, 5]))  # the first build settles the guard (full path)
    found.clear()
    monkeypatch.setitem(entry.__dict__, "rows", lambda *a: pytest.fail("rows read on a step without new rows"))
    step = step_of([10, 1, 31], [1, 1, 1], [3, 4, 5])
    metadata = build(step)
    shared = handoff_of(metadata)
    assert shared.host_fresh == 0 and shared.decode is None and not found, "decode rows found unasked"
    assert handoff_of(build(step_of([12, 3, 33], [1, 1, 1], [3, 4, 5]))) is shared  # one per builder
    metadata = build(step)
    own = shared.in_capture(metadata)
    assert own is not shared and own.in_capture is None and own.decode is decode_rows
    assert len(found) == 1 and found[0][0] is step and found[0][1] is metadata
    assert own.table.caches == tables[-1] and len(tables) == 1
    rebound = bind_poisoned_caches(config)  # vLLM binds new caches: the next idle step's table has them
    metadata = build(step_of([11, 2, 32], [1, 1, 1], [3, 4, 5]))
    assert handoff_of(metadata) is shared
    assert len(tables) == 2 and shared.in_capture(metadata).table.caches == rebound


def test_the_cost_benchmarks_clock_sees_every_build(monkeypatch):
    """``benchmarks/engine_cost.py`` charges the hook what runs under the functions its build
    wrappers call (``HookClock.HOOK_FUNCTIONS``): a build on a step without new rows (the common
    case, by keyword as vLLM's runners call it) must go through one of them too, or the engine
    cost table reads 0 us for such steps; and one nested in another counts once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from engine_cost import HookClock

    for name in HookClock.HOOK_FUNCTIONS:  # restored afterwards
        monkeypatch.setattr(metadata_hook, name, getattr(metadata_hook, name))
    config = vllm_config(configured=True)
    bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    clock = HookClock()
    builder.build(common_prefix_len=0, common_attn_metadata=bug_step())
    builder.build(common_prefix_len=0, common_attn_metadata=step_of([10, 1, 31], [1, 1, 1], [3, 4, 5]))
    assert handoff_of(builder.build(common_prefix_len=0, common_attn_metadata=step_of(
        [11, 2, 32], [1, 1, 1], [3, 4, 5]))).host_fresh == 0
    # one timed call per build, two where vLLM 0.31+'s split is kept on the decode path first
    calls_per_build = 2 if metadata_hook.state_of(builder).keeps_decodes else 1
    assert len(clock.calls) == 3 * calls_per_build

