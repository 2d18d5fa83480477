"""Restored vs fresh, exactly: every kind of row vLLM's scheduler puts in a GDN step.

A row must start from zero state if and only if no token of its request was
computed before this step; the slot that matters is the one vLLM's kernels
read the row's initial state from. Each test builds one step with the real
``GDNAttentionMetadataBuilder`` (configured with GDNStatePass, so the metadata
hook stages rows and, with no guarded op run in this process, the step guard
zeroes the fresh slots at build time) from a real ``CommonAttentionMetadata``,
for each kind of row:

- a brand-new request (the bug: one token next to decodes, called a decode);
- a request resumed after preemption (recomputed from zero, or from a
  prefix-cache hit);
- a prefix-cache hit in mamba "align" mode, down to a one-token remainder
  that vLLM calls a decode (its state is restored: it must not be zeroed);
- a chunked-prefill continuation;
- speculative rows: continuing, a fresh request padded with placeholder
  drafts, and a restored request padded the same way.

Per request it checks the staged ``has_initial_state``, ``valid``, the slot
the staged row names, and which cache slots the step guard really zeroed:
those of the fresh rows that vLLM's split puts on a path whose kernels read
the slot whatever ``has_initial_state`` says (its decodes, the first
``num_decodes`` non-speculative rows, and its speculative rows). A fresh row
on the prefill path keeps its slot as it was: vLLM's prefill starts it from
zero state itself (``qwen_gdn_linear_attn.py``: ``initial_state[~prefill_has_initial_state]
= 0``; ``causal_conv1d.py`` loads no prior tokens without initial state; the
CPU op zeroes ``ssm_state[no_initial_state]``).
Every expected value comes from vLLM's own fields, with the vLLM source that
gives it (read in vLLM 0.26, 0.27 and 0.30), never from the hook.

vLLM facts used throughout (paths under ``vllm/``):

- ``v1/core/sched/scheduler.py`` ``Scheduler.schedule``: a waiting request
  (new, or resumed) with ``num_computed_tokens == 0`` gets its prefix-cache
  hit as ``num_computed_tokens`` (0 without prefix caching) and is scheduled
  ``request.num_tokens - num_computed_tokens`` tokens ("to consider the
  resumed requests, which have output tokens"), capped by the token budget;
  ``_update_after_schedule`` then adds the scheduled tokens to
  ``num_computed_tokens``.
- ``v1/core/sched/scheduler.py`` ``_preempt_request``: frees the request's
  blocks and resets ``num_computed_tokens`` to 0.
- Mamba blocks are handed out without zeroing: ``v1/core/
  single_type_kv_cache_manager.py`` records new blocks for worker-side zeroing
  only for attention specs (``_record_new_block_ids``: full/MLA attention in
  0.26/0.27, ``AttentionSpec`` in 0.30), never ``MambaSpec``. A fresh row's
  slot holds its previous owner's state.
- ``model_executor/models/config.py`` ``MambaModelConfig``: prefix caching
  turns mamba cache mode "none" into "align" (GDN models are not
  ``SupportsMambaPrefixCaching``, so "all" falls back to "align" too): prefix
  hits on a GDN model are always "align" hits.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import compat, handoff, metadata_hook, step_guard, support
from gdn_pass.vllm.builders import gdn
from gdn_pass.vllm.handoff import handoff_of
from tests.vllm.test_metadata_hook import LAYERS, common_metadata, new_builder, stage_all

BLOCK = 16  # block_size of the MambaSpec that new_builder() gives the builder
NUM_BLOCKS = 32  # slots in each test cache; block 0 is vLLM's null block
SPEC = 2  # num_speculative_tokens of the speculative engines


@dataclasses.dataclass(frozen=True)
class Req:
    """One request's row of a step, in vLLM's fields, and what must be staged for it."""

    computed: int  # num_computed_tokens before this step
    query_len: int  # tokens scheduled this step
    blocks: tuple[int, ...]  # the request's row of the mamba block table
    restored: bool  # expected has_initial_state
    reads: int  # the slot vLLM's kernels read the row's initial state from
    drafts: int = -1  # its num_decode_draft_tokens_cpu entry: -1 = not speculative
    accepted: int = 1  # its num_accepted_tokens entry (speculative engines)


def kernel_read_slot(req: Req, cache_mode: str) -> int:
    """The slot vLLM reads ``req``'s initial state from, by vLLM's own rules.

    - "none": the block table is the request's 1 + num_speculative_blocks
      blocks as is; "align": the builder gathers the blocks from
      ``(seq_len - 1) // block_size`` on (``v1/attention/backends/utils.py``
      ``mamba_get_block_table_tensor``), which is where the runner keeps the
      running state and copies a prefix hit's state to before the forward
      (``v1/worker/mamba_utils.py`` ``preprocess_mamba``: ``curr_state_idx =
      cdiv(num_computed_tokens + num_scheduled_tokens, block_size) - 1``).
    - the non-speculative kernels read column 0 (``gdn_attn.py`` ``build``:
      ``non_spec_state_indices_tensor = block_table_tensor[:, 0]``); the
      speculative recurrent kernel reads column ``num_accepted_tokens - 1``
      (``third_party/flash_linear_attention/ops/fused_recurrent.py``:
      ``i_t = num_accepted_tokens[i_n] - 1``).
    """
    start = 0
    if cache_mode == "align":
        start = -(-(req.computed + req.query_len) // BLOCK) - 1
    column = req.accepted - 1 if req.drafts >= 0 else 0
    return req.blocks[start + column]


def engine_config(cache_mode: str, num_spec: int):
    """A configured engine's VllmConfig: mamba cache mode, speculative tokens."""
    from vllm.config import CacheConfig, CompilationConfig, VllmConfig

    from gdn_pass.vllm import VllmGDNStatePass

    cc = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()})
    cache = CacheConfig(enable_prefix_caching=cache_mode == "align", mamba_cache_mode=cache_mode)
    config = VllmConfig(compilation_config=cc, cache_config=cache,
                        additional_config={"gdn_prefill_backend": "triton"})
    if num_spec:
        # A real SpeculativeConfig needs a model; the builder reads only these two fields.
        config.speculative_config = SimpleNamespace(num_speculative_tokens=num_spec,
                                                    parallel_drafting=False)
    return config


