"""One step's rows to zero, as the host knows them: what every state builder's rows are made of.

Each builder's file (``gdn_pass.vllm.builders``) reads its metadata and the
scheduler's ``CommonAttentionMetadata`` (never a device value) into
``HostRows``: the slots the builder's decode kernels read, and which of them
belong to a brand-new row (no token computed before this step) that those
kernels would read as if it had history::

    fresh[i] = num_computed_tokens[i] == 0 and query_len[i] > 0 and row i runs a decode path

and, on CUDA, its decode rows in vLLM's own device tensors (``DecodeRows``).

Invariant (the metadata hook's idle steps rely on it): a builder's rows to
zero are always among the step's new rows (``SchedulerRows.new``), so a step
with no new row has none to zero in any builder.

What depends on the scheduler alone (``SchedulerRows``: lengths, counts, the
new rows) is computed once per step (``scheduler_rows``) and shared by the
step's builders, one per KV-cache group (three for Qwen3-Next-80B's 36 GDN
layers); each builder adds only its own split and slots. Whether a step has a
new row at all (``has_new_rows``, the metadata hook's question on every build)
is decided first, on most steps from one reduction over the host lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gdn_pass.metadata import MetadataError, StagedRowMetadata
from gdn_pass.vllm import compat

__all__ = ["DecodeRows", "HostRows", "SchedulerRows", "fitting_decode_rows", "has_new_rows", "num_computed_tokens",
           "one_step", "scheduler_rows", "slot_count_error"]

# --- a step's lengths on the host, and its decode rows in vLLM's device tensors ---------------

_SEQ_LEN_FIELDS = ("seq_lens_cpu_upper_bound", "seq_lens_cpu")
_COMPUTED_FIELD = "num_computed_tokens_cpu"
_HOST_LENGTH_FIELDS = (*_SEQ_LEN_FIELDS, _COMPUTED_FIELD)


def host_lengths(common) -> tuple[torch.Tensor | None, str | None]:
    """The host tensor ``num_computed_tokens`` reads and its field of ``common``; ``(None, None)``
    where ``common`` has none and the counts come from the device.

    Sequence lengths first: their upper bounds are exact for prefill rows and
    only over-estimate decode rows, which have state either way.
    """
    for field in _HOST_LENGTH_FIELDS:
        lengths = getattr(common, field, None)
        if lengths is not None:
            return lengths, field
    return None, None


# Numpy views of the host tensors the runners hand the builders, by (address, dtype, stride).
# Each view holds its tensor (numpy keeps the base alive), so no other tensor can take that
# address while the view is kept; a runner that makes new arrays every step fills it up, and
# it starts over.
_host_arrays: dict[tuple, np.ndarray] = {}
_HOST_ARRAYS_KEPT = 16


def host_array(tensor: torch.Tensor, num_reqs: int) -> np.ndarray:
    """``tensor.numpy()[:num_reqs]`` for a 1-D host tensor, without torch's ``numpy()`` on every call.

    vLLM's runners (0.26-0.33) hand each step a new view of the same persistent
    host buffers (``query_start_loc_cpu``, the sequence lengths): ``numpy()``
    costs about 0.9 us of dispatch on each, the lookup here about 0.5 us. The
    view reads the buffer's memory, so it sees what the runner wrote this step.
    """
    size = tensor.numel()
    if size < num_reqs:
        num_reqs = size
    key = (tensor.data_ptr(), tensor.dtype, tensor.stride())
    array = _host_arrays.get(key)
    if array is None or array.size < num_reqs:
        array = tensor.numpy()
        if len(_host_arrays) >= _HOST_ARRAYS_KEPT:
            _host_arrays.clear()
        _host_arrays[key] = array
    return array[:num_reqs]


def num_computed_tokens(common, query_lens: np.ndarray, lengths: tuple[torch.Tensor | None, str | None]) -> np.ndarray:
    """Tokens computed before this step, per row, on the host, without a device sync where possible.

    ``query_lens``: ``[num_reqs]`` numpy integers (from ``query_start_loc_cpu``);
    ``lengths``: ``host_lengths(common)``.
    """
    num_reqs = query_lens.size
    tensor, field = lengths
    if tensor is None:
        return common.compute_num_computed_tokens()[:num_reqs].cpu().numpy()
    if field == _COMPUTED_FIELD:
        return host_array(tensor, num_reqs)
    return host_array(tensor, num_reqs) - query_lens


@dataclasses.dataclass(eq=False, slots=True)
class DecodeRows:
    """A step's decode rows as vLLM's own device tensors say them (``zero_rows.zero_new_rows_all``).

    ``slots``: the slots the builder's decode kernels read, ``[rows]`` or
    ``[rows, columns]`` (a speculative row reads one of its ``1 + k``
    columns; all are its own); ``query_start_loc``: the rows' query offsets;
    ``seq_lens``: the scheduler's per-row sequence lengths; the first
    ``num_rows`` (``num_decodes``) rows run the decode path. Under FULL CUDA
    graphs all three are vLLM's persistent buffers, refreshed before each
    replay. vLLM 0.26-0.33 build them as int32 tensors on the builder's device.
    """

    slots: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_rows: int


def fitting_decode_rows(slots, starts, seq_lens, num_rows) -> DecodeRows | None:
    """``DecodeRows`` of these tensors, or None where one is missing or shorter than the decode rows."""
    if slots is None or starts is None or seq_lens is None:
        return None
    num_rows = int(num_rows)
    if num_rows > slots.shape[0] or num_rows >= starts.shape[0] or num_rows > seq_lens.shape[0]:
        return None
    return DecodeRows(slots, starts, seq_lens, num_rows)



@dataclasses.dataclass(eq=False, slots=True)
class HostRows:
    """One step's rows in staged order for one builder, as the host knows them (no device read).

    ``query_lens`` / ``computed``: ``[n]`` numpy integers; ``slot_parts``: the
    builder's device slot tensors, concatenated in the same order;
    ``zero_start_rows``: the builder's prefill run, whose kernels start a row
    without history from zero themselves; ``new``: ``[n]`` bool, the rows with
    no token computed before this step (read only: it may be the step's shared
    ``SchedulerRows.new``); ``fresh``: how many rows the guards must zero, the
    new rows outside ``zero_start_rows`` (``to_zero``).
    """

    query_lens: np.ndarray
    computed: np.ndarray
    slot_parts: list[torch.Tensor]
    zero_start_rows: tuple[int, int]
    new: np.ndarray
    fresh: int

    @classmethod
    def counted(cls, query_lens, computed, slot_parts, zero_start_rows, new) -> HostRows:
        rows = cls(query_lens, computed, slot_parts, zero_start_rows, new, 0)
        rows.fresh = int(np.count_nonzero(rows.to_zero))
        return rows

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def to_zero(self) -> np.ndarray:
        """``[n]`` bool: the rows whose slots the guards must zero (new, and on a path whose kernels read
        the slot)."""
        start, stop = self.zero_start_rows
        if start >= stop:
            return self.new
        to_zero = self.new.copy()
        to_zero[start:stop] = False
        return to_zero

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


@dataclasses.dataclass(eq=False, slots=True)
class SchedulerRows:
    """One step's rows as the scheduler knows them, shared by every builder of the step.

    ``query_lens`` / ``computed``: ``[num_reqs]`` numpy integers; ``new``:
    ``[num_reqs]`` bool, a row with tokens and none computed before this step;
    ``num_new``: how many (no builder has more rows to zero). ``key``: what
    the step is recognized by (``scheduler_rows``).
    """

    query_lens: np.ndarray
    computed: np.ndarray
    new: np.ndarray
    num_new: int
    key: tuple
    # [num_reqs + 1]: how many of the first i rows are new; made on the first ask (steps with new rows)
    new_before: np.ndarray | None = None

    def new_among_first(self, rows: int) -> int:
        """How many of the first ``rows`` rows are new (all of them where ``rows`` covers the step)."""
        if self.num_new == 0 or rows >= self.new.size:
            return self.num_new
        if self.new_before is None:
            self.new_before = np.zeros(self.new.size + 1, dtype=np.int64)
            np.cumsum(self.new, out=self.new_before[1:])
        return int(self.new_before[min(rows, self.new.size)])


# The last step's SchedulerRows, or the key of the last step proven to have no new row
# (``has_new_rows``). A key holds the step's host tensors themselves (a strong reference:
# no later tensor can take their id) and their version counters.
_last_step: list[SchedulerRows | None] = [None]
_last_idle_key: list[tuple | None] = [None]
# Set at the first inference host tensor met (``_step_key``): a runner that makes one makes them
# every step, and reading their version counter raises, which costs about 6 us a build on a CPU host
# (``hook_host_time.py --inference-host-tensors``); ``is_inference()`` asks in about 0.1 us.
# Runners without them never pay the question.
_inference_host: list[bool] = [False]
# The rows of the build in progress where the step's tensors keep no version counter (inference
# tensors): the hook asks for them twice in one build (``has_new_rows``, then the entry's
# ``stage_step``). Kept for that build only: ``has_new_rows``, the first thing each build asks,
# forgets them, and so does the hook after a build it staged (``forget_build_rows``).
_build_rows: list = [None, None]
# While builds known to be one step's are resolved together (``one_step``): [True, what the first
# of them found], that is the step's SchedulerRows, or _NO_NEW_ROWS where it was proven to have no
# new row without them; [False, None] otherwise.
_one_step: list = [False, None]
_NO_NEW_ROWS = object()


def one_step(begin: bool) -> None:
    """Begin (True) or end (False) a run of builds the caller knows to be one step's.

    Within it, the first build's ``has_new_rows`` / ``scheduler_rows`` answer for
    every later one, even where the step's host tensors cannot tell (vLLM 0.34's
    inference tensors, which otherwise give every build rows of its own: 15.9 us a
    build on the H100 host, ``hook_host_time.md``). ``handoff.resolve_deferred``
    runs its step's deferred builds inside one.
    """
    _one_step[0], _one_step[1] = begin, None


def _is_step(key: tuple | None, common, starts_cpu: torch.Tensor) -> bool:
    """Whether ``key`` (``_step_key``) is ``common``'s step."""
    if key is None or key[0] is not starts_cpu or key[1] != starts_cpu._version or key[5] != common.num_reqs:
        return False
    lengths = getattr(common, key[3], None)
    return lengths is key[2] and key[4] == lengths._version


