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
    # vLLM's class as installed: a test's wrapper must not outlive it
    cls = runner_metadata_class()
    monkeypatch.setattr(cls, "get_extra_attn_kwargs", cls.get_extra_attn_kwargs)


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
    """A next release whose runner passes every builder its counts (upstream fixed)."""

    def __init__(self, is_prefilling, num_accepted_tokens, num_decode_draft_tokens_cpu):
        self.counts = {"num_accepted_tokens": num_accepted_tokens,
                       "num_decode_draft_tokens_cpu": num_decode_draft_tokens_cpu}

    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs):
        return {name: t[:num_reqs] for name, t in self.counts.items()}


class _RenamedField:
    """A next release whose runner metadata names its fields otherwise."""

    def __init__(self, is_prefilling, accepted_counts=None):
        pass


def _next_release(monkeypatch, cls):
    import types

    module = types.ModuleType("next_release_runner")
    module.MambaHybridAttnMetadata = cls
    monkeypatch.setattr(accepted_counts, "RUNNER_METADATA", (module.__name__, "MambaHybridAttnMetadata"))
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)


def test_a_runner_that_passes_counts_is_left_as_it_is(monkeypatch):
    _next_release(monkeypatch, _PassesCounts)
    builder, _ = speculating_builder(configured=True)
    assert state_of(builder).prompt_chunks is not None
    assert not hasattr(_PassesCounts.get_extra_attn_kwargs, accepted_counts._MARK)
    assert accepted_counts._SUPPLIED not in builder.__dict__


@pytest.mark.parametrize("runner, why", [
    (_RenamedField, "is not the one gdn-pass reads (TypeError"),
    (None, "is not in next_release_runner"),
])
def test_a_runner_it_cannot_read_is_said_at_start_and_left_alone(monkeypatch, caplog, runner, why):
    _next_release(monkeypatch, runner)
    if runner is None:
        monkeypatch.delattr(__import__("sys").modules["next_release_runner"], "MambaHybridAttnMetadata")
    with caplog.at_level("WARNING", logger="gdn_pass"):
        builder, _ = speculating_builder(configured=True)
    assert state_of(builder).prompt_chunks is None  # no repair: the builder keeps vLLM's split
    assert state_of(builder) is not None  # fresh rows still guarded
    assert "gdn-pass cannot pass them" in caplog.text and why in caplog.text
    assert accepted_counts._SUPPLIED not in builder.__dict__
