"""The V2 runner's accepted counts for the speculating Lightning builder (``gdn_pass.vllm.accepted_counts``).

The runner's own ``MambaHybridAttnMetadata`` (every CI release has it) gives
the real ``BailingLinearAttentionMetadataBuilder`` its keyword arguments, as
``build_attn_metadata`` does each step. The oracle is the Lightning
recurrence token by token over the tokens a request accepted (``S' = k v^T +
exp(-slope) S``, from its own state); decodes run in the torch stand-in of
vLLM's spec kernel, prefills in the recurrence over every token of the row
(what the prefill kernel computes). Every other slot holds poison.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gdn_pass.vllm import accepted_counts, prompt_chunks, support
from gdn_pass.vllm.metadata_hook import state_of
from tests.vllm.test_linear_attention_builders import new_linear_builder, poisoned_caches, qkv, step
from tests.vllm.test_metadata_hook import vllm_config
from tests.vllm.test_prompt_chunks import K, decode, own_state, recurrence

K_TOKENS = 1 + K


@pytest.fixture(autouse=True)
def _v2_runner_with_one_speculative_token(monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: K))
    monkeypatch.setattr(support, "runs_v2_model_runner", lambda vllm_config: True)
    monkeypatch.setattr(prompt_chunks, "_said", set())
    # vLLM's classes as installed: a test's wrappers must not outlive it. The model state's
    # prepare_attn (which needs a whole input batch) runs the builds a test hands it.
    cls = runner_metadata_class()
    monkeypatch.setattr(cls, "get_extra_attn_kwargs", cls.get_extra_attn_kwargs)
    module, name = accepted_counts.RUNNER_STATE
    monkeypatch.setattr(getattr(importlib.import_module(module), name), "prepare_attn",
                        lambda self, input_batch, builds: builds())


def runner_metadata_class():
    module, name = accepted_counts.RUNNER_METADATA
    return getattr(importlib.import_module(module), name)


def runner_kwargs(builder, accepted, drafts):
    """What the V2 runner passes ``builder.build`` this step (``build_attn_metadata``)."""
    metadata = runner_metadata_class()(
        is_prefilling=torch.zeros(len(accepted), dtype=torch.bool),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))
    return metadata.get_extra_attn_kwargs(builder, len(accepted))


def speculating_builder(configured: bool):
    config = vllm_config(configured=configured)
    caches = poisoned_caches(config)
    builder = new_linear_builder(config, spec_tokens=K)
    return builder, caches


def test_vllm_passes_the_lightning_builder_no_counts():
    """The premise, on the installed release: GDN's builder gets the counts, Lightning's none."""
    builder, _ = speculating_builder(configured=False)
    assert runner_kwargs(builder, [2], [K]) == {}
    assert state_of(builder) is None


@pytest.mark.parametrize("configured", [True, False])
def test_rejected_draft_stays_out_of_the_state(configured):
    """A speculating row [token, draft] whose draft the sampler then rejects: the next step must
    read the state after the token alone. Given the counts, the builder runs the row on its
    speculative path (one state per token); without them, on the prefill path, whose state
    holds the draft too."""
    builder, caches = speculating_builder(configured)
    history = own_state(caches, 6, seed=1)
    kwargs = runner_kwargs(builder, accepted=[1], drafts=[K])
    first = builder.build(0, step([20], [K_TOKENS], [[6, 7]]), **kwargs)
    q, k, v = qkv(K_TOKENS, seed=2)
    if first.num_decodes:  # the speculative path
        decode(first, caches, q, k, v)
    else:  # the prefill path: from column 0, the state after every token back into column 0
        caches[0][6] = recurrence(caches[0][6].clone(), k, v, q)[1]
    # The draft was rejected (accepted 1): the next step decodes the corrected token and a new draft.
    second = builder.build(0, step([21], [K_TOKENS], [[6, 7]]),
                           **runner_kwargs(builder, accepted=[1], drafts=[K]))
    q2, k2, v2 = qkv(K_TOKENS, seed=3)
    after_token = recurrence(history, k[:1], v[:1], q[:1])[1]
    expected = recurrence(after_token, k2, v2, q2)[0]
    if configured:
        assert (first.num_decodes, first.num_prefills) == (1, 0)
        assert first.num_accepted_tokens.tolist() == [1]
        assert torch.equal(decode(second, caches, q2, k2, v2), expected)
    else:
        assert (first.num_decodes, first.num_prefills) == (0, 1) and first.num_accepted_tokens is None
        state = caches[0][6].clone()  # the second step on the prefill path too
        assert not torch.allclose(recurrence(state, k2, v2, q2)[0], expected)


def test_prompt_chunk_on_the_v2_runner_is_repaired_as_on_v1():
    """With the counts, a prompt's last chunk of 1 + k tokens beside a speculating row is a decode
    for the builder (threshold 1 + k); the V2 runner marks it -1 in the draft counts, and
    ``prompt_chunks`` keeps its state in the column the next step reads."""
    builder, caches = speculating_builder(configured=True)
    history = own_state(caches, 6, seed=4)
    md = builder.build(0, step([20, 8], [K_TOKENS, K_TOKENS], [[3, 4], [6, 7]]),
                       **runner_kwargs(builder, accepted=[1, 1], drafts=[K, -1]))
    assert (md.num_decodes, md.num_prefills) == (2, 0)
    assert md.state_indices_tensor_d.tolist() == [[3, 4], [6, 6]]
    q, k, v = qkv(2 * K_TOKENS, seed=5)
    decode(md, caches, q, k, v)
    assert torch.equal(caches[0][6], recurrence(history, k[K_TOKENS:], v[K_TOKENS:], q[K_TOKENS:])[1])
    assert state_of(builder).prompt_chunks.rows_repaired == 1


def prepared(batch, builds):
    """``builds()`` inside the runner's ``prepare_attn`` of a step with ``batch``'s rows."""
    module, name = accepted_counts.RUNNER_STATE
    return getattr(importlib.import_module(module), name).prepare_attn(object(), batch, builds)


def test_a_padded_new_request_keeps_its_placeholder_draft_out_of_the_state():
    """The scheduler pads a new one-token request with k placeholder drafts (1 + k tokens) beside
    a speculating row, and the V2 runner counts it -1 (it is still prefilling). It is one prompt
    token and k drafts, not a prompt of 1 + k tokens: the state after its one token is what the
    next step reads (the placeholder is rejected: accepted 1)."""

    builder, caches = speculating_builder(configured=True)
    batch = SimpleNamespace(num_draft_tokens_per_req=np.array([K, K], dtype=np.int32),
                            num_scheduled_tokens=np.array([K_TOKENS, K_TOKENS], dtype=np.int32))
    md = prepared(batch, lambda: builder.build(0, step([20, 0], [K_TOKENS, K_TOKENS], [[3, 4], [6, 7]]),
                                               **runner_kwargs(builder, accepted=[1, 1], drafts=[K, -1])))
    assert md.state_indices_tensor_d.tolist() == [[3, 4], [6, 7]]  # not a prompt chunk: as vLLM made it
    assert torch.count_nonzero(caches[0][6]) == 0  # fresh: zeroed by the guard
    q, k, v = qkv(2 * K_TOKENS, seed=6)
    decode(md, caches, q, k, v)
    second = builder.build(0, step([1], [K_TOKENS], [[6, 7]]), **runner_kwargs(builder, accepted=[1], drafts=[K]))
    q2, k2, v2 = qkv(K_TOKENS, seed=7)
    token = K_TOKENS  # the new request's one token
    after_token = recurrence(torch.zeros_like(caches[0][6]), k[token:token + 1], v[token:token + 1],
                             q[token:token + 1])[1]
    assert torch.equal(decode(second, caches, q2, k2, v2), recurrence(after_token, k2, v2, q2)[0])
    assert state_of(builder).prompt_chunks.rows_repaired == 0


def test_only_the_builders_gdn_pass_acts_for_get_counts():
    ours, _ = speculating_builder(configured=True)
    theirs = new_linear_builder(vllm_config(configured=False), spec_tokens=K)
    counts = runner_kwargs(ours, accepted=[2, 1], drafts=[K, -1])
    assert counts["num_accepted_tokens"].tolist() == [2, 1]
    assert counts["num_decode_draft_tokens_cpu"].tolist() == [K, -1]
    assert runner_kwargs(theirs, accepted=[2, 1], drafts=[K, -1]) == {}
    speculating_builder(configured=True)  # a second engine's builder: wrapped once
    assert getattr(runner_metadata_class().get_extra_attn_kwargs, accepted_counts._MARK)
    assert runner_metadata_class().get_extra_attn_kwargs.__wrapped__.__qualname__.endswith(
        "MambaHybridAttnMetadata.get_extra_attn_kwargs")


class _PassesCounts:
    """A next release whose runner passes every builder its counts, and its V2 draft counts."""

    def __init__(self, is_prefilling, num_accepted_tokens, num_decode_draft_tokens_cpu):
        self.num_accepted_tokens = num_accepted_tokens
        self.num_decode_draft_tokens_cpu = num_decode_draft_tokens_cpu

    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs):
        return {"num_accepted_tokens": self.num_accepted_tokens[:num_reqs],
                "num_decode_draft_tokens_cpu": self.num_decode_draft_tokens_cpu[:num_reqs],
                "next_release_field": True}


class _ModelState:
    def prepare_attn(self, input_batch, cudagraph_mode, build):
        return build()


class _RenamedField:
    """A next release whose runner metadata names its fields otherwise."""

    def __init__(self, is_prefilling, accepted_counts=None):
        pass


class _PrepareWithoutBatch:
    def prepare_attn(self, cudagraph_mode, input_batch):
        pass


def _next_release(monkeypatch, metadata, state=_ModelState):
    import sys
    import types

    module = types.ModuleType("next_release_runner")
    if metadata is not None:
        module.MambaHybridAttnMetadata = metadata
    module.MambaHybridModelState = state
    monkeypatch.setattr(accepted_counts, "RUNNER_METADATA", (module.__name__, "MambaHybridAttnMetadata"))
    monkeypatch.setattr(accepted_counts, "RUNNER_STATE", (module.__name__, "MambaHybridModelState"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for cls in (metadata, state):  # a test's wrappers must not outlive it
        for name in ("get_extra_attn_kwargs", "prepare_attn"):
            if cls is not None and name in cls.__dict__:
                monkeypatch.setattr(cls, name, cls.__dict__[name])


def test_a_runner_that_passes_counts_still_gets_padded_rows_counted(monkeypatch):
    """Where vLLM passes the counts itself, its V2 draft counts still call a padded new request -1."""
    from types import SimpleNamespace

    _next_release(monkeypatch, _PassesCounts)
    builder, _ = speculating_builder(configured=True)
    assert state_of(builder).prompt_chunks is not None and accepted_counts.supplies(builder)
    theirs = new_linear_builder(vllm_config(configured=False), spec_tokens=K)
    metadata = _PassesCounts(None, torch.tensor([1, 1], dtype=torch.int32), torch.tensor([-1, -1], dtype=torch.int32))
    batch = SimpleNamespace(num_draft_tokens_per_req=np.array([K, 0], dtype=np.int32),
                            num_scheduled_tokens=np.array([1 + K, 2], dtype=np.int32))
    ours = _ModelState().prepare_attn(batch, None, lambda: metadata.get_extra_attn_kwargs(builder, 2))
    assert ours["num_decode_draft_tokens_cpu"].tolist() == [K, -1] and ours["next_release_field"]
    plain = _ModelState().prepare_attn(batch, None, lambda: metadata.get_extra_attn_kwargs(theirs, 2))
    assert plain["num_decode_draft_tokens_cpu"].tolist() == [-1, -1]


@pytest.mark.parametrize("metadata, state, why", [
    (_RenamedField, _ModelState, "is not the one gdn-pass reads (TypeError"),
    (None, _ModelState, "is not where gdn-pass reads it"),
    (_PassesCounts, _PrepareWithoutBatch, "does not take the step's input_batch first"),
])
def test_a_runner_it_cannot_read_is_said_at_start_and_left_alone(monkeypatch, caplog, metadata, state, why):
    _next_release(monkeypatch, metadata, state)
    with caplog.at_level("WARNING", logger="gdn_pass"):
        builder, _ = speculating_builder(configured=True)
    assert state_of(builder).prompt_chunks is None  # no repair: the builder keeps vLLM's split
    assert state_of(builder) is not None  # fresh rows still guarded
    assert "gdn-pass cannot pass them" in caplog.text and why in caplog.text
    assert not accepted_counts.supplies(builder)
    assert not hasattr(state.prepare_attn, "__wrapped__")


# --- GDN: a new request the scheduler padded, on a builder that routes fresh rows to prefill itself ---

def _gdn_step(computed, query_lens, blocks, prefilling):
    """The scheduler's step for the real GDN builder: rows on ``blocks`` (one per slot column)."""
    import dataclasses

    from tests.vllm.test_metadata_hook import common_metadata

    common = dataclasses.replace(common_metadata(computed, query_lens),
                                 block_table_tensor=torch.tensor(blocks, dtype=torch.int32))
    if hasattr(common, "is_prefilling"):  # 0.31+: what the runner says of each row
        common = dataclasses.replace(common, is_prefilling=torch.tensor(prefilling))
    return common


