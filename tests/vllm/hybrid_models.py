"""Tiny models of the hybrid families, written at test time with seeded random weights (transformers builds
each from its config), for real vLLM engines without a hub: a Gemma 3 (sliding-window and full-attention
layers), a Qwen3-Next (Gated DeltaNet and full attention), a Nemotron-H (Mamba2, attention and MLP layers)
and a DeepSeek-V2 (MLA). The tokenizer is the tiny Llama's (:mod:`kvredis.tinymodel`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvredis.tinymodel import SPECIAL, VOCAB, _write_tokenizer

MAX_POSITIONS = 2048
COMMON = {"vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "torch_dtype": "float32",
          "bos_token_id": SPECIAL["<s>"], "eos_token_id": SPECIAL["</s>"], "pad_token_id": SPECIAL["<pad>"],
          "tie_word_embeddings": False}


def _save_random(folder: str | Path, config: dict[str, Any], seed: int,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Build the Hugging Face model of ``config`` with seeded random weights; save it and the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    _write_tokenizer(path, MAX_POSITIONS)
    return path


def gemma3_config(layers: int = 4, hidden: int = 128, sliding_window: int = 64) -> dict[str, Any]:
    return {
        **COMMON, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "query_pre_attn_scalar": 64,
        "sliding_window": sliding_window,
        "layer_types": ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }


def write_gemma3(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    return _save_random(folder, gemma3_config(**shape), seed)


def qwen3_next_config(layers: int = 4, hidden: int = 128, linear_head_dim: int = 64) -> dict[str, Any]:
    return {
        **COMMON, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
        "shared_expert_intermediate_size": hidden, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
    }


def write_qwen3_next(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    return _save_random(folder, qwen3_next_config(**shape), seed, torch.bfloat16)


def nemotron_h_config(pattern: str = "M*M-", hidden: int = 128) -> dict[str, Any]:
    return {
        **COMMON, "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "hybrid_override_pattern": pattern,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "mamba_num_heads": 4, "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 64, "conv_kernel": 4,
        "expand": 2, "chunk_size": 64, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
        "use_conv_bias": True, "mamba_proj_bias": False, "use_bias": False, "layer_norm_epsilon": 1e-5,
        "num_nextn_predict_layers": 0, "rescale_prenorm_residual": False,
    }


def write_nemotron_h(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    return _save_random(folder, nemotron_h_config(**shape), seed)


def deepseek_mla_config(layers: int = 2, hidden: int = 128, version: int = 2) -> dict[str, Any]:
    config = {
        **COMMON, "model_type": f"deepseek_v{version}", "architectures": [f"DeepseekV{version}ForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "q_lora_rank": None if version == 2 else 64,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 0,
    }
    if version == 2:
        config["topk_method"] = "greedy"
    else:  # as DeepSeek-V3's own config.json: sigmoid scores with a correction bias
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    return config


def write_deepseek_mla(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    return _save_random(folder, deepseek_mla_config(**shape), seed)

