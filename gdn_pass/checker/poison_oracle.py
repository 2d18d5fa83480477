"""The poison oracle for one step of a GDN layer over slot-indexed caches.

Every slot that no real row of the batch legitimately owns is filled with
poison (NaN), and the slots of fresh rows with a previous owner's state
(large finite values), then three runs are compared:

    guarded     the step compiled with GDNStatePass (the code under test)
    unguarded   the same step compiled without the pass
    reference   eager PyTorch on the real rows only, fresh slots zeroed first

Requirements (``check`` returns the violated ones, empty when all hold):
    fresh rows       output and new state equal the reference (tolerance by dtype)
    history rows     output and new state bitwise equal the unguarded graph
    all other slots  bitwise unchanged (no padding row wrote anything), except
                     the engine's scratch slot, which no request ever owns
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def poison_caches(caches, batch, *, generator=None) -> None:
    """History slots: plausible state; fresh slots: stale state; the rest: NaN."""
    history = {int(batch.slots[i]) for i in batch.history}
    fresh = {int(batch.slots[i]) for i in batch.fresh}
    for cache in caches:
        cache.fill_(float("nan"))
        for slot in history:
            cache[slot] = torch.randn(cache.shape[1:], generator=generator).to(cache.dtype)
        for slot in fresh:
            cache[slot] = (5 + 5 * torch.rand(cache.shape[1:], generator=generator)).to(cache.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so that NaN == NaN."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if atol == 0.0:
        return torch.equal(_bits(a), _bits(b))
    return torch.allclose(a.float(), b.float(), rtol=0.0, atol=atol, equal_nan=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_reference(layer, caches, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Eager step on the real rows only, with the fresh rows' slots zeroed."""
    caches = tuple(c.clone() for c in caches)
    for cache in caches:
        for i in batch.fresh:
            cache[int(batch.slots[i])] = 0
    real = slice(0, batch.real)
    device = caches[0].device
    with torch.no_grad():
        out = layer(batch.hidden[real].to(device), *caches, batch.slots[real].to(device))
    return out, caches


def check(guarded: Callable, unguarded: Callable, layer, caches, batch, *, scratch_slot=None,
          history_atol: float = 0.0) -> list[str]:
    """Run the guarded step on copies of ``caches``, then ``check_result``.

    ``guarded`` / ``unguarded``: callables (hidden, *caches, slots) -> out that
    run the compiled step (the guarded one must read metadata staged for ``batch``).
    """
    device = caches[0].device
    g_caches = tuple(c.clone() for c in caches)
    with torch.no_grad():
        g_out = guarded(batch.hidden.to(device), *g_caches, batch.slots.to(device)).clone()
    return check_result(g_out, g_caches, unguarded, layer, caches, batch, scratch_slot=scratch_slot,
                        history_atol=history_atol)


def check_result(
    g_out, g_caches, unguarded: Callable, layer, caches, batch, *, scratch_slot=None,
    history_atol: float = 0.0,
) -> list[str]:
    """Check a guarded step's output and caches (e.g. after a CUDA-graph replay).

    ``caches`` are the poisoned caches as they were before the guarded step;
    ``scratch_slot``, a slot no request ever owns, is the one slot padding
    rows may write. ``history_atol`` > 0 relaxes "bitwise" for history rows
    to an absolute tolerance, for graphs whose kernels the gate re-partitions.
    """
    errors: list[str] = []
    device = caches[0].device
    u_caches = tuple(c.clone() for c in caches)
    with torch.no_grad():
        u_out = unguarded(batch.hidden.to(device), *u_caches, batch.slots.to(device)).clone()
    r_out, r_caches = run_reference(layer, caches, batch)

    tol = TOLERANCE.get(g_out.dtype, TOLERANCE[torch.float32])
    for i in batch.fresh:
        slot = int(batch.slots[i])
        if not torch.allclose(g_out[i].float(), r_out[i].float(), **tol):
            diff = (g_out[i].float() - r_out[i].float()).abs().max().item()
            errors.append(f"fresh row {i} (slot {slot}): output differs from fresh-state reference by {diff:.3g}")
        for k, (g, r) in enumerate(zip(g_caches, r_caches)):
            state_tol = TOLERANCE.get(g.dtype, TOLERANCE[torch.float32])
            if not torch.allclose(g[slot].float(), r[slot].float(), **state_tol):
                errors.append(f"fresh row {i} (slot {slot}): new state {k} differs from reference")
    for i in batch.history:
        slot = int(batch.slots[i])
        if not _same(g_out[i], u_out[i], history_atol):
            errors.append(f"history row {i} (slot {slot}): output not bitwise equal to the unguarded "
                          f"graph (max diff {_max_diff(g_out[i], u_out[i]):.3g})")
        for k, (g, u) in enumerate(zip(g_caches, u_caches)):
            if not _same(g[slot], u[slot], history_atol):
                errors.append(f"history row {i} (slot {slot}): new state {k} not bitwise equal to "
                              f"unguarded (max diff {_max_diff(g[slot], u[slot]):.3g})")
    not_owned = torch.ones(caches[0].shape[0], dtype=torch.bool)
    not_owned[batch.slots[: batch.real].long()] = False
    if scratch_slot is not None:
        not_owned[scratch_slot] = False
    for k, (g, before) in enumerate(zip(g_caches, caches)):
        changed = (_bits(g) != _bits(before)).flatten(1).any(1).cpu() & not_owned
        for slot in changed.nonzero().flatten().tolist():
            errors.append(f"slot {slot} (not owned by a real row) changed in state {k}")
    return errors
