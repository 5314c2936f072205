"""The Llama models of OpenDiLoCo (arXiv 2407.07852, Sec. 3), built from scratch with transformers.

The model knows nothing about distribution: ranks, process groups and DiLoCo live elsewhere.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from transformers import LlamaConfig, LlamaForCausalLM

_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "initializer_range",
    "tie_word_embeddings",
)


def llama_config(model_cfg: DictConfig) -> LlamaConfig:
    """Validate a `model/*.yaml` entry and turn it into a LlamaConfig."""
    hidden, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
    kv_heads = model_cfg.num_key_value_heads
    if hidden % heads:
        raise ValueError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}")
    if heads % kv_heads:
        raise ValueError(
            f"model.num_attention_heads={heads} is not divisible by model.num_key_value_heads={kv_heads}"
        )
    kwargs = {k: model_cfg[k] for k in _SHAPE_KEYS}
    # pad = eos = </s> (id 2) and bos = <s> (id 1), as in the Mistral-7B tokenizer and the bundled sample's.
    return LlamaConfig(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=2, use_cache=False)


def build_model(model_cfg: DictConfig, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama (training starts from scratch, as in the paper), seeded."""
    config = llama_config(model_cfg)
    config._attn_implementation = model_cfg.get("attn_implementation", "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Total parameters and parameters without the input embedding and the (untied) output head."""
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(
        p.numel() for n, p in model.named_parameters() if "embed_tokens" in n or n.startswith("lm_head")
    )
    return {"total": total, "non_embedding": total - embedding}


def shape_fingerprint(model: torch.nn.Module) -> str:
    """A short string that changes with any parameter name, shape or dtype (compared across ranks/checkpoints)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
