"""Every difference between the vLLM releases gdn-pass supports, in one place.

The rest of the package asks this module instead of reading vLLM internals:

================  ========  ===============================  ===========================
release           platform  GDN builder                      GDN/KDA core ops (vllm::)
================  ========  ===============================  ===========================
0.26.0            CUDA      no base ``__init__``; ``build``  qwen_gdn_attention_core,
                            called by keyword                olmo_hybrid_gdn_full_forward,
                                                             kda_attention (Kimi-Linear),
                                                             cpu_gdn_attention_core
0.27.0            CPU       no base ``__init__``             as 0.26 minus kda_attention
                                                             (Kimi's KDA read is plain Python)
0.28.0, 0.29.0    CPU       no base ``__init__``             + ..._fused_norm_packed,
                                                             bailing_v3_kda_attention
0.30.0            CPU       base ``__init__`` (``device``,   as 0.28
                            ``layer_names`` attributes)
0.31.0, 0.32.0    CPU       upstream fix (fresh rows are     as 0.28
                            prefills): the ``gdn`` entry
                            stands down
0.33.0            CUDA      as 0.32 (Python read, not run)   as 0.28
0.34.0            CUDA      as 0.32; ``build`` takes the     as 0.28
                            draft counts before
                            ``fast_build``; the V1 model
                            runner is removed
================  ========  ===============================  ===========================

The Lightning linear-attention builders (``builders``: ``bailing_linear``,
``minimax_linear``) are the same in every release from 0.26 to 0.34, and
unfixed in all of them. None of this decides what gdn-pass does with a
builder: that is asked of the installed code at engine start
(``support.decide``), so a release newer than every tested one runs where
its builders pass the checks (``check_release`` only names it untested).

All of them have ``PAD_SLOT_ID = -1`` and ``NULL_BLOCK_ID = 0`` and keep
``InductorPass`` in ``vllm.compilation.passes.inductor_pass`` (older releases
had ``vllm.compilation.inductor_pass``). Nothing here imports vLLM at module
import time: the plugin entry point must stay cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from typing import Any

import torch

from gdn_pass.opaque_ops import KNOWN_OPAQUE_STATE_OPS, LOOKS_LIKE_STATE_OP, schema_mismatch

__all__ = [
    "BuilderContext",
    "HiddenSignature",
    "CORE_OPS",
    "CoreOp",
    "TESTED_RELEASES",
    "UnsupportedVLLM",
    "unsupported",
    "wrapped_build",
    "builder_context",
    "core_op_problems",
    "check_release",
    "engine_compiles",
    "fields_of",
    "inductor_pass_base",
    "pad_slot_ids",
    "step_inputs",
    "version_tuple",
    "vllm_version",
]

# Releases the project runs end to end (benchmarks/results/version_matrix.md,
# benchmarks/results/gpu_vllm_e2e.md). "fixed" carries vLLM's own fix.
TESTED_RELEASES = {
    "0.26.0": "cuda",
    "0.27.0": "cpu",
    "0.28.0": "cpu",
    "0.29.0": "cpu",
    "0.30.0": "cpu",
    "0.31.0": "cpu, GDN fixed upstream",
    "0.32.0": "cpu, GDN fixed upstream",
    "0.33.0": "cuda, GDN fixed upstream; builders' Python read, equal to 0.32's where it matters",
    "0.34.0": "cuda, GDN fixed upstream",
}
# The oldest release the adapter supports (older ones lack what it reads); there is no newest.
OLDEST_KNOWN = (0, 26)

_INDUCTOR_PASS_MODULES = (
    "vllm.compilation.passes.inductor_pass",
    "vllm.compilation.inductor_pass",
)


class UnsupportedVLLM(ImportError):
    """The installed vLLM lacks something gdn-pass needs to guard GDN state."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def unsupported(what: str) -> UnsupportedVLLM:
    tested = ", ".join(f"{v} ({p})" for v, p in TESTED_RELEASES.items())
    return UnsupportedVLLM(
        f"gdn-pass cannot guard GDN state on vLLM {vllm_version()}: {what}. "
        f"Tested releases: {tested}. Remove VllmGDNStatePass from the compilation config "
        "to run this vLLM unguarded; `gdn-pass doctor` shows each state builder's checks."
    )