def _step_key(common, starts_cpu: torch.Tensor, tensor: torch.Tensor, field: str) -> tuple | None:
    """(query_start_loc_cpu, its version, lengths tensor, its field, its version, num_reqs); None where
    the tensors keep no version counter (inference tensors: vLLM 0.34's V2 runner makes its host
    tensors under ``inference_mode``). Without a key nothing is reused across builds: an in-place
    refill of the same tensors could not be told from the step before."""
    if _inference_host[0] and (starts_cpu.is_inference() or tensor.is_inference()):
        return None
    try:
        return (starts_cpu, starts_cpu._version, tensor, field, tensor._version, common.num_reqs)
    except RuntimeError:  # an inference tensor: "Inference tensors do not track version counter"
        _inference_host[0] = True
        return None


def has_new_rows(common) -> bool:
    """Whether ``common``'s step has a new row (``SchedulerRows.new``), decided once per step.

    Most steps of a serving engine have none, and most of those are proven so by
    one reduction over the host lengths: every row's length exceeds what a new
    row's can be (the bound below); two more where a FULL CUDA
    graph's padding rows follow the real ones. Only other steps compute the
    step's ``SchedulerRows`` (which builders with new rows read anyway). Same
    answer as ``scheduler_rows(common).num_new != 0`` on every step.
    """
    if _one_step[0] and _one_step[1] is not None:  # a later build of builds known to be one step's
        known = _one_step[1]
        return known is not _NO_NEW_ROWS and known.num_new != 0
    starts_cpu = common.query_start_loc_cpu
    _build_rows[0] = None  # a new build: rows kept for an earlier one are not this one's
    # The identity tests first, inline: on a step's first build both fail at once.
    key = _last_idle_key[0]
    if key is not None and key[0] is starts_cpu and _is_step(key, common, starts_cpu):
        return False  # most builds: a later group of a step without new rows
    last = _last_step[0]
    if last is not None and last.key and last.key[0] is starts_cpu and _is_step(last.key, common, starts_cpu):
        return last.num_new != 0
    tensor, field = host_lengths(common)
    if tensor is not None:
        num_reqs = common.num_reqs
        lengths = host_array(tensor, num_reqs)
        # The most a new row's host length can be: it has no token computed, so its sequence length
        # is its query length, at most the step's max_query_len (the bound vLLM's own split trusts,
        # 0.26-0.34); its computed count is 0. A row whose length exceeds it is not new.
        bound = 0 if field == _COMPUTED_FIELD else common.max_query_len
        # argmin, not min: numpy's reductions cost about 1.5 us of per-call overhead, argmin 0.3 us
        least = lengths.argmin() if num_reqs else None
        if least is not None and lengths[least] == 0 and bound > 0:  # bound > 0: sequence lengths
            # A sequence length of 0 is a row without tokens, not new: vLLM's runners count a
            # FULL graph's padding rows in num_reqs, after the real rows, with length 0. Where
            # every row from the first such one on has length 0, the real rows before it decide.
            tail = lengths[least:]
            if tail[tail.argmax()] == 0:
                lengths = lengths[:least]
                least = lengths.argmin() if least else None
        if least is None or lengths[least] > bound:
            _last_idle_key[0] = _step_key(common, starts_cpu, tensor, field)
            if _one_step[0]:
                _one_step[1] = _NO_NEW_ROWS
            return False
    return scheduler_rows(common).num_new != 0