def poisoned_caches(config) -> list[torch.Tensor]:
    """Every layer's conv and recurrent state, slot s filled with s + 1 (never 0)."""
    caches = []
    for name in LAYERS:
        conv = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.bfloat16).view(-1, 1, 1).expand(-1, 3, 8)
        ssm = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 2, 4, 4)
        layer = SimpleNamespace(kv_cache=[conv.contiguous(), ssm.contiguous()])
        config.compilation_config.static_forward_context[name] = layer
        caches.extend(layer.kv_cache)
    return caches


def run_step(reqs: list[Req], *, cache_mode: str, num_spec: int, like_0_26: bool, monkeypatch):
    """Build one step; return vLLM's metadata, the hook's staged rows (only what its
    guards read: the rows to zero and their slots), every row of the step staged
    in full (``stage_all``), and the caches after the build."""
    config = engine_config(cache_mode, num_spec)
    caches = poisoned_caches(config)
    # No guarded op has run in this process: the step guard owns the group and
    # zeroes the fresh slots at build time, so the test sees what was zeroed.
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())
    builder = new_builder(config, like_0_26=like_0_26, monkeypatch=monkeypatch)
    # As MambaBase.get_kv_cache_spec (model_executor/layers/mamba/abstract.py) makes it:
    # the cache mode, and one spare block per speculative token.
    builder.kv_cache_spec = dataclasses.replace(builder.kv_cache_spec, mamba_cache_mode=cache_mode,
                                                num_speculative_blocks=num_spec)
    width = max(len(r.blocks) for r in reqs)
    table = torch.tensor([list(r.blocks) + [0] * (width - len(r.blocks)) for r in reqs], dtype=torch.int32)
    common = dataclasses.replace(common_metadata([r.computed for r in reqs], [r.query_len for r in reqs]),
                                 block_table_tensor=table)
    kwargs = {}
    if num_spec:
        kwargs = dict(num_accepted_tokens=torch.tensor([r.accepted for r in reqs], dtype=torch.int32),
                      num_decode_draft_tokens_cpu=torch.tensor([r.drafts for r in reqs], dtype=torch.int32))
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common, **kwargs)  # 0.26's call
    rows = handoff_of(metadata).rows
    full = StagedRowMetadata(rows.max_rows, pad_slot_ids=compat.pad_slot_ids())
    stage_all(full, common, metadata, kwargs.get("num_decode_draft_tokens_cpu"))
    metadata.test_common = common  # for check_step's look at vLLM's own device lengths
    return metadata, rows, full, caches


