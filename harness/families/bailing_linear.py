"""Tiny Bailing-MoE-v2.5 (Ring/Ling 2.5 hybrid): Lightning linear attention, one MLA layer, MoE.

vLLM's ``BailingMoeV2_5ForCausalLM`` (model_executor/models/bailing_moe_linear.py,
class ``BailingMoeV25ForCausalLM``) takes layer ``i`` as linear attention
unless ``(i + 1) % layer_group_size == 0``: with ``layer_group_size ==
num_hidden_layers == 3`` layers 0-1 are Lightning linear attention
(``BailingMoELinearAttention``, model_executor/layers/mamba/linear/
bailing_linear_attn.py) and layer 2 is MLA (``BailingMoeV25MLAAttention``).
The linear state update runs inside the opaque op ``vllm::linear_attention``
on ``LinearAttentionMetadataBuilder`` (v1/attention/backends/linear_attn.py),
not on the GDN builder: a decayed ``k^T v`` state of (heads, head_dim,
head_dim) per request, no delta rule, no conv. The ``_mtp`` kind adds one
next-token-prediction layer (``num_nextn_predict_layers: 1``) that vLLM builds
as ``BailingMoeV25MTPModel`` (model_executor/models/bailing_moe_mtp.py) under
``speculative_config={"method": "mtp", ...}``: config/speculative.py rewrites
``bailing_hybrid`` to ``bailing_hybrid_mtp``. Its weights are
``model.layers.<num_hidden_layers>.*`` (enorm, hnorm, eh_proj, an MLA layer, a
MoE, final_layernorm); the drafter takes its embedding from
``model.word_embeddings`` and its head from ``lm_head``.

Engine arguments: ``trust_remote_code=True`` (no network: the config class is
:data:`CONFIG_SOURCE`, written beside ``config.json`` as
``configuration_bailing_linear.py``, see ``EXTRA_FILES``). Neither vLLM nor
transformers ships a config class for this layout: vLLM has none for
``bailing_hybrid``, and transformers 5's ``BailingHybridConfig`` describes
Bailing-MoE-v3 (KDA) and overwrites ``head_dim`` with ``qk_rope_head_dim``.
The released Ring-2.5 checkpoints carry their own class the same way.

Config choices that matter:
  * ``model_type`` must be ``bailing_hybrid``: vLLM takes the MLA path
    (``is_deepseek_mla``) and the MTP rewrite by that name.
  * every attribute vLLM reads is set in ``config.json`` and stored as is by
    the config class: transformers 4 and 5 defaults differ, and vLLM falls
    back to its own defaults through ``getattr`` (0.30+ takes ``softmax``
    routing where ``score_function`` is missing, 0.26 passes ``None``).
  * ``head_dim`` 128 is the Lightning head dim (the release's): the decode
    kernels (``linear_decode_forward_triton`` and the spec-decode step kernel)
    take ``tl.arange(0, head_dim)`` in blocks of 32, and the prefill kernel
    wants a multiple of 64 (128 from 128 on), so 64 or 128.
  * MLA dims (qk_nope, qk_rope, v) = (128, 64, 128) with kv_lora_rank 512,
    DeepSeek-V3's, the only ones every CUDA MLA backend takes (see
    kimi_linear.py). MLA reads no ``head_dim``; it shares
    ``num_attention_heads`` with the linear layers.
  * ``score_function: sigmoid`` needs the router's ``expert_bias``
    (``moe_router_enable_expert_bias``): vLLM asserts the pair.
  * ``use_qk_norm``, ``group_norm_size`` 4 (gated group RMSNorm) and
    ``partial_rotary_factor`` 0.5 as in the release; the MLA layer drops the
    factor and rotates its full ``qk_rope_head_dim``.
  * checkpoint names use ``.attention.``; vLLM maps them to ``.self_attn.``
    and ``attention.dense`` to ``self_attn.dense`` (linear) or
    ``self_attn.o_proj`` (MLA).

vLLM registers ``BailingMoeV2_5ForCausalLM`` and ``BailingMoeV25MTPModel``
from 0.26 (the CUDA release this project runs) through 0.33, with the same
parameter names. The Lightning kernels are Triton only, so vLLM's CPU build
(no Triton) can build and load the model but not run a forward step; the
family is not in ``E2E_FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Iterator

from gdn_pass.checker.checkpoints import TINY_TOKENS, embedding_and_head_tensors
from harness.families.bailing_moe_v3 import bailing_mla, bailing_mlp

CONFIG_MODULE = "configuration_bailing_linear"
CONFIG_CLASS = "BailingMoeV25TinyConfig"

BAILING_MOE_V2_5_CONFIG = {
    "architectures": ["BailingMoeV2_5ForCausalLM"],
    "model_type": "bailing_hybrid",
    "auto_map": {"AutoConfig": f"{CONFIG_MODULE}.{CONFIG_CLASS}"},
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "layer_group_size": 3,  # layers 0-1 Lightning, layer 2 MLA
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    # Lightning linear attention
    "head_dim": 128,
    "block": 256,  # prefill block of the Lightning kernel
    "use_qkv_bias": False,
    "use_bias": False,
    "use_qk_norm": True,
    "group_norm_size": 4,
    "linear_silu": False,
    "linear_rope": True,
    "partial_rotary_factor": 0.5,
    "rope_theta": 600000.0,
    # MLA (layer 2), no q-LoRA
    "q_lora_rank": None,
    "kv_lora_rank": 512,  # + qk_rope_head_dim = 576, the MLA cache's head size
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    # MoE on every layer but the first
    "first_k_dense_replace": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 1.0,
    "router_dtype": "fp32",
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    **TINY_TOKENS,
    "pad_token_id": 0,
}

# With one MTP layer, for speculative decoding (method "mtp").
BAILING_MOE_V2_5_MTP_CONFIG = {**BAILING_MOE_V2_5_CONFIG, "num_nextn_predict_layers": 1}

# Keys PretrainedConfig itself takes (transformers 4 and 5); the rest the class stores.
_BASE_KEYS = ("architectures", "model_type", "auto_map", "tie_word_embeddings", "torch_dtype",
              "pad_token_id", "bos_token_id", "eos_token_id")
_ATTRIBUTES = "".join(f"\n    {key!r}," for key in BAILING_MOE_V2_5_CONFIG if key not in _BASE_KEYS)

CONFIG_SOURCE = f'''"""Tiny Bailing-MoE-v2.5 config class, from harness.families.bailing_linear."""

from transformers import PretrainedConfig

# Every attribute vLLM's BailingMoeV2_5ForCausalLM reads, stored as config.json
# gives it: no defaults of this class or of transformers (4 and 5 differ) apply.
ATTRIBUTES = ({_ATTRIBUTES}
)


class {CONFIG_CLASS}(PretrainedConfig):
    model_type = "bailing_hybrid"

    def __init__(self, **kwargs):
        for name in ATTRIBUTES:
            setattr(self, name, kwargs.pop(name, None))
        super().__init__(**kwargs)
'''


def _is_linear(layer: int, c: dict) -> bool:
    return (layer + 1) % c["layer_group_size"] != 0


def _bailing_moe_v2_5_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = c["hidden_size"]
    yield from embedding_and_head_tensors(c, "model.word_embeddings.weight")
    heads, hd = c["num_attention_heads"], c["head_dim"]
    inner = heads * hd
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        a = f"{p}.attention"
        if _is_linear(i, c):
            yield f"{a}.query_key_value.weight", (3 * inner, h)  # q, k, v; k/v heads = heads
            yield f"{a}.query_layernorm.weight", (hd,)
            yield f"{a}.key_layernorm.weight", (hd,)
            yield f"{a}.g_proj.weight", (inner, h)
            yield f"{a}.g_norm.weight", (inner,)
            yield f"{a}.dense.weight", (h, inner)
        else:
            yield from bailing_mla(a, c)
        yield from bailing_mlp(f"{p}.mlp", c, dense=i < c["first_k_dense_replace"])


def _bailing_moe_v2_5_mtp_tensors(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The target model plus its next-token-prediction layers, numbered after the decoder's."""
    yield from _bailing_moe_v2_5_tensors(c)
    h = c["hidden_size"]
    for i in range(c["num_hidden_layers"], c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
            yield f"{p}.{norm}.weight", (h,)
        yield f"{p}.eh_proj.weight", (h, 2 * h)
        yield from bailing_mla(f"{p}.attention", c)
        yield from bailing_mlp(f"{p}.mlp", c, dense=False)  # always MoE, whatever first_k_dense_replace


CHECKPOINTS = {
    "bailing_moe_v2_5": (BAILING_MOE_V2_5_CONFIG, _bailing_moe_v2_5_tensors),
    "bailing_moe_v2_5_mtp": (BAILING_MOE_V2_5_MTP_CONFIG, _bailing_moe_v2_5_mtp_tensors),
}

EXTRA_FILES = {kind: {f"{CONFIG_MODULE}.py": CONFIG_SOURCE} for kind in CHECKPOINTS}