# --- InductorPass ---------------------------------------------------------------


@functools.cache
def inductor_pass_base() -> type:
    for name in _INDUCTOR_PASS_MODULES:
        try:
            return importlib.import_module(name).InductorPass
        except (ImportError, AttributeError):
            continue
    raise unsupported(f"no InductorPass in any of {_INDUCTOR_PASS_MODULES}")


# --- padding sentinels ----------------------------------------------------------


@functools.cache
def pad_slot_ids() -> tuple[int, ...]:
    """Slot ids that mark a padding row in this vLLM's GDN metadata.

    ``PAD_SLOT_ID = -1`` in older releases; ``NULL_BLOCK_ID = 0`` since
    vllm#39064 (block 0 is then the reserved null block, never a live slot).
    """
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    ids = [getattr(utils, "PAD_SLOT_ID", -1)]
    if hasattr(utils, "NULL_BLOCK_ID"):
        ids.append(utils.NULL_BLOCK_ID)
    return tuple(dict.fromkeys(ids))


# --- the GDN metadata builder ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BuilderContext:
    """What a GDN builder was given at construction.

    0.30's builder keeps these as attributes (through the base class's
    ``__init__``); 0.26-0.29's do not, so they are taken from the constructor's
    arguments, which every release has.
    """

    layer_names: tuple[str, ...]
    device: torch.device
    kv_cache_spec: Any
    vllm_config: Any


_CONSTRUCTOR_ARGS = ("kv_cache_spec", "layer_names", "vllm_config", "device")


@functools.cache
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)  # once per function: build() runs every step


def builder_context(init, builder, args: tuple, kwargs: dict) -> BuilderContext:
    """Bind a builder constructor call's arguments (positional or keyword)."""
    bound = _signature(init).bind(builder, *args, **kwargs).arguments
    missing = [name for name in _CONSTRUCTOR_ARGS if name not in bound]
    if missing:
        raise unsupported(f"{type(builder).__name__}.__init__ takes no {missing}")
    return BuilderContext(
        layer_names=tuple(bound["layer_names"]),
        device=torch.device(bound["device"]),
        kv_cache_spec=bound["kv_cache_spec"],
        vllm_config=bound["vllm_config"],
    )


class HiddenSignature(Exception):
    """A wrapper around a builder's ``build`` hides the parameters vLLM passes (the message names it)."""


def _takes_common(function) -> bool:
    try:
        return "common_attn_metadata" in inspect.signature(function, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False


def _closed_over_callables(function):
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value):
            yield value


@functools.cache
def wrapped_build(build):
    """The function whose parameters a call of ``build`` is bound by, and the wrappers in front of it.

    Returns ``(function, wrappers)``: ``function`` takes ``common_attn_metadata``;
    ``wrappers`` are the functions between ``build`` and it, outermost first (empty
    for vLLM's own ``build``). Another plugin or a profiler may have replaced a
    builder's ``build`` with a wrapper: one made with ``functools.wraps`` says what
    it wraps (``__wrapped__``); one made without is followed to the function it
    closes over. A wrapper that hides its target both ways raises
    ``HiddenSignature`` naming it: its calls cannot be read.
    """
    wrappers = []
    function = build
    for _ in range(16):  # a chain of wrappers, never a cycle
        if _takes_common(function):
            return function, tuple(wrappers)
        wrappers.append(function)
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            inner = next((c for c in _closed_over_callables(function) if _takes_common(inner_of(c))), None)
        if inner is None:
            break
        function = inner
    outer = wrappers[0] if wrappers else build
    raise HiddenSignature(
        f"{describe(outer)} hides the parameters of the build() it wraps (no common_attn_metadata, no "
        "__wrapped__, no wrapped function in its closure): wrap it with functools.wraps, or install it "
        "after gdn-pass")


def inner_of(function):
    """``function`` unwrapped through ``__wrapped__`` (``inspect.unwrap``)."""
    try:
        return inspect.unwrap(function)
    except ValueError:
        return function


