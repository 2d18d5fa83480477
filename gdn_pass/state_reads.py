"""Find graph-visible recurrent-state reads in a post-grad ATen graph.

A state read is a gather of rows of a graph input by slot indices that the
graph also writes back at the same indices (read-modify-write): the
functionalized form of ``state = cache[slots]; ...; cache[slots] = new``::

    read  = aten.index.Tensor(cache, [slots])         # or index_select(cache, 0, slots)
    ...
    put   = aten.index_put.default(cache, [slots], new)
    aten.copy_.default(cache, put)                    # the mutation of the input

Gathers that are not written back at the same indices (embedding lookups,
parameter gathers) and gathers of intermediate activations are not state and
are reported as left alone, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

__all__ = ["StateGather", "SkippedGather", "find_state_gathers"]

aten = torch.ops.aten

_GATHERS = (aten.index.Tensor, aten.index_select.default)
_PUTS = (aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default)
# Views that keep dim 0 (the slot dim) and element order, and dtype casts of
# the indices, both seen between the cache/slots input and the gather.
_VIEWS = (aten.view.default, aten.reshape.default, aten._reshape_alias.default)
_INDEX_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


@dataclass
class StateGather:
    read: Node
    cache: Node  # the graph input holding the state
    index: Node  # the slot index tensor as the read uses it
    writes: list[Node] = field(default_factory=list)  # index_put nodes at the same slots


@dataclass
class SkippedGather:
    node: Node
    reason: str


def find_state_gathers(graph: Graph) -> tuple[list[StateGather], list[SkippedGather]]:
    found, skipped = [], []
    puts = [n for n in graph.nodes if n.op == "call_function" and n.target in _PUTS]
    for node in graph.nodes:
        if node.meta.get("gdn_pass_inserted"):
            continue
        gathered = _as_row_gather(node)
        if gathered is None:
            continue
        source, index = gathered
        cache = _view_root(source)
        if cache.op != "placeholder":
            skipped.append(SkippedGather(node, "gathers an intermediate value, not a graph input"))
            continue
        writes = [
            p for p in puts
            if _view_root(p.args[0]) is cache and _same_index(_put_index(p), index)
        ]
        if not writes:
            skipped.append(SkippedGather(
                node, "never written back at the same indices (embedding or parameter gather)"))
            continue
        found.append(StateGather(read=node, cache=cache, index=index, writes=writes))
    return found, skipped


def _as_row_gather(node: Node) -> tuple[Node, Node] | None:
    """(source, index) if ``node`` gathers whole rows along dim 0 by a 1-D index."""
    if node.op != "call_function" or node.target not in _GATHERS:
        return None
    if node.target is aten.index_select.default:
        source, dim, index = node.args[:3]
        return (source, index) if dim == 0 and _is_1d_int(index) else None
    source, indices = node.args[:2]
    if len(indices) != 1 or not isinstance(indices[0], Node) or not _is_1d_int(indices[0]):
        return None
    return source, indices[0]


def _put_index(put: Node) -> Node | None:
    indices = put.args[1]
    return indices[0] if len(indices) == 1 and isinstance(indices[0], Node) else None


def _is_1d_int(node: Node) -> bool:
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 1
        and not val.dtype.is_floating_point
        and val.dtype != torch.bool
    )


def _view_root(node: Node) -> Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _index_root(node: Node | None) -> Node | None:
    while node is not None and node.op == "call_function" and node.target in _INDEX_CASTS:
        node = node.args[0]
    return node


def _same_index(a: Node | None, b: Node | None) -> bool:
    return a is not None and _index_root(a) is _index_root(b)
