"""Tiny models written locally, for running real vLLM engines with no hub and no GPU.

``kvredis up``, ``kvredis demo`` and the engine tests use the Llama; the multimodal engine tests use a
BLIP-2 (a small vision tower and Q-Former in front of the same Llama); the hybrid-model tests a Gemma 3, a
Qwen3-Next, a Nemotron-H and a DeepSeek-V2 (MLA), which transformers builds from their configs. The weights
are seeded random numbers saved as safetensors (so vLLM's real loader runs), and the tokenizer is a
word-level vocabulary of ``t<N>`` words, so a prompt ``"t5 t9 t12"`` is the token IDs ``[5, 9, 12]``. Needs
``safetensors`` and ``tokenizers`` (and ``transformers`` for the other families), which vLLM installs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = VOCAB  # the BLIP-2's image placeholder, one past the words
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
"""Turns joined with a space (the word-level tokenizer reads each turn's words)."""


def write_tiny_llama(
    folder: str | Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write config, tokenizer and seeded weights of a small Llama into ``folder``; returns it."""
    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    shape = _LlamaShape(VOCAB, layers, hidden, heads, kv_heads, head_dim, intermediate, max_positions)
    config = {"architectures": ["LlamaForCausalLM"], **shape.config()}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(path, max_positions)
    generator = torch.Generator().manual_seed(seed)
    save_file(shape.tensors(generator, ""), str(path / "model.safetensors"))
    return path


def write_tiny_blip2(
    folder: str | Path,
    *,
    image_size: int = 64,
    patch_size: int = 16,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 2,
    query_tokens: int = 40,
    qformer_layers: int = 2,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a small BLIP-2 (``Blip2ForConditionalGeneration``: vision tower, Q-Former, projection, the tiny
    Llama as its language model) with its processor files into ``folder``; returns it. Every image, whatever
    its size, becomes ``query_tokens`` placeholder tokens at the start of the prompt, so two images give the
    same token IDs."""
    from safetensors.torch import save_file

    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    shape = _LlamaShape(VOCAB + 1, layers, hidden, heads, kv_heads, head_dim, intermediate, max_positions)
    config = {
        "architectures": ["Blip2ForConditionalGeneration"], "model_type": "blip-2", "torch_dtype": "float32",
        "num_query_tokens": query_tokens, "image_token_index": IMAGE_TOKEN_ID,
        "use_decoder_only_language_model": True, "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "blip_2_vision_model", "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden, "num_hidden_layers": vision_layers,
            "num_attention_heads": vision_heads, "image_size": image_size, "patch_size": patch_size,
            "hidden_act": "gelu", "layer_norm_eps": 1e-6, "qkv_bias": True},
        "qformer_config": {
            "model_type": "blip_2_qformer", "hidden_size": vision_hidden, "num_hidden_layers": qformer_layers,
            "num_attention_heads": vision_heads, "intermediate_size": 2 * vision_hidden,
            "encoder_hidden_size": vision_hidden, "cross_attention_frequency": 1, "hidden_act": "gelu",
            "layer_norm_eps": 1e-12, "vocab_size": 32, "max_position_embeddings": 64},
        "text_config": {"architectures": ["LlamaForCausalLM"], **shape.config()},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(path, max_positions, image_token=True)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "BlipImageProcessor", "processor_class": "Blip2Processor",
        "size": {"height": image_size, "width": image_size}, "do_resize": True, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}, indent=1))
    (path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Blip2Processor", "num_query_tokens": query_tokens}, indent=1))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    generator = torch.Generator().manual_seed(seed)
    tensors = shape.tensors(generator, "language_model.")

    def random(name: str, *size: int, scale: float) -> None:
        tensors[name] = (torch.randn(*size, generator=generator) * scale).contiguous()

    def linear(name: str, out: int, inp: int, scale: float) -> None:
        random(name + ".weight", out, inp, scale=scale)
        tensors[name + ".bias"] = torch.zeros(out)

    def norm(name: str) -> None:
        tensors[name + ".weight"] = torch.ones(vision_hidden)
        tensors[name + ".bias"] = torch.zeros(vision_hidden)

    width = vision_hidden
    # Vision tower: pixels in [-1, 1] cut into patches, pre-norm encoder layers.
    patches = (image_size // patch_size) ** 2
    random("vision_model.embeddings.class_embedding", 1, 1, width, scale=0.5)
    random("vision_model.embeddings.position_embedding", 1, patches + 1, width, scale=0.5)
    random("vision_model.embeddings.patch_embedding.weight", width, 3, patch_size, patch_size, scale=0.05)
    tensors["vision_model.embeddings.patch_embedding.bias"] = torch.zeros(width)
    for layer in range(vision_layers):
        prefix = f"vision_model.encoder.layers.{layer}."
        linear(prefix + "self_attn.qkv", 3 * width, width, 0.2)
        linear(prefix + "self_attn.projection", width, width, 0.2)
        norm(prefix + "layer_norm1")
        linear(prefix + "mlp.fc1", 2 * width, width, 0.2)
        linear(prefix + "mlp.fc2", width, 2 * width, 0.2)
        norm(prefix + "layer_norm2")
    norm("vision_model.post_layernorm")
    # Q-Former: learned queries attending to each other and to the image in every layer, post-norm.
    random("query_tokens", 1, query_tokens, width, scale=1.0)
    norm("qformer.layernorm")
    for layer in range(qformer_layers):
        prefix = f"qformer.encoder.layer.{layer}."
        for block in ("attention", "crossattention"):
            for name in ("query", "key", "value"):
                linear(f"{prefix}{block}.attention.{name}", width, width, 0.2)
            linear(f"{prefix}{block}.output.dense", width, width, 0.2)
            norm(f"{prefix}{block}.output.LayerNorm")
        linear(prefix + "intermediate_query.dense", 2 * width, width, 0.2)
        linear(prefix + "output_query.dense", width, 2 * width, 0.2)
        norm(prefix + "output_query.LayerNorm")
    linear("language_projection", hidden, width, 0.05)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def prompt_text(token_ids: list[int]) -> str:
    """The text that the tiny tokenizer turns into exactly ``token_ids``."""
    return " ".join(f"t{i}" for i in token_ids)


class _LlamaShape:
    """A Llama's sizes: its config and its seeded weights, named as in Hugging Face checkpoints."""

    def __init__(self, vocab: int, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, max_positions: int) -> None:
        self.vocab, self.layers, self.hidden, self.heads = vocab, layers, hidden, heads
        self.kv_heads, self.head_dim, self.intermediate = kv_heads, head_dim, intermediate
        self.max_positions = max_positions

    def config(self) -> dict[str, Any]:
        return {
            "model_type": "llama", "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        }

    def tensors(self, generator: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
        """The weights under ``prefix`` (``""`` for a Llama alone), drawn from ``generator`` in one order."""
        hidden, q_width, kv_width = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * 0.05).contiguous()

        tensors = {
            prefix + "model.embed_tokens.weight": weight(self.vocab, hidden),
            prefix + "model.norm.weight": torch.ones(hidden),
            prefix + "lm_head.weight": weight(self.vocab, hidden),
        }
        for layer in range(self.layers):
            name = f"{prefix}model.layers.{layer}."
            tensors[name + "input_layernorm.weight"] = torch.ones(hidden)
            tensors[name + "post_attention_layernorm.weight"] = torch.ones(hidden)
            tensors[name + "self_attn.q_proj.weight"] = weight(q_width, hidden)
            tensors[name + "self_attn.k_proj.weight"] = weight(kv_width, hidden)
            tensors[name + "self_attn.v_proj.weight"] = weight(kv_width, hidden)
            tensors[name + "self_attn.o_proj.weight"] = weight(hidden, q_width)
            tensors[name + "mlp.gate_proj.weight"] = weight(self.intermediate, hidden)
            tensors[name + "mlp.up_proj.weight"] = weight(self.intermediate, hidden)
            tensors[name + "mlp.down_proj.weight"] = weight(hidden, self.intermediate)
        return tensors


def _write_tokenizer(path: Path, max_positions: int, *, image_token: bool = False) -> None:
    """The word-level tokenizer's files; with ``image_token``, ``<image>`` is a special token (``VOCAB``)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocabulary = dict(SPECIAL) | {f"t{i}": i for i in range(len(SPECIAL), VOCAB)}
    if image_token:
        vocabulary[IMAGE_TOKEN] = IMAGE_TOKEN_ID
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if image_token:
        # Found inside words too: a processor writes an image's placeholders with no space between them.
        tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_positions,
    }))


# -- other families: built by transformers from their configs (the vLLM environment has it) ---------------

HYBRID_MAX_POSITIONS = 2048
_HF_COMMON = {"vocab_size": VOCAB, "max_position_embeddings": HYBRID_MAX_POSITIONS, "torch_dtype": "float32",
              "bos_token_id": SPECIAL["<s>"], "eos_token_id": SPECIAL["</s>"],
              "pad_token_id": SPECIAL["<pad>"], "tie_word_embeddings": False}
"""What every tiny model of another family shares with the Llama: the vocabulary and special tokens."""


def _write_random_hf(folder: str | Path, config: dict[str, Any], seed: int,
                     dtype: torch.dtype = torch.float32) -> Path:
    """Build the Hugging Face model of ``config`` with seeded random weights; save it and the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    model_type = config.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    with torch.random.fork_rng():  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(path), safe_serialization=True)
    _write_tokenizer(path, HYBRID_MAX_POSITIONS)
    return path


def _gemma3_config(layers: int = 4, hidden: int = 128, sliding_window: int = 64,
                   full_every: int = 2) -> dict[str, Any]:
    return {
        **_HF_COMMON, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "query_pre_attn_scalar": 64,
        "sliding_window": sliding_window,
        "layer_types": ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }


def write_tiny_gemma3(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    """A tiny Gemma 3 (sliding-window layers, window 64, and every ``full_every``-th layer full attention:
    Gemma 3's own ratio is 6); returns its folder. ``shape``: layers, hidden, sliding_window, full_every."""
    return _write_random_hf(folder, _gemma3_config(**shape), seed)


def _qwen3_next_config(layers: int = 4, hidden: int = 128, linear_head_dim: int = 64) -> dict[str, Any]:
    return {
        **_HF_COMMON, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
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


def write_tiny_qwen3_next(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    """A tiny Qwen3-Next (three Gated DeltaNet layers to one of full attention, MoE), in bfloat16: vLLM's
    CPU GDN kernels need it. Returns its folder."""
    return _write_random_hf(folder, _qwen3_next_config(**shape), seed, torch.bfloat16)


def _nemotron_h_config(pattern: str = "M*M-", hidden: int = 128) -> dict[str, Any]:
    return {
        **_HF_COMMON, "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "hybrid_override_pattern": pattern,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "mamba_num_heads": 4, "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 64, "conv_kernel": 4,
        "expand": 2, "chunk_size": 64, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
        "use_conv_bias": True, "mamba_proj_bias": False, "use_bias": False, "layer_norm_epsilon": 1e-5,
        "num_nextn_predict_layers": 0, "rescale_prenorm_residual": False,
    }


def write_tiny_nemotron_h(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    """A tiny Nemotron-H (Mamba2, attention and MLP layers, ``pattern`` ``M*M-``); returns its folder."""
    return _write_random_hf(folder, _nemotron_h_config(**shape), seed)


def _deepseek_mla_config(layers: int = 2, hidden: int = 128, version: int = 2) -> dict[str, Any]:
    config = {
        **_HF_COMMON, "model_type": f"deepseek_v{version}",
        "architectures": [f"DeepseekV{version}ForCausalLM"],
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


def write_tiny_deepseek_mla(folder: str | Path, seed: int = 0, **shape: Any) -> Path:
    """A tiny DeepSeek-V2 (``version=3``: V3) with MLA (kv_lora_rank 512 and rope dim 64, as vLLM's CPU MLA
    kernel needs); returns its folder."""
    return _write_random_hf(folder, _deepseek_mla_config(**shape), seed)

