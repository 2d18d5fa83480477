"""Ask the installed builder itself: does its split send a fresh row to a path that reads the slot?

The bug class (vllm#51562) is one decision inside a state builder's
``build``: which rows are decodes. gdn-pass does not read that decision from
a version table. At engine start (and in ``gdn-pass doctor``) it builds
two-row steps with the builder vLLM made (its own ``build``, unhooked) and
reads the split it returns. The runner orders decodes first, so the fresh row
is the last one and ran a decode path exactly when every row is a decode::

    probe                 rows: (computed, new tokens)          the fresh row reads its slot if
    one_token             (10, 1) history, (0, 1) fresh          num_decodes (+ num_spec_decodes) == 2
    without_prefilling    as one_token, is_prefilling=None       (asked where one_token is rerouted:
                                                                 can gdn-pass keep the step on decode?)
    speculative (k > 0)   (10, 1 + k) speculating, (0, 1 + k)    as one_token
                          fresh; drafts [k, -1], accepted 1
    padded (k > 0)        as speculative, drafts [k, k]: a new    as one_token
                          one-token request the scheduler padded
                          with k placeholder drafts, its drafts
                          counted (as vLLM's V1 runner counts them)

``is_prefilling`` (0.31+) is what the runner says of each row: False for
the row with history, True for the fresh one. The steps are small host and
device tensors on the builder's device; the build writes only the builder's
own persistent decode buffers, which vLLM refills before every use.

Every field of the installed ``CommonAttentionMetadata`` that has no default
must be one this module knows how to fill; a new required field makes the
probe fail with ``ProbeError`` naming it (the entry then refuses, at start-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import traceback

import torch

from gdn_pass.vllm.compat import wrapped_build

__all__ = ["ProbeError", "SplitFindings", "as_inference_tensors", "probe_split", "synthetic_step"]

_HISTORY = 10  # tokens computed before the step by the row with history
_BLOCK_TABLE_WIDTH = 16  # blocks per row; wider than any index the probes' lengths reach


class ProbeError(Exception):
    """The builder's split could not be probed (the message says why)."""


@dataclasses.dataclass(frozen=True)
class SplitFindings:
    """What the builder's own split did with a fresh row (see the module table).

    ``without_prefilling`` is None where it was not asked (``one_token`` reads
    the slot, or this release has no ``is_prefilling``); ``speculative`` and
    ``padded`` are None where not asked (no speculative decoding; ``padded``:
    a builder without draft counts, or with slot columns, which ``speculative``
    covers). ``padded`` is not part of ``reads_stale_slot``: whether the
    runner counts a padded row's drafts is the runner's, not the builder's
    (``support.decide``).
    """

    one_token: bool
    without_prefilling: bool | None
    speculative: bool | None
    padded: bool | None = None
    # The one_token probe's step and the metadata the builder built for it (the rows check reads them).
    step: object = dataclasses.field(default=None, repr=False, compare=False)
    metadata: object = dataclasses.field(default=None, repr=False, compare=False)
    # The padded probe's step, metadata and draft counts (the rows check reads them too).
    padded_build: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def reads_stale_slot(self) -> bool:
        """Does a fresh row reach a decode path in a step the runner sends as it is?"""
        return self.one_token or bool(self.speculative)


def _fields():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata, {f.name: f for f in dataclasses.fields(CommonAttentionMetadata)}


