"""Act, stand down or refuse: ``support.decide`` on this vLLM's real builders and on a fake next release.

Runs in every CPU environment of ``scripts/test`` (0.30 here; 0.27, 0.31 and
0.32 through ``test_releases.py``). The reference for the real builders is
what vLLM's own ``build``, unhooked, does with a step where every row has one
token and one row is brand new (the bug when that row is a decode), and the
releases' known facts: GDN's builder reroutes such a row from 0.31
(vllm#51565), the Lightning builders never do (0.26-0.34).

The fake next release is this release's real builders with one thing
changed each, as a future vLLM might change it: a renamed metadata field, a
changed ``build`` signature, a fixed split, a changed state layout, a new
required field of ``CommonAttentionMetadata``. Each must get the decision
that change calls for, naming the check. A ``build`` wrapped by another
plugin, with or without ``functools.wraps``, is still guarded; one whose
wrapper hides what it wraps refuses, naming the wrapper.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gdn_pass.vllm import builders, compat, metadata_hook, step_guard, support
from gdn_pass.vllm.handoff import handoff_of
from tests.vllm.test_linear_attention_builders import new_linear_builder, poisoned_caches, step
from tests.vllm.test_metadata_hook import new_builder, vllm_config

BUILT_IN_FIX = compat.version_tuple() >= (0, 31)  # vllm#51565 (GDN, Kimi-K3 KDA)
CPU = torch.device("cpu")


def _entry(key: str) -> builders.StateBuilder:
    return next(e for e in builders.REGISTRY if e.key == key)


def _fresh_row_is_a_decode_in_vllms_own_build(builder) -> bool:
    """The reference: vLLM's unhooked build of a one-token step whose second row is brand new."""
    common = step([9, 0], [1, 1], [[3] * 16, [4] * 16])
    if "is_prefilling" in compat.fields_of(type(common)):
        common = dataclasses.replace(common, is_prefilling=torch.tensor([False, True]))
    metadata = builders.unhooked_build(type(builder))(builder, 0, common)
    return metadata.num_decodes == 2


@pytest.mark.parametrize("key", ["gdn", "bailing_linear", "minimax_linear"])
def test_each_real_builder_acts_exactly_where_its_own_split_reads_a_stale_slot(key, monkeypatch):
    entry = _entry(key)
    cls = entry.builder_class()
    reference = new_builder(vllm_config(configured=False), like_0_26=False, monkeypatch=monkeypatch, acting=False,
                            cls=cls) if key == "gdn" else new_linear_builder(vllm_config(configured=False), cls.__name__)
    has_bug = _fresh_row_is_a_decode_in_vllms_own_build(reference)
    # (new_builder stubs the GDN prefill-backend choice, which 0.32 reads from a model config; none here)
    decision = support.decide_for_class(entry, cls, vllm_config(configured=True), CPU)
    assert has_bug == (key != "gdn" or not BUILT_IN_FIX), (compat.vllm_version(), key)  # the releases' facts
    # On CPU no FULL decode graph replays a rerouted step: where vLLM fixed the split, the entry stands down.
    assert decision.action == (support.ACTS if has_bug else support.STANDS_DOWN), decision
    assert decision.failed() == []
    assert [c.name for c in decision.checks][:2] == ["build", "split"]


def test_the_decision_for_an_engine_is_the_one_doctor_shows(monkeypatch):
    """The hook's decision at engine start equals ``decide_for_class``'s for the same config."""
    config = vllm_config(configured=True)
    new_linear_builder(config)
    at_start = support.recorded("bailing_linear")
    cls = _entry("bailing_linear").builder_class()
    assert at_start.action == support.decide_for_class(_entry("bailing_linear"), cls, config, CPU).action == support.ACTS