def staged_by_slot(rows) -> dict[int, tuple[bool, bool]]:
    """``{slot named by the staged row: (has_initial_state, valid)}`` over the staged rows."""
    n = rows.num_rows
    return {int(s): (bool(h), bool(v)) for s, h, v in
            zip(rows.state_slot[:n], rows.has_initial_state[:n], rows.valid[:n])}


def zeroed_slots(caches: list[torch.Tensor]) -> list[set[int]]:
    """Per cache, the slots the build zeroed (all slots started non-zero)."""
    return [{s for s in range(NUM_BLOCKS) if not cache[s].any()} for cache in caches]


# --- the row kinds -------------------------------------------------------------
#
# Steps list their rows in vLLM's batch order: one-token rows (decodes) first
# (reorder_batch_threshold = 1; 1 + num_spec with speculation), then longer ones.

# Decoding requests: num_computed_tokens > 0, so their state is restored.
DECODE = Req(9, 1, (3,), restored=True, reads=3)
DECODE_2 = Req(30, 1, (5,), restored=True, reads=5)


def none_step(reqs, every_row_one_token, id):
    return pytest.param("none", reqs, every_row_one_token, id=id)


def align_step(reqs, every_row_one_token, id):
    return pytest.param("align", reqs, every_row_one_token, id=id)


NONE_MODE = [
    none_step(
        # The bug's step. New request, no prefix caching: num_computed_tokens = 0
        # (scheduler.py schedule); a one-token prompt is one token. Every row has
        # one token, so gdn_attn.py build's split_decodes_and_prefills calls all of
        # them decodes and sets has_initial_state = None; the decode kernels then
        # read slot 4, its previous owner's state. Fresh.
        [DECODE, Req(0, 1, (4,), restored=False, reads=4), DECODE_2],
        True, id="brand_new_one_token_among_decodes"),
    none_step(
        # Resumed after preemption: _preempt_request set num_computed_tokens = 0
        # and freed its blocks; schedule() recomputes prompt + output tokens
        # (8 + 3) from zero, on a newly allocated (recycled) block. Fresh.
        [DECODE, Req(0, 11, (6,), restored=False, reads=6)],
        False, id="resumed_after_preemption_recomputes_from_zero"),
    none_step(
        # The same resume with one token of budget left: schedule() caps the chunk
        # (num_new_tokens = min(num_new_tokens, request_token_budget)) to one token;
        # the step is all one-token rows, so vLLM calls it a decode. Fresh.
        [DECODE, Req(0, 1, (6,), restored=False, reads=6), DECODE_2],
        True, id="resumed_after_preemption_one_token_chunk_among_decodes"),
    none_step(
        # Second chunk of a 48-token prompt: _update_after_schedule added the first
        # 32 tokens to num_computed_tokens; the chunk continues the state the first
        # chunk left in the request's own block. Restored.
        [DECODE, Req(32, 16, (7,), restored=True, reads=7)],
        False, id="chunked_prefill_continuation"),
    none_step(
        # The same continuation cut to one token by the budget, next to a brand-new
        # one-token request: both are "decodes" to vLLM, but only the new one is
        # fresh; the continuation's slot holds its own first chunk. Restored / fresh.
        [DECODE, Req(32, 1, (7,), restored=True, reads=7), Req(0, 1, (4,), restored=False, reads=4),
         DECODE_2],
        True, id="chunked_prefill_continuation_one_token_next_to_a_new_request"),
]

