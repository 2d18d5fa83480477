"""One registry entry: what gdn-pass knows of a vLLM recurrent-state metadata builder (``StateBuilder``).

Each builder's file in this folder makes one (``ENTRY``); the registry
(``gdn_pass.vllm.builders``) lists them. Nothing here imports vLLM at module
import time.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gdn_pass._logging import logger
from gdn_pass.vllm import compat

if TYPE_CHECKING:
    from gdn_pass.metadata import StagedRowMetadata
    from gdn_pass.vllm.rows import DecodeRows

__all__ = ["HOOK_MARK", "StateBuilder", "unhooked_build"]

# Set on the ``build`` wrapper the metadata hook puts on a registered class.
HOOK_MARK = "__gdn_pass_wrapped__"


def unhooked_build(cls: type):
    """``cls.build`` as it was before the metadata hook wrapped it (vLLM's, or another plugin's wrapper)."""
    build = cls.build
    return build.__wrapped__ if getattr(build, HOOK_MARK, False) else build


@dataclasses.dataclass(frozen=True)
class StateBuilder:
    """One recurrent-state metadata builder of vLLM (see the registry's table, ``gdn_pass.vllm.builders``).

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
    # Its split sends a row of 1 + k tokens without drafts (a prompt's last chunk) to its prefill
    # path, which no speculative FULL CUDA graph may replay (``draftless_steps``).
    prefills_draftless_rows: bool = False
    # CUDA: the step's decode rows in vLLM's own device tensors (``rows.DecodeRows``), from which
    # one zeroing launch finds the fresh rows itself; None (or a None result): the host stages them.
    device_rows: Callable | None = None
    # The families of core ops (``compat.CoreOp.family``) that read this builder's layers: the
    # op guard, in their guarded ops, zeroes what this builder's hook staged.
    op_families: tuple[str, ...] = ()
    # Imported by the plugin at engine start. False: hooked when vLLM itself first
    # makes one (a subclass of a hooked builder), never imported by gdn-pass.
    eager: bool = True

    def stage_step(self, staged: StagedRowMetadata, common, metadata, draft_counts, *,
                   on_device: bool) -> tuple[int, DecodeRows | None]:
        """Stage one step's rows to zero for the guards; return the host's count of them and the
        step's decode rows where the zeroing launch finds them itself (else None).

        ``staged``: the builder's persistent buffers; ``on_device``: the group's caches have a
        CUDA table, so one launch can read vLLM's own tensors (``decode_rows``), and then nothing
        is staged. Otherwise only what the guards read: the rows to zero and their slots, or
        nothing to zero (no new row, or all of them on the prefill path).
        """
        step = self.rows(common, metadata, draft_counts)
        decode = self.decode_rows(common, metadata, staged.max_rows) if on_device else None
        if decode is None:
            if step.fresh:
                step.stage_fresh(staged)
            else:
                staged.stage_no_fresh(step.num_rows)
        return step.fresh, decode

    def decode_rows(self, common, metadata, max_rows: int) -> DecodeRows | None:
        """The step's decode rows in vLLM's own device tensors (``device_rows``), or None where this
        entry does not read them there or they are more than the staged buffers hold (``max_rows``)."""
        if self.device_rows is None:
            return None
        decode = self.device_rows(common, metadata)
        return None if decode is None or decode.num_rows > max_rows else decode

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