def _padded_row_is_a_speculative_decode_in_vllms_own_build(builder, k: int) -> bool:
    """The reference: vLLM's unhooked build of a step where a new one-token request, padded with ``k``
    placeholder drafts and its drafts counted, sits beside a speculating row."""
    common = step([20, 0], [1 + k, 1 + k], [[3] * 16, [4] * 16])
    if "is_prefilling" in compat.fields_of(type(common)):
        common = dataclasses.replace(common, is_prefilling=torch.tensor([False, True]))
    metadata = builders.unhooked_build(type(builder))(
        builder, 0, common, num_accepted_tokens=torch.ones(2, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor([k, k], dtype=torch.int32))
    return metadata.num_spec_decodes == 2


@pytest.mark.parametrize("v2_runner", [True, False])
def test_gdn_acts_for_padded_new_requests_where_it_routes_fresh_rows_to_prefill(v2_runner, monkeypatch):
    """With speculative decoding, GDN's builder (every release) runs a new request the scheduler padded
    with placeholder drafts on its speculative path once the drafts are counted, reading the recycled
    slot; where the builder reroutes other fresh rows itself (0.31+) the entry acts for such rows only,
    at metadata build (no guarded op: the pass is told it needs none); elsewhere it acts as before."""
    from vllm.config import VllmConfig

    from tests.vllm.test_metadata_hook_row_kinds import engine_config

    k = 1
    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: k))
    monkeypatch.setattr(support, "runs_v2_model_runner", lambda vllm_config: v2_runner)
    entry = _entry("gdn")
    unconfigured = engine_config("none", k)
    unconfigured.compilation_config.inductor_compile_config.pop("post_grad_custom_post_pass")
    reference = new_builder(unconfigured, like_0_26=False, monkeypatch=monkeypatch, acting=False)
    assert _padded_row_is_a_speculative_decode_in_vllms_own_build(reference, k)
    config = engine_config("none", k)
    decision = support.decide_for_class(entry, entry.builder_class(), config, CPU)
    assert decision.action == support.ACTS and decision.failed() == [], decision
    assert decision.counts_padded_drafts
    assert decision.padded_only == BUILT_IN_FIX, decision
    monkeypatch.setattr(support, "_DECISIONS", {})  # the compile-time question, before any engine's builder
    monkeypatch.setattr(support, "_CLASS_DECISIONS", {})
    reason = support.stand_down_reason(entry, config)
    assert (reason is not None) == BUILT_IN_FIX  # no guarded op where the step guard alone acts
    assert "new one-token request padded with 1 draft(s), its drafts counted -> decode" in decision.checked()
    # Without speculative decoding the padding never happens: as before (acts, or stands down).
    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: 0))
    plain = support.decide_for_class(entry, entry.builder_class(), vllm_config(configured=True), CPU)
    assert plain.action == (support.STANDS_DOWN if BUILT_IN_FIX else support.ACTS) and not plain.padded_only


# --- the fake next release --------------------------------------------------------------------

def _bailing():
    from vllm.v1.attention.backends.linear_attn import BailingLinearAttentionMetadataBuilder

    return BailingLinearAttentionMetadataBuilder


def test_next_release_with_a_renamed_metadata_field_refuses_naming_it(monkeypatch):
    from vllm.v1.attention.backends import linear_attn

    real = linear_attn.BailingLinearAttentionMetadata

    @dataclasses.dataclass
    class Renamed(real):  # the builder still fills the old class; the entry reads the new one's fields
        pass

    Renamed.__dataclass_fields__ = {k: v for k, v in real.__dataclass_fields__.items() if k != "state_indices_tensor_d"}
    monkeypatch.setattr(linear_attn, "BailingLinearAttentionMetadata", Renamed)
    with pytest.raises(compat.UnsupportedVLLM) as error:
        new_linear_builder(vllm_config(configured=True))
    assert "metadata: BailingLinearAttentionMetadata.state_indices_tensor_d" in str(error.value)
    new_linear_builder(vllm_config(configured=False))  # unconfigured: starts


def test_next_release_with_a_changed_build_signature_refuses_naming_build(monkeypatch):
    cls = _bailing()

    class Changed(cls):
        def build(self, common_prefix_len, attn_metadata, fast_build=False):  # renamed parameter
            return super().build(common_prefix_len, attn_metadata, fast_build)

    metadata_hook.install()
    metadata_hook._wrap(_entry("bailing_linear"), Changed)
    monkeypatch.setattr(builders, "_BY_NAME", {**builders._BY_NAME, (Changed.__module__, Changed.__qualname__):
                                               _entry("bailing_linear")})
    builders.entry_of.cache_clear()
    try:
        decision = support.decide_for_class(_entry("bailing_linear"), Changed, vllm_config(configured=True), CPU)
    finally:
        builders.entry_of.cache_clear()
    assert decision.action == support.REFUSES
    assert decision.why.startswith("build: ") and "Changed.build (" in decision.why, decision.why


def _fixed_split(monkeypatch):
    """vLLM fixes the Lightning split as it fixed GDN's: short extends of new rows are prefills."""
    from vllm.v1.attention.backends import linear_attn

    real = linear_attn.split_decodes_and_prefills
    monkeypatch.setattr(linear_attn, "split_decodes_and_prefills",
                        functools.partial(real, treat_short_extends_as_decodes=False))


@pytest.mark.skipif(compat.version_tuple() < (0, 31), reason="is_prefilling (what a fixed split reads) is 0.31+")
def test_next_release_with_a_fixed_split_stands_down_where_the_fix_holds(monkeypatch):
    _fixed_split(monkeypatch)
    decision = support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert decision.action == support.STANDS_DOWN and "prefill" in decision.why, decision
    # An engine that could replay a FULL decode graph on the step (the V1 runner): this split cannot be
    # kept on the decode path (it needs is_prefilling), so the entry refuses rather than guess.
    monkeypatch.setattr(support, "reroute_holds", lambda config: None)
    decision = support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert decision.action == support.REFUSES and decision.why.startswith("split: the builder reroutes"), decision