def _toy_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, 4, 4, generator=torch.Generator().manual_seed(seed))


def _toy_gdn(metadata, common, ssm: torch.Tensor, tokens: torch.Tensor) -> None:
    """The torch stand-in of vLLM's GDN state kernels on one layer's recurrent cache (toy update
    ``S' = S / 2 + x``): a speculative row reads column ``num_accepted - 1`` of its slots and writes
    token ``j``'s state into column ``j``; a decode reads its slot; a prefill starts from its slot only
    where the row has tokens computed (``has_initial_state``), else from zero; both write the final
    state back into the slot."""
    query_start = common.query_start_loc_cpu.tolist()
    computed = (common.seq_lens_cpu_upper_bound - (common.query_start_loc_cpu.diff())).tolist()
    masks = metadata.spec_sequence_masks
    spec = [False] * common.num_reqs if masks is None else masks.tolist()
    spec_i = non_spec_i = 0
    for row in range(common.num_reqs):
        x = tokens[query_start[row]:query_start[row + 1]]
        if spec[row]:
            slots = metadata.spec_state_indices_tensor[spec_i].tolist()
            state = ssm[slots[int(metadata.num_accepted_tokens[spec_i]) - 1]].clone()
            for j in range(x.shape[0]):
                state = state / 2 + x[j]
                ssm[slots[j]] = state
            spec_i += 1
            continue
        slot = int(metadata.non_spec_state_indices_tensor[non_spec_i])
        decode = non_spec_i < int(metadata.num_decodes)
        state = ssm[slot].clone() if decode or computed[row] > 0 else torch.zeros_like(ssm[slot])
        for j in range(x.shape[0]):
            state = state / 2 + x[j]
        ssm[slot] = state
        non_spec_i += 1


