"""What gdn-pass does with each state builder of the installed vLLM: act, stand down, or refuse.

Decided from the installed code itself, never from its version number, by
one function (``decide``) that the metadata hook calls when vLLM makes a
builder in an engine that configured the pass, and that ``gdn-pass doctor``
calls on a builder of its own. The checks, in order::

    check          passes when                                                   else
    build          build() takes common_attn_metadata, through any wrapper       refuses (at once)
                   (``compat.wrapped_build``; a wrapper is named)
    split          the builder's own split ran on the probe steps (split_probe)  refuses
    -- the split reroutes fresh rows and this engine never replays a FULL decode graph on such
       a step (``reroute_holds``): stands down here, the rest is not needed; unless, with
       speculative decoding, a new one-token request the scheduler padded with placeholder
       drafts takes the path that reads its slot once its drafts are counted (split_probe's
       ``padded``): then it acts for such rows only (``Decision.padded_only``) --
    metadata       the metadata class has every field the entry's rows read      refuses
    common         CommonAttentionMetadata has query_start_loc_cpu, num_reqs     refuses
                   and a per-row computed-token count
    state layout   the group's MambaSpec holds per-slot state as the entry       refuses
                   expects (``StateBuilder.state_layout``)
    engine         layer names, compilation_config.static_forward_context        refuses
    core ops       (entries with the op guard) every vllm:: op that looks like   refuses
                   a GDN/KDA core op is known, with the known schema
    rows           gdn-pass's own per-step rows (``entry.rows``) on the probe     refuses
                   step, its host tensors as inference tensors, find exactly
                   the fresh row the split put on a decode path
    -- a refusal names every check that failed --
    -- acts: where the split reads a stale slot; or, where it reroutes but this engine may
       replay a FULL decode graph on buffers the rerouted build left unstaged, keeping
       one-token steps on the decode path (``without_prefilling`` must show that path back;
       else refuses) --

A release newer than every tested one gets no special treatment: it acts,
stands down or refuses by the same checks, and the start-up line says it is
untested and lists what was checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import torch

from gdn_pass.vllm import builders, compat
from gdn_pass.vllm.split_probe import ProbeError, SplitFindings, as_inference_tensors, probe_split

__all__ = ["ACTS", "Check", "Decision", "REFUSES", "STANDS_DOWN", "captures_full_graphs", "decide", "decide_for_class",
           "is_probing", "reroute_holds", "stood_down"]

ACTS, STANDS_DOWN, REFUSES = "acts", "stands down", "refuses"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of ``decide``: its name, what it found, and whether it passed."""

    name: str
    passed: bool
    found: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """What gdn-pass does with one builder in one engine, and why (the module table).

    ``keeps_decodes``: acting on a builder that reroutes fresh rows, one-token
    steps are built without ``is_prefilling`` so that they stay on the decode
    path, where the guards zero them. ``padded_only``: acting on a builder that
    reroutes fresh rows, for the new requests the scheduler pads with
    placeholder drafts only: their drafts are counted (vLLM's V2 runner counts
    none: ``accepted_counts``), so that they take the speculative path, whose
    state per token keeps the placeholders out of the state the next step
    reads, and the step guard zeroes their slots at build (no guarded op).
    ``counts_padded_drafts``: acting, such rows read their slot once their
    drafts are counted, so they must be (true with ``padded_only``).
    """

    entry: builders.StateBuilder
    action: str
    why: str
    checks: tuple[Check, ...]
    keeps_decodes: bool = False
    padded_only: bool = False
    counts_padded_drafts: bool = False

    def checked(self) -> str:
        return "; ".join(f"{c.name}: {c.found}" for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


def decide(entry: builders.StateBuilder, builder, build, context: compat.BuilderContext) -> Decision:
    """The decision for ``builder`` (vLLM's, just made; ``build``: its class's ``build`` before
    gdn-pass's hook, possibly another plugin's wrapper). Never raises: a failed check is a
    decision to refuse, which the caller turns into the start-up error."""
    checks: list[Check] = []

    def refusal() -> Decision:
        failed = [c for c in checks if not c.passed]
        return Decision(entry, REFUSES, "; ".join(f"{c.name}: {c.found}" for c in failed), tuple(checks))

    try:
        function, wrappers = compat.wrapped_build(build)
    except compat.HiddenSignature as exc:
        checks.append(Check("build", False, str(exc)))
        return refusal()
    via = f" through {', '.join(map(compat.describe, wrappers))}" if wrappers else ""
    checks.append(Check("build", True, f"{compat.describe(function)} takes common_attn_metadata{via}"))

    spec_tokens = _speculative_tokens(builder, context.vllm_config)
    findings = None
    try:
        findings = probe_split(build, builder, context.device, num_speculative_tokens=spec_tokens,
                               speculative=entry.spec_columns)
        checks.append(Check("split", True, _describe_split(findings, spec_tokens)))
    except ProbeError as exc:
        checks.append(Check("split", False, str(exc)))
    padded_only = False
    if findings is not None and not findings.reads_stale_slot():
        holds = reroute_holds(context.vllm_config)
        rerouted = f"vLLM {compat.vllm_version()}'s {entry.class_name} routes fresh rows to its prefill path itself"
        if holds is not None and not findings.padded:  # the rest is not needed: nothing of the builder's is read
            return Decision(entry, STANDS_DOWN, f"{rerouted}, {holds}", tuple(checks))
        if holds is not None:
            padded_only = True
        elif not findings.without_prefilling:
            checks.append(Check("split", False, "the builder reroutes fresh rows, this engine can replay a FULL "
                                "decode graph on buffers the rerouted build leaves unstaged, and without "
                                "is_prefilling the builder does not keep a one-token step on its decode path"))

    for name, problems in _static_checks(entry, context):
        checks.append(Check(name, not problems, "; ".join(problems) if problems else "has what gdn-pass reads"))
    if findings is not None and all(c.passed for c in checks):
        checks.append(_rows_check(entry, findings))
    if any(not c.passed for c in checks):
        return refusal()
    if padded_only:
        why = (f"{rerouted}, {holds}; but with {spec_tokens} speculative token(s) the scheduler pads a new "
               f"one-token request with placeholder drafts, and counted as drafts (which gdn-pass makes sure "
               f"of) they take the speculative path, which reads the request's recycled slot: gdn-pass zeroes "
               f"the slots of such rows at metadata build")
        return Decision(entry, ACTS, why, tuple(checks), padded_only=True, counts_padded_drafts=True)
    keeps_decodes = not findings.reads_stale_slot()
    if keeps_decodes:
        why = (f"vLLM {compat.vllm_version()}'s {entry.class_name} routes fresh rows to its prefill path, but "
               "this engine's runner can replay a FULL decode graph on buffers the builder did not stage "
               "for such a step: gdn-pass keeps one-token steps on the decode path and zeroes their fresh rows")
    else:
        why = f"vLLM {compat.vllm_version()}'s {entry.class_name} sends fresh rows to its decode path"
    return Decision(entry, ACTS, why, tuple(checks), keeps_decodes, counts_padded_drafts=bool(findings.padded))


def _describe_split(findings: SplitFindings, spec_tokens: int) -> str:
    def say(decoded: bool) -> str:
        return "decode (reads the slot)" if decoded else "prefill"

    parts = [f"fresh one-token row -> {say(findings.one_token)}"]
    if findings.without_prefilling is not None:
        parts.append(f"without is_prefilling -> {say(findings.without_prefilling)}")
    if findings.speculative is not None:
        parts.append(f"fresh {1 + spec_tokens}-token prompt next to a speculating row -> "
                     f"{say(findings.speculative)}")
    if findings.padded is not None:
        parts.append(f"new one-token request padded with {spec_tokens} draft(s), its drafts counted -> "
                     f"{say(findings.padded)}")
    return ", ".join(parts)


def _static_checks(entry: builders.StateBuilder, context: compat.BuilderContext):
    """(name, problems) of the checks after the split (the module table)."""
    from vllm.v1.attention import backend

    yield "metadata", entry.layout_problems()
    common_fields = compat.fields_of(backend.CommonAttentionMetadata)
    common = [f"CommonAttentionMetadata.{f}" for f in ("query_start_loc_cpu", "num_reqs") if f not in common_fields]
    if not ({"seq_lens_cpu_upper_bound", "seq_lens_cpu", "num_computed_tokens_cpu"} & common_fields
            or hasattr(backend.CommonAttentionMetadata, "compute_num_computed_tokens")):
        common.append("any per-row computed-token count on CommonAttentionMetadata")
    yield "common", common
    yield "state layout", entry.state_layout_problems(context.kv_cache_spec)
    engine = []
    if not context.layer_names:
        engine.append(f"the layer names of {entry.class_name}")
    if getattr(context.vllm_config.compilation_config, "static_forward_context", None) is None:
        engine.append("compilation_config.static_forward_context")
    yield "engine", engine
    if "op" in entry.guards:
        yield "core ops", compat.core_op_problems()


def _rows_check(entry: builders.StateBuilder, findings: SplitFindings) -> Check:
    """gdn-pass's own per-step reading of rows (``entry.rows``) on the one-token probe's step and metadata,
    with the step's host tensors as inference tensors: it must find exactly the fresh row where the
    split put it on a decode path, and none where it did not. A failure here would otherwise surface
    at the engine's first step."""
    probes = [("probe step", findings.step, findings.metadata, None, 1 if findings.one_token else 0)]
    if findings.padded_build is not None:  # the padded row's step: the row is found where it reads its slot
        probes.append(("padded probe step", *findings.padded_build, 1 if findings.padded else 0))
    said = []
    for name, step, metadata, draft_counts, expected in probes:
        try:
            found = entry.rows(as_inference_tensors(step), metadata, draft_counts).fresh
        except Exception as exc:  # noqa: BLE001 - the finding
            return Check("rows", False, f"gdn-pass's rows of the {name} raised {exc!r}")
        if found != expected:
            return Check("rows", False, f"gdn-pass's rows of the {name} zero {found} row(s), not {expected}")
        said.append(f"the {name}'s rows to zero: {found}")
    return Check("rows", True, ", ".join(said))


def _speculative_tokens(builder, vllm_config) -> int:
    """The engine's speculative tokens per step, as the builder took them (Bailing's ``num_spec_tokens``)."""
    own = getattr(builder, "num_spec_tokens", None)
    if isinstance(own, int):
        return own
    try:
        return int(getattr(vllm_config, "num_speculative_tokens", None) or 0)
    except Exception:  # noqa: BLE001 - a config without speculative decoding
        return 0


def reroute_holds(vllm_config) -> str | None:
    """Where a builder that reroutes fresh rows keeps them off the decode kernels in this engine: how.

    None where it may not: vLLM's V1 model runner (0.26-0.33) picks a FULL
    decode graph from the batch shape before the build and would replay it on
    decode buffers the rerouted build did not stage. ``vllm_config`` may be
    None (asked at compile time where vLLM set no current config): then it
    cannot tell, and says None.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return "and this platform replays no CUDA graphs"
    if vllm_config is None:
        return None
    if not captures_full_graphs(vllm_config):
        return "and this engine captures no FULL CUDA graphs"
    if runs_v2_model_runner(vllm_config):
        return "and the V2 model runner keeps steps with a fresh prefill off FULL decode graphs"
    return None


def captures_full_graphs(vllm_config) -> bool:
    """Whether the engine's compilation config captures FULL CUDA graphs (FULL, FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE: vLLM's ``CUDAGraphMode.has_full_cudagraphs``)."""
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and mode.has_full_cudagraphs()


def runs_v2_model_runner(vllm_config) -> bool:
    """The V2 model runner: chosen by the config where vLLM has both (0.31-0.33), the only one where the
    V1 runner's module is gone (0.34 removed it)."""
    if importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None:
        return True
    try:
        return bool(vllm_config.use_v2_model_runner)
    except Exception:  # noqa: BLE001 - cannot tell: the V1 runner, where acting is correct on either
        return False


