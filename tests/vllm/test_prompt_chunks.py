"""Prompt rows on the speculating Lightning builder's decode path (``gdn_pass.vllm.prompt_chunks``).

vLLM's real ``BailingLinearAttentionMetadataBuilder`` (the same in 0.26-0.34),
made as the runner makes it for an engine with one speculative token, builds
each step; the decode runs in the torch stand-in of vLLM's
``bailing_linear_attention_decode_spec`` (``lightning_spec_decode_stand_in``:
launch ``j`` reads column ``num_accepted - 1`` for ``j = 0``, else ``j - 1``,
and writes column ``j``). The reference is the recurrence run token by token
from the request's own state (``S' = k v^T + exp(-slope) S``), as a prefill
computes it. Every other slot holds poison.
"""

from __future__ import annotations

import pytest
import torch

from gdn_pass.vllm.metadata_hook import state_of
from tests.vllm.test_linear_attention_builders import (
    NUM_BLOCKS, SLOPE, D, H, lightning_spec_decode_stand_in, new_linear_builder, poisoned_caches, qkv, step)
from tests.vllm.test_metadata_hook import vllm_config

K = 1  # speculative tokens: the builder's threshold is 1 + K


@pytest.fixture(autouse=True)
def _one_speculative_token(monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: K))


def speculating_builder(configured: bool, cudagraph_mode: str = "PIECEWISE"):
    from vllm.config import CUDAGraphMode

    config = vllm_config(configured=configured)
    config.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, cudagraph_mode)
    caches = poisoned_caches(config)
    builder = new_linear_builder(config)
    assert builder.use_spec_decode and builder.decode_state_indices_tensor.shape[1] == 1 + K
    # what _init_reorder_batch_threshold sets from a speculative_config (this config has none)
    builder.reorder_batch_threshold = 1 + K
    return builder, caches


def recurrence(state, k, v, q):
    """Token by token from ``state`` ``[H, D, D]``: the outputs ``[T, H, D]`` and the final state."""
    decay = torch.exp(-SLOPE).double()[:, None, None]
    out = []
    for t in range(k.shape[0]):
        state = k[t][:, :, None] * v[t][:, None, :] + decay * state
        out.append((q[t][:, :, None] * state).sum(1))
    return torch.stack(out), state


def decode(metadata, caches, q, k, v):
    return lightning_spec_decode_stand_in(q, k, v, caches[0], metadata.state_indices_tensor_d,
                                          metadata.query_start_loc_d, metadata.num_accepted_tokens)


def own_state(caches, slot, seed):
    state = torch.rand(H, D, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for cache in caches:
        cache[slot] = state
    return state.clone()


@pytest.mark.parametrize("configured", [True, False])
def test_prompt_chunk_next_to_a_speculating_row_keeps_its_state_for_the_next_step(configured):
    """Row 1 is a prompt's last chunk of 1 + k tokens (8 computed, on slots [6, 7]) beside a
    speculating row: the builder puts it on the speculative path, which leaves its state in
    column 1; the next step reads column 0. With the pass, the state is where it is read."""
    builder, caches = speculating_builder(configured)
    history = own_state(caches, 6, seed=1)
    speculating = own_state(caches, 4, seed=2)  # row 0 accepted 2 last step: column 1
    common = step([20, 8], [2, 2], [[3, 4], [6, 7]])
    drafts = torch.tensor([K, -1], dtype=torch.int32)
    first = builder.build(0, common, num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32),
                          num_decode_draft_tokens_cpu=drafts)
    assert (first.num_decodes, first.num_prefills) == (2, 0)  # vLLM's split: the chunk is a decode
    q, k, v = qkv(4, seed=3)
    out = decode(first, caches, q, k, v)
    chunk_out, chunk_state = recurrence(history, k[2:], v[2:], q[2:])
    assert torch.equal(out[2:], chunk_out)  # this step's outputs are right either way
    assert torch.equal(out[:2], recurrence(speculating, k[:2], v[:2], q[:2])[0])
    # Next step: the request decodes its first token and one draft; it accepted nothing before.
    second = builder.build(0, step([10], [2], [[6, 7]]), num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
                           num_decode_draft_tokens_cpu=torch.tensor([K], dtype=torch.int32))
    q2, k2, v2 = qkv(2, seed=4)
    out2 = decode(second, caches, q2, k2, v2)
    expected = recurrence(chunk_state, k2, v2, q2)[0]
    if configured:
        assert first.state_indices_tensor_d.tolist() == [[3, 4], [6, 6]]
        assert torch.equal(out2, expected)
        assert state_of(builder).prompt_chunks.rows_repaired == 1
    else:  # vLLM as is: the state after the chunk's first token only
        assert first.state_indices_tensor_d.tolist() == [[3, 4], [6, 7]]
        assert not torch.allclose(out2, expected)


def test_the_pass_leaves_the_block_table_and_other_rows_as_they_were():
    """The repaired row is a copy: vLLM's block table (the other groups' builds read it) is unchanged."""
    builder, _ = speculating_builder(True)
    common = step([20, 8, 0], [2, 2, 1], [[3, 4], [6, 7], [9, 10]])
    table = common.block_table_tensor.clone()
    md = builder.build(0, common, num_accepted_tokens=torch.tensor([1, 1, 1], dtype=torch.int32),
                       num_decode_draft_tokens_cpu=torch.tensor([K, -1, -1], dtype=torch.int32))
    assert torch.equal(common.block_table_tensor, table)
    # the speculating row and the fresh one-token row keep their columns
    assert md.state_indices_tensor_d.tolist() == [[3, 4], [6, 6], [9, 10]]