@pytest.mark.parametrize("configured", [True, False])
def test_a_padded_new_gdn_request_is_speculated_from_zero_state(configured, monkeypatch):
    """vLLM 0.31+'s GDN builder routes fresh rows to its prefill path, and its V2 runner counts no
    drafts for a row still prefilling; the scheduler pads a new one-token request with a placeholder
    draft beside a speculating row (vLLM 0.34, H200: 12 of 14 one-token prompts then went wrong).
    The oracle: after the step, the column the request's next step reads holds the state after its
    one prompt token from zero (the placeholder is rejected: accepted 1). Unconfigured (vLLM's own,
    on every release's V2 runner), the prefill path leaves the placeholder in that state. Where the
    builder itself sends fresh rows to its decode path (0.27-0.30), gdn-pass counts the drafts too."""
    from tests.vllm.test_metadata_hook import new_builder
    from tests.vllm.test_metadata_hook_row_kinds import engine_config, poisoned_caches

    config = engine_config("none", K)
    if not configured:
        config.compilation_config.inductor_compile_config.pop("post_grad_custom_post_pass")
    caches = poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False)
    history = caches[1][3].clone()
    batch = SimpleNamespace(num_draft_tokens_per_req=np.array([K, K], dtype=np.int32),
                            num_scheduled_tokens=np.array([K_TOKENS, K_TOKENS], dtype=np.int32),
                            is_prefilling_np=np.array([False, True]))
    first = _gdn_step([20, 0], [K_TOKENS, K_TOKENS], [[3, 4], [6, 7]], [False, True])
    md = prepared(batch, lambda: builder.build(0, first, **runner_kwargs(builder, [1, 1], [K, -1])))
    tokens = _toy_tokens(2 * K_TOKENS, seed=8)
    for ssm in caches[1::2]:
        _toy_gdn(md, first, ssm, tokens)
    # The placeholder rejected: the request's next step, a speculative decode (accepted 1).
    second = _gdn_step([1], [K_TOKENS], [[6, 7]], [False])
    md2 = prepared(SimpleNamespace(num_draft_tokens_per_req=np.array([K], dtype=np.int32),
                                   num_scheduled_tokens=np.array([K_TOKENS], dtype=np.int32),
                                   is_prefilling_np=np.array([False])),
                   lambda: builder.build(0, second, **runner_kwargs(builder, [1], [K])))
    read = int(md2.spec_state_indices_tensor[0, int(md2.num_accepted_tokens[0]) - 1])
    after_token = torch.zeros_like(history) / 2 + tokens[K_TOKENS]  # the request's one prompt token
    for ssm in caches[1::2]:
        if configured:  # counted drafts, zeroed slot
            assert torch.equal(ssm[read], after_token)
        else:
            assert not torch.allclose(ssm[read], after_token)  # vLLM's own: the placeholder is in it
        assert torch.equal(ssm[3], (history / 2 + tokens[0]))  # the speculating row: from its own state


