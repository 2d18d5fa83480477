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

One row needs more than vLLM's counts: the scheduler pads a new request's one
token with ``k`` placeholder drafts (``-1``) to keep the step's rows uniform,
and the V2 runner, which gives the counts only to rows past their prompt, marks
that row ``-1`` (no drafts). For the Lightning builder such a row is one token
and ``k`` drafts on its speculative path, as the V1 runner says (a row's drafts
where it has ``1 + drafts`` tokens): this module passes that count, so that
``prompt_chunks`` does not take the placeholders for prompt tokens (H200,
vLLM 0.34: it did, and 8 one-token prompts of 40 went wrong from their second
token).

    draft_counts[i] = drafts_i    if drafts_i > 0 and tokens_i == 1 + drafts_i   (V1's rule)
                      runner's    otherwise

Invariants: only builders gdn-pass acts for get counts (marked at engine
start, ``supply``); every other builder gets what vLLM gives it, and a marked
builder every other argument vLLM gives it; where vLLM passes the counts
itself, the draft counts of padded rows still come from here; where the
classes or fields are not what this module reads (checked on the installed
classes at engine start, not by version), ``supply`` says why and nothing
is changed. Prompt rows the split then puts
on the speculative path are ``prompt_chunks``' job.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import numpy as np
import torch

__all__ = ["RUNNER_METADATA", "step_has_padded_rows", "supplies", "supply"]

# Where the V2 runner keeps its per-step speculative metadata, and the model state that makes it
# from the step's input batch (vLLM 0.27-0.34).
RUNNER_METADATA = ("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridAttnMetadata")
RUNNER_STATE = ("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState")
_COUNTS = ("num_accepted_tokens", "num_decode_draft_tokens_cpu")
# The attribute marking a builder gdn-pass passes counts to, and the wrapper it installs.
_SUPPLIED = "_gdn_pass_accepted_counts"
_MARK = "_gdn_pass_passes_counts"


def supply(builder) -> str | None:
    """Make the V2 runner pass ``builder`` the step's accepted and draft counts.

    None when it will (the runner's classes are wrapped for it); else why not,
    for a start-up line: a class is missing, or its fields or methods are not
    the ones read here (then nothing is wrapped).
    """
    try:
        runner_metadata, runner_state = (getattr(importlib.import_module(module), name)
                                         for module, name in (RUNNER_METADATA, RUNNER_STATE))
    except (ImportError, AttributeError) as exc:
        return f"the V2 runner's {RUNNER_METADATA[1]} or {RUNNER_STATE[1]} is not where gdn-pass reads it ({exc})"
    class_name = RUNNER_METADATA[1]
    try:
        _passes_counts(runner_metadata, builder)  # its fields and method as read here, or it raises
        # Wrapped even where vLLM passes counts itself: its draft counts leave padded rows out.
        if list(inspect.signature(runner_state.prepare_attn).parameters)[:2] != ["self", "input_batch"]:
            return f"{RUNNER_STATE[1]}.prepare_attn does not take the step's input_batch first"
        _wrap(runner_metadata, runner_state)
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


def _passes_counts(runner_metadata: type, builder, method=None) -> bool:
    """Does the runner's method (``method``: another version of it, e.g. vLLM's own before gdn-pass
    wrapped it) give ``builder`` the counts? Asked of the installed class, one row."""
    probe = runner_metadata(
        is_prefilling=torch.zeros(1, dtype=torch.bool),
        num_accepted_tokens=torch.ones(1, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.full((1,), -1, dtype=torch.int32),
    )
    extra = (method or runner_metadata.get_extra_attn_kwargs)(probe, builder, 1)
    return all(isinstance(extra.get(name), torch.Tensor) for name in _COUNTS)


class _Step:
    """The step's padded rows, from ``prepare_attn`` (which makes the runner's metadata) to its
    builds: the engine core prepares one step at a time, in one thread."""

    padded_drafts: np.ndarray | None = None


def step_has_padded_rows() -> bool:
    """Does the step being prepared have a padded new request's row (the wrapped ``prepare_attn``
    found one)? False outside ``prepare_attn`` and on every step without one."""
    return _Step.padded_drafts is not None


def padded_draft_counts(input_batch) -> np.ndarray | None:
    """Per row, the drafts of a prompt row of ``1 + drafts`` tokens with drafts (a new request the
    scheduler padded; V1's rule), else -1; None where the step has none (the common step: no row
    is still prefilling, and the runner counts every other row's drafts itself)."""
    drafts = getattr(input_batch, "num_draft_tokens_per_req", None)
    if drafts is None:
        return None
    n = len(drafts)
    prefilling = getattr(input_batch, "is_prefilling_np", None)
    if prefilling is not None:
        if len(prefilling) != n:
            prefilling = prefilling[:n]
        # count_nonzero, not any(): a ufunc reduction costs the step about 5 us more on a 2-core
        # host between vLLM's builds (benchmarks/padded_requests_host_time.py)
        if not np.count_nonzero(prefilling):
            return None
    padded = (drafts > 0) & (np.asarray(input_batch.num_scheduled_tokens)[:n] == drafts + 1)
    if prefilling is not None:
        padded &= prefilling
    if not padded.any():
        return None
    return np.where(padded, drafts, -1).astype(np.int32)


def _draft_counts(runner_drafts: torch.Tensor | None, num_reqs: int) -> torch.Tensor | None:
    """The runner's draft counts, with each padded new request's placeholders counted."""
    padded = _Step.padded_drafts
    if padded is None or runner_drafts is None:  # most steps
        return runner_drafts
    counts = runner_drafts.clone()
    n = min(num_reqs, len(padded))
    counts[:n] = torch.from_numpy(np.maximum(counts[:n].numpy(), padded[:n]))
    return counts


def _wrap(runner_metadata: type, runner_state: type) -> None:
    """Wrap each of the two methods that is not wrapped already (idempotent, method by method: a
    method someone replaced after an earlier wrap is wrapped again, the other left as it is)."""
    original = runner_metadata.get_extra_attn_kwargs
    original_prepare = runner_state.prepare_attn

    @functools.wraps(original)
    def get_extra_attn_kwargs(self, attn_metadata_builder, num_reqs):
        extra = original(self, attn_metadata_builder, num_reqs)
        if not attn_metadata_builder.__dict__.get(_SUPPLIED, False):
            return extra
        if _Step.padded_drafts is None and "num_decode_draft_tokens_cpu" in extra:
            return extra  # vLLM passes this builder the counts itself and no row is padded: its own
        accepted, drafts = self.num_accepted_tokens, self.num_decode_draft_tokens_cpu
        return {**extra, "num_accepted_tokens": None if accepted is None else accepted[:num_reqs],
                "num_decode_draft_tokens_cpu": _draft_counts(None if drafts is None else drafts[:num_reqs],
                                                             num_reqs)}

    @functools.wraps(original_prepare)
    def prepare_attn(self, input_batch, *args, **kwargs):
        _Step.padded_drafts = padded_draft_counts(input_batch)
        try:
            return original_prepare(self, input_batch, *args, **kwargs)
        finally:
            _Step.padded_drafts = None

    setattr(get_extra_attn_kwargs, _MARK, True)
    setattr(prepare_attn, _MARK, True)
    if not getattr(original, _MARK, False):
        runner_metadata.get_extra_attn_kwargs = get_extra_attn_kwargs
    if not getattr(original_prepare, _MARK, False):
        runner_state.prepare_attn = prepare_attn
