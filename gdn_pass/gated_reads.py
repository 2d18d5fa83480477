"""Rewrite graph-visible state reads and write-backs to respect staged row metadata.

    before:
        state = aten.index.Tensor(cache, [slots])
        ...
        put   = aten.index_put.default(cache, [slots], new)
    after:
        keep  = reads_state[:B]                           # staged: valid & has_initial_state
        state = gdn_pass.gated_gather(cache, slots, keep)  # masked load: fresh/padding rows read 0
        ...
        fv    = argmax(valid[:B])                         # first real row
        to    = where(any(valid[:B]), slots[fv], 0)        # slot 0 where no row is real
        put   = aten.index_put.default(cache, [where(valid, slots, to)],
                                       where(valid, new, new[fv]))

Padding rows never write a live slot. With a scratch slot (a slot the engine
never hands out, like vLLM's null block) their writes are redirected there:
``index_put(cache, [where(valid, slots, scratch)], new)``, pointwise and fused
like the original. Without one, as drawn above, they write the first real
row's value to that row's slot: the duplicate is byte-identical, so no slot
changes and no write goes through a sentinel index. A batch with no real row
at all (a CUDA graph's capture runs one) targets slot 0 instead and writes its
current value back to it: no read or write goes outside the cache.

The staged buffers enter the graph as constants held by reference, so one
compiled or captured graph reads whatever ``StagedRowMetadata.stage`` last
wrote. Inductor inlines 1-D constants of at most 8 elements by value, hence
``StagedRowMetadata.graph_buffers`` hands out storage of at least 16 rows.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node
from torch.utils._pytree import tree_map

from gdn_pass.metadata import StagedRowMetadata
from gdn_pass.state_reads import StateGather
from inductor_ext import gated_gather as gg

__all__ = ["GateBuilder", "INSERTED"]

aten = torch.ops.aten
INSERTED = "gdn_pass_inserted"  # node.meta key on every node the rewrite adds


class GateBuilder:
    """Inserts gating nodes (with fake-tensor metadata) into one graph."""

    def __init__(self, graph: Graph, rows: StagedRowMetadata, *, masked_load: bool):
        self.graph = graph
        self.rows = rows
        self.masked_load = masked_load
        self.fake_mode = _fake_mode(graph)
        self._buffers: dict[str, Node] = {}

    # -- node helpers ------------------------------------------------------
    def call(self, target, *args) -> Node:
        node = self.graph.call_function(target, args)
        fake_args = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, args)
        with self.fake_mode:
            node.meta["val"] = target(*fake_args)
        node.meta[INSERTED] = True
        return node

    def buffer(self, name: str) -> Node:
        if name not in self._buffers:
            gm = self.graph.owning_module
            attr = f"_gdn_pass_{name}"
            tensor = self.rows.graph_buffers()[name]
            gm.register_buffer(attr, tensor, persistent=False)
            first = next(iter(self.graph.find_nodes(op="placeholder")), None) or next(iter(self.graph.nodes))
            with self.graph.inserting_after(first):
                node = self.graph.get_attr(attr)
            node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
            node.meta[INSERTED] = True
            self._buffers[name] = node
        return self._buffers[name]

    def rows_of(self, name: str, index: Node) -> Node:
        """``buffer[:B]`` for a gather of B rows."""
        b = index.meta["val"].shape[0]
        if isinstance(b, int) and b > self.rows.max_rows:
            raise ValueError(
                f"graph gathers {b} state rows but the staged metadata holds {self.rows.max_rows}; "
                "size StagedRowMetadata for the largest batch"
            )
        if not isinstance(b, int):
            b = self.call(aten.sym_size.int, index, 0)
        return self.call(aten.slice.Tensor, self.buffer(name), 0, 0, b)

    def gather(self, source: Node, index: Node, keep: Node) -> Node:
        if self.masked_load:
            return self.call(gg.gated_gather, source, index, keep)
        safe = self.call(aten.where.ScalarOther, keep, index, 0)
        rows = self.call(aten.index.Tensor, source, [safe])
        return self.call(aten.where.ScalarOther, self._bcast(keep, rows), rows, 0)

    def _bcast(self, row_mask: Node, like: Node) -> Node:
        extra = like.meta["val"].dim() - 1
        return self.call(aten.view.default, row_mask, [-1] + [1] * extra) if extra else row_mask

    # -- the two rewrites ------------------------------------------------------
    def gate_read(self, gather: StateGather) -> None:
        read = gather.read
        source = read.args[0]
        with self.graph.inserting_before(read):
            keep = self.rows_of("reads_state", gather.index)
            gated = self.gather(source, gather.index, keep)
        read.replace_all_uses_with(gated)
        self.graph.erase_node(read)

    def gate_write(self, put: Node) -> None:
        dest, (index,), values = put.args[0], put.args[1], put.args[2]
        if self.rows.scratch_slot is not None:
            with self.graph.inserting_before(put):
                valid = self.rows_of("valid", index)
                slots = self.call(aten.where.ScalarOther, valid, index, self.rows.scratch_slot)
            put.args = (dest, [slots], values, *put.args[3:])
            return
        with self.graph.inserting_before(put):
            valid = self.rows_of("valid", index)
            first = self.call(aten.argmax.default, self.call(
                torch.ops.prims.convert_element_type.default, valid, torch.int32))
            first = self.call(aten.unsqueeze.default, first, 0)
            any_valid = self.call(aten.any.default, valid)
            # A batch with no real row (a CUDA graph's capture and warm-up run one) has no real
            # slot to fold onto: index[first] is then a padding row's sentinel (-1), which the
            # masked load below does not wrap. Slot 0 stands in: read and written back unchanged.
            target = self.call(aten.where.ScalarOther, any_valid,
                               self.call(aten.index.Tensor, index, [first]), 0)
            slots = self.call(aten.where.self, valid, index, target)
            first_value = self.call(aten.index.Tensor, values, [first])
            # Only a batch with no real row loads the target's current value.
            none_valid = self.call(aten.logical_not.default,
                                   self.call(aten.logical_or.default, valid, any_valid))
            current = self.gather(dest, slots, none_valid)
            pad_value = self.call(aten.where.self, any_valid, first_value, current)
            gated_values = self.call(aten.where.self, self._bcast(valid, values), values, pad_value)
        put.args = (dest, [slots], gated_values, *put.args[3:])


def _fake_mode(graph: Graph):
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
