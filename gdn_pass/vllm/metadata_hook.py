"""Stage per-row freshness for vLLM's recurrent-state metadata, derived from the scheduler.

Wraps ``build`` of every state builder in the registry (``builders``: GDN,
Kimi-K3 KDA, Bailing and MiniMax linear attention). The builder's own
decode/prefill split is exactly what is wrong (a fresh one-token row counts
as a decode and gets ``has_initial_state=None``), so the rows are derived
from the scheduler's ``CommonAttentionMetadata`` instead (the entry's
``rows``, made in the builder's file in ``gdn_pass.vllm.builders``); for GDN:

    has_initial_state[i] = num_computed_tokens[i] > 0
    valid[i]             = query_len[i] > 0 and state_slot[i] not a sentinel

for the builder's non-speculative rows, in the order of
``non_spec_state_indices_tensor``, then its speculative rows (whose first step
can be fresh too). The rows live in one ``StagedRowMetadata``
per builder (persistent buffers, refreshed in place); the hook hands them to
the guards, with what else it computed for the step, as one
``handoff.StepHandoff`` attached to the built metadata. Only what the guards read
is staged: on a step with a row to zero, its flag and slot
(``StagedRowMetadata.stage_fresh``: two copies, no kernel); on the others,
nothing (``stage_no_fresh``: ``fresh`` cleared once after a step that had
fresh rows). On CUDA nothing is staged at all where the entry can read its
decode rows in vLLM's own device tensors (``StateBuilder.device_rows``: GDN
steps without speculative rows, every Lightning step): the guard's one
zeroing launch finds the new decode rows itself (``rows.DecodeRows``: a
row whose ``seq_len`` equals its query length), and the host only counts
them, so that a step with none launches nothing. Where no guarded op covers
every layer of the builder's group (eager engines, reads behind no op), the
step guard (``step_guard``) zeroes the fresh slots right after the build
(the Lightning builders' too, whose reads the guarded twin of
``vllm::linear_attention`` covers in compiled engines). An entry whose builder this vLLM already
fixed stands down at engine start (``support.decide``).

Where the op guard owns the group on CUDA, in an engine that replays FULL
CUDA graphs, a step's builds make no rows at all: each attaches its
builder's deferred hand-off, and the step's first guarded op makes the rows
of every group of the step (``handoff.resolve_deferred``)::

    build:               metadata.handoff = state.deferred                  # no row read
    first guarded op:    for each deferred build of the step: _check_step(...)   # as at build
    FULL graph replay:   nothing on the host (no guarded op's Python runs; the captured
                         launch finds the new rows in vLLM's own tensors)

so a replayed step, with new rows or without, costs the host the wrappers
alone. Inside a FULL graph's capture a deferred build resolves to the
capture's hand-off (nothing staged: a capture must not record a copy), and
once a capture has zeroed through staged rows (a step vLLM's tensors cannot
describe), every build checks its step again (``handoff.captured_staged_rows``).
Steps with a prompt row (``max_query_len`` over 1: vLLM's runners replay FULL
graphs for decode steps only), vLLM's builds for a CUDA graph's capture
(``build_for_cudagraph_capture``) and CPU engines, whose every step runs its
guarded ops, are checked at build as before. Where ``build``'s signature allows
(every vLLM release's builders), the wrapper has ``build``'s own parameters and
runs the two paths of most steps itself (``_own_parameters_build``): a deferred
build's deferral, and a step without a new row checked at build (``_attach_idle``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from gdn_pass.kernels.zero_rows import CacheTable
from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.vllm import (accepted_counts, builders, compat, draftless_steps, piecewise, prompt_chunks,
                           step_guard, support)
from gdn_pass.vllm.configured import SERVE_PASS, configured_pass
from gdn_pass.vllm.handoff import (ATTR, StepHandoff, attach, captured_staged_rows, defer, join,
                                   note_not_deferred)
from gdn_pass.vllm.rows import forget_build_rows, has_new_rows, scheduler_rows

__all__ = ["BuilderState", "state_of", "install", "is_installed"]

from gdn_pass._logging import logger

_MARK = builders.HOOK_MARK
# The one attribute gdn-pass sets on a builder it acts for.
_BUILDER_STATE = "_gdn_pass_state"
_warned: set[str] = set()


@dataclasses.dataclass(eq=False, slots=True)
class BuilderState:
    """What the hook keeps for one builder it acts for (one KV-cache group of state layers).

    ``entry`` / ``context``: its registry entry and what vLLM gave its
    ``__init__``; ``keeps_decodes``: one-token steps stay on the decode path
    (``support.Decision.keeps_decodes``); ``rows``: its persistent
    ``StagedRowMetadata`` (made at the first build); ``owner``: the guard that
    zeroes its group (decided at the first build, then fixed);
    ``prompt_chunks``: the repair of prompt rows on a speculating Lightning
    builder's decode path (``prompt_chunks.for_builder``), or None.
    """

    entry: builders.StateBuilder
    context: compat.BuilderContext
    keeps_decodes: bool = False
    # The step guard zeroes this group whatever the compiled graph holds (``Decision.padded_only``).
    step_guard_only: bool = False
    # A padded new request's row is the only one to guard (``Decision.padded_only``), and the V2
    # runner names each step's padded rows before its builds (``accepted_counts``): a build of a
    # step without one is vLLM's alone, nothing staged, nothing attached.
    padded_rows_only: bool = False
    # vLLM derives other groups' metadata from this builder's (``update_block_table``): each build
    # keeps its inputs on its metadata for them.
    shares_metadata: bool = False
    rows: StagedRowMetadata | None = None
    owner: step_guard.Owner | None = None
    prompt_chunks: prompt_chunks.PromptChunks | None = None
    # The group's state (``_group_state``): vLLM's forward context and the group's first layer's
    # name, that layer's ``kv_cache`` object when the rest were read, every state tensor of the
    # group and (CUDA) their ``CacheTable``.
    forward_context: dict | None = None
    first_name: str | None = None
    first_kv_cache: object = None
    caches: list | None = None
    table: CacheTable | None = None
    # The hand-off of every step without a new row, made once the owner is decided (the
    # builder's first build): such a step (most of a serving engine's) only attaches it
    # (``_guard_step``). ``common``: the last such step's ``CommonAttentionMetadata``, for a
    # FULL CUDA graph's capture (``_capture_handoff``).
    idle: StepHandoff | None = None
    common: object = None
    # The hand-off a build only attaches where the op guard owns the group (``_why_not_deferred``): the
    # step's first guarded op makes the step's rows (``handoff.resolve_deferred``), and a FULL CUDA
    # graph's replay, which runs no guarded op's Python, never makes them on the host.
    deferred: StepHandoff | None = None
    # Inside vLLM's ``build_for_cudagraph_capture`` (``_mark_capture_builds``): its builds are not deferred.
    capture_builds: int = 0


def state_of(builder) -> BuilderState | None:
    """The hook's state for ``builder``; None where it does not act for it (not configured,
    stood down, or not a registered builder)."""
    return builder.__dict__.get(_BUILDER_STATE)


def is_installed() -> bool:
    """Is the hook on every state builder this vLLM has?

    A lazily imported builder (``eager=False``: Kimi-K3's) is hooked through its
    registered base's ``__init__`` when vLLM first makes one, so its module
    being imported (vLLM 0.34's Kimi-Linear imports it and makes GDN builders
    only) does not make the hook missing.
    """
    found = [(entry, cls) for entry, cls in builders.installed() if entry.eager]
    return bool(found) and all(getattr(cls.__dict__.get("build"), _MARK, False) for _, cls in found)


def install() -> bool:
    """Wrap ``__init__`` and ``build`` of every registered builder this vLLM has (idempotent).

    True if any was newly wrapped. Where GDNStatePass is not configured the
    wrappers only record and pass through: nothing they do can raise into the
    engine. Where it is, every check that can fail runs in ``__init__``, at
    engine start. A builder's wrappers act only for instances whose registry
    entry is that builder's (``builders.entry_of``), so a subclass with an
    entry of its own is hooked once.
    """
    newly = False
    for entry, cls in builders.installed():
        if getattr(cls.__dict__.get("build"), _MARK, False):
            continue
        _wrap(entry, cls)
        newly = True
    return newly


def _wrap(entry: builders.StateBuilder, cls: type) -> None:
    original_init, original_build = cls.__init__, cls.build

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if support.is_probing():  # gdn-pass's own builder (doctor, the pass at compile time)
            return
        own = builders.registered_base(type(self))
        if own is None:
            return
        if own[0] is entry:
            _on_builder_created(self, entry, original_init, original_build, args, kwargs)
        elif not getattr(own[1].__dict__.get("build"), _MARK, False):
            # A lazily imported builder (Kimi-K3's) made for the first time, inside
            # its own __init__'s call of this one: hook its class now.
            own_build = own[1].build
            _wrap(*own)
            _on_builder_created(self, own[0], original_init, own_build, args, kwargs)

    @functools.wraps(original_build)
    def build(self, *args, **kwargs):
        state = self.__dict__.get(_BUILDER_STATE)
        if state is None or state.entry is not entry:
            # not configured, stood down, or a subclass's own hook acts
            return original_build(self, *args, **kwargs)
        if state.padded_rows_only and not accepted_counts.step_has_padded_rows():
            return original_build(self, *args, **kwargs)  # most steps of such an engine
        if state.keeps_decodes:
            args, kwargs = _one_token_step_as_decodes(original_build, self, args, kwargs)
        chunks, inputs = state.prompt_chunks, None
        if chunks is not None:
            inputs = compat.step_inputs(original_build, self, args, kwargs)  # read once per build
            kwargs = chunks.call_kwargs(inputs[0], kwargs)
        metadata = original_build(self, *args, **kwargs)
        if chunks is not None:
            chunks.keep_state_in_first_column(self, *inputs, metadata)
        if state.shares_metadata:
            setattr(metadata, _BUILD_INPUTS, (args, kwargs))
        # Everything the hook does after vLLM's build is under _guard_step (benchmarks time it there).
        return _guard_step(self, state, original_build, args, kwargs, metadata, inputs)

    own = _own_parameters_build(entry, original_build, build)
    setattr(build, _MARK, True)
    if own is not None:
        setattr(own, _MARK, True)
    cls.__init__ = __init__
    cls.build = own or build
    _mark_capture_builds(cls)
    original_update = cls.__dict__.get("update_block_table")
    if original_update is None:
        return

    @functools.wraps(original_update)
    def update_block_table(self, metadata, *args, **kwargs):
        derived = original_update(self, metadata, *args, **kwargs)
        state = self.__dict__.get(_BUILDER_STATE)
        # Guarded once, by the wrapper the builder's class resolves to (a subclass's own, if any).
        if state is None or type(self).update_block_table is not update_block_table:
            return derived
        if state.padded_rows_only and not accepted_counts.step_has_padded_rows():
            return derived  # as its first group's build: vLLM's alone
        # Another group's metadata made from this step's first build: guarded as if built here.
        inputs = getattr(metadata, _BUILD_INPUTS, None)
        if inputs is None:  # not from a build this hook saw (never in vLLM 0.31-0.34): built from the next step on
            self.supports_update_block_table = False
            _warn_once(f"update-block-table-source:{entry.key}",
                       f"gdn-pass: {type(self).__name__}.update_block_table was given metadata no hooked build "
                       "made, so one step of its group went unguarded; the group builds its own metadata from "
                       "the next step on")
            return derived
        return _guard_step(self, state, original_build, *inputs, derived)

    setattr(update_block_table, _MARK, True)
    cls.update_block_table = update_block_table


# The build wrapper with ``build``'s own parameters (``_own_parameters_build``); ``{...}`` are
# filled from the signature. The two paths of most steps run here, without packing the call into
# ``*args, **kwargs`` or calling ``_guard_step``: a deferred build (most of a FULL-graph engine's
# steps), with the same checks as ``_guard_step``'s deferred branch in the same order; and a build
# that changes nothing before vLLM's and is not deferred (the step guard's groups, CPU engines),
# which checks its step at once as ``_check_step`` does (``_attach_idle``; a step with a new row
# goes on to ``_stage_new_step``). Every other build goes to the generic wrapper, each argument by keyword.
_OWN_PARAMETERS_TEMPLATE = """
def make(entry, original_build, generic_build, {defaults}):
    def build({self}, {declared}):
        state = {self}.__dict__.get(_BUILDER_STATE)
        if state is None or state.entry is not entry:
            return original_build({self}, {forward})
        if state.padded_rows_only and not accepted_counts.step_has_padded_rows():
            return original_build({self}, {forward})
        deferred = state.deferred
        if deferred is None:
            if state.keeps_decodes or state.prompt_chunks is not None or state.shares_metadata:
                return generic_build({self}, {by_keyword})
            metadata = original_build({self}, {forward})
            if state.idle is not None and _attach_idle(state, common_attn_metadata, metadata):
                return metadata
            return _stage_new_step({self}, state, original_build, (), {{{by_name}}}, metadata,
                                   common_attn_metadata, _UNREAD)
        if state.capture_builds or common_attn_metadata.max_query_len > 1 or captured_staged_rows():
            return generic_build({self}, {by_keyword})
        metadata = original_build({self}, {forward})
        if getattr(state.forward_context.get(state.first_name), "kv_cache", None) is not state.first_kv_cache:
            _group_state(state)
        setattr(metadata, _BUILD_INPUTS, (({positional}), {keyword_only}))
        return defer(metadata, deferred)
    return build
"""


def _own_parameters_build(entry: builders.StateBuilder, original_build, generic_build):
    """``generic_build`` (the hook's ``build(self, *args, **kwargs)``) as a function of
    ``original_build``'s own parameters, made from its signature; None where the signature has
    ``*args``, ``**kwargs`` or positional-only parameters (a wrapper of someone else's, for example),
    or no ``common_attn_metadata``: such a ``build`` keeps the generic wrapper.

    Why: vLLM's runners call ``build`` by keyword, and a ``*args, **kwargs`` wrapper packs every call
    into a tuple and a dict and unpacks them again for vLLM's build (1.0-1.2 us a step of three
    builds on the GPU host, ``hook_host_time.md``). The function is made with ``exec`` over this
    module's globals, as every function that keeps an arbitrary signature must be.
    """
    try:
        parameters = list(inspect.signature(original_build, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in parameters]
    if (len(parameters) < 2 or any(p.kind not in plain for p in parameters)
            or parameters[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
            or "common_attn_metadata" not in names[1:]
            or any(not n.isidentifier() or n in _TEMPLATE_NAMES or n.startswith("default_") for n in names)):
        return None
    self_name, rest = names[0], parameters[1:]
    defaults = {f"default_{i}": p.default for i, p in enumerate(rest) if p.default is not p.empty}
    declared, keyword_only_seen = [], False
    for i, p in enumerate(rest):
        if p.kind is p.KEYWORD_ONLY and not keyword_only_seen:
            declared.append("*")
            keyword_only_seen = True
        declared.append(p.name if p.default is p.empty else f"{p.name}=default_{i}")
    positional = [p.name for p in rest if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in rest if p.kind is p.KEYWORD_ONLY]
    source = _OWN_PARAMETERS_TEMPLATE.format(
        self=self_name, declared=", ".join(declared),
        defaults=", ".join(defaults) or "_=None",
        forward=", ".join([*positional, *(f"{n}={n}" for n in keyword_only)]),
        by_keyword=", ".join(f"{p.name}={p.name}" for p in rest),
        by_name=", ".join(f"{p.name!r}: {p.name}" for p in rest),
        positional="".join(f"{n}, " for n in positional),
        keyword_only="{" + ", ".join(f"{n!r}: {n}" for n in keyword_only) + "}")
    namespace: dict = {}
    try:
        exec(compile(source, f"<gdn-pass build wrapper of {original_build.__qualname__}>", "exec"),  # noqa: S102
             globals(), namespace)
        build = namespace["make"](entry, original_build, generic_build, **defaults)
    except Exception as exc:  # noqa: BLE001 - installing runs in every vLLM process: never stop one here
        logger.debug("gdn-pass: %s keeps the generic build wrapper (%r)", original_build.__qualname__, exc)
        return None
    return functools.wraps(original_build)(build)


# Names the template uses: a build parameter named so would hide them.
_TEMPLATE_NAMES = frozenset({
    "make", "build", "entry", "original_build", "generic_build", "state", "deferred", "metadata", "accepted_counts",
    "captured_staged_rows", "defer", "getattr", "setattr", "_group_state", "_BUILD_INPUTS", "_BUILDER_STATE",
    "_attach_idle", "_stage_new_step", "_UNREAD"})


def _mark_capture_builds(cls: type) -> None:
    """Count, on the builder's state, the builds vLLM makes for a CUDA graph's capture
    (``build_for_cudagraph_capture``): they are checked at build, never deferred (``_guard_step``),
    and the wrapper of ``build``'s own parameters cannot tell them by how they pass their inputs."""
    original_capture = getattr(cls, "build_for_cudagraph_capture", None)
    if original_capture is None or getattr(original_capture, _MARK, False):
        return

    @functools.wraps(original_capture)
    def build_for_cudagraph_capture(self, *args, **kwargs):
        state = self.__dict__.get(_BUILDER_STATE)
        if state is None:
            return original_capture(self, *args, **kwargs)
        state.capture_builds += 1
        try:
            return original_capture(self, *args, **kwargs)
        finally:
            state.capture_builds -= 1

    setattr(build_for_cudagraph_capture, _MARK, True)
    cls.build_for_cudagraph_capture = build_for_cudagraph_capture


def _one_token_step_as_decodes(original_build, builder, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A step whose rows all have at most one token, without ``is_prefilling``: vLLM 0.31+'s builder
    then keeps its fresh rows on the decode path (and stages its FULL-graph buffers) as before its
    reroute, and the guards zero them (``support.Decision.keeps_decodes``)."""
    common, _ = compat.step_inputs(original_build, builder, args, kwargs)
    if getattr(common, "is_prefilling", None) is None or common.max_query_len > 1:
        return args, kwargs
    common = dataclasses.replace(common, is_prefilling=None)
    if "common_attn_metadata" in kwargs:
        return args, {**kwargs, "common_attn_metadata": common}
    at = compat.common_position(original_build)
    return (*args[:at], common, *args[at + 1:]), kwargs


def _guard_step(builder, state: BuilderState, original_build, args: tuple, kwargs: dict, metadata,
                inputs: tuple | None = None):
    """Stage the step's rows to zero, and zero them here where the step guard owns the group; or,
    where the group's builds are deferred (``_why_not_deferred``), vLLM's runner calls this one with its
    inputs by keyword, not for a CUDA graph's capture (``BuilderState.capture_builds``), and every
    row of the step has at most one token (the steps a FULL decode graph can replay), leave that to
    the step's first guarded op. The wrapper of ``build``'s own parameters runs this deferred
    branch itself (``_OWN_PARAMETERS_TEMPLATE``): the two change together.

    ``inputs``: the build's ``(common_attn_metadata, num_decode_draft_tokens_cpu)`` where the caller
    has read them already (``compat.step_inputs``)."""
    deferred = state.deferred
    if deferred is not None:
        # A step with a prompt row (max_query_len over 1) replays no FULL decode graph in vLLM's
        # runners: its guarded ops run, and deferring would only move its check into them.
        common = kwargs.get("common_attn_metadata")
        if (common is not None and common.max_query_len <= 1 and not state.capture_builds
                and not captured_staged_rows()):
            if getattr(state.forward_context.get(state.first_name), "kv_cache", None) is not state.first_kv_cache:
                _group_state(state)  # vLLM bound new caches: the table a capture zeroes is made here
            setattr(metadata, _BUILD_INPUTS, (args, kwargs))
            return defer(metadata, deferred)
    return _check_step(builder, state, original_build, args, kwargs, metadata, inputs)


def _check_step(builder, state: BuilderState, original_build, args: tuple, kwargs: dict, metadata,
                inputs: tuple | None = None, resolving: bool = False):
    """``_guard_step`` of a build whose step's rows are made now: at the build, or (a deferred
    build, ``resolving``) at the step's first guarded op (``_resolve``), where a step with a new
    row takes the lean path where it can (``_resolve_on_device``)."""
    if inputs is not None:
        common, draft_counts = inputs
    else:
        common, draft_counts = kwargs.get("common_attn_metadata"), _UNREAD  # vLLM's runners: by keyword
        if common is None:  # by position (a CUDA graph's capture, build_for_cudagraph_capture)
            common, draft_counts = compat.step_inputs(original_build, builder, args, kwargs)
    if state.idle is not None and _attach_idle(state, common, metadata):
        return metadata
    if resolving and _resolve_on_device(state, common, metadata):
        return metadata
    return _stage_new_step(builder, state, original_build, args, kwargs, metadata, common, draft_counts)


def _stage_new_step(builder, state: BuilderState, original_build, args: tuple, kwargs: dict, metadata, common,
                    draft_counts):
    """``_stage_step``, once the step is known to need it (a new row, or the builder's first build):
    the step is not checked again (under vLLM 0.34's inference host tensors the check recomputes the
    step's rows, 7.5 us a build on the GPU host)."""
    try:
        return _stage_step(builder, state, original_build, args, kwargs, metadata, common, draft_counts)
    finally:
        forget_build_rows()


def _attach_idle(state: BuilderState, common, metadata) -> bool:
    """Most steps: no new row. Attach the builder's hand-off of such steps (``BuilderState.idle``)
    and say True; False, attaching nothing, where the step has a new row. The step's one check is
    made by its first build (``rows.has_new_rows``); a later build of the step finds it by identity."""
    if has_new_rows(common):
        return False
    if getattr(state.forward_context.get(state.first_name), "kv_cache", None) is not state.first_kv_cache:
        _group_state(state)  # vLLM bound new caches: the table a capture zeroes is made here
    rows = state.rows
    if not rows.fresh_clear:  # the first such step after one with fresh rows
        rows.stage_no_fresh(rows.num_rows)
    state.common = common
    setattr(metadata, ATTR, state.idle)
    return True


def _stage_step(builder, state: BuilderState, original_build, args: tuple, kwargs: dict, metadata, common,
                draft_counts):
    """``_guard_step`` of a step with a new row, or of a builder's first build."""
    if draft_counts is _UNREAD:  # the step's inputs are read once per build
        common, draft_counts = compat.step_inputs(original_build, builder, args, kwargs)
    rows = state.rows
    if rows is None:
        rows = state.rows = _new_rows(builder, state.context, state.entry)
    caches, table = _group_state(state)
    owner = state.owner
    if owner is None:
        owner = state.owner = _decide_owner(state)
        state.idle = StepHandoff(rows, 0, None, None, owner is _STEP,
                                 in_capture=functools.partial(_capture_handoff, state))
        why_not = _why_not_deferred(builder, state)
        if why_not is None:
            state.deferred = StepHandoff(rows, None, None, None, False,
                                         resolve=functools.partial(_resolve, builder, state, original_build))
        else:
            note_not_deferred(state.entry.key, why_not)
    step_owned = owner is _STEP
    fresh, decode = state.entry.stage_step(rows, common, metadata, draft_counts, on_device=table is not None)
    handoff = StepHandoff(rows, fresh, table, decode, step_owned)
    if step_owned:
        step_guard.zero_group(caches, handoff)
    elif decode is not None and fresh:
        # The op guard's first op of the step zeroes every group joined here in one launch.
        join(scheduler_rows(common), handoff)
    return attach(metadata, handoff)


def _capture_handoff(state: BuilderState, metadata) -> StepHandoff:
    """A hand-off of this step's own for an op guard inside a FULL CUDA graph's capture, on a step
    without new rows: the guard launches anyway, so that the replayed graph zeroes later steps'
    rows, from vLLM's decode rows where the entry reads them (its persistent buffers then), else
    from the staged rows. The group's table was made at build, outside the capture."""
    table, rows = state.table, state.rows
    decode = None if table is None else state.entry.decode_rows(state.common, metadata, rows.max_rows)
    return StepHandoff(rows, 0, table, decode, state.owner is _STEP)


def _why_not_deferred(builder, state: BuilderState) -> str | None:
    """None where this group's builds may leave the step's rows to its first guarded op; else why not.

    Deferred: the op guard owns it, on CUDA (a cache table), in an engine that replays FULL CUDA
    graphs (whose steps then read no row on the host), and the build changes nothing before vLLM's
    (no rows kept for other groups, no decodes kept, no prompt chunks, not only padded rows) nor
    speculates (a speculative step's new rows are the host's to say). Elsewhere every step runs its
    guarded ops, and deferring would only add to them. Decided at the group's first build; the
    reason is reported (``handoff.deferral_activity``)."""
    if state.owner is not step_guard.Owner.OP or state.step_guard_only or state.padded_rows_only:
        return "the step guard zeroes the group at build"
    if state.table is None:
        return "no CUDA cache table at the group's first build (CPU caches, or none bound yet)"
    if not support.captures_full_graphs(state.context.vllm_config):
        return "the engine captures no FULL CUDA graph"
    if getattr(builder, "use_spec_decode", False):
        return "speculative decoding (the host says a speculative step's new rows)"
    if state.shares_metadata:
        return "other groups' metadata is derived from this group's builds (update_block_table)"
    if state.keeps_decodes:
        return "one-token steps are kept on the decode path at build"
    if state.prompt_chunks is not None:
        return "prompt chunks are repaired at build"
    return None


def _resolve(builder, state: BuilderState, original_build, metadata, capturing: bool) -> StepHandoff:
    """A deferred build's step hand-off, made from the build's inputs kept on its metadata, and
    attached. Inside a FULL CUDA graph's capture, the capture's own (``_capture_handoff``), which
    stages nothing: its launch is recorded, not run, and replays read vLLM's tensors (or, where
    the entry cannot read them there, the staged rows, and the op guard then stops deferral)."""
    args, kwargs = getattr(metadata, _BUILD_INPUTS)
    if capturing:
        state.common, _ = compat.step_inputs(original_build, builder, args, kwargs)
        handoff = _capture_handoff(state, metadata)
        attach(metadata, handoff)
        return handoff
    _check_step(builder, state, original_build, args, kwargs, metadata, resolving=True)
    return getattr(metadata, ATTR)


def _resolve_on_device(state: BuilderState, common, metadata) -> bool:
    """A deferred build's step with a new row, where the zeroing launch finds the new decode rows in
    vLLM's own tensors (``StateBuilder.decode_rows``): attach its hand-off from those and the count
    of new rows among the step's first ``num_rows`` (the decode rows: vLLM's runners order decodes
    first), and say True. Nothing is staged, as ``StateBuilder.stage_step`` stages nothing there, and
    the builder's own rows are not read (6.7 us a build on the H100 host under vLLM 0.34's inference
    tensors): the step's rows, read once for all its groups (``rows.one_step``), give the count,
    which decides only whether the launch runs; the launch tells the rows itself. False where the
    entry cannot read its decode rows there (``_stage_new_step`` then stages them as at build).

    The count is the entry's ``HostRows.fresh``: a deferred step has no row of more than one token,
    so the builders' prefill runs, whose kernels start new rows from zero, are empty, and the rows
    to zero are the new rows among the decode rows (``test_metadata_hook_deferral.py`` checks the count
    against the step's own computed counts, FULL-graph padding rows included)."""
    _, table = _group_state(state)
    decode = state.entry.decode_rows(common, metadata, state.rows.max_rows)
    if decode is None or decode.slots.dim() != 1:  # a speculative row's columns: the entry's own rows count them
        return False
    step = scheduler_rows(common)
    fresh = step.new_among_first(decode.num_rows)
    forget_build_rows()
    handoff = StepHandoff(state.rows, fresh, table, decode, False)
    if fresh:
        join(step, handoff)
    attach(metadata, handoff)
    return True


def _on_builder_created(builder, entry: builders.StateBuilder, init, build, args, kwargs) -> None:
    """Keep what the builder was given, if this engine asked for the guard.

    Unconfigured engines get the one-time warnings and nothing else; no error
    here may reach them. Configured engines that cannot be guarded stop here,
    at start-up, with UnsupportedVLLM naming what is missing. An entry whose
    builder vLLM already fixed says so once and keeps nothing: its builds pass
    straight through.
    """
    if _BUILDER_STATE in builder.__dict__:  # hooked twice (a subclass's hook and its base's): decided once
        return
    vllm_config = kwargs.get("vllm_config") or next(
        (a for a in args if hasattr(a, "compilation_config")), None)
    try:
        configured = configured_pass(vllm_config.compilation_config) is not None
    except Exception as exc:  # noqa: BLE001 - no pass could have been configured: run as is
        logger.debug("gdn-pass: %s not recorded (%r)", entry.class_name, exc)
        return
    try:
        _warn_about_mode(vllm_config, configured)
    except Exception as exc:  # noqa: BLE001 - a warning must never stop an engine
        logger.debug("gdn-pass: could not check the compilation mode (%r)", exc)
    if not configured:
        return
    untested = compat.check_release()
    context = compat.builder_context(init, builder, args, kwargs)
    decision = support.decide(entry, builder, build, context)
    support.record(decision)
    if decision.action == support.REFUSES:
        raise compat.unsupported(f"{entry.class_name} ({entry.key}): {decision.why}")
    if untested:
        _info_once(f"untested:{entry.key}", f"{untested}; {entry.class_name} {decision.action}: "
                   f"{decision.checked()}")
    if decision.action == support.STANDS_DOWN:
        _info_once(f"stand-down:{entry.key}",
                   f"gdn-pass: {decision.why}; standing down for {entry.class_name} ({entry.models}): "
                   "no per-step work")
        return
    state = builder.__dict__[_BUILDER_STATE] = BuilderState(entry, context)
    if getattr(builder, "supports_update_block_table", False):
        # vLLM builds this metadata for the first group of a step only and derives the other
        # groups' by update_block_table (GDN's, 0.31+ on the V2 runner): the hook's wrapper of
        # that method guards each derived metadata from the first build's inputs, which every
        # build keeps on its metadata. A class whose own method is not wrapped is built per group.
        if not getattr(getattr(type(builder), "update_block_table", None), _MARK, False):
            builder.supports_update_block_table = False
            _info_once(f"update-block-table:{entry.key}",
                       f"gdn-pass: {entry.class_name} builds every group's metadata itself (vLLM's "
                       "update_block_table shortcut would bypass the guard)")
        else:
            state.shares_metadata = True
    counted = decision.counts_padded_drafts and _count_padded_drafts(entry, builder, context.vllm_config)
    if decision.padded_only:
        state.step_guard_only = True
        state.padded_rows_only = counted
        _info_once(f"padded-only:{entry.key}", f"gdn-pass: {decision.why}")
    state.prompt_chunks = prompt_chunks.for_builder(entry, builder, context.vllm_config)
    if entry.prefills_draftless_rows:
        draftless_steps.keep_off_full_graphs(builder, context.vllm_config)
    if decision.keeps_decodes:
        state.keeps_decodes = True
        _info_once(f"keeps-decodes:{entry.key}", f"gdn-pass: {decision.why}")


def _count_padded_drafts(entry: builders.StateBuilder, builder, vllm_config) -> bool:
    """Make sure the padded new requests' drafts reach ``builder`` (``Decision.padded_only``): vLLM's V2
    runner counts none for a row still prefilling; ``accepted_counts`` makes it. Where it cannot,
    start-up says what remains (vLLM's own: the placeholders stay in such a request's state).
    True where ``accepted_counts`` names each step's padded rows for the builds (the V2 runner)."""
    if not support.runs_v2_model_runner(vllm_config):
        return False  # the V1 runner counts a padded row's drafts itself
    why_not = accepted_counts.supply(builder)
    if why_not is None:
        return True
    _warn_once(f"padded-drafts:{entry.key}",
               f"gdn-pass: vLLM {compat.vllm_version()}'s V2 model runner counts no drafts for a new "
               f"request the scheduler padded with placeholder drafts, and gdn-pass cannot count them for "
               f"{entry.class_name}: {why_not}. Such a request's prefill path keeps the placeholders in its "
               "state, and its later tokens can come out wrong (vLLM's own)")
    return False


_STEP = step_guard.Owner.STEP
_NOT_BOUND = object()  # _group_state: the group's first layer has no caches
_UNREAD = object()  # _guard_step: the draft counts not read yet
# The attribute on a build's metadata that keeps the build's inputs for update_block_table.
_BUILD_INPUTS = "_gdn_pass_build_inputs"


def _decide_owner(state: BuilderState) -> step_guard.Owner:
    """Which guard zeroes this group's fresh slots: decided at the first build, then fixed."""
    context, entry = state.context, state.entry
    # Micro-batched steps hand the op guard one metadata dict per micro-batch: the step guard
    # zeroes each micro-batch's fresh rows at its own build instead.
    micro_batched = compat.micro_batched(context.vllm_config)
    op_guarded = "op" in entry.guards and not micro_batched and not state.step_guard_only
    owner = step_guard.decide_owner(
        context.layer_names, compiled=op_guarded and compat.engine_compiles(context.vllm_config))
    uncovered = sorted(set(context.layer_names) - step_guard.guarded_layers())
    # Layers the op guard could have had but no guarded op reached (splits_graphs: a compiling engine).
    missed_op = owner is _STEP and op_guarded and bool(uncovered)
    if missed_op and compat.splits_graphs(context.vllm_config) and piecewise.installed_after_a_split():
        _warn_once(
            "split-before-plugin",
            "gdn-pass: its vLLM plugin was not loaded before this engine split its graph (the "
            "'gdn_pass' entry point of vllm.general_plugins: install gdn-pass with pip, and where "
            "VLLM_PLUGINS is set, include gdn_pass in it). The state ops vLLM split out run "
            "unguarded: the step guard zeroes their groups' fresh slots at metadata build instead "
            "(one launch per group and step with fresh rows, replayed FULL CUDA graphs included)")
    logger.info(
        "gdn-pass: %d %s layer(s) of this group guarded %s%s", len(context.layer_names), entry.key,
        "by the op guard (the guarded ops in the compiled graph)" if owner is step_guard.Owner.OP
        else "by the step guard at metadata build (one zeroing launch per step with fresh rows)",
        f"; no guarded op ran for {uncovered[:3]}{'...' if len(uncovered) > 3 else ''}" if missed_op
        else "; micro-batched steps (dual-batch overlap)" if micro_batched else "")
    return owner


def _group_state(state: BuilderState) -> tuple[list[torch.Tensor], CacheTable | None]:
    """Every state tensor (conv, recurrent, ...) of the group's layers, and (CUDA) their one-launch table.

    Kept per builder while the group's first layer keeps the same ``kv_cache``
    object: vLLM binds every layer's caches in one pass when it allocates them
    (profiling runs have empty ones) and never swaps tensors inside them, so
    one identity check per build covers the group (12 layers in Qwen3-Next-80B's
    groups). The table is built here, outside CUDA-graph capture.
    """
    forward_context = state.forward_context
    if forward_context is not None:
        if getattr(forward_context.get(state.first_name), "kv_cache", None) is state.first_kv_cache:
            return state.caches, state.table
    context = state.context
    forward_context = context.vllm_config.compilation_config.static_forward_context
    bound = [getattr(forward_context.get(name), "kv_cache", None) for name in context.layer_names]
    caches = [t for kv_cache in bound for t in (kv_cache or ())
              if isinstance(t, torch.Tensor) and t.numel()]
    state.caches, state.table = caches, _cache_table(caches, context.device)
    state.forward_context, state.first_name = forward_context, context.layer_names[0]
    # A first layer missing from the forward context, or without caches, keeps every build of
    # the group on the full path: its caches are read again each time.
    state.first_kv_cache = _NOT_BOUND if bound[0] is None else bound[0]
    return state.caches, state.table


def _cache_table(caches: list[torch.Tensor], device: torch.device) -> CacheTable | None:
    """The group's one-launch table (CUDA), or None: zeroed cache by cache (CPU)."""
    return CacheTable.build(caches) if caches and device.type == "cuda" else None


def _new_rows(builder, context: compat.BuilderContext, entry: builders.StateBuilder) -> StagedRowMetadata:
    cfg = context.vllm_config
    max_rows = max(
        cfg.scheduler_config.max_num_seqs,
        getattr(builder, "decode_cudagraph_max_bs", 0),
        cfg.compilation_config.max_cudagraph_capture_size or 0,
    )
    if entry.spec_columns:  # one staged row per slot column of a speculative row
        max_rows *= 1 + (getattr(cfg, "num_speculative_tokens", None) or 0)
    return StagedRowMetadata(max_rows, device=context.device, pad_slot_ids=compat.pad_slot_ids())


def _warn_about_mode(vllm_config, configured: bool) -> None:
    """Say once per process when the plugin is installed but not asked to guard."""
    if not configured:
        _warn_once(
            "unconfigured",
            "plugin installed but VllmGDNStatePass is not in "
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


def _info_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.info(message)