def scheduler_rows(common) -> SchedulerRows:
    """``common``'s ``SchedulerRows``, computed once per step whatever the number of builders.

    vLLM's runners make one ``CommonAttentionMetadata`` per step and hand each
    KV-cache group a shallow copy of it (or the same host tensors): a new
    ``query_start_loc_cpu`` tensor object every step (a view of a persistent
    buffer, or ``torch.from_numpy`` of a new array), the same object for every
    group of the step (read in 0.26's and 0.30's V1 runner and 0.30's V2
    runner; 0.27-0.32 run the tests). So a step is recognized by the identity
    of its ``query_start_loc_cpu`` and of the sequence-length tensor the rows
    are read from, held here so that no later tensor can reuse their ids, and
    by their version counters, which torch's in-place writes bump (a caller
    that refills the same tensors with torch ops gets fresh rows; writes
    through a numpy view of them would not be seen, and vLLM's runners make
    new tensor objects instead). Tensors without version counters (inference
    tensors: vLLM 0.34's V2 runner) get their rows once per build instead
    (``_build_rows``), or once for builds known to be one step's (``one_step``).
    """
    if _build_rows[0] is common:
        return _build_rows[1]
    if _one_step[0] and isinstance(_one_step[1], SchedulerRows):
        return _one_step[1]
    starts_cpu = common.query_start_loc_cpu
    last = _last_step[0]
    if last is not None and _is_step(last.key, common, starts_cpu):
        return last
    lengths = host_lengths(common)
    num_reqs = common.num_reqs
    # numpy on views of vLLM's host tensors: a torch op on a few dozen CPU
    # elements costs several microseconds of dispatch, numpy's about one.
    starts = host_array(starts_cpu, num_reqs + 1)
    query_lens = starts[1 : num_reqs + 1] - starts[:num_reqs]
    computed = num_computed_tokens(common, query_lens, lengths)
    new = computed == 0
    num_new = int(np.count_nonzero(new))
    if num_new:  # a row without tokens is not new (vLLM schedules none; most steps have no new row)
        new &= query_lens > 0
        num_new = int(np.count_nonzero(new))
    rows = SchedulerRows(query_lens, computed, new, num_new, ())
    tensor, field = lengths
    if tensor is not None:  # else the counts came from device tensors: not kept
        rows.key = _step_key(common, starts_cpu, tensor, field)
        _last_step[0] = rows
        if rows.key is None:
            _build_rows[0], _build_rows[1] = common, rows
    if _one_step[0]:
        _one_step[1] = rows
    return rows


def forget_build_rows() -> None:
    """The build in progress is over: its rows (``_build_rows``) are no later build's."""
    _build_rows[0] = _build_rows[1] = None


def slot_count_error(kind: str, slots: int, rows: int) -> MetadataError:
    return MetadataError(
        f"{kind} metadata has {slots} state slots for {rows} scheduler rows "
        f"(vLLM {compat.vllm_version()}); this builder layout is not supported by gdn-pass")