# Align mode (prefix caching on). A request's row of the block table holds null
# blocks (0) where no state is kept: single_type_kv_cache_manager.py
# MambaManager.allocate_new_blocks fills skipped blocks with the null block, and
# a prefix hit keeps the hit state in its last block ("When a new request hits
# the prefix cache, the last block saves the hit state"). The builder reads the
# block of the row's last token this step, (seq_len - 1) // block_size
# (utils.py mamba_get_block_table_tensor); before the forward the runner copies
# the state of block (num_computed_tokens - 1) // block_size there
# (mamba_utils.py preprocess_mamba, called from gpu_model_runner.py). So the slot
# a prefix-hit row reads is not the hit block but the new block after it.
ALIGN_DECODE = Req(9, 1, (3,), restored=True, reads=3)
# A decode in its third block: the older blocks were retired to the null block
# (MambaManager.remove_skipped_blocks).
ALIGN_DECODE_2 = Req(40, 1, (0, 0, 5), restored=True, reads=5)

ALIGN_MODE = [
    align_step(
        # 40-token prompt, 32 tokens (2 blocks) in the prefix cache:
        # num_computed_tokens = 32 (scheduler.py schedule: kv_cache_manager.get_computed_blocks).
        # Hit state in block 7 (index 1); the runner copies it into block 8
        # (index cdiv(40, 16) - 1 = 2), which the kernels read. Restored, slot 8.
        [ALIGN_DECODE, Req(32, 8, (0, 7, 8), restored=True, reads=8)],
        False, id="align_prefix_hit"),
    align_step(
        # 33-token prompt: the hit is capped at num_tokens - 1 = 32 tokens
        # (kv_cache_manager.py get_computed_blocks: max_cache_hit_length), one token
        # remains. Every row has one token: vLLM calls the hit row a decode,
        # has_initial_state = None, and the decode kernel reads block 8, which
        # preprocess_mamba filled from hit block 7. It must NOT be zeroed; the
        # brand-new one-token request next to it (block 9) must be. Restored / fresh.
        [ALIGN_DECODE, Req(32, 1, (0, 7, 8), restored=True, reads=8),
         Req(0, 1, (9,), restored=False, reads=9), ALIGN_DECODE_2],
        True, id="align_prefix_hit_one_token_remainder_among_decodes"),
    align_step(
        # A decode crossing into its third block: the same fields as the one-token
        # remainder (num_computed_tokens = 32, block 4 -> 6 copied by
        # preprocess_mamba: prev_state_idx 1 != curr_state_idx 2). Restored.
        [ALIGN_DECODE, Req(32, 1, (0, 4, 6), restored=True, reads=6),
         Req(0, 1, (9,), restored=False, reads=9)],
        True, id="align_decode_crossing_a_block_boundary"),
    align_step(
        # Resumed after preemption with a prefix hit: _preempt_request reset
        # num_computed_tokens to 0, so the resume takes schedule()'s prefix lookup
        # like a new request: 8 prompt + 35 output = 43 tokens, 32 cached, 11 left,
        # read from block index cdiv(43, 16) - 1 = 2. Restored, slot 8.
        [ALIGN_DECODE, Req(32, 11, (0, 7, 8), restored=True, reads=8)],
        False, id="align_resumed_after_preemption_with_prefix_hit"),
    align_step(
        # The same resume with one token left (33 tokens, 32 cached), among decodes. Restored.
        [ALIGN_DECODE, Req(32, 1, (0, 7, 8), restored=True, reads=8), ALIGN_DECODE_2],
        True, id="align_resumed_with_prefix_hit_one_token_left_among_decodes"),
    align_step(
        # Resumed without a prefix hit: 43 tokens from zero; its only real block is
        # the running-state block at index 2 (the null blocks before it hold
        # nothing). Fresh, slot 10, not column 0 (the null block).
        [ALIGN_DECODE, Req(0, 43, (0, 0, 10), restored=False, reads=10)],
        False, id="align_resumed_after_preemption_without_prefix_hit"),
]

