"""A tiny Llama model folder written locally, for running real vLLM engines with no hub and no GPU.

``kvredis up``, ``kvredis demo`` and the engine tests use it. The weights are seeded random numbers saved
as safetensors (so vLLM's real loader runs), and the tokenizer is a word-level vocabulary of ``t<N>``
words, so a prompt ``"t5 t9 t12"`` is the token IDs ``[5, 9, 12]``. Needs ``safetensors`` and
``tokenizers``, which vLLM installs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 1024
SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}


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
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocabulary = dict(SPECIAL) | {f"t{i}": i for i in range(len(SPECIAL), VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_positions,
    }))
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).contiguous()

    tensors = {
        "model.embed_tokens.weight": weight(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": weight(VOCAB, hidden),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[prefix + "self_attn.q_proj.weight"] = weight(heads * head_dim, hidden)
        tensors[prefix + "self_attn.k_proj.weight"] = weight(kv_heads * head_dim, hidden)
        tensors[prefix + "self_attn.v_proj.weight"] = weight(kv_heads * head_dim, hidden)
        tensors[prefix + "self_attn.o_proj.weight"] = weight(hidden, heads * head_dim)
        tensors[prefix + "mlp.gate_proj.weight"] = weight(intermediate, hidden)
        tensors[prefix + "mlp.up_proj.weight"] = weight(intermediate, hidden)
        tensors[prefix + "mlp.down_proj.weight"] = weight(hidden, intermediate)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def prompt_text(token_ids: list[int]) -> str:
    """The text that the tiny tokenizer turns into exactly ``token_ids``."""
    return " ".join(f"t{i}" for i in token_ids)