def describe(function) -> str:
    """``module.qualname`` of a function, and where its code is (a wrapper, in start-up messages).

    From the code object: ``functools.wraps`` copies the wrapped function's names onto a wrapper.
    """
    code = getattr(function, "__code__", None)
    if code is None:
        return f"{getattr(function, '__module__', None) or '?'}.{type(function).__qualname__}"
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


def step_inputs(build, builder, args: tuple, kwargs: dict) -> tuple[Any, torch.Tensor | None]:
    """``common_attn_metadata`` and ``num_decode_draft_tokens_cpu`` of a ``build`` call, bound once.

    Either may be passed by position (0.30) or by keyword (0.26). ``build`` may
    be wrapped by someone else (``wrapped_build``): the call is bound by the
    parameters of the function it wraps.

    The draft counts are per row the draft tokens of a speculative row (``>= 0``)
    or -1; the builder's ``spec_sequence_masks`` is their ``>= 0`` (0.26-0.31),
    here on the host without a device sync. None without speculation.
    """
    common_at, drafts_at = _step_input_positions(build)
    # Fast path (every step): vLLM passes these by keyword or by position;
    # binding the whole signature costs ~15 us per build on the engine's host thread.
    if "common_attn_metadata" in kwargs:
        common = kwargs["common_attn_metadata"]
    elif common_at < len(args):
        common = args[common_at]
    else:
        bound = _signature(wrapped_build(build)[0]).bind(builder, *args, **kwargs).arguments  # raises what is missing
        return bound["common_attn_metadata"], bound.get("num_decode_draft_tokens_cpu")
    if drafts_at is not None and drafts_at < len(args):
        return common, args[drafts_at]
    return common, kwargs.get("num_decode_draft_tokens_cpu")


def common_position(build) -> int:
    """Position (after ``self``) of ``common_attn_metadata`` in ``build``'s signature."""
    return _step_input_positions(build)[0]


@functools.cache
def _step_input_positions(build) -> tuple[int, int | None]:
    """Positions (after ``self``) of ``common_attn_metadata`` and ``num_decode_draft_tokens_cpu``."""
    try:
        function = wrapped_build(build)[0]
    except HiddenSignature as exc:
        raise unsupported(str(exc)) from None
    names = list(inspect.signature(function, follow_wrapped=False).parameters)[1:]
    drafts = names.index("num_decode_draft_tokens_cpu") if "num_decode_draft_tokens_cpu" in names else None
    return names.index("common_attn_metadata"), drafts


def engine_compiles(vllm_config) -> bool:
    """Does this engine run its model through a compiled graph (a place for guarded ops)?

    False for ``enforce_eager=True`` and for compilation mode NONE (``mode`` in
    0.26-0.31; ``level`` in older releases), which some architectures force.
    """
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    cc = vllm_config.compilation_config
    mode = getattr(cc, "mode", None)
    if mode is None:
        mode = getattr(cc, "level", 0)
    return int(mode or 0) != 0


def splits_graphs(vllm_config) -> bool:
    """Does this engine cut its Dynamo graph at splitting ops (``VLLM_COMPILE`` piecewise), calling
    each from a stitching submodule that no Inductor pass sees? False with ``splitting_ops=[]``
    and with Inductor graph partition, where the ops stay inside the compiled graph."""
    cc = vllm_config.compilation_config
    return (engine_compiles(vllm_config) and int(getattr(cc, "mode", 0) or 0) == 3  # VLLM_COMPILE
            and bool(getattr(cc, "splitting_ops", None))
            and not getattr(cc, "use_inductor_graph_partition", False))


