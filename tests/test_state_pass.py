"""GDNStatePass on graphs without GDN state: a reported no-op; uuid and pickling; engine ops
known only through a registered engine adapter."""

import logging
import pickle

import pytest
import torch

import gdn_pass
from gdn_pass import GDNStatePass, opaque_ops


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)  # a gather that is not state
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, ids):
        return torch.relu(self.proj(self.embed(ids))).sum(-1)


def test_non_gdn_graph_is_unchanged_and_reported(tmp_path):
    torch.manual_seed(0)
    model, ids = TinyMLP(), torch.randint(0, 64, (4, 3))
    expected = model(ids)
    gdn_pass.clear_reports()
    torch._dynamo.reset()
    compiled = torch.compile(
        model,
        options={"post_grad_custom_post_pass": GDNStatePass(report_dir=str(tmp_path)),
                 "fx_graph_cache": False},
    )
    torch.testing.assert_close(compiled(ids), expected, rtol=0, atol=1e-6)
    (report,) = gdn_pass.reports()
    assert report.reads == [] and not report.graph_changed
    assert "no GDN state reads" in report.summary()
    (written,) = gdn_pass.load_reports(tmp_path)
    assert written["num_nodes"] == report.num_nodes and written["guarded_per_op"] == {}


def test_uuid_follows_options_and_survives_pickling():
    default, off = GDNStatePass(), GDNStatePass(guard_opaque_ops=False)
    assert default.uuid() != off.uuid()
    assert pickle.loads(pickle.dumps(default)).uuid() == default.uuid()
    # Where the report goes does not change the compiled graph.
    assert GDNStatePass(report_dir="/tmp/x").uuid() == default.uuid()


# --- engine ops come from registered adapters (gdn_pass.opaque_ops) -------------------

_NS = "gdn_pass_test_engine"
_lib = torch.library.Library(_NS, "DEF")
for _name in ("fake_gdn_core", "fake_gdn_core_guarded"):
    _lib.define(f"{_name}(Tensor x, Tensor(a!) out, str layer_name) -> ()")
CORE = getattr(torch.ops, _NS).fake_gdn_core.default
GUARDED = getattr(torch.ops, _NS).fake_gdn_core_guarded.default
SPEC = opaque_ops.OpaqueStateOp(f"{_NS}::fake_gdn_core", ("x", "out", "layer_name"))


class FakeGuards:
    def __init__(self, stand_down=None):
        self.stand_down = stand_down

    def stand_down_reason(self, spec):
        return self.stand_down

    def guarded_overload(self, op, spec):
        assert op is CORE and spec is SPEC
        return GUARDED


@pytest.fixture
def registry():
    """The core's engine registry, emptied for the test and restored after it."""
    saved = dict(opaque_ops.ENGINES), dict(opaque_ops.KNOWN_OPAQUE_STATE_OPS)
    opaque_ops.ENGINES.clear()
    opaque_ops.KNOWN_OPAQUE_STATE_OPS.clear()
    yield opaque_ops
    for live, kept in zip((opaque_ops.ENGINES, opaque_ops.KNOWN_OPAQUE_STATE_OPS), saved):
        live.clear()
        live.update(kept)


def adapter(behaviour=(), stand_down=None):
    return opaque_ops.EngineAdapter(namespace=_NS, name="tests.fake_engine", ops=(SPEC,),
                                    guards=FakeGuards(stand_down), behaviour=behaviour)


def engine_graph() -> torch.fx.Graph:
    g = torch.fx.Graph()
    x, out = g.placeholder("x"), g.placeholder("out")
    g.call_function(CORE, (x, out), {"layer_name": "model.layers.0.linear_attn"})
    g.output(out)
    return g


def run(graph):
    gdn_pass.clear_reports()
    GDNStatePass()(graph)
    (report,) = gdn_pass.reports()
    return report


def test_an_engine_op_without_its_adapter_is_reported_not_skipped(registry):
    g = engine_graph()
    before = str(g)
    (read,) = run(g).left_alone
    assert str(g) == before
    assert read.op == f"{_NS}::fake_gdn_core" and read.layer == "model.layers.0.linear_attn"
    assert f"no engine adapter is registered for the {_NS!r} op namespace" in read.reason


def test_a_registered_adapter_guards_its_ops(registry):
    registry.register_engine(adapter())
    registry.register_engine(adapter())  # idempotent
    assert registry.KNOWN_OPAQUE_STATE_OPS == {SPEC.qualname: SPEC}
    g = engine_graph()
    (read,) = run(g).guarded
    assert read.action == "guarded_op" and [n.target for n in g.nodes if n.op == "call_function"] == [GUARDED]


def test_an_op_the_engine_fixed_itself_is_reported_not_needed_without_a_warning(registry, caplog):
    # vLLM 0.31+ GDN: the engine's own fix holds, the pass stands down. That is not a read left
    # unguarded, and a user must not be told it is.
    registry.register_engine(adapter(stand_down="the engine routes fresh rows itself"))
    g = engine_graph()
    before = str(g)
    with caplog.at_level(logging.INFO, logger="gdn_pass"):
        report = run(g)
    assert str(g) == before and report.guarded == [] and report.left_alone == []
    (read,) = report.not_needed
    assert read.action == "not_needed" and read.reason == "not needed: the engine routes fresh rows itself"
    assert "1 not needed" in report.summary() and "UNGUARDED" not in report.summary()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_an_adapter_registers_only_its_own_namespace(registry):
    with pytest.raises(ValueError, match="outside its namespace"):
        registry.register_engine(opaque_ops.EngineAdapter(
            namespace="other", name="tests.fake_engine", ops=(SPEC,), guards=FakeGuards()))


def test_uuid_covers_the_registered_adapters_source(registry):
    import gdn_pass.report as module_a
    import gdn_pass.metadata as module_b

    alone = GDNStatePass().uuid()
    registry.register_engine(adapter(behaviour=(module_a,)))
    with_a = GDNStatePass().uuid()
    registry.register_engine(adapter(behaviour=(module_b,)))
    assert len({alone, with_a, GDNStatePass().uuid()}) == 3