def test_next_release_with_a_changed_state_layout_refuses_naming_it():
    from vllm.v1.kv_cache_interface import MambaSpec

    config = vllm_config(configured=True)
    poisoned_caches(config)
    metadata_hook.install()
    spec = MambaSpec(block_size=16, shapes=((2, 4), (2, 4, 8)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(compat.UnsupportedVLLM, match=r"state layout: BailingLinearAttentionMetadataBuilder's "
                                                     r"layers hold state of shapes \[\(2, 4\), \(2, 4, 8\)\]"):
        _bailing()(spec, ["model.layers.0.attention"], config, CPU)


def test_next_release_with_a_new_required_common_field_refuses_naming_it(monkeypatch):
    from vllm.v1.attention import backend

    real = backend.CommonAttentionMetadata

    @dataclasses.dataclass
    class WithNewField(real):
        request_priorities: torch.Tensor = dataclasses.field(kw_only=True)

    monkeypatch.setattr(backend, "CommonAttentionMetadata", WithNewField)
    decision = support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert decision.action == support.REFUSES
    assert "split: CommonAttentionMetadata has required fields gdn-pass cannot fill: ['request_priorities']" \
        in decision.why


def test_a_builder_that_needs_the_runner_s_aligned_state_indices_is_probed_with_the_step_s_own():
    """vLLM 0.34's runner sets ``mamba_aligned_state_indices`` on a builder before each build in the
    "align" cache mode, and its Kimi-K3 KDA builder asserts it did (on the H200 the probe without
    them refused that entry). The probe hands the step's own block table, then restores the builder."""
    from gdn_pass.vllm import split_probe

    seen = []

    class NeedsAlignedIndices(_bailing()):
        mamba_aligned_state_indices = None  # a class attribute, as in vLLM's KDA builder

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            assert self.mamba_aligned_state_indices is not None, "Aligned Mamba state indices must be precomputed"
            seen.append(self.mamba_aligned_state_indices[: common_attn_metadata.num_reqs, 0].tolist())
            return super().build(common_prefix_len, common_attn_metadata, fast_build)

    config = vllm_config(configured=False)
    builder = NeedsAlignedIndices(new_linear_builder(config).kv_cache_spec, ["model.layers.0.attention"], config, CPU)
    findings = split_probe.probe_split(builders.unhooked_build(NeedsAlignedIndices), builder, CPU)
    assert findings.one_token  # the Lightning split: the fresh row is a decode
    assert seen[0] == [1, 1 + 16]  # row i's first block of the probe step (synthetic_step)
    assert "mamba_aligned_state_indices" not in vars(builder) and builder.mamba_aligned_state_indices is None
    builder.mamba_aligned_state_indices = torch.zeros(1, 1, dtype=torch.int32)  # the runner's, of a last step
    split_probe.probe_split(builders.unhooked_build(NeedsAlignedIndices), builder, CPU)
    assert builder.mamba_aligned_state_indices.shape == (1, 1)


# --- other plugins' wrappers --------------------------------------------------------------------

def _rehook_with_a_foreign_wrapper(monkeypatch, make_wrapper):
    """Bailing's builder as vLLM defines it, its ``build`` replaced by ``make_wrapper(build)`` (another
    plugin, loaded before gdn-pass), then hooked by gdn-pass; monkeypatch restores the class."""
    cls = _bailing()
    metadata_hook.install()
    monkeypatch.setattr(cls, "__init__", cls.__init__.__wrapped__)
    monkeypatch.setattr(cls, "build", make_wrapper(builders.unhooked_build(cls)))
    metadata_hook._wrap(_entry("bailing_linear"), cls)
    return cls


def _spec():
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=16, shapes=((2, 4, 4),), dtypes=(torch.float64,))


@pytest.mark.parametrize("wraps", [True, False])
@pytest.mark.parametrize("by_keyword", [True, False])
def test_a_build_wrapped_by_another_plugin_is_still_guarded(wraps, by_keyword, monkeypatch):
    calls = []

    def tracing_plugin(inner):
        def traced(self, *args, **kwargs):
            calls.append(len(args))
            return inner(self, *args, **kwargs)

        return functools.wraps(inner)(traced) if wraps else traced

    cls = _rehook_with_a_foreign_wrapper(monkeypatch, tracing_plugin)
    config = vllm_config(configured=True)
    caches = poisoned_caches(config)
    builder = cls(_spec(), ["model.layers.0.attention", "model.layers.2.attention"], config, CPU)
    common = step([9, 0], [1, 1], [[3], [4]])
    before = [c.clone() for c in caches]
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common) if by_keyword \
        else builder.build(0, common)
    assert calls, "the other plugin's wrapper was bypassed"
    decision = support.recorded("bailing_linear")
    assert decision.action == support.ACTS
    assert "takes common_attn_metadata through " in decision.checks[0].found
    assert "tracing_plugin.<locals>.traced (" in decision.checks[0].found, decision.checks[0]
    assert handoff_of(metadata) is not None and metadata.num_decodes == 2
    changed = [sorted(s for s in range(b.shape[0]) if not torch.equal(b[s], c[s])) for b, c in zip(before, caches)]
    assert changed == [[4], [4]]  # the fresh row's slot zeroed in both layers, nothing else


