"""Stage per-row freshness for vLLM's GDN metadata, derived from the scheduler.

Wraps ``GDNAttentionMetadataBuilder.build``. The builder's own decode/prefill
split is exactly what is wrong (a fresh one-token row counts as a decode and
gets ``has_initial_state=None``), so the rows are derived from the scheduler's
``CommonAttentionMetadata`` instead:

    has_initial_state[i] = num_computed_tokens[i] > 0
    valid[i]             = query_len[i] > 0 and state_slot[i] not a sentinel

for the builder's non-speculative rows, in the order of
``non_spec_state_indices_tensor``, then its speculative rows (whose first step
can be fresh too). The rows live in one ``StagedRowMetadata``
per builder (persistent buffers, refreshed in place) and are attached to the
built metadata, where the guarded ops find them. Only what the guards read
is staged: on a step with a row to zero, its flag and slot
(``StagedRowMetadata.stage_fresh``: two copies, no kernel); on the others,
nothing (``stage_no_fresh``: ``fresh`` cleared once after a step that had
fresh rows). On CUDA steps without speculative rows nothing is staged at
all: the guards' one zeroing launch finds the new decode rows itself in
vLLM's own device tensors (``compat.DecodeRows``: a row whose
``seq_len`` equals its query length), and the host only counts them, so that
an eager step with none launches nothing. Where no guarded op covers
every layer of the builder's group (eager engines, reads behind no op), the
hook zeroes the fresh slots itself right after the build (``step_guard``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.vllm import compat, step_guard
from gdn_pass.vllm.state_guard import CACHES_ATTR, DECODE_ROWS_ATTR, HOST_FRESH_ATTR, ROWS_ATTR
from gdn_pass.vllm.zero_rows import CacheTable

__all__ = ["HostRows", "host_rows", "install", "is_installed", "stage_rows"]

from gdn_pass._logging import logger

_MARK = "__gdn_pass_wrapped__"
_BUILDER_CONTEXT = "_gdn_pass_context"
_BUILDER_ROWS = "_gdn_pass_rows"
_BUILDER_GROUP_STATE = "_gdn_pass_group_state"
_BUILDER_OWNER = "_gdn_pass_owner"
_warned: set[str] = set()


def is_installed() -> bool:
    return getattr(compat.builder_class().build, _MARK, False)


def install() -> bool:
    """Wrap the GDN builder's ``__init__`` and ``build`` (idempotent). True if newly wrapped.

    Where GDNStatePass is not configured both wrappers only record and pass
    through: nothing they do can raise into the engine. Where it is, every
    check that can fail runs in ``__init__``, at engine start.
    """
    builder = compat.builder_class()
    if getattr(builder.build, _MARK, False):
        return False
    original_init, original_build = builder.__init__, builder.build

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _on_builder_created(self, original_init, original_build, args, kwargs)

    @functools.wraps(original_build)
    def build(self, *args, **kwargs):
        metadata = original_build(self, *args, **kwargs)
        context = self.__dict__.get(_BUILDER_CONTEXT)
        if context is None:  # not configured (or built before the hook existed)
            return metadata
        common, draft_counts = compat.step_inputs(original_build, self, args, kwargs)
        rows = self.__dict__.get(_BUILDER_ROWS)
        if rows is None:
            rows = self.__dict__[_BUILDER_ROWS] = _new_rows(self, context)
        step = host_rows(common, metadata, draft_counts)
        fresh = step.fresh
        step_owned = _owner(self, context) is step_guard.Owner.STEP
        caches, table = _group_state(self, context)
        decode = None
        if table is not None and not step_owned:
            decode = compat.decode_rows(common, metadata)
            if decode is not None and decode.num_rows > rows.max_rows:
                decode = None
        if decode is not None:  # the zeroing launch finds the new rows in vLLM's tensors
            pass
        elif fresh:  # only what the guards read: the rows to zero and their slots
            step.stage_fresh(rows)
        else:  # most steps: nothing to zero
            rows.stage_no_fresh(step.num_rows)
        setattr(metadata, ROWS_ATTR, rows)
        setattr(metadata, CACHES_ATTR, table)
        setattr(metadata, HOST_FRESH_ATTR, fresh)
        setattr(metadata, DECODE_ROWS_ATTR, decode)
        if step_owned:
            step_guard.zero_group(caches, table, rows, fresh)
            setattr(metadata, step_guard.ZEROED_ATTR, True)
        return metadata

    setattr(build, _MARK, True)
    builder.__init__ = __init__
    builder.build = build
    return True


def _on_builder_created(builder, init, build, args, kwargs) -> None:
    """Keep what the builder was given, if this engine asked for the guard.

    Unconfigured engines get the one-time warnings and nothing else; no error
    here may reach them. Configured engines that cannot be guarded stop here,
    at start-up, with UnsupportedVLLM naming what is missing.
    """
    vllm_config = kwargs.get("vllm_config") or next(
        (a for a in args if hasattr(a, "compilation_config")), None)
    try:
        from gdn_pass.vllm.gdn_state_pass import configured_pass

        configured = configured_pass(vllm_config.compilation_config) is not None
    except Exception as exc:  # noqa: BLE001 - no pass could have been configured: run as is
        logger.debug("gdn-pass: GDN builder not recorded (%r)", exc)
        return
    try:
        _warn_about_mode(vllm_config, configured)
    except Exception as exc:  # noqa: BLE001 - a warning must never stop an engine
        logger.debug("gdn-pass: could not check the compilation mode (%r)", exc)
    if configured:
        context = compat.builder_context(init, builder, args, kwargs)
        compat.check_supported(context, build)
        builder.__dict__[_BUILDER_CONTEXT] = context


def _owner(builder, context: compat.BuilderContext) -> step_guard.Owner:
    """Which guard zeroes this group's fresh slots: decided at the first build, then fixed."""
    owner = builder.__dict__.get(_BUILDER_OWNER)
    if owner is None:
        owner = builder.__dict__[_BUILDER_OWNER] = step_guard.decide_owner(
            context.layer_names, compiled=compat.engine_compiles(context.vllm_config))
        uncovered = sorted(set(context.layer_names) - step_guard.twin_layers())
        logger.info(
            "gdn-pass: %d GDN layer(s) of this group guarded %s%s", len(context.layer_names),
            "by the guarded core ops in the compiled graph" if owner is step_guard.Owner.GRAPH
            else "at metadata build (one zeroing launch per step with fresh rows)",
            f"; no guarded core op ran for {uncovered[:3]}{'...' if len(uncovered) > 3 else ''}"
            if owner is step_guard.Owner.STEP and uncovered else "")
    return owner


