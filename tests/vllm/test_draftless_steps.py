"""Draftless prompt chunks of 1 + k tokens kept off the speculative FULL graph (``gdn_pass.vllm.draftless_steps``).

The installed vLLM's own pieces decide each step: the V1 runner's
``_determine_batch_execution_and_padding`` with a real ``CudagraphDispatcher``
whose keys are those of ``FULL_AND_PIECEWISE`` graphs, and the real
``GDNAttentionMetadataBuilder`` of an engine with one speculative token. The
oracle is the builder's own classification: a step it builds with a prefill
must not get the FULL graph, whose decode buffers it did not stage.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gdn_pass.vllm import draftless_steps, support
from harness.v1_runner import graph_choosing_runner, runner_class, with_cuda_graphs
from tests.vllm.test_metadata_hook import common_metadata, new_builder
from tests.vllm.test_metadata_hook_row_kinds import engine_config, poisoned_caches

K = 1  # speculative tokens: a speculative decode row has 1 + K tokens


@pytest.fixture(autouse=True)
def _one_speculative_token_v1_runner(monkeypatch):
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "num_speculative_tokens", property(lambda self: K))
    monkeypatch.setattr(support, "runs_v2_model_runner", lambda vllm_config: False)
    monkeypatch.setattr(draftless_steps, "_ACTIVITY", {"steps": 0, "checked": 0})
    monkeypatch.setattr(draftless_steps, "_BUILDERS", weakref.WeakSet())
    monkeypatch.setattr(draftless_steps, "_said", set())
    # vLLM's class as installed: a test's wrapper must not outlive it
    cls = runner_class()
    monkeypatch.setattr(cls, draftless_steps._CHOOSE, getattr(cls, draftless_steps._CHOOSE))
    # the runner's input preparation needs a whole input batch: what it does to the draft counts
    monkeypatch.setattr(cls, draftless_steps._PREPARE, prepare_draft_counts_as_vllm)


def prepare_draft_counts_as_vllm(self, scheduler_output, num_scheduled_tokens):
    """What ``_prepare_inputs`` does to the draft counts (vLLM 0.26-0.31, read in its source): it
    writes them only in a step where some row has drafts, a row's drafts where it has 1 + drafts
    tokens, else -1; in a step without drafts they stay as a past step left them."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if not drafts:
        return
    counts = np.full(len(num_scheduled_tokens), -1, dtype=np.int32)
    for row, tokens in drafts.items():
        if num_scheduled_tokens[row] == len(tokens) + 1:
            counts[row] = len(tokens)
    self.num_decode_draft_tokens.np[: counts.size] = counts


def engine(cudagraph_mode: str = "FULL_AND_PIECEWISE", *, configured: bool = True):
    """A speculating engine's config (graphs as the GPU has them) and its real GDN builder's step inputs."""
    config = engine_config("none", K)
    if not configured:
        config.compilation_config.inductor_compile_config.pop("post_grad_custom_post_pass")
    return with_cuda_graphs(config, cudagraph_mode, [1, 2, 4, 8])


def runner_for(config, builders=()):
    """The V1 runner's state that its graph choice reads; its draft counts a past speculative
    step's (every row K drafts)."""
    return graph_choosing_runner(config, builders, speculative_tokens=K, draft_rows=8)


def graph_for(runner, query_lens: list[int], drafts: list[int], **force) -> str:
    """The CUDA-graph mode the runner picks for a step of these rows, each with its drafts (-1: none),
    its inputs prepared first as ``execute_model`` does (by keyword, as vLLM calls it)."""
    if not force:  # a step (a capture prepares no inputs)
        scheduled = {row: [0] * d for row, d in enumerate(drafts) if d > 0}
        runner._prepare_inputs(SimpleNamespace(scheduled_spec_decode_tokens=scheduled), np.array(query_lens))
    mode, _descriptor, *_ = runner._determine_batch_execution_and_padding(
        num_tokens=sum(query_lens), num_reqs=len(query_lens), num_scheduled_tokens_np=np.array(query_lens),
        max_num_scheduled_tokens=max(query_lens), use_cascade_attn=False, **force)
    return mode.name


def gdn_step(builder, computed, query_lens, drafts):
    """The real GDN builder's build of one step (vLLM 0.26's call), rows on blocks 3, 4, ..."""
    common = dataclasses.replace(
        common_metadata(computed, query_lens),
        block_table_tensor=torch.tensor([[3 + i, 0] for i in range(len(query_lens))], dtype=torch.int32))
    return builder.build(common_prefix_len=0, common_attn_metadata=common,
                         num_accepted_tokens=torch.ones(len(query_lens), dtype=torch.int32),
                         num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))


# A speculating row (1 + K tokens, K drafts) next to a prompt's last chunk of 1 + K tokens (no drafts).
CHUNK_BESIDE_SPEC = dict(computed=[9, 8], query_lens=[1 + K, 1 + K], drafts=[K, -1])
# The same chunk alone in its step.
CHUNK_ALONE = dict(computed=[8], query_lens=[1 + K], drafts=[-1])
STEPS = pytest.mark.parametrize("step", [CHUNK_BESIDE_SPEC, CHUNK_ALONE], ids=["beside_spec", "alone"])


@STEPS
def test_vllm_replays_the_spec_full_graph_on_a_step_its_gdn_builder_builds_with_a_prefill(monkeypatch, step):
    """The hazard, from vLLM's own pieces without gdn-pass: the shape says speculative decode,
    the builder says prefill and stages none of the graph's buffers."""
    config = engine(configured=False)
    poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    assert builder.use_spec_decode and builder.use_full_cuda_graph
    metadata = gdn_step(builder, **step)
    assert metadata.num_prefills == 1
    # the FULL graph reads these persistent buffers; a step with a prefill leaves them as they were
    staged = metadata.spec_state_indices_tensor
    assert staged is None or staged.data_ptr() != builder.spec_state_indices_tensor.data_ptr()
    assert graph_for(runner_for(config), step["query_lens"], step["drafts"]) == "FULL"


@STEPS
def test_configured_engine_runs_such_a_step_without_the_full_graph(monkeypatch, step):
    config = engine()
    poisoned_caches(config)
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)  # the hook acts at engine start
    assert set(draftless_steps._BUILDERS) == {builder}
    assert graph_for(runner_for(config, builders=[builder]), step["query_lens"], step["drafts"]) == "PIECEWISE"
    assert draftless_steps.activity()["steps"] == 1
    assert gdn_step(builder, **step).num_prefills == 1  # what the builder builds, unchanged


def test_only_the_runner_of_such_a_builder_is_changed(monkeypatch):
    config = engine()
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    runner = runner_for(config, builders=[builder])
    runner.vllm_config = copy.copy(config)  # the builder is what tells, not the config object
    assert graph_for(runner, CHUNK_ALONE["query_lens"], CHUNK_ALONE["drafts"]) == "PIECEWISE"
    other = runner_for(config)  # another engine's runner in the process: none of its builders asked
    assert graph_for(other, CHUNK_ALONE["query_lens"], CHUNK_ALONE["drafts"]) == "FULL"
    assert draftless_steps.activity() == {"steps": 1, "checked": 1}


@pytest.mark.parametrize("query_lens, drafts, graph", [
    ([1 + K, 1 + K], [K, K], "FULL"),          # speculative decodes: every row has drafts
    ([1, 1], [-1, -1], "PIECEWISE"),           # one-token rows: not the speculative shape
    ([1 + K, 1], [K, -1], "PIECEWISE"),        # mixed lengths: the runner does not call it uniform
    ([1 + K, 1 + K, 3 + K], [K, -1, -1], "PIECEWISE"),  # a longer prompt chunk
    ([1, 1 + 2 * K], [-1, -1], "PIECEWISE"),   # (1 + K) tokens a row on average, not in each
], ids=["all_speculating", "one_token_rows", "mixed", "longer_prompt", "uneven"])
def test_other_steps_get_the_graph_vllm_picks(monkeypatch, query_lens, drafts, graph):
    config = engine()
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    assert graph_for(runner_for(config, builders=[builder]), query_lens, drafts) == graph
    assert draftless_steps.activity() == {"steps": 0, "checked": 1}


def test_a_forced_choice_is_kept(monkeypatch):
    """CUDA-graph capture and dummy runs force the choice: never changed."""
    config = engine()
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    assert graph_for(runner_for(config, builders=[builder]), [1 + K], [-1], force_uniform_decode=True) == "FULL"
    assert draftless_steps.activity() == {"steps": 0, "checked": 0}


@pytest.mark.parametrize("why", ["unconfigured", "piecewise_graphs", "v2_runner"])
def test_engines_it_does_not_apply_to_are_unchanged(monkeypatch, why):
    config = engine("PIECEWISE" if why == "piecewise_graphs" else "FULL_AND_PIECEWISE",
                    configured=why != "unconfigured")
    if why == "v2_runner":
        monkeypatch.setattr(support, "runs_v2_model_runner", lambda vllm_config: True)
        # the V2 runner's classes as installed: the padded rows' draft counts wrap them for this engine
        import importlib

        from gdn_pass.vllm import accepted_counts

        for (module, name), method in ((accepted_counts.RUNNER_METADATA, "get_extra_attn_kwargs"),
                                       (accepted_counts.RUNNER_STATE, "prepare_attn")):
            cls = getattr(importlib.import_module(module), name)
            monkeypatch.setattr(cls, method, getattr(cls, method))
    builder = new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    assert len(draftless_steps._BUILDERS) == 0
    if why != "piecewise_graphs":  # the runner picks as vLLM does
        assert graph_for(runner_for(config, builders=[builder]), CHUNK_ALONE["query_lens"],
                         CHUNK_ALONE["drafts"]) == "FULL"


def test_a_runner_it_cannot_read_is_said_at_start_and_left_alone(monkeypatch, caplog):
    class RunnerWithoutTheChoice:
        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, max_num_scheduled_tokens):
            return None

    import sys

    module = SimpleNamespace(GPUModelRunner=RunnerWithoutTheChoice)
    monkeypatch.setitem(sys.modules, "fake_runner_module", module)
    monkeypatch.setattr(draftless_steps, "RUNNER", ("fake_runner_module", "GPUModelRunner"))
    config = engine()
    with caplog.at_level("WARNING", logger="gdn_pass"):
        new_builder(config, like_0_26=False, monkeypatch=monkeypatch)
    assert len(draftless_steps._BUILDERS) == 0
    assert "cannot prevent it" in caplog.text and "takes no force_uniform_decode" in caplog.text
    assert not getattr(RunnerWithoutTheChoice._determine_batch_execution_and_padding, draftless_steps._MARK, False)