def test_a_wrapper_that_hides_what_it_wraps_refuses_naming_the_wrapper(monkeypatch):
    table = {}

    def registering_plugin(inner):
        table["build"] = inner

        def hidden(self, *args, **kwargs):  # finds its target through a table: nothing to follow
            return table["build"](self, *args, **kwargs)

        return hidden

    cls = _rehook_with_a_foreign_wrapper(monkeypatch, registering_plugin)
    with pytest.raises(compat.UnsupportedVLLM) as error:
        cls(_spec(), ["model.layers.0.attention"], vllm_config(configured=True), CPU)
    builder = cls(_spec(), ["model.layers.0.attention"], vllm_config(configured=False), CPU)
    assert handoff_of(builder.build(0, step([9, 0], [1, 1], [[3], [4]]))) is None  # unconfigured: untouched
    message = str(error.value)
    assert "): build: test_a_wrapper_that_hides" in message and "registering_plugin.<locals>.hidden (" in message
    assert "test_support.py" in message, message
    assert "hides the parameters" in message and "functools.wraps" in message


def test_step_guard_never_runs_on_a_builder_of_gdn_pass_s_own():
    before = step_guard.activity()["steps_zeroed"]
    support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert step_guard.activity()["steps_zeroed"] == before


def test_the_rows_check_runs_gdn_pass_s_own_rows_on_the_probe_step_as_vllm_0_34_makes_it(monkeypatch):
    """Where gdn-pass's own reading of a step would fail (here: its step key read the version counter
    that inference tensors lack, as on vLLM 0.34), a configured engine stops at start-up naming the
    rows check, not at its first step."""
    from gdn_pass.vllm import rows

    def versioned_key(common, starts_cpu, tensor, field):
        return (starts_cpu, starts_cpu._version, tensor, field, tensor._version, common.num_reqs)

    decision = support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert decision.action == support.ACTS and decision.checks[-1] == support.Check(
        "rows", True, "the probe step's rows to zero: 1")
    monkeypatch.setattr(rows, "_step_key", versioned_key)
    monkeypatch.setattr(rows, "_last_step", [None])
    monkeypatch.setattr(rows, "_last_idle_key", [None])
    decision = support.decide_for_class(_entry("bailing_linear"), _bailing(), vllm_config(configured=True), CPU)
    assert decision.action == support.REFUSES
    assert decision.why.startswith("rows: gdn-pass's rows of the probe step raised RuntimeError('Inference tensors")


def test_each_core_op_family_is_guarded_unless_every_builder_it_reads_stands_down(monkeypatch):
    """The compile-time question (``guarded_ops.stand_down_reason``), per family of core ops: GDN's
    and KDA's ops read the GDN builder's layers, and their guarded twins go in where it acts (as
    that entry decides for the engine: on 0.26-0.30 always); ``vllm::linear_attention`` reads the
    Lightning builders' layers, unfixed on every release, so its twin always goes in. Judged by
    vLLM's own builders on this release."""
    from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS
    from gdn_pass.vllm import guarded_ops

    monkeypatch.setattr(support, "_DECISIONS", {})
    monkeypatch.setattr(support, "_CLASS_DECISIONS", {})
    config = vllm_config(configured=True)
    monkeypatch.setattr("vllm.config.get_current_vllm_config_or_none", lambda: config)
    families = {spec.family: spec for spec in KNOWN_OPAQUE_STATE_OPS.values()}
    assert set(families) == {"gdn", "kda", "lightning"}
    assert [e.key for e in builders.reading("lightning")] == ["bailing_linear", "minimax_linear"]
    gdn_reason = support.stand_down_reason(builders.GDN, config)
    if not BUILT_IN_FIX:
        assert gdn_reason is None
    for family in ("gdn", "kda"):
        assert guarded_ops.stand_down_reason(families[family]) == gdn_reason, family
    assert guarded_ops.stand_down_reason(families["lightning"]) is None
