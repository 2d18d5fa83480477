"""The pass's own time per graph: vLLM-shaped post-grad graphs with N GDN layers.

Each layer is a GDN core op inside ``auto_functionalized`` between 20 pointwise
nodes (a 600-node graph has about the tiny model's shape per layer), plus an
embedding-like gather. Prints the median pass time against the graph size.

    python benchmarks/pass_time.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def vllm_like_graph(num_layers: int) -> Graph:
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import register_cpu_gdn_attention_ops

    register_cpu_gdn_attention_ops()
    core = torch.ops.vllm.cpu_gdn_attention_core.default
    aten = torch.ops.aten
    g = Graph()
    x = g.placeholder("x")
    table, ids = g.placeholder("table"), g.placeholder("ids")
    h = g.call_function(aten.index.Tensor, (table, [ids]))
    for i in range(num_layers):
        for _ in range(20):
            h = g.call_function(aten.add.Tensor, (h, x))
        out = g.call_function(aten.empty_like.default, (h,))
        node = g.call_function(torch.ops.higher_order.auto_functionalized, (core,), dict(
            mixed_qkv=h, b=h, a=h, core_attn_out=out, layer_name=f"model.layers.{i}.linear_attn"))
        h = g.call_function(operator.getitem, (node, 1))
    g.output((h,))
    GraphModule(torch.nn.Module(), g)
    return g


def main() -> None:
    from gdn_pass.report import reports
    from gdn_pass.vllm import VllmGDNStatePass

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    for layers in (3, 24, 100):
        times = []
        for _ in range(7):
            g = vllm_like_graph(layers)
            start = time.perf_counter()
            VllmGDNStatePass()(g)
            times.append(time.perf_counter() - start)
        assert len(reports()[-1].guarded) == layers
        rows.append(dict(gdn_layers=layers, nodes=len(g.nodes), median_ms=statistics.median(times) * 1e3))
        print(f"{layers:4d} GDN layers, {len(g.nodes):5d} nodes: {rows[-1]['median_ms']:.1f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import platform

    meta = dict(command="python benchmarks/pass_time.py", machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
                torch=torch.__version__)
    (out / "pass_time.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))


if __name__ == "__main__":
    main()