# Speculative engines (num_speculative_tokens = 2). Without prefix caching a
# request holds 1 + num_speculative_blocks blocks (MambaManager.allocate_new_blocks).
# A row is speculative when the runner sets its num_decode_draft_tokens to its
# draft count, i.e. it was scheduled 1 + drafts tokens (gpu_model_runner.py
# _prepare_inputs; -1 for every other row, "For chunked prefills, use -1"); the
# builder's spec_sequence_masks is that >= 0 (gdn_attn.py build). A new request's
# num_accepted_tokens is 1 (gpu_input_batch.py add_request), so it reads column 0.
# schedule() pads a new one-token request scheduled next to running speculative
# decodes to 1 + num_spec tokens with [-1] * num_spec placeholder drafts ("Pad new
# decode requests to uniform spec decoding size"): a fresh row that vLLM treats
# as a speculative decode reading its recycled slot.
SPEC_DECODE = Req(40, 3, (3, 4, 5), restored=True, reads=3, drafts=SPEC)
SPEC_NEW_PADDED = Req(0, 3, (6, 7, 8), restored=False, reads=6, drafts=SPEC)

SPEC_NONE_MODE = [
    pytest.param(
        # Every row speculative: the builder has no non-speculative slots at all
        # (non_spec_state_indices_tensor = None). Restored / fresh.
        [SPEC_DECODE, SPEC_NEW_PADDED],
        id="spec_decode_and_fresh_request_padded_with_placeholder_drafts"),
    pytest.param(
        # Next to non-speculative rows (drafts -1), which the builder takes from
        # column 0 (block_table_tensor[~spec_sequence_masks_cpu, 0]): a chunked-prefill
        # continuation (restored) and a brand-new prompt (fresh).
        [SPEC_DECODE, SPEC_NEW_PADDED, Req(32, 8, (9, 10, 11), restored=True, reads=9),
         Req(0, 8, (12, 13, 14), restored=False, reads=12)],
        id="spec_rows_next_to_a_continuation_and_a_new_prompt"),
]

SPEC_ALIGN_MODE = [
    pytest.param(
        # Align mode with speculation: the builder gathers 1 + num_speculative_blocks
        # blocks from (seq_len - 1) // block_size. The 33-token prompt with a 32-token
        # hit is padded to 3 tokens like a new one (0.26/0.27 pad whenever running
        # requests were scheduled; 0.30 also pads when num_computed_tokens > 0):
        # seq_len 35, blocks from index 2 = (8, 20, 21); preprocess_mamba copies hit
        # block 7 into block 8 (curr_state_idx = cdiv(35, 16) + 2 - 1 - 2 = 2) and the
        # kernel reads column num_accepted_tokens - 1 = 0: slot 8. Restored, though it
        # is a speculative row in its first step. The fresh padded request next to it
        # reads its first block. Restored / fresh.
        [Req(40, 3, (0, 0, 3, 4, 5), restored=True, reads=3, drafts=SPEC),
         Req(32, 3, (0, 7, 8, 20, 21), restored=True, reads=8, drafts=SPEC),
         Req(0, 3, (6, 22, 23), restored=False, reads=6, drafts=SPEC)],
        id="align_spec_restored_and_fresh_requests_padded_with_placeholder_drafts"),
]


def reads_slot_regardless(reqs, metadata) -> list[bool]:
    """Per request, by vLLM's own split: does its path read the slot whatever
    ``has_initial_state`` says? Speculative rows do; of the others (batch
    order), the builder's first ``num_decodes`` (``gdn_attn.py`` ``build``)."""
    out, non_spec = [], 0
    for r in reqs:
        if r.drafts >= 0:
            out.append(True)
            continue
        out.append(non_spec < metadata.num_decodes)
        non_spec += 1
    return out


