"""Tiny random transformers models, one per architecture family medusa_spec claims, built offline."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 96
WINDOW = 5  # sliding window small enough that prompts + outputs run far past it

_SHARED = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, **_SHARED)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_LLAMA_LIKE),
    "mistral": lambda: transformers.MistralConfig(sliding_window=WINDOW, **_LLAMA_LIKE),
    "qwen2": lambda: transformers.Qwen2Config(**_LLAMA_LIKE),
    "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **_LLAMA_LIKE),
    "gemma": lambda: transformers.GemmaConfig(head_dim=8, **_LLAMA_LIKE),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0, **_LLAMA_LIKE),
    "phi3": lambda: transformers.Phi3Config(**_LLAMA_LIKE),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **_SHARED),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, **_SHARED),
    "opt": lambda: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                          word_embed_proj_dim=32, max_position_embeddings=256, **_SHARED),
}
ARCHITECTURES = sorted(CONFIGS)
SLIDING = ("mistral", "gemma3")


def tiny_model(arch: str = "llama", seed: int = 0, lm_head_scale: float = 8.0, **overrides) -> torch.nn.Module:
    config = CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy ties never decide a test
    # (lm_head_scale=1 keeps them, for the test that counts the near-ties that do).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
    return model