def micro_batched(vllm_config) -> bool:
    """Does this engine split a step into micro-batches (dual-batch overlap, ``ubatch_size > 1``)?

    The forward context then holds one metadata dict per micro-batch
    (``parallel_config.use_ubatching``, 0.27-0.34)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return bool(getattr(parallel, "use_ubatching", False))


# --- GDN/KDA core ops -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CoreOp:
    """A vLLM custom op that reads one layer's GDN/KDA state slots inside.

    ``arg_names`` is the schema as registered by every release in
    ``releases`` (checked by ``tests/vllm/test_compat.py`` in each CPU
    environment and ``tests/gpu/test_vllm_e2e.py`` on CUDA).
    """

    qualname: str
    arg_names: tuple[str, ...]
    releases: str
    family: str = "gdn"
    layer_arg: str = "layer_name"


CORE_OPS: tuple[CoreOp, ...] = (
    CoreOp("vllm::cpu_gdn_attention_core",
           ("mixed_qkv", "b", "a", "core_attn_out", "layer_name"), "0.26-0.31"),
    CoreOp("vllm::qwen_gdn_attention_core",
           ("qkv_or_qkvz", "b_or_ba", "a_or_z_out", "core_attn_out", "layer_name", "use_aiter"),
           "0.26-0.31"),
    CoreOp("vllm::qwen_gdn_attention_core_fused_norm_packed",
           ("mixed_qkvz", "ba", "core_attn_out", "layer_name"), "0.28-0.31"),
    CoreOp("vllm::olmo_hybrid_gdn_full_forward",
           ("hidden_states", "output", "layer_name"), "0.26-0.31"),
    CoreOp("vllm::gdn_attention_core_xpu",
           ("core_attn_out", "z", "projected_states_qkvz", "projected_states_ba", "layer_name"),
           "0.26-0.31"),
    CoreOp("vllm::kda_attention",  # Kimi-Linear; from 0.27 its read is plain Python
           ("q_proj_states", "k_proj_states", "v_proj_states", "g1", "beta", "core_attn_out",
            "layer_name"), "0.26", family="kda"),
    CoreOp("vllm::bailing_v3_kda_attention",
           ("q_proj_states", "k_proj_states", "v_proj_states", "g1", "beta", "core_attn_out",
            "layer_name"), "0.28-0.31", family="kda"),
    # MiniMax's Lightning layer op, which Bailing-MoE-v2.5's layers call too (unfixed upstream).
    CoreOp("vllm::linear_attention", ("hidden_states", "output", "positions", "layer_name"), "0.26-0.34",
           family="lightning"),
)

# No vllm:: op of 0.26-0.31 whose name says it carries GDN/KDA state
# (LOOKS_LIKE_STATE_OP, the core's) is missing from CORE_OPS (tests/vllm/test_compat.py).
# The adapter registers them with the core pass in ``registration``.


def _registered_vllm_ops() -> list[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("vllm::"))


def core_op_problems() -> list[str]:
    """Why the GDN/KDA core ops registered in this process cannot all be guarded.

    Empty when every registered op that looks like one is known, with the
    known schema.
    """
    problems = []
    for qualname in _registered_vllm_ops():
        name = qualname.split("::", 1)[1]
        spec = KNOWN_OPAQUE_STATE_OPS.get(qualname)
        if spec is None:
            if LOOKS_LIKE_STATE_OP.search(name):
                problems.append(f"{qualname} looks like a GDN/KDA core op but gdn-pass does not know it")
            continue
        mismatch = schema_mismatch(getattr(torch.ops.vllm, name).default, spec)
        if mismatch:
            problems.append(f"{qualname}: {mismatch}")
    return problems


def version_tuple() -> tuple[int, ...]:
    """``(major, minor)`` of the installed vLLM."""
    return tuple(int(p) for p in re.findall(r"\d+", vllm_version())[:2])


def check_release() -> str | None:
    """Raise UnsupportedVLLM for a release older than every supported one (engine start, configured only).

    A release newer than every tested one is not refused for its number: the
    entry's own start-up checks decide (``support.decide``). Returns the
    start-up line that names such a release as untested, None for a tested one.
    """
    if version_tuple() < OLDEST_KNOWN:
        oldest = ".".join(map(str, OLDEST_KNOWN))
        raise unsupported(f"gdn-pass supports vLLM {oldest} and newer")
    if vllm_version().split("+")[0] in TESTED_RELEASES:
        return None
    return (f"gdn-pass: vLLM {vllm_version()} is not one of the tested releases "
            f"({', '.join(TESTED_RELEASES)}); its state builders passed the start-up checks")


# --- start-up check -------------------------------------------------------------


def fields_of(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {}))