def check_step(reqs, cache_mode, metadata, rows, full, caches):
    # The case table itself follows vLLM's read rule (catches a typo in a slot).
    assert [r.reads for r in reqs] == [kernel_read_slot(r, cache_mode) for r in reqs]
    assert rows.num_rows == full.num_rows == len(reqs)
    # Each request is staged once, naming the slot vLLM reads, as a real row,
    # restored exactly when tokens were computed before this step.
    assert staged_by_slot(full) == {r.reads: (r.restored, True) for r in reqs}
    read_anyway = reads_slot_regardless(reqs, metadata)
    fresh = {r.reads for r, reads in zip(reqs, read_anyway) if not r.restored and reads}
    assert set(full.fresh_slots().tolist()) == fresh
    # The hook stages only what its guards read: the rows to zero and their slots.
    assert set(rows.fresh_slots().tolist()) == fresh
    # The step guard zeroed exactly the slots of the fresh rows whose kernels
    # read them, in every cache: a restored row's state (a prefix hit's copied
    # state included) and a fresh prefill's recycled slot are untouched.
    assert zeroed_slots(caches) == [fresh] * len(caches)
    # On CUDA steps without speculative rows the zeroing launch finds the rows in
    # vLLM's own tensors instead (rows.DecodeRows): they name the same slots.
    decode = gdn.gdn_decode_rows(metadata.test_common, metadata)
    if any(r.drafts >= 0 for r in reqs):
        assert decode is None
    else:
        slots, new_rows = handoff.new_decode_rows(decode)
        assert set(slots[new_rows].tolist()) == fresh


@pytest.mark.parametrize("like_0_26", [True, False])
@pytest.mark.parametrize("cache_mode, reqs, every_row_one_token", NONE_MODE + ALIGN_MODE)
def test_non_speculative_row_kinds(monkeypatch, like_0_26, cache_mode, reqs, every_row_one_token):
    metadata, rows, full, caches = run_step(reqs, cache_mode=cache_mode, num_spec=0, like_0_26=like_0_26,
                                      monkeypatch=monkeypatch)
    if every_row_one_token:
        # vLLM's own classification gives no per-row freshness here: every row is
        # a decode and has_initial_state is None (gdn_attn.py build).
        assert (metadata.num_decodes, metadata.num_prefills) == (len(reqs), 0)
        assert metadata.has_initial_state is None
    check_step(reqs, cache_mode, metadata, rows, full, caches)


@pytest.mark.parametrize("like_0_26", [True, False])
@pytest.mark.parametrize("reqs", SPEC_NONE_MODE)
def test_speculative_row_kinds(monkeypatch, like_0_26, reqs):
    metadata, rows, full, caches = run_step(reqs, cache_mode="none", num_spec=SPEC, like_0_26=like_0_26,
                                      monkeypatch=monkeypatch)
    assert metadata.num_spec_decodes == sum(r.drafts >= 0 for r in reqs)
    check_step(reqs, "none", metadata, rows, full, caches)


@pytest.mark.parametrize("like_0_26", [True, False])
@pytest.mark.parametrize("reqs", SPEC_ALIGN_MODE)
def test_speculative_row_kinds_in_align_mode(monkeypatch, like_0_26, reqs):
    metadata, rows, full, caches = run_step(reqs, cache_mode="align", num_spec=SPEC, like_0_26=like_0_26,
                                      monkeypatch=monkeypatch)
    assert metadata.num_spec_decodes == len(reqs)
    # The builder's own slots are the gathered ones, not column 0 (a null block).
    assert metadata.spec_state_indices_tensor[:, 0].tolist() == [r.reads for r in reqs]
    check_step(reqs, "align", metadata, rows, full, caches)