def test_the_fuzz_trace_counts_only_the_rows_gdn_pass_gave_counts(monkeypatch):
    """The GPU fuzz's trace (``harness.step_trace``) counts a row as given counts by gdn-pass where vLLM
    gives its builder none (Lightning's: every speculating row) and, where vLLM does (GDN's), only a
    padded new request's row: vLLM's own unwrapped method decides, also once gdn-pass wrapped it."""
    from harness.step_trace import _vllm_passes_counts
    from tests.vllm.test_metadata_hook import new_builder
    from tests.vllm.test_metadata_hook_row_kinds import engine_config

    lightning, _ = speculating_builder(configured=True)  # wraps the runner's method
    assert accepted_counts.supplies(lightning) and not _vllm_passes_counts(lightning)
    config = engine_config("none", K)
    config.compilation_config.inductor_compile_config.pop("post_grad_custom_post_pass")
    assert _vllm_passes_counts(new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False))


def test_a_gdn_step_without_a_padded_request_is_vllm_s_alone(monkeypatch):
    """Where gdn-pass acts for padded new requests only (``Decision.padded_only``, vLLM 0.31+), a
    step without one, a new prompt's prefill included, costs the builder's own build and no more:
    nothing attached for a guard, nothing zeroed, and another group's metadata derived by
    ``update_block_table`` passes through with its shortcut kept. A padded step is still guarded."""
    from gdn_pass.vllm import metadata_hook
    from gdn_pass.vllm.handoff import ATTR
    from tests.vllm.test_metadata_hook import new_builder
    from tests.vllm.test_metadata_hook_row_kinds import engine_config, poisoned_caches

    config = engine_config("none", K)
    caches = poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False)
    if not support.recorded("gdn").padded_only:
        pytest.skip("this release's GDN builder runs fresh rows on its decode path: the entry acts on every step")
    assert state_of(builder).padded_rows_only
    poison = [c.clone() for c in caches]
    # a speculating row beside a new 5-token prompt (no drafts: not padded)
    batch = SimpleNamespace(num_draft_tokens_per_req=np.array([K, 0], dtype=np.int32),
                            num_scheduled_tokens=np.array([K_TOKENS, 5], dtype=np.int32),
                            is_prefilling_np=np.array([False, True]))
    step = _gdn_step([20, 0], [K_TOKENS, 5], [[3, 4], [6, 7]], [False, True])
    md = prepared(batch, lambda: builder.build(0, step, **runner_kwargs(builder, [1, 1], [K, -1])))
    assert not hasattr(md, ATTR) and not hasattr(md, metadata_hook._BUILD_INPUTS)
    assert all(torch.equal(c, p) for c, p in zip(caches, poison))
    if hasattr(builder, "update_block_table"):
        monkeypatch.setattr(builder, "supports_update_block_table", True, raising=False)
        derived = prepared(batch, lambda: builder.update_block_table(
            md, torch.tensor([[10, 11], [13, 14]], dtype=torch.int32), step.slot_mapping))
        assert not hasattr(derived, ATTR) and builder.supports_update_block_table
    # the same rows, the new request one token padded with a placeholder draft: guarded
    batch = SimpleNamespace(num_draft_tokens_per_req=np.array([K, K], dtype=np.int32),
                            num_scheduled_tokens=np.array([K_TOKENS, K_TOKENS], dtype=np.int32),
                            is_prefilling_np=np.array([False, True]))
    step = _gdn_step([20, 0], [K_TOKENS, K_TOKENS], [[3, 4], [6, 7]], [False, True])
    md = prepared(batch, lambda: builder.build(0, step, **runner_kwargs(builder, [1, 1], [K, -1])))
    assert hasattr(md, ATTR)
    assert all(torch.count_nonzero(c[6]) == 0 and torch.equal(c[3], p[3]) for c, p in zip(caches, poison))