def _group_state(builder, context: compat.BuilderContext) -> tuple[list[torch.Tensor], CacheTable | None]:
    """Every state tensor (conv, recurrent, ...) of the group's layers, and (CUDA) their one-launch table.

    Kept per builder while every layer keeps the same ``kv_cache`` object:
    vLLM binds a new one when it allocates the caches (profiling runs have
    empty ones) and never swaps tensors inside it. The table is built here,
    outside CUDA-graph capture.
    """
    forward_context = context.vllm_config.compilation_config.static_forward_context
    bound = [getattr(forward_context.get(name), "kv_cache", None) for name in context.layer_names]
    kept = builder.__dict__.get(_BUILDER_GROUP_STATE)
    if kept is not None and len(kept[0]) == len(bound) and all(a is b for a, b in zip(kept[0], bound)):
        return kept[1], kept[2]
    caches = [t for kv_cache in bound for t in (kv_cache or ())
              if isinstance(t, torch.Tensor) and t.numel()]
    table = CacheTable.build(caches) if caches and context.device.type == "cuda" else None
    builder.__dict__[_BUILDER_GROUP_STATE] = (bound, caches, table)
    return caches, table


def _new_rows(builder, context: compat.BuilderContext) -> StagedRowMetadata:
    cfg = context.vllm_config
    max_rows = max(
        cfg.scheduler_config.max_num_seqs,
        getattr(builder, "decode_cudagraph_max_bs", 0),
        cfg.compilation_config.max_cudagraph_capture_size or 0,
    )
    return StagedRowMetadata(max_rows, device=context.device, pad_slot_ids=compat.pad_slot_ids())


