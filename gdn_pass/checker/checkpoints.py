"""Tiny seeded checkpoints (config.json + model.safetensors) that vLLM loads normally.

Weights are real random tensors, not vLLM's dummy init: that init draws every
tensor from U(-1e-3, 1e-3) with one seed, which gives near-uniform logits, so
a wrong recurrent state changes no token and a test built on it cannot fail.
Here each tensor is U(-scale, scale) from its own seed (derived from the
checkpoint seed and the tensor name), large enough that a different state
gives different greedy tokens.

The bundled kinds are ``qwen3_next`` (``gdn-pass check tiny-qwen3-next``) and
``llama`` (a model without GDN layers); the test harness registers more
(``register_checkpoints``: ``harness/tiny_checkpoints.py``).

    python -m gdn_pass.checker.checkpoints qwen3_next OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from gdn_pass.checker import qwen_layers

__all__ = ["QWEN3_NEXT_CONFIG", "LLAMA_CONFIG", "TINY_GDN_DECODER", "TINY_TOKENS", "CHECKPOINTS", "EXTRA_FILES",
           "embedding_and_head_tensors", "qwen3_next_tensors", "qwen3_next_layer", "register_checkpoints", "write_checkpoint", "write_tokenizer"]

# The tiny Qwen-style hybrid decoder every GDN checkpoint kind shares (the test harness's
# Qwen3.5 and InternS2-Mobius too): three GDN layers, then one gated full-attention layer.
TINY_GDN_DECODER = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# Untied embeddings, bf16 weights, the tokenizer's special ids.
TINY_TOKENS = {
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
}

QWEN3_NEXT_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    **TINY_GDN_DECODER,
    "intermediate_size": 512,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    **TINY_TOKENS,
}

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    **TINY_TOKENS,
}


def embedding_and_head_tensors(c: dict, embedding: str = "model.embed_tokens.weight",
                               ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The token embedding, the final norm and the (untied) LM head of a decoder-only checkpoint."""
    h, v = c["hidden_size"], c["vocab_size"]
    yield embedding, (v, h)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def qwen3_next_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield from embedding_and_head_tensors(c)
    for i, kind in enumerate(c["layer_types"]):
        yield from qwen3_next_layer(f"model.layers.{i}", kind, c)


def qwen3_next_layer(p: str, kind: str, c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    return qwen_layers.decoder_layer(p, kind, c, fused_gdn=True)  # fused in_proj_qkvz / in_proj_ba


def _llama_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    yield from embedding_and_head_tensors(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (heads * hd, h)
        yield f"{p}.self_attn.k_proj.weight", (kv_heads * hd, h)
        yield f"{p}.self_attn.v_proj.weight", (kv_heads * hd, h)
        yield f"{p}.self_attn.o_proj.weight", (h, heads * hd)
        yield f"{p}.mlp.gate_proj.weight", (inter, h)
        yield f"{p}.mlp.up_proj.weight", (inter, h)
        yield f"{p}.mlp.down_proj.weight", (h, inter)


# kind -> (config, tensor names and shapes)
CHECKPOINTS = {
    "qwen3_next": (QWEN3_NEXT_CONFIG, qwen3_next_tensors),
    "llama": (LLAMA_CONFIG, _llama_tensors),
}

# kind -> {file name: text} written beside config.json (a family's config class,
# for checkpoints that need trust_remote_code).
EXTRA_FILES: dict[str, dict[str, str]] = {}


def register_checkpoints(checkpoints: dict, extra_files: dict | None = None) -> None:
    """Add kinds (``kind -> (config, tensors)``) and their extra files to what ``write_checkpoint`` writes."""
    CHECKPOINTS.update(checkpoints)
    EXTRA_FILES.update(extra_files or {})


def _seeded_uniform(name: str, shape: tuple[int, ...], seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.rand(shape, generator=gen) * 2 - 1) * scale


def write_checkpoint(kind: str, out_dir: str | Path, *, seed: int = 0, scale: float = 0.2) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the kind's ``EXTRA_FILES`` into ``out_dir``."""
    from safetensors.torch import save_file

    config, tensors = CHECKPOINTS[kind]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        name: _seeded_uniform(name, shape, seed, scale).to(torch.bfloat16)
        for name, shape in tensors(config)
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name, text in EXTRA_FILES.get(kind, {}).items():
        (out / name).write_text(text)
    return out


def write_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer whose token ``i`` is the word ``t<i>``, next to a checkpoint.

    For servers, which need a tokenizer to detokenize (``/v1/completions``
    refuses to run without one); prompts are sent as token ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1",
        "model_max_length": 4096}, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(CHECKPOINTS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.2)
    ap.add_argument("--tokenizer", action="store_true", help="also write a word-level tokenizer")
    args = ap.parse_args()
    out = write_checkpoint(args.kind, args.out_dir, seed=args.seed, scale=args.scale)
    if args.tokenizer:
        write_tokenizer(out, CHECKPOINTS[args.kind][0]["vocab_size"])
    print(out)


if __name__ == "__main__":
    main()