@pytest.mark.parametrize("configured", [True, False])
def test_a_step_without_drafts_stages_the_full_graph_buffers_it_replays(configured):
    """A prompt's last chunk of 1 + k tokens alone in its step: no request has drafts, so the runner
    passes no accepted counts, yet it replays the FULL graph captured for speculative decodes of
    that shape, which reads the builder's persistent decode buffers. Without the pass the builder
    calls the row a prefill and leaves the buffers as the last decode step staged them: the
    replay reads and writes that step's slots."""
    builder, caches = speculating_builder(configured, "FULL_AND_PIECEWISE")
    earlier = builder.build(0, step([30], [2], [[3, 4]]), num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
                            num_decode_draft_tokens_cpu=torch.tensor([K], dtype=torch.int32))
    assert earlier.num_prefills == 0  # staged the buffers for slots [3, 4]
    other = own_state(caches, 3, seed=5)
    history = own_state(caches, 6, seed=1)
    alone = builder.build(0, step([8], [2], [[6, 7]]))  # the runner's call: no accepted counts
    q, k, v = qkv(2, seed=6)
    # What the replayed graph reads: the persistent buffers, one row.
    replayed = lightning_spec_decode_stand_in(q, k, v, caches[0], builder.decode_state_indices_tensor[:1],
                                              builder.decode_query_start_loc[:2],
                                              builder.decode_num_accepted_tokens[:1])
    expected = recurrence(history, k, v, q)[0]
    if configured:
        assert (alone.num_decodes, alone.num_prefills) == (1, 0)
        assert builder.decode_state_indices_tensor[0].tolist() == [6, 6]
        assert torch.equal(replayed, expected)
        assert torch.equal(caches[0][3], other)  # the earlier request's state untouched
        assert state_of(builder).prompt_chunks.steps_staged == 1
    else:
        assert (alone.num_decodes, alone.num_prefills) == (0, 1)
        assert builder.decode_state_indices_tensor[0].tolist() == [3, 4]  # the earlier step's
        assert not torch.allclose(replayed, expected)
        assert not torch.equal(caches[0][3], other)  # and it wrote into another request's slot


def test_fresh_prompt_of_one_plus_k_tokens_alone_reads_zero_state():
    """The same step for a brand-new 2-token prompt: staged, one slot, and that slot zeroed."""
    builder, caches = speculating_builder(True, "FULL_AND_PIECEWISE")
    md = builder.build(0, step([0], [2], [[6, 7]]))
    assert builder.decode_state_indices_tensor[0].tolist() == [6, 6]
    assert torch.count_nonzero(caches[0][6]) == 0 and torch.count_nonzero(caches[1][6]) == 0
    q, k, v = qkv(2, seed=7)
    replayed = lightning_spec_decode_stand_in(q, k, v, caches[0], builder.decode_state_indices_tensor[:1],
                                              builder.decode_query_start_loc[:2],
                                              builder.decode_num_accepted_tokens[:1])
    zero = torch.zeros(H, D, D, dtype=torch.float64)
    out, state = recurrence(zero, k, v, q)
    assert torch.equal(replayed, out) and torch.equal(caches[0][6], state)
    assert md.num_decodes == 1


@pytest.mark.parametrize("mode, qlens, computed", [
    ("FULL_AND_PIECEWISE", [2, 1], [8, 5]),  # not a uniform speculative shape: no FULL replay
    ("FULL_AND_PIECEWISE", [1, 1], [8, 5]),
    ("PIECEWISE", [2, 2], [8, 16]),  # no FULL graphs captured
])
def test_steps_no_full_graph_replays_build_as_vllm(mode, qlens, computed):
    builder, _ = speculating_builder(True, mode)
    blocks = [[6, 7], [9, 10]]
    md = builder.build(0, step(computed, qlens, blocks))
    plain = type(builder).build.__wrapped__(builder, 0, step(computed, qlens, blocks))
    assert (md.num_decodes, md.num_prefills) == (plain.num_decodes, plain.num_prefills)
    assert md.num_accepted_tokens is None and state_of(builder).prompt_chunks.steps_staged == 0


def test_rows_with_drafts_and_one_token_rows_are_never_changed():
    builder, _ = speculating_builder(True)
    common = step([20, 31, 0], [2, 1, 1], [[3, 4], [6, 7], [9, 10]])
    md = builder.build(0, common, num_accepted_tokens=torch.tensor([2, 1, 1], dtype=torch.int32),
                       num_decode_draft_tokens_cpu=torch.tensor([K, 0, -1], dtype=torch.int32))
    assert md.state_indices_tensor_d.tolist() == [[3, 4], [6, 7], [9, 10]]
    assert state_of(builder).prompt_chunks.rows_repaired == 0


def test_no_repair_without_speculation(monkeypatch):
    from vllm.config import VllmConfig

    builder, _ = speculating_builder(True)
    assert state_of(builder).prompt_chunks is not None
    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: 0))
    config = vllm_config(configured=True)
    poisoned_caches(config)
    assert state_of(new_linear_builder(config)).prompt_chunks is None


def test_poison_is_everywhere_else():
    """The fixture's premise: every slot but the ones a test sets holds non-zero poison."""
    config = vllm_config(configured=False)
    caches = poisoned_caches(config)
    assert all(torch.count_nonzero(c[s]) == H * D * D for c in caches for s in range(NUM_BLOCKS))
