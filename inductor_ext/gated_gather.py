"""``gdn_pass::gated_gather``: a state gather whose masked rows never touch memory.

    out[b, ...] = cache[index[b], ...]   if keep[b]
                  0                      otherwise

Shapes: ``cache [num_slots, *S]``, ``index [B]`` (integer), ``keep [B]``
(bool) -> ``out [B, *S]`` with ``cache``'s dtype.

Eagerly it is a ``where`` over a gather at a safe index. Under Inductor it
lowers to a pointwise node whose load is wrapped in ``ops.masked``: the
generated Triton has ``tl.load(cache + ..., mask=keep, other=0)``, the C++
an ``if (keep)`` around the load, and the node fuses into its consumers like
any other pointwise node. A masked row's index is never dereferenced, so
padding sentinels (``-1``, which Inductor would otherwise wrap to the last,
live slot) and stale slots cost no memory traffic and leak nothing.
"""

from __future__ import annotations

import torch

__all__ = ["gated_gather", "register_lowering", "LOWERING_ERROR"]

_LIB = torch.library.Library("gdn_pass", "FRAGMENT")
_LIB.define("gated_gather(Tensor cache, Tensor index, Tensor keep) -> Tensor")


def _check(cache: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> None:
    if index.dim() != 1 or keep.shape != index.shape or keep.dtype != torch.bool:
        raise ValueError(
            f"gated_gather wants index [B] and bool keep [B], got index {tuple(index.shape)} "
            f"{index.dtype}, keep {tuple(keep.shape)} {keep.dtype}"
        )


def _gated_gather_eager(cache, index, keep):
    _check(cache, index, keep)
    safe = torch.where(keep, index, torch.zeros_like(index))
    rows = cache.index_select(0, safe.long())
    return torch.where(keep.view(-1, *([1] * (cache.dim() - 1))), rows, torch.zeros_like(rows))


def _gated_gather_fake(cache, index, keep):
    _check(cache, index, keep)
    return cache.new_empty((index.shape[0], *cache.shape[1:]))


_LIB.impl("gated_gather", _gated_gather_eager, "CompositeExplicitAutograd")
_LIB._register_fake("gated_gather", _gated_gather_fake)

gated_gather = torch.ops.gdn_pass.gated_gather.default

# Why the lowering could not be registered (None when it was): the pass then
# falls back to an explicit where-after-gather and says so in its report.
LOWERING_ERROR: str | None = "not registered yet"


def register_lowering() -> str | None:
    """Register the masked-load lowering with Inductor (idempotent).

    Returns None on success, else why it is unavailable in this torch.
    """
    global LOWERING_ERROR
    if LOWERING_ERROR is None:
        return None
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import lowerings, register_lowering as _register
        from torch._inductor.virtualized import ops
    except ImportError as e:  # private API moved
        LOWERING_ERROR = f"Inductor lowering API unavailable: {e}"
        return LOWERING_ERROR

    if gated_gather in lowerings:
        LOWERING_ERROR = None
        return None

    @_register(gated_gather, type_promotion_kind=None)
    def _lower(cache, index, keep):
        load_cache, load_index, load_keep = cache.make_loader(), index.make_loader(), keep.make_loader()
        num_slots = cache.get_size()[0]
        dtype = cache.get_dtype()
        zero = False if dtype == torch.bool else 0

        def inner_fn(idx):
            row, rest = idx[:1], list(idx[1:])
            # The slot id is loaded outside the mask, in parallel with the
            # flag: the state load then waits on one level of loads, as the
            # unguarded gather does. A masked row's (possibly sentinel) slot
            # id only forms an address that is never dereferenced.
            slot = ops.indirect_indexing(load_index(row), num_slots, check=False, wrap_neg=False)
            return ops.masked(load_keep(row), lambda: load_cache([slot, *rest]), zero)

        return ir.Pointwise.create(
            device=cache.get_device(),
            dtype=dtype,
            inner_fn=inner_fn,
            ranges=[index.get_size()[0], *cache.get_size()[1:]],
        )

    LOWERING_ERROR = None
    return None
