"""What the metadata hook hands the guards for one step: one object, under one attribute.

The metadata hook (``metadata_hook``) runs when vLLM builds a step's metadata
for a group of recurrent-state layers; the guards that zero the fresh rows'
slots run later (the op guard, ``op_guard``, inside each guarded op at
forward time) or right away (the step guard, ``step_guard``, at the build).
Everything the hook computed for the step travels as one ``StepHandoff``,
attached to the metadata object vLLM hands every layer of the group::

    metadata = build(...)                                  # vLLM
    attach(metadata, StepHandoff(rows, host_fresh, ...))   # metadata_hook
    ...
    handoff = handoff_of(metadata)                         # op_guard, in each guarded op

The metadata object is new for every step, so is its hand-off. Both guards
zero through it (``StepHandoff.zero``): one launch over the group's cache
table, or cache by cache; the fresh rows from vLLM's device tensors or from
the staged rows. The three-way choice is made here only.

A step with new decode rows in several groups that the op guard owns (a
48-layer Qwen3-Next has three) is zeroed in one launch for all of them: the
hook joins each group's hand-off to the step's ``JointZeroing`` as it builds
(``join``), and the first guarded op of the step, which runs after every
build, zeroes them together::

    for group in groups: attach(metadata[group], join(step, StepHandoff(...)))   # the builds
    first guarded op:    handoff.joint.zero()    # one launch, every group's slots; the rest skip
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import torch

from gdn_pass._logging import logger
from gdn_pass.kernels.zero_rows import CacheTable, zero_new_rows_all, zero_new_rows_groups, zero_rows, zero_rows_all
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm.rows import DecodeRows, one_step

__all__ = ["ATTR", "JointZeroing", "StepHandoff", "attach", "captured_staged_rows", "defer", "deferral_activity",
           "handoff_of", "join", "joint_activity", "new_decode_rows", "note_not_deferred", "note_staged_capture",
           "resolve_deferred"]

# The one attribute of vLLM's metadata object that gdn-pass sets.
ATTR = "gdn_pass_handoff"


@dataclasses.dataclass(eq=False, slots=True)
class StepHandoff:
    """One step's rows to zero for one builder's group of layers, as the metadata hook left them.

    ``rows``: the builder's persistent ``StagedRowMetadata``, refreshed in
    place for this step with the rows to zero (``fresh``) and their slots
    (``state_slot``); not refreshed where ``decode`` is set.

    ``host_fresh``: the host's count of rows to zero. With 0 an op guard
    launches nothing outside CUDA-graph capture (inside, it launches anyway,
    so that the replayed graph zeroes later steps' rows). None: not counted,
    zero whatever ``rows`` has staged.

    ``table``: the ``CacheTable`` of every layer of the group (CUDA only), so
    that the first guarded op of the step zeroes them all in one launch.

    ``decode``: the step's ``rows.DecodeRows`` where the zeroing launch
    finds the fresh rows in vLLM's own tensors (CUDA, no speculative rows);
    ``rows`` is then not staged for the step. None otherwise.

    ``zeroed_at_build``: the step guard owns the group and has zeroed its
    fresh slots at this build (or found none): the op guards do nothing.

    ``zeroed_by_op``: set by the first op guard of the step that zeroed the
    whole ``table``, so that the group's other guarded ops skip.

    ``in_capture``: set on a builder's hand-off of the steps without a new row
    (``host_fresh == 0``), shared by all of them: an op guard that must launch
    anyway (inside a FULL CUDA graph's capture) asks it for the step's own
    hand-off, ``in_capture(metadata)``, and zeroes through that one. None on a
    step's own hand-off.

    ``resolve``: set on a builder's *deferred* hand-off, shared by every step
    whose build only attached it (``metadata_hook``: the op guard owns the
    group, on CUDA, in an engine that replays FULL CUDA graphs). The step's
    rows are then not known yet: ``resolve(metadata, capturing)`` makes them
    and attaches the step's real hand-off (``resolve_deferred`` does it for
    every deferred build of the step at once, so that one launch still zeroes
    them all). A FULL CUDA graph's replay runs no guarded op's Python: its
    captured launch reads vLLM's own tensors, and the step's rows are never
    made on the host.
    """

    rows: StagedRowMetadata
    host_fresh: int | None = None
    table: CacheTable | None = None
    decode: DecodeRows | None = None
    zeroed_at_build: bool = False
    zeroed_by_op: bool = False
    in_capture: Callable[[object], StepHandoff] | None = None
    joint: JointZeroing | None = None
    resolve: Callable[[object, bool], StepHandoff] | None = None

    def zero(self, caches, *, whole_table: bool) -> int:
        """Zero this step's fresh slots; the launches made. Both guards zero through here.

        ``whole_table``: one launch over the group's ``table`` (every cache of
        every layer); else cache by cache of ``caches``. The fresh rows come
        from vLLM's own tensors where the hook left them there (``decode``,
        no host sync, capturable), else from the staged ``rows``.
        """
        rows, decode = self.rows, self.decode
        if whole_table:
            if decode is not None:
                zero_new_rows_all(self.table, decode.slots, decode.query_start_loc, decode.seq_lens,
                                  decode.num_rows, rows.max_rows)
            else:
                zero_rows_all(self.table, rows.state_slot, rows.fresh_rows())
            return 1
        slots, fresh = (rows.state_slot, rows.fresh_rows()) if decode is None else new_decode_rows(decode)
        for cache in caches:
            zero_rows(cache, slots, fresh)
        return len(caches)


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)
class JointZeroing:
    """One step's hand-offs whose new decode rows the first guarded op of the step zeroes together.

    ``step``: what identifies the step (its ``rows.SchedulerRows``, one object
    per step whatever the number of groups); ``handoffs``: the joined groups'
    hand-offs, in build order, each with a ``table`` and ``decode``; ``done``:
    set once they are zeroed (their ``zeroed_by_op`` too).
    """

    step: object
    handoffs: list[StepHandoff] = dataclasses.field(default_factory=list)
    done: bool = False

    def zero(self) -> int:
        """Zero every joined group's new decode rows; the launches made (one for up to
        ``MAX_GROUPS`` groups that read the step's rows, as vLLM's runners hand every group of
        a step; a group that does not gets a launch of its own).

        A group reads the step's rows where its ``seq_lens`` is the first group's tensor (the
        scheduler's, one for every group of a step) and it has as many decode rows. Its query
        offsets may be a tensor of its own with the same values: where FULL CUDA graphs can
        replay, vLLM's GDN builder copies a decode step's offsets into a persistent buffer per
        builder (vLLM 0.26, H100: one launch per group in every FULL-capable mode). The launch
        reads the first group's, written on the same stream before the forward.
        """
        shared, own = [], []
        first = self.handoffs[0].decode
        for handoff in self.handoffs:
            decode = handoff.decode
            same_rows = (decode.num_rows == first.num_rows and handoff.rows.max_rows == self.handoffs[0].rows.max_rows
                         and decode.slots.dtype == first.slots.dtype
                         and decode.query_start_loc.dtype == first.query_start_loc.dtype
                         and decode.seq_lens.data_ptr() == first.seq_lens.data_ptr())
            (shared if same_rows else own).append(handoff)
        launches = 0
        if len(shared) > 1 and _joint_launch[0]:
            try:
                launches += zero_new_rows_groups([h.table for h in shared], [h.decode.slots for h in shared],
                                                 first.query_start_loc, first.seq_lens, first.num_rows,
                                                 self.handoffs[0].rows.max_rows)
                shared = []
            except Exception as exc:  # noqa: BLE001 - inside the step: zero group by group instead
                _joint_launch[0] = False
                logger.warning("gdn-pass: the one zeroing launch for %d groups failed (%r); zeroing group "
                               "by group from now on (one launch per group and step with new rows)",
                               len(shared), exc)
        own = shared + own
        for handoff in own:
            launches += handoff.zero((), whole_table=True)
        for handoff in self.handoffs:
            handoff.zeroed_by_op = True
        self.done = True
        _JOINT_ACTIVITY["steps"] += 1
        _JOINT_ACTIVITY["groups"] += len(self.handoffs)
        _JOINT_ACTIVITY["launches"] += launches
        return launches


# The step whose hand-offs are being joined (``join``): the last one that had new decode rows, as a
# weak reference: its hand-offs (on the step's metadata) keep it while the step lives, and nothing
# here keeps an engine's caches (in their tables) past it.
_joining: list[Callable[[], JointZeroing | None]] = [lambda: None]
# While ``resolve_deferred`` resolves one step's deferred builds: True, then the joint they join
# (made by the first that joins); None otherwise.
_resolving: list[JointZeroing | bool | None] = [None]
# What joint zeroings did in this process, for reports and tests (``joint_activity``).
_JOINT_ACTIVITY = {"steps": 0, "groups": 0, "launches": 0}


def joint_activity() -> dict:
    """``{"steps": n, "groups": n, "launches": n}``: steps whose joined groups the op guard zeroed
    together, the groups they covered and the launches they made (one per step where they shared
    the step's rows)."""
    return dict(_JOINT_ACTIVITY)


# False once a joint launch raised (it runs inside the step, so it never raises into vLLM): every
# group is then zeroed by a launch of its own, as before joint launches.
_joint_launch: list[bool] = [True]


def join(step, handoff: StepHandoff) -> StepHandoff:
    """Join ``handoff`` (a group's, built for ``step``) to that step's ``JointZeroing``; return it.

    The builds of a step come one after another, before its forward: a step
    object other than the last one's starts a new joint. Deferred builds resolved
    together (``resolve_deferred``) join that resolution's joint."""
    joint = _resolving[0]
    if joint is True:
        joint = _resolving[0] = JointZeroing(step)
    elif joint is None:
        joint = _joining[0]()
        if joint is None or joint.step is not step or joint.done:
            joint = JointZeroing(step)
            _joining[0] = weakref.ref(joint)
    joint.handoffs.append(handoff)
    handoff.joint = joint
    return handoff


def new_decode_rows(decode: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' slots and which of them are new, as device tensors (no sync, capturable)."""
    n = decode.num_rows
    starts = decode.query_start_loc
    query_lens = starts[1 : n + 1] - starts[:n]
    # zero_rows reads the slots densely; vLLM's are a column of the block table outside FULL graphs.
    return decode.slots[:n].contiguous(), (query_lens > 0) & (decode.seq_lens[:n] == query_lens)


def attach(metadata, handoff: StepHandoff):
    """Hand ``handoff`` to the guards on vLLM's step ``metadata``; return ``metadata``."""
    setattr(metadata, ATTR, handoff)
    return metadata


# The builds deferred since the step's first (``defer``), in build order: each builder's deferred
# hand-off, and a weak reference to the build's metadata (a step whose forward runs no guarded op,
# a FULL CUDA graph's replay, leaves them to die with its metadata). A builder's hand-off noted
# again starts the lists over: that is a new step (vLLM builds every group once per step, in one
# thread).
_deferred: list[StepHandoff] = []
_deferred_metadata: list[weakref.ref] = []
# Builds deferred and steps whose deferred builds a guarded op resolved in this process, for reports
# and tests (``deferral_activity``); and, per registry entry, why a group's builds are not deferred.
_DEFERRAL_ACTIVITY = {"deferred_builds": 0, "resolved_steps": 0}
_NOT_DEFERRED: dict[str, str] = {}
# Set once a FULL CUDA graph's capture zeroed through staged rows (``note_staged_capture``): its
# replays read the staged buffers, which only a build refreshes, so no build may be deferred.
_staged_capture: list[bool] = [False]


def defer(metadata, pending: StepHandoff):
    """Attach a builder's deferred hand-off ``pending`` (``StepHandoff.resolve``) to the step's
    ``metadata``, and note the build for ``resolve_deferred``; return ``metadata``."""
    if pending in _deferred:  # identity: hand-offs compare by it
        _deferred.clear()
        _deferred_metadata.clear()
    try:
        ref = weakref.ref(metadata)
    except TypeError:  # a metadata class without weak references (none of vLLM's): kept for the step
        ref = functools.partial(_same, metadata)
    _deferred.append(pending)
    _deferred_metadata.append(ref)
    _DEFERRAL_ACTIVITY["deferred_builds"] += 1
    setattr(metadata, ATTR, pending)
    return metadata


def resolve_deferred(metadata, *, capturing: bool = False) -> StepHandoff:
    """The step's real hand-off of ``metadata`` (whose attached one is deferred), after resolving
    every deferred build of the step noted before it, in build order: the first guarded op of the
    step asks, and one launch then zeroes every group's new rows, as where the builds staged them.
    ``capturing``: the op asks inside a FULL CUDA graph's capture, where nothing may be staged."""
    noted = [(pending, ref()) for pending, ref in zip(_deferred, _deferred_metadata)]
    _deferred.clear()
    _deferred_metadata.clear()
    _DEFERRAL_ACTIVITY["resolved_steps"] += 1
    # The builds resolved here are one step's: they join one JointZeroing and read the step's rows
    # once (``rows.one_step``), whether or not their step can be told by its host tensors (vLLM
    # 0.34's inference tensors give every build its own SchedulerRows, rows.scheduler_rows, and
    # ``join`` would start a joint per group).
    _resolving[0] = True
    one_step(True)
    try:
        for pending, other in noted:
            if other is not None and getattr(other, ATTR, None) is pending:
                pending.resolve(other, capturing)
        handoff = getattr(metadata, ATTR)
        return handoff.resolve(metadata, capturing) if handoff.resolve is not None else handoff
    finally:
        _resolving[0] = None
        one_step(False)


def _same(value):
    return value


def deferral_activity() -> dict:
    """What deferral did in this process: ``deferred_builds``, the builds that only attached their
    deferred hand-off; ``resolved_steps``, the steps whose deferred builds a guarded op resolved (a
    replayed FULL graph's steps resolve none); ``staged_capture``, whether a FULL graph's capture
    zeroed through staged rows, which stops deferral (``note_staged_capture``); ``not_deferred``,
    registry key -> why that builder's groups are checked at build instead."""
    return dict(_DEFERRAL_ACTIVITY, staged_capture=_staged_capture[0], not_deferred=dict(_NOT_DEFERRED))


def note_not_deferred(key: str, why: str) -> None:
    """A group of registry entry ``key`` checks its steps at build, for ``why`` (its first build)."""
    _NOT_DEFERRED.setdefault(key, why)


def note_staged_capture() -> None:
    """A FULL CUDA graph's capture zeroed through staged rows: no build is deferred from now on."""
    _staged_capture[0] = True


def captured_staged_rows() -> bool:
    return _staged_capture[0]


def handoff_of(metadata) -> StepHandoff | None:
    """The hand-off the metadata hook attached to ``metadata``; None where it attached none
    (pass not configured, plugin not installed, or the builder's entry stood down). A deferred
    build's is resolved first (``resolve_deferred``): whoever reads it gets the step's rows."""
    handoff = getattr(metadata, ATTR, None)
    if handoff is not None and handoff.resolve is not None:
        return resolve_deferred(metadata)
    return handoff