@pytest.mark.parametrize("accepted", [1, 2, 3])
def test_continuing_speculative_row_is_never_zeroed_whatever_it_accepted(monkeypatch, accepted):
    """After accepting ``accepted - 1`` drafts a speculative decode reads column
    ``accepted - 1`` of its slots (fused_recurrent.py); none of its slots may be
    zeroed, while the fresh padded request next to it (num_accepted_tokens 1,
    gpu_input_batch.py add_request) has its column 0 zeroed."""
    spec_decode = dataclasses.replace(SPEC_DECODE, accepted=accepted, reads=SPEC_DECODE.blocks[accepted - 1])
    _, rows, full, caches = run_step([spec_decode, SPEC_NEW_PADDED], cache_mode="none", num_spec=SPEC,
                               like_0_26=False, monkeypatch=monkeypatch)
    assert full.has_initial_state[:2].tolist().count(False) == 1
    assert rows.fresh_slots().tolist() == [SPEC_NEW_PADDED.reads]
    assert zeroed_slots(caches) == [{SPEC_NEW_PADDED.reads}] * len(caches)


def _has_update_block_table() -> bool:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    return "update_block_table" in GDNAttentionMetadataBuilder.__dict__


@pytest.mark.skipif(not _has_update_block_table(), reason="GDN's update_block_table is vLLM 0.31+")
def test_another_group_s_metadata_made_by_update_block_table_is_guarded(monkeypatch):
    """vLLM's V2 runner (CUDA, 0.31+) builds GDN metadata for a step's first group only and makes
    every other group's with ``update_block_table`` from it: no build, so no build hook, runs for
    them. A new request the scheduler padded with a draft (its drafts counted) must still have its
    column-0 slot zeroed in the second group's caches; every other slot keeps its poison."""
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    k = 1
    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: k))
    config = engine_config("none", k)
    caches_a = poisoned_caches(config)
    first = new_builder(config, like_0_26=False, monkeypatch=monkeypatch, acting=False)
    assert support.recorded("gdn").action == support.ACTS
    layers_b = ["model.layers.4.linear_attn", "model.layers.5.linear_attn"]
    caches_b = []
    for name in layers_b:
        kv = [torch.arange(1, 33, dtype=torch.bfloat16).view(-1, 1, 1).expand(-1, 3, 8).contiguous(),
              torch.arange(1, 33, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 2, 4, 4).contiguous()]
        config.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=kv)
        caches_b.extend(kv)
    spec = MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))
    second = GDNAttentionMetadataBuilder(spec, layers_b, config, torch.device("cpu"))
    # What the hook does for a CUDA builder of the V2 runner, whose supports_update_block_table is set.
    metadata_hook.state_of(first).shares_metadata = True
    common = dataclasses.replace(common_metadata([20, 0], [1 + k, 1 + k]),
                                 block_table_tensor=torch.tensor([[3, 4], [6, 7]], dtype=torch.int32))
    if hasattr(common, "is_prefilling"):
        common = dataclasses.replace(common, is_prefilling=torch.tensor([False, True]))
    made = first.build(0, common, num_accepted_tokens=torch.ones(2, dtype=torch.int32),
                       num_decode_draft_tokens_cpu=torch.tensor([k, k], dtype=torch.int32))
    derived = second.update_block_table(made, torch.tensor([[10, 11], [13, 14]], dtype=torch.int32),
                                        common.slot_mapping)
    assert derived.spec_state_indices_tensor.tolist() == [[10, 11], [13, 14]]  # vLLM's own re-gather
    for caches, zeroed in ((caches_a, 6), (caches_b, 13)):
        for cache in caches:
            assert torch.count_nonzero(cache[zeroed]) == 0
            others = torch.cat([cache[:zeroed], cache[zeroed + 1:]])
            slots = torch.cat([torch.arange(1, zeroed + 1), torch.arange(zeroed + 2, 33)]).to(cache.dtype)
            assert torch.equal(others.flatten(1)[:, 0], slots), "a slot other than the new row's was touched"
