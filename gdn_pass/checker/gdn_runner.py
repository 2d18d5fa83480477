"""A small engine around a GDN layer: slot allocator, padded batches, staged metadata.

It plays the part of vLLM's model runner for the torch-native examples:

- slots are recycled most-recently-freed first and never zeroed (like vLLM's
  mamba pages), so a new request lands on a previous owner's state;
- slot 0 is a null slot never handed out (vLLM's null block); batches are
  padded to a captured size with zero-length rows whose slot is the padding
  sentinel (``-1`` like older vLLM, or ``0`` like vLLM since #39064);
- before every step the per-row metadata is staged in place into the
  persistent buffers the compiled (and captured) graph reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_pass import GDNStatePass, StagedRowMetadata


class SlotPool:
    """State slots 1..num_slots-1; slot 0 is the null slot, never handed out (as in vLLM)."""

    NULL_SLOT = 0

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out low slots first

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("out of state slots")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)  # most recently freed is handed out next


@dataclass
class Batch:
    """One padded step. Rows ``real ..`` are padding."""

    hidden: torch.Tensor  # [P, L, hidden]
    slots: torch.Tensor  # [P]
    num_computed_tokens: torch.Tensor  # [P]
    query_lens: torch.Tensor  # [P]
    real: int

    @property
    def fresh(self) -> list[int]:
        return [i for i in range(self.real) if self.num_computed_tokens[i] == 0]

    @property
    def history(self) -> list[int]:
        return [i for i in range(self.real) if self.num_computed_tokens[i] > 0]


def make_batch(rows, *, pad_to: int, chunk: int, hidden: int, pad_slot_id: int,
               dtype=torch.float32, generator=None) -> Batch:
    """``rows``: list of (slot, num_computed_tokens); every real row runs ``chunk`` tokens."""
    real = len(rows)
    if real > pad_to:
        raise ValueError(f"{real} rows do not fit a batch padded to {pad_to}")
    h = torch.randn(pad_to, chunk, hidden, generator=generator).to(dtype)
    h[real:] = 0
    slots = [s for s, _ in rows] + [pad_slot_id] * (pad_to - real)
    computed = [c for _, c in rows] + [0] * (pad_to - real)
    qlens = [chunk] * real + [0] * (pad_to - real)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return Batch(h, as_long(slots), as_long(computed), as_long(qlens), real)


class GDNRunner:
    """Runs a GDN layer compiled with GDNStatePass over persistent caches."""

    def __init__(self, layer, *, num_slots: int, max_batch: int, pad_slot_id: int = -1,
                 state_dtype=torch.float32, device="cpu", guard: bool = True,
                 masked_load: bool = True, scratch_slot: bool = True, compile_options=None):
        self.layer = layer.to(device)
        self.device = torch.device(device)
        self.pad_slot_id = pad_slot_id
        self.pool = SlotPool(num_slots)
        self.rows = StagedRowMetadata(
            max_batch, device=device, pad_slot_ids=sorted({-1, pad_slot_id}),
            scratch_slot=SlotPool.NULL_SLOT if scratch_slot else None,
        )
        self.conv, self.ssm = layer.new_caches(num_slots, state_dtype=state_dtype, device=device)
        options = dict(compile_options or {})
        if guard:
            options["post_grad_custom_post_pass"] = GDNStatePass(self.rows, masked_load=masked_load)
        self.step_fn = torch.compile(self.layer, options=options, dynamic=False)
        self._graphs: dict[tuple, tuple] = {}

    def stage(self, batch: Batch) -> None:
        self.rows.stage(num_computed_tokens=batch.num_computed_tokens,
                        query_lens=batch.query_lens, state_slots=batch.slots)

    @torch.no_grad()
    def step(self, batch: Batch) -> torch.Tensor:
        self.stage(batch)
        return self.step_fn(batch.hidden.to(self.device), self.conv, self.ssm, batch.slots.to(self.device))

    # -- full CUDA-graph capture and replay ---------------------------------
    @torch.no_grad()
    def capture(self, pad_to: int, chunk: int = 1) -> None:
        """Capture one step for batches padded to ``pad_to`` rows."""
        hidden = torch.zeros(pad_to, chunk, self.layer.shape.hidden, device=self.device,
                             dtype=self.layer.in_proj_qkv.dtype)
        slots = torch.full((pad_to,), self.pad_slot_id, dtype=torch.int64, device=self.device)
        self.rows.stage(num_computed_tokens=torch.zeros(pad_to, dtype=torch.int64),
                        query_lens=torch.zeros(pad_to, dtype=torch.int64), state_slots=slots.cpu())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm up outside capture
                self.step_fn(hidden, self.conv, self.ssm, slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step_fn(hidden, self.conv, self.ssm, slots)
        self._graphs[(pad_to, chunk)] = (graph, hidden, slots, out)

    @torch.no_grad()
    def replay(self, batch: Batch) -> torch.Tensor:
        graph, hidden, slots, out = self._graphs[(batch.slots.numel(), batch.hidden.shape[1])]
        hidden.copy_(batch.hidden, non_blocking=True)
        slots.copy_(batch.slots, non_blocking=True)
        self.stage(batch)
        graph.replay()
        return out