@dataclasses.dataclass
class HostRows:
    """One step's rows in staged order, as the host knows them (no device read).

    ``query_lens`` / ``computed``: ``[n]`` numpy integers; ``slot_parts``: the
    builder's device slot tensors, concatenated in the same order;
    ``zero_start_rows``: the builder's prefill run; ``to_zero``: ``[n]`` bool,
    the rows whose slots the guards must zero (fresh, and on a path whose
    kernels read the slot); ``fresh``: their count.
    """

    query_lens: np.ndarray
    computed: np.ndarray
    slot_parts: list[torch.Tensor]
    zero_start_rows: tuple[int, int]
    to_zero: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def fresh(self) -> int:
        return int(np.count_nonzero(self.to_zero))

    def _slots(self) -> torch.Tensor:
        parts = self.slot_parts
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        return parts[0] if len(parts) == 1 else torch.cat([s.to(parts[0].dtype) for s in parts])

    def stage(self, rows: StagedRowMetadata) -> None:
        """Every buffer (``StagedRowMetadata.stage``)."""
        rows.stage(num_computed_tokens=torch.from_numpy(self.computed), query_lens=torch.from_numpy(self.query_lens),
                   state_slots=self._slots(), zero_start_rows=self.zero_start_rows if self.slot_parts else None)

    def stage_fresh(self, rows: StagedRowMetadata) -> None:
        """Only what the guards read: ``fresh`` and the slots (``StagedRowMetadata.stage_fresh``)."""
        rows.stage_fresh(fresh_rows=self.to_zero, state_slots=self._slots())


def host_rows(common, metadata, draft_counts: torch.Tensor | None = None) -> HostRows:
    """One step's rows from vLLM's common and GDN metadata (see ``stage_rows``), on the host."""
    num_reqs = common.num_reqs
    # numpy on views of vLLM's host tensors: a torch op on a few dozen CPU
    # elements costs several microseconds of dispatch, numpy's about one.
    starts = common.query_start_loc_cpu.numpy()
    query_lens = starts[1 : num_reqs + 1] - starts[:num_reqs]
    computed = compat.num_computed_tokens(common, query_lens)
    non_spec_slots = metadata.non_spec_state_indices_tensor
    spec_slots = getattr(metadata, "spec_state_indices_tensor", None)
    num_decodes = int(metadata.num_decodes)
    if metadata.spec_sequence_masks is None and non_spec_slots is not None:
        # Most steps: one part, the builder's decodes (the only rows to zero) first.
        if query_lens.size != non_spec_slots.numel():
            raise _slot_count_error(non_spec_slots.numel(), query_lens.size)
        decodes = min(num_decodes, num_reqs)
        to_zero = (computed == 0) & (query_lens > 0)
        to_zero[decodes:] = False
        return HostRows(query_lens, computed, [non_spec_slots], (decodes, num_reqs), to_zero)
    if metadata.spec_sequence_masks is None:
        parts = [(query_lens, computed, non_spec_slots)]
    else:
        if draft_counts is not None:
            spec = draft_counts[:num_reqs].cpu().numpy() >= 0
        else:  # a device-to-host copy; vLLM 0.26-0.31 always pass the host counts
            spec = metadata.spec_sequence_masks[:num_reqs].cpu().numpy()
        parts = [(query_lens[~spec], computed[~spec], non_spec_slots),
                 (query_lens[spec], computed[spec], None if spec_slots is None else spec_slots[:, 0])]
    lens, done, slots = [], [], []
    for part_lens, part_done, part_slots in parts:
        if part_slots is None:
            if np.count_nonzero(part_lens > 0):
                raise MetadataError(
                    f"GDN metadata has no state slots for {part_lens.size} scheduler rows "
                    f"(vLLM {compat.vllm_version()}); this builder layout is not supported by gdn-pass")
            continue
        if part_lens.size != part_slots.numel():
            raise _slot_count_error(part_slots.numel(), part_lens.size)
        lens.append(part_lens)
        done.append(part_done)
        slots.append(part_slots)
    if not slots:
        empty = np.zeros(0, dtype=np.int64)
        return HostRows(empty, empty, [], (0, 0), np.zeros(0, dtype=np.bool_))
    # Staged order: the non-speculative rows (the builder's decodes first, then its
    # prefills), then the speculative rows. The prefills are the one run of rows
    # whose kernels start a fresh row from zero state themselves.
    non_spec_rows = lens[0].size if non_spec_slots is not None else 0
    prefills = (min(num_decodes, non_spec_rows), non_spec_rows)
    query_lens = lens[0] if len(lens) == 1 else np.concatenate(lens)
    computed = done[0] if len(done) == 1 else np.concatenate(done)
    to_zero = (computed == 0) & (query_lens > 0)
    to_zero[prefills[0]:prefills[1]] = False
    return HostRows(query_lens, computed, slots, prefills, to_zero)


