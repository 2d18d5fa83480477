"""Guarded ops resolve in a process where no pass ran (a compile-cache hit)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from gdn_pass.vllm import guarded_ops


def test_guarded_op_is_defined_on_first_lookup_in_a_fresh_process():
    # A cached graph's code does exactly this lookup, with the model's ops
    # registered and no GDNStatePass run in the process.
    code = textwrap.dedent("""
        import torch
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
        gdn_attention.register_cpu_gdn_attention_ops()  # as the model's layer does
        import gdn_pass.vllm
        gdn_pass.vllm.install()
        guarded = torch.ops.gdn_pass.guarded_cpu_gdn_attention_core.default
        original = torch.ops.vllm.cpu_gdn_attention_core.default
        assert str(guarded._schema).split("(", 1)[1] == str(original._schema).split("(", 1)[1]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_unknown_guarded_op_says_what_to_do():
    with pytest.raises(AttributeError, match="not a registered known GDN core op"):
        torch.ops.gdn_pass.guarded_no_such_core_op


def test_other_gdn_pass_ops_still_resolve():
    guarded_ops.define_on_lookup()
    import inductor_ext.gated_gather  # noqa: F401  (defines gdn_pass::gated_gather)

    assert torch.ops.gdn_pass.gated_gather.default is not None