def synthetic_step(computed: list[int], query_lens: list[int], *, device: torch.device,
                   is_prefilling: list[bool] | None):
    """A ``CommonAttentionMetadata`` of the installed vLLM for rows of the given lengths.

    Row ``i`` owns blocks ``1 + i * W ...`` (W = 16; block 0 is vLLM's null
    block). ``is_prefilling`` is set where the class has the field.
    """
    cls, fields = _fields()
    n = len(query_lens)
    qsl_cpu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_cpu = torch.tensor(computed, dtype=torch.int32) + torch.tensor(query_lens, dtype=torch.int32)
    tokens = int(qsl_cpu[-1])
    blocks = (1 + torch.arange(n * _BLOCK_TABLE_WIDTH, dtype=torch.int32)).view(n, _BLOCK_TABLE_WIDTH)
    known = {
        "query_start_loc": qsl_cpu.to(device),
        "query_start_loc_cpu": qsl_cpu,
        "seq_lens": seq_cpu.to(device),
        "seq_lens_cpu": seq_cpu.clone(),
        "seq_lens_cpu_upper_bound": seq_cpu.clone(),
        "num_computed_tokens_cpu": torch.tensor(computed, dtype=torch.int32),
        "num_reqs": n,
        "num_actual_tokens": tokens,
        "max_query_len": max(query_lens),
        "max_seq_len": int(seq_cpu.max()),
        "block_table_tensor": blocks.to(device),
        "slot_mapping": torch.arange(tokens, dtype=torch.int64).to(device),
        "is_prefilling": None if is_prefilling is None else torch.tensor(is_prefilling, dtype=torch.bool),
    }
    unknown = sorted(name for name, f in fields.items() if name not in known and f.init
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if unknown:
        raise ProbeError(f"CommonAttentionMetadata has required fields gdn-pass cannot fill: {unknown}")
    return cls(**{name: value for name, value in known.items() if name in fields})


def _decodes(metadata) -> int:
    return int(metadata.num_decodes) + int(getattr(metadata, "num_spec_decodes", 0) or 0)


_ALIGNED = "mamba_aligned_state_indices"
_MISSING = object()


@contextlib.contextmanager
def _runner_inputs(builder, common):
    """What vLLM's runner hands a builder before each build, handed for the probe step, then taken back.

    In the "align" mamba cache mode the runner sets each step's aligned state indices on every
    builder that has the attribute (0.34: ``v1/worker/gpu/model_states/mamba_hybrid.py``), and
    0.34's Kimi-K3 KDA builder asserts they were set. The probe step's are its block table (what
    the builders read outside align mode). The builder's own value is restored afterwards: the
    runner sets it again before the engine's first build.
    """
    if not hasattr(builder, _ALIGNED):
        yield
        return
    own = vars(builder).get(_ALIGNED, _MISSING)
    setattr(builder, _ALIGNED, common.block_table_tensor)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(builder, _ALIGNED)
        else:
            setattr(builder, _ALIGNED, own)


def _build(build, builder, common, **extra):
    """One call of the builder's own ``build`` (keywords: the form vLLM 0.26's runner uses)."""
    try:
        with _runner_inputs(builder, common):
            return build(builder, common_prefix_len=0, common_attn_metadata=common, **extra)
    except Exception as exc:  # noqa: BLE001 - any failure of the real build is the finding
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ProbeError(f"{type(builder).__name__}.build raised on a synthetic step: {exc!r} at "
                         f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno} ({where.line})") from exc


def probe_split(build, builder, device: torch.device, *, num_speculative_tokens: int = 0,
                speculative: bool = False) -> SplitFindings:
    """Run ``build`` (the builder's own, unhooked) on the module's probe steps; what its split did.

    ``speculative``: also probe a fresh prompt of ``1 + k`` tokens next to a
    speculating row (``k = num_speculative_tokens > 0``; builders whose
    decode threshold is ``1 + k``).
    """
    _, fields = _fields()
    has_is_prefilling = "is_prefilling" in fields
    flags = [False, True] if has_is_prefilling else None

    built = []

    def fresh_row_decoded(computed, query_lens, is_prefilling, **extra) -> bool:
        step = synthetic_step(computed, query_lens, device=device, is_prefilling=is_prefilling)
        metadata = _build(build, builder, step, **extra)
        built.append((step, metadata))
        return _decodes(metadata) == len(query_lens)

    one_token = fresh_row_decoded([_HISTORY, 0], [1, 1], flags)
    step, metadata = built[0]
    without_prefilling = None
    if not one_token and has_is_prefilling:
        try:
            without_prefilling = fresh_row_decoded([_HISTORY, 0], [1, 1], None)
        except ProbeError:  # a split that needs is_prefilling: the decode path cannot be kept
            without_prefilling = False
    spec = padded = padded_build = None
    k = num_speculative_tokens
    if k > 0:
        params = inspect.signature(wrapped_build(build)[0]).parameters
        takes_drafts = "num_decode_draft_tokens_cpu" in params

        def counts(drafts: list[int]) -> dict:
            extra = {}
            if "num_accepted_tokens" in params:
                extra["num_accepted_tokens"] = torch.ones(2, dtype=torch.int32, device=device)
            if takes_drafts:
                extra["num_decode_draft_tokens_cpu"] = torch.tensor(drafts, dtype=torch.int32)
            return extra

        if speculative:
            spec = fresh_row_decoded([_HISTORY, 0], [1 + k, 1 + k], flags, **counts([k, -1]))
        elif takes_drafts:
            extra = counts([k, k])
            padded = fresh_row_decoded([_HISTORY, 0], [1 + k, 1 + k], flags, **extra)
            padded_build = (*built[-1], extra["num_decode_draft_tokens_cpu"])
    return SplitFindings(one_token, without_prefilling, spec, padded, step, metadata, padded_build)


def as_inference_tensors(common):
    """``common`` with its host tensors made again under ``torch.inference_mode`` (vLLM 0.34's V2 runner
    makes them so: no version counter), for the rows check's stricter run of gdn-pass's own code."""
    host = {}
    with torch.inference_mode():
        for f in dataclasses.fields(common):
            value = getattr(common, f.name)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                host[f.name] = value.clone()
    return dataclasses.replace(common, **host)