# --- decisions made in this process ----------------------------------------------------------

_DECISIONS: dict[str, Decision] = {}
# Registry entries that stood down in this process: vLLM fixed their builder. Kept once made, for
# the op guard (a guarded op without a hand-off is then the original op, not an error).
_STOOD_DOWN: set[str] = set()


def record(decision: Decision) -> None:
    """Keep the engine's decision for its entry (the pass asks it at compile time)."""
    _DECISIONS[decision.entry.key] = decision
    if decision.action == STANDS_DOWN:
        _STOOD_DOWN.add(decision.entry.key)


def recorded(key: str) -> Decision | None:
    return _DECISIONS.get(key)


def stood_down() -> frozenset[str]:
    """The entries that stood down in this process."""
    return frozenset(_STOOD_DOWN)


def stand_down_reason(entry: builders.StateBuilder, vllm_config) -> str | None:
    """Why ``entry`` needs no guarded op in the engine of ``vllm_config``, or None where it needs one
    (or cannot tell): it stands down, or acts at metadata build only (``Decision.padded_only``).

    The decision this process made for a builder of the entry if there is one;
    else (vLLM compiles the model before it makes its builders) the decision
    for a builder of gdn-pass's own. Never raises: it only chooses whether the
    pass swaps in guarded ops, and a guarded op passes through where the entry
    stands down.
    """
    decision = recorded(entry.key) or _CLASS_DECISIONS.get((entry.key, id(vllm_config)))
    if decision is None:
        try:
            cls = entry.builder_class()
            if cls is None:
                return None
            config = vllm_config
            if config is None:  # vLLM's CPU compile sets no current config
                from vllm.config import VllmConfig

                config = VllmConfig()
            decision = decide_for_class(entry, cls, config, _device(config))
        except Exception:  # noqa: BLE001 - see above
            return None
        _CLASS_DECISIONS[(entry.key, id(vllm_config))] = decision
    if decision.padded_only:  # acts, at metadata build only: the step guard zeroes the padded rows
        return f"{decision.why} (the step guard's work, no guarded op)"
    return decision.why if decision.action == STANDS_DOWN else None