def _slot_count_error(slots: int, rows: int) -> MetadataError:
    return MetadataError(
        f"GDN metadata has {slots} state slots for {rows} scheduler rows "
        f"(vLLM {compat.vllm_version()}); this builder layout is not supported by gdn-pass")


def stage_rows(rows: StagedRowMetadata, common, metadata, draft_counts: torch.Tensor | None = None) -> int:
    """Refresh ``rows`` for one step from vLLM's common and GDN metadata.

    Non-speculative rows come first, in the order of
    ``non_spec_state_indices_tensor``; then speculative rows, each with
    column 0 of ``spec_state_indices_tensor``: the slot a fresh row's kernels
    read (a request's first step has one accepted token). A continuing
    speculative row reads column ``num_accepted_tokens - 1`` instead, a device
    value; it is restored, so no guard ever acts on its staged slot, and
    staging it needs no sync. A speculative row can be fresh: vLLM's scheduler pads a new
    one-token request admitted next to speculating decodes to ``1 + k`` tokens
    with placeholder drafts, and the builder then treats it as a speculative
    decode that reads its (recycled) slot. ``draft_counts`` is the build's
    ``num_decode_draft_tokens_cpu`` (host copy of the speculative mask).

    Only rows on a path whose kernels read the slot whatever
    ``has_initial_state`` says are staged as fresh (to be zeroed): the first
    ``metadata.num_decodes`` non-speculative rows (the builder's decodes,
    batch order puts them first) and every speculative row. A fresh row on
    the prefill path needs nothing: vLLM's prefill kernels start a row without
    initial state from zero state themselves (they zero or mask its slot).

    Every buffer is staged. The metadata hook stages only what its guards read:
    ``HostRows.stage_fresh`` on steps with a row to zero,
    ``StagedRowMetadata.stage_no_fresh`` on the others.
    Returns the number of fresh rows as the host sees them (``HostRows.fresh``).
    """
    step = host_rows(common, metadata, draft_counts)
    step.stage(rows)
    return step.fresh


def _warn_about_mode(vllm_config, configured: bool) -> None:
    """Say once per process when the plugin is installed but not asked to guard."""
    from gdn_pass.vllm.gdn_state_pass import SERVE_PASS

    if not configured:
        _warn_once(
            "unconfigured",
            "plugin installed but GDNStatePass is not in "
            "compilation_config['inductor_compile_config']['post_grad_custom_post_pass'] "
            "(or 'joint_custom_post_pass', or compilation_config['inductor_passes'] as "
            f"{SERVE_PASS!r}); GDN state reads are not guarded"
            + (" (this engine runs eagerly: the same line switches on the guard at "
               "metadata build)." if not compat.engine_compiles(vllm_config) else "."),
        )


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
