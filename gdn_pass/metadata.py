"""Padding-aware per-row state metadata, staged in persistent buffers.

A GDN layer must read a row's recurrent/conv state slot only when the row
already has state. Engines decide that per step, on the host; a captured
CUDA graph, however, only ever sees the addresses it was captured with. So
the per-row facts live in buffers allocated once, sized for the largest
batch, and refreshed in place before every step:

    rows (max_rows)        0      1      2      3 ...  n-1 | n ... max_rows-1
    has_initial_state      T      F      T      T       T  | F ...
    valid                  T      T      T      F       T  | F ...   (padding)
    state_slot             17     4      9     -1       2  | -1 ...

    fresh row   = valid & ~has_initial_state   -> state must read as zero
    padding row = ~valid                       -> must neither read nor write

A fresh row only needs its slot zeroed where the kernels it runs read the
slot whatever ``has_initial_state`` says (vLLM's decode and speculative
paths). Callers that know which rows run kernels that start a row without
initial state from zero state themselves (vLLM's prefill path: one run of
rows) say so with ``zero_start_rows``; ``fresh`` leaves those rows out:

    fresh (to zero) = valid & ~has_initial_state & ~zero_start_rows

A row is padding when its query length is zero or its slot id is a padding
sentinel (``-1``, vLLM's ``PAD_SLOT_ID``; ``0``, vLLM's ``NULL_BLOCK_ID``
since vllm#39064). Rows past the staged batch are padding too.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["StagedRowMetadata", "MetadataError"]

_MIN_GRAPH_ROWS = 16


class MetadataError(ValueError):
    """Per-row metadata that cannot describe the batch (shape, dtype, device)."""


class StagedRowMetadata:
    """Persistent per-row buffers: ``has_initial_state``, ``valid``, ``state_slot``.

    Args:
        max_rows: the largest batch (rows, not tokens) ever staged.
        device: where the consumers (the compiled graph, vLLM's op and step guards) run.
        pad_slot_ids: slot ids that mark a padding row.
        scratch_slot: a slot the engine never hands to a request (vLLM's null
            block 0, say). Graph-visible write-backs of padding rows are sent
            there, a plain pointwise redirect; without one they are folded
            onto the first real row's write (byte-identical duplicates), which
            costs two small reductions per write-back.

    Buffers (all of shape ``[max_rows]``, allocated once, never reallocated):
        has_initial_state: bool, the row has computed tokens before this step.
        valid: bool, the row is a real request row.
        reads_state: bool, ``valid & has_initial_state``: the row may read its slot.
        fresh: bool, ``valid & ~has_initial_state``, outside ``zero_start_rows``:
            the row's slot must read as zero and its kernels would read it.
        state_slot: int64, the state slot the row reads and writes (for a
            restored speculative row, its first column, as the vLLM
            adapter's ``builders.gdn.gdn_rows`` orders them), or the first padding
            sentinel for padding rows.
    """

    def __init__(
        self,
        max_rows: int,
        device: torch.device | str = "cpu",
        pad_slot_ids: Iterable[int] = (-1,),
        scratch_slot: int | None = None,
    ):
        if max_rows <= 0:
            raise MetadataError(f"max_rows must be positive, got {max_rows}")
        self.max_rows = int(max_rows)
        self.device = torch.device(device)
        self.pad_slot_ids = tuple(int(s) for s in pad_slot_ids)
        if not self.pad_slot_ids:
            raise MetadataError("pad_slot_ids must name at least one sentinel")
        if scratch_slot is not None and scratch_slot < 0:
            raise MetadataError(f"scratch_slot must be a real (non-negative) slot, got {scratch_slot}")
        self.scratch_slot = scratch_slot
        # Inductor inlines 1-D graph constants of <= 8 elements by value; the
        # storage handed to compiled graphs is never that small.
        capacity = max(self.max_rows, _MIN_GRAPH_ROWS)
        self._storage = {
            "has_initial_state": torch.zeros(capacity, dtype=torch.bool, device=self.device),
            "valid": torch.zeros(capacity, dtype=torch.bool, device=self.device),
            # valid & has_initial_state, precomputed so the compiled graph's
            # gated load waits on one flag, not two.
            "reads_state": torch.zeros(capacity, dtype=torch.bool, device=self.device),
            # valid & ~has_initial_state, staged once per step for every layer's guard.
            "fresh": torch.zeros(capacity, dtype=torch.bool, device=self.device),
            "state_slot": torch.full(
                (capacity,), self.pad_slot_ids[0], dtype=torch.int64, device=self.device
            ),
        }
        self.has_initial_state = self._storage["has_initial_state"][: self.max_rows]
        self.valid = self._storage["valid"][: self.max_rows]
        self.reads_state = self._storage["reads_state"][: self.max_rows]
        self.fresh = self._storage["fresh"][: self.max_rows]
        self.state_slot = self._storage["state_slot"][: self.max_rows]
        self.num_rows = 0
        # Host-side knowledge that ``fresh`` is all False on the device (as
        # allocated, or after ``stage_no_fresh``): lets ``stage_no_fresh`` skip its fill.
        self.fresh_clear = True

    def stage(
        self,
        *,
        num_computed_tokens: torch.Tensor,
        query_lens: torch.Tensor,
        state_slots: torch.Tensor,
        zero_start_rows: tuple[int, int] | None = None,
    ) -> None:
        """Refresh the buffers in place for one step of ``n`` rows.

        Args:
            num_computed_tokens: ``[n]`` integer, tokens each row computed before
                this step (0 for a brand-new request).
            query_lens: ``[n]`` integer, tokens each row runs this step
                (0 for a padding row).
            state_slots: ``[n]`` integer, the state slot of each row.
            zero_start_rows: ``(start, stop)``, rows ``start .. stop-1`` run
                kernels that start a row without initial state from zero state
                by themselves (vLLM's prefill path): never ``fresh``, their slots
                are left as they are. None: every row may be fresh.

        Rows ``n .. max_rows-1`` become padding. Inputs may live on any device;
        the copies are asynchronous and never synchronize the host.
        """
        n = self._check_rows(
            num_computed_tokens=num_computed_tokens,
            query_lens=query_lens,
            state_slots=state_slots,
        )
        if zero_start_rows is not None:
            start, stop = zero_start_rows
            if not 0 <= start <= stop <= n:
                raise MetadataError(f"zero_start_rows {zero_start_rows} is not a run of the {n} staged rows")
        self.fresh_clear = False
        if self._fused_stage(num_computed_tokens, query_lens, state_slots, zero_start_rows, n):
            self.num_rows = n
            return
        slots = state_slots.to(self.device, non_blocking=True)
        is_pad_slot = torch.zeros_like(slots, dtype=torch.bool)
        for sentinel in self.pad_slot_ids:
            is_pad_slot |= slots == sentinel
        valid = (query_lens.to(self.device, non_blocking=True) > 0) & ~is_pad_slot

        self.valid[:n].copy_(valid)
        self.has_initial_state[:n].copy_(num_computed_tokens > 0, non_blocking=True)
        self.state_slot[:n].copy_(torch.where(valid, slots, self.pad_slot_ids[0]))
        self.valid[n:].fill_(False)
        self.has_initial_state[n:].fill_(False)
        torch.logical_and(self.valid, self.has_initial_state, out=self.reads_state)
        torch.logical_not(self.has_initial_state, out=self.fresh)
        self.fresh.logical_and_(self.valid)
        if zero_start_rows is not None and zero_start_rows[0] < zero_start_rows[1]:
            self.fresh[zero_start_rows[0]:zero_start_rows[1]].fill_(False)
        self.state_slot[n:].fill_(self.pad_slot_ids[0])
        self.num_rows = n

    def stage_no_fresh(self, num_rows: int) -> None:
        """Stage a step the caller knows has no fresh row: ``fresh`` becomes all False, nothing else changes.

        For consumers that read only the fresh rows (vLLM's guards read
        ``fresh`` and, where it is set, ``state_slot``). ``has_initial_state``,
        ``valid``, ``reads_state`` and ``state_slot`` keep the last ``stage``'s
        values, so graph-visible gated reads need ``stage``. Costs one fill the
        first time after a step with fresh rows and nothing (no launch, no copy)
        after that: most steps of a serving engine have no fresh row.
        """
        if not 0 <= num_rows <= self.max_rows:
            raise MetadataError(f"batch of {num_rows} rows does not fit the staged capacity of {self.max_rows}")
        if not self.fresh_clear:
            self._storage["fresh"].fill_(False)
            self.fresh_clear = True
        self.num_rows = num_rows

    def stage_fresh(self, *, fresh_rows: np.ndarray, state_slots: torch.Tensor) -> None:
        """Stage only the rows to zero, as the caller determined them on the host.

        ``fresh_rows``: ``[n]`` host bool (numpy), the rows whose slots must be
        zeroed; ``state_slots``: ``[n]`` integer, each row's slot (any device).
        ``fresh`` becomes ``fresh_rows`` (rows ``n ..`` False) and
        ``state_slot[:n]`` the slots; nothing else changes. For consumers that
        read only the fresh rows (as ``stage_no_fresh``): one host-to-device
        copy and one slot copy, no kernel of ours. The caller vouches that a
        fresh row names a real slot (the guards still never write a negative one).
        """
        if not isinstance(fresh_rows, np.ndarray) or fresh_rows.ndim != 1 or fresh_rows.dtype != np.bool_:
            raise MetadataError(f"fresh_rows must be a 1-D numpy bool array, got {fresh_rows!r:.80}")
        n = self._check_rows(state_slots=state_slots)
        if fresh_rows.size != n:
            raise MetadataError(f"fresh_rows has {fresh_rows.size} rows, state_slots {n}")
        self._copy_fresh_flags(fresh_rows)
        self.state_slot[:n].copy_(state_slots, non_blocking=True)
        self.fresh_clear = not fresh_rows.any()
        self.num_rows = n

    def _copy_fresh_flags(self, fresh_rows: np.ndarray) -> None:
        """``fresh`` := ``fresh_rows`` (rows past them False): one host-to-device copy."""
        target = self._storage["fresh"]
        flags = np.zeros(target.numel(), dtype=np.bool_)
        flags[: fresh_rows.size] = fresh_rows
        # Pageable memory: the copy returns once the bytes are staged, so the
        # array may go right away, and it does not wait for the stream. Pinned
        # blocks reused in turn, each waiting on an event, cost the host 10-15 us
        # more per build on the H200 (an earlier hook_host_time run; git history).
        target.copy_(torch.from_numpy(flags), non_blocking=True)

    def _fused_stage(self, num_computed_tokens, query_lens, state_slots, zero_start_rows, n) -> bool:
        """CUDA: one flags copy and one launch (``gdn_pass.kernels.stage``) instead of ~20 launches.

        Taken when the per-row counts are on the host (as vLLM's are) and the
        slots already on this device; False leaves the staging to PyTorch ops.
        """
        if (self.device.type != "cuda" or num_computed_tokens.is_cuda or query_lens.is_cuda
                or state_slots.device != self.state_slot.device or len(self.pad_slot_ids) > 2):
            return False
        from gdn_pass.kernels import stage

        pads = self.pad_slot_ids
        # From pageable memory: on the H200 a build enqueued behind 2 ms of GPU
        # work returns in ~0.1 ms either way, and a pinned block costs ~12 us more
        # per build (an earlier hook_host_time run; git history).
        flags = stage.row_flags(query_lens, num_computed_tokens)
        stage.stage_rows_fused(
            flags=flags.to(self.device, non_blocking=True),
            slots=state_slots,
            zero_start_rows=zero_start_rows if zero_start_rows is not None else (0, 0),
            pad_slot_ids=(pads[0], pads[-1]),
            has_initial_state=self.has_initial_state,
            valid=self.valid,
            reads_state=self.reads_state,
            fresh=self.fresh,
            state_slot=self.state_slot,
        )
        return True

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent tensors a compiled graph reads (rows past ``max_rows`` are padding)."""
        return dict(self._storage)

    def fresh_rows(self) -> torch.Tensor:
        """``[max_rows]`` bool: real rows that have no prior state (the staged buffer)."""
        return self.fresh

    def fresh_slots(self) -> torch.Tensor:
        """Slot ids of the fresh rows (data-dependent size: host sync on GPU)."""
        return self.state_slot[self.fresh_rows()]

    def _check_rows(self, **tensors: torch.Tensor) -> int:
        sizes = set()
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise MetadataError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 1:
                raise MetadataError(
                    f"{name} must be 1-D [num_rows], got shape {tuple(t.shape)}"
                )
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise MetadataError(f"{name} must be an integer tensor, got {t.dtype}")
            sizes.add(t.numel())
        if len(sizes) != 1:
            shapes = {k: tuple(v.shape) for k, v in tensors.items()}
            raise MetadataError(f"per-row inputs disagree on the number of rows: {shapes}")
        n = sizes.pop()
        if n > self.max_rows:
            raise MetadataError(
                f"batch of {n} rows exceeds the staged capacity of {self.max_rows}; "
                "size the metadata for the largest batch the engine can schedule"
            )
        return n

    def __repr__(self) -> str:
        return (
            f"StagedRowMetadata(max_rows={self.max_rows}, device={self.device}, "
            f"pad_slot_ids={self.pad_slot_ids}, scratch_slot={self.scratch_slot})"
        )