_CLASS_DECISIONS: dict[tuple[str, int], Decision] = {}


def _device(vllm_config) -> torch.device:
    from vllm.platforms import current_platform

    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return torch.device(device if device is not None else current_platform.device_type)


# --- a builder of gdn-pass's own: doctor, and the pass at compile time ------------------------

_PROBING = [0]


def is_probing() -> bool:
    """Is a builder being made by ``decide_for_class`` (the hook then records nothing)?"""
    return _PROBING[0] > 0


@contextlib.contextmanager
def _probing():
    _PROBING[0] += 1
    try:
        yield
    finally:
        _PROBING[0] -= 1


def decide_for_class(entry: builders.StateBuilder, cls: type, vllm_config, device: torch.device) -> Decision:
    """``decide`` on a builder of ``cls`` made here, for an engine of ``vllm_config``, with a state
    spec of the entry's layout (``StateBuilder.probe_spec``). A builder that cannot be made here
    is a refusal naming why (the engine's own start-up check is then the one that counts)."""
    spec = entry.probe_spec()
    layer_names = [f"gdn_pass.probe.{entry.key}"]
    with _eager():
        try:
            with _probing():
                builder = cls(spec, layer_names, vllm_config, device)
        except Exception as exc:  # noqa: BLE001 - reported as the finding
            return Decision(entry, REFUSES, f"builder: {cls.__name__} could not be made outside an engine: "
                            f"{exc!r}", (Check("builder", False, repr(exc)),))
        context = compat.BuilderContext(tuple(layer_names), torch.device(device), spec, vllm_config)
        return decide(entry, builder, builders.unhooked_build(cls), context)


@contextlib.contextmanager
def _eager():
    """Real tensors, also when asked from inside a compile (the pass at compile time): the probe's
    builds run torch ops and ``.item()``, which under the compiler's fake or proxy modes would trace
    into its graph (unbacked symbols)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield
