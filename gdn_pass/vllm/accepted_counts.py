"""The V2 model runner's accepted counts, passed to a speculating Lightning builder too.

vLLM's V2 model runner (the only one in 0.34; chosen by config in 0.31-0.33)
computes each step's ``num_accepted_tokens`` and ``num_decode_draft_tokens_cpu``
for every state builder, but ``MambaHybridAttnMetadata.get_extra_attn_kwargs``
hands them only to the builder classes it lists (Mamba2, GDN, ShortConv,
PleShortConv). ``BailingLinearAttentionMetadataBuilder`` gets none: it turns
``use_spec_decode`` off, splits with threshold 1 and sends every speculating
row (``1 + k`` tokens, drafts included) to the Lightning *prefill* path, which
cannot roll back a rejected draft: the state then holds tokens the request
never produced (H200, vLLM 0.34: two MTP engines of one configuration give
one request different tokens; ``benchmarks/results/gpu_vllm_bailing_034.md``).
Given the counts, the builder takes its speculative path, whose kernel keeps
one state per token and reads the accepted one (as it does on the V1 runner).

    before (V2 runner, Lightning builder)        after
    get_extra_attn_kwargs(builder, n) -> {}      -> {num_accepted_tokens: counts[:n],
                                                     num_decode_draft_tokens_cpu: drafts[:n]}

Invariants: only builders gdn-pass acts for get counts (marked at engine
start, ``supply``); every other builder gets what vLLM gives it; where vLLM
already passes them (checked on the installed class, not by version) nothing
is wrapped; where the class or its fields are not what this module reads,
``supply`` says why and nothing is changed. Prompt rows the split then puts
on the speculative path are ``prompt_chunks``' job.
"""

from __future__ import annotations

import functools
import importlib

import torch

__all__ = ["RUNNER_METADATA", "supplies", "supply"]

# Where the V2 runner keeps its per-step speculative metadata (vLLM 0.27-0.34).
RUNNER_METADATA = ("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridAttnMetadata")
_COUNTS = ("num_accepted_tokens", "num_decode_draft_tokens_cpu")
# The attribute marking a builder gdn-pass passes counts to, and the wrapper it installs.
_SUPPLIED = "_gdn_pass_accepted_counts"
_MARK = "_gdn_pass_passes_counts"


def supply(builder) -> str | None:
    """Make the V2 runner pass ``builder`` the step's accepted and draft counts.

    None when it will (vLLM already did, or the runner's class is now wrapped
    for it); else why not, for a start-up line: the runner's class is missing,
    or its fields or method are not the ones read here.
    """
    module_name, class_name = RUNNER_METADATA
    try:
        runner_metadata = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        return f"the V2 runner's {class_name} is not in {module_name} ({exc})"
    try:
        if _passes_counts(runner_metadata, builder):
            return None  # vLLM passes them itself
        _wrap(runner_metadata)
        builder.__dict__[_SUPPLIED] = True
        if _passes_counts(runner_metadata, builder):
            return None
        builder.__dict__.pop(_SUPPLIED, None)
        return f"{class_name}.get_extra_attn_kwargs still passes no counts once wrapped"
    except Exception as exc:  # noqa: BLE001 - a runner we cannot read: said at start-up, nothing changed
        builder.__dict__.pop(_SUPPLIED, None)
        return f"{class_name} is not the one gdn-pass reads ({type(exc).__name__}: {exc})"


def supplies(builder) -> bool:
    """Does gdn-pass pass ``builder`` the V2 runner's counts (``supply`` wrapped the runner for it)?"""
    return bool(builder.__dict__.get(_SUPPLIED, False))


def _passes_counts(runner_metadata: type, builder) -> bool:
    """Does the runner's method give ``builder`` the counts? Asked of the installed class, one row."""
    probe = runner_metadata(
        is_prefilling=torch.zeros(1, dtype=torch.bool),
        num_accepted_tokens=torch.ones(1, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.full((1,), -1, dtype=torch.int32),
    )
    extra = probe.get_extra_attn_kwargs(builder, 1)
    return all(isinstance(extra.get(name), torch.Tensor) for name in _COUNTS)


def _wrap(runner_metadata: type) -> None:
    original = runner_metadata.get_extra_attn_kwargs
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs):
        extra = original(self, attn_metadata_builder, num_reqs)
        if extra or not attn_metadata_builder.__dict__.get(_SUPPLIED, False):
            return extra
        accepted, drafts = self.num_accepted_tokens, self.num_decode_draft_tokens_cpu
        return {"num_accepted_tokens": None if accepted is None else accepted[:num_reqs],
                "num_decode_draft_tokens_cpu": None if drafts is None else drafts[:num_reqs]}

    setattr(get_extra_attn_kwargs, _MARK, True)
    runner_metadata.get_extra_attn_kwargs = get_extra_attn_kwargs
