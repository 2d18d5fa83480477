"""benchmarks/engine_cost.py's model: Qwen3-Next-80B's layer dimensions, as issue 14 gives them (no engine)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from engine_cost import write_model  # noqa: E402


@pytest.mark.parametrize("layers", [12, 48])
def test_qwen3_next_80b_layer_dimensions(tmp_path, layers):
    config = json.loads((write_model("qwen3-next-80b", layers, tmp_path) / "config.json").read_text())
    assert config["num_hidden_layers"] == layers == len(config["layer_types"])
    # full attention every 4th layer, GDN elsewhere
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == list(range(3, layers, 4))
    assert config["hidden_size"] == 2048
    gdn = {k: config[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                  "linear_value_head_dim", "linear_conv_kernel_dim")}
    assert gdn == dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4)
    attention = {k: config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    assert attention == dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256)
    moe = {k: config[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")}
    assert moe == dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[])
    # config only: the engine runs it with load_format="dummy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_the_config_loads_as_qwen3_next(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(write_model("qwen3-next-80b", 12, tmp_path))
    assert config.model_type == "qwen3_next" and config.num_experts == 512


def test_bailing_2048_is_a_bailing_hybrid_at_the_same_scale(tmp_path):
    config = json.loads((write_model("bailing-2048", 12, tmp_path) / "config.json").read_text())
    assert config["model_type"] == "bailing_hybrid" and config["architectures"] == ["BailingMoeV2_5ForCausalLM"]
    assert config["num_hidden_layers"] == 12 and config["layer_group_size"] == 4  # every 4th layer MLA
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (2048, 16, 128)
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (512, 10, 512)
    # its config class beside config.json (loaded with trust_remote_code), no weights (dummy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "configuration_bailing_linear.py"]


def test_a_stall_in_one_step_moves_the_window_mean_not_its_typical_step():
    from engine_cost import _rows, render

    # Two rounds of one case; in round 2 the gdn-pass window had one step stalled by 20 ms
    # (its mean over 20 steps grows by 1 ms), its median step equals the unguarded one's.
    ms = 1e-3
    times = {"B=1 fresh=0": {"unguarded": [2 * ms, 2 * ms], "gdn-pass": [2 * ms, 3 * ms],
                             "alternative": [2 * ms, 2 * ms]}}
    typical = {"B=1 fresh=0": {"unguarded": [1.9 * ms, 1.9 * ms], "gdn-pass": [1.9 * ms, 1.9 * ms],
                               "alternative": [1.9 * ms, 1.9 * ms]}}
    empty = {"B=1 fresh=0": []}
    row = _rows(times, empty, empty, empty, empty, typical)[0]
    assert row["gdn-pass_ratio"] == 1.25 and row["gdn-pass_typical_ratio"] == 1.0
    result = dict(dims="tiny", layers=12, vllm="x", command="c", rounds=2, steps=20, check_valid=True,
                  fresh_row_check={}, stream=None, rows=[row])
    line = [x for x in render(result).splitlines() if x.startswith("| B=1 fresh=0")][0]
    assert "| x1.25 [1.000-1.500] |" in line and "| x1.0 [1.000-1.000] / x1.0 [1.000-1.000] |" in line
    # a result recorded before the typical step was kept renders without it
    old = {k: v for k, v in row.items() if not (k.endswith("_typical_ratio") or k == "typical_samples")}
    line = [x for x in render(dict(result, rows=[old])).splitlines() if x.startswith("| B=1 fresh=0")][0]
    assert "| - |" in line


def test_a_window_keeps_its_median_step_beside_its_mean():
    import time

    pytest.importorskip("vllm")
    from engine_cost import Engine

    class Stepper:  # vLLM's engine, as far as Engine.steps uses it: the 5th timed step stalls
        calls = 0

        def add_request(self, *args):
            pass

        def step(self):
            Stepper.calls += 1
            time.sleep(0.03 if Stepper.calls == 4 + 1 + 5 else 0.001)  # 4 prefill steps, 1 warm-up
            return []

        def abort_request(self, ids):
            pass

        def has_unfinished_requests(self):
            return False

    engine = object.__new__(Engine)
    engine.engine, engine.clock, engine.serial, engine.max_tokens = Stepper(), None, 0, 8
    reply = engine.steps(batch=2, fresh=0, steps=9, warmup=1)
    # the stall adds 30 ms / 9 to the mean; the median is one of the 1 ms steps
    assert reply["step_median_s"] >= 0.001 and reply["step_median_s"] < reply["step_s"] - 0.002
