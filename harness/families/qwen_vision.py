"""The tiny Qwen3-VL vision tower and the released multimodal config around a text config.

For the multimodal layouts (Qwen3.5, InternS2-Mobius): text-only requests never
run the tower, but vLLM loads it.

    vision_tower(prefix, v) the tower's tensors (``VISION_CONFIG``)
    multimodal_config(...)  the released multimodal config around a text config
"""

from __future__ import annotations

from gdn_pass.checker.qwen_layers import Tensors

# A tiny Qwen3-VL vision tower: vLLM builds it unless every modality's prompt
# limit is 0 (then it is a StageMissingLayer and its weights are skipped), so
# it is present but small.
VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 256,  # = the text hidden_size of every tiny Qwen-style checkpoint
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [],
}


def vision_tower(v: str, c: dict) -> Tensors:
    d, inter, out = c["hidden_size"], c["intermediate_size"], c["out_hidden_size"]
    merged = d * c["spatial_merge_size"] ** 2
    yield f"{v}.patch_embed.proj.weight", (d, c["in_channels"], c["temporal_patch_size"],
                                           c["patch_size"], c["patch_size"])
    yield f"{v}.patch_embed.proj.bias", (d,)
    yield f"{v}.pos_embed.weight", (c["num_position_embeddings"], d)
    for i in range(c["depth"]):
        b = f"{v}.blocks.{i}"
        for norm in ("norm1", "norm2"):
            yield f"{b}.{norm}.weight", (d,)
            yield f"{b}.{norm}.bias", (d,)
        yield f"{b}.attn.qkv.weight", (3 * d, d)
        yield f"{b}.attn.qkv.bias", (3 * d,)
        yield f"{b}.attn.proj.weight", (d, d)
        yield f"{b}.attn.proj.bias", (d,)
        yield f"{b}.mlp.linear_fc1.weight", (inter, d)
        yield f"{b}.mlp.linear_fc1.bias", (inter,)
        yield f"{b}.mlp.linear_fc2.weight", (d, inter)
        yield f"{b}.mlp.linear_fc2.bias", (d,)
    m = f"{v}.merger"
    yield f"{m}.norm.weight", (d,)  # pre-shuffle norm: over the unmerged width
    yield f"{m}.norm.bias", (d,)
    yield f"{m}.linear_fc1.weight", (merged, merged)
    yield f"{m}.linear_fc1.bias", (merged,)
    yield f"{m}.linear_fc2.weight", (out, merged)
    yield f"{m}.linear_fc2.bias", (out,)


def multimodal_config(architecture: str, model_type: str, text_config: dict) -> dict:
    """The released multimodal layout: ``text_config`` next to the tiny vision tower."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text_config,
        "vision_config": VISION_CONFIG,
        # Special tokens at the top of the vocabulary, away from the prompt ids.
        "image_token_id": 1020,
        "video_token_id": 1021,
        "vision_start_token_id": 1022,
        "vision_end_token_id": 1023,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
