"""The Llama models of OpenDiLoCo (arXiv 2407.07852, Sec. 3), built from scratch with transformers.

The model knows nothing about distribution: ranks, process groups and DiLoCo live elsewhere.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig, LlamaForCausalLM

if TYPE_CHECKING:
    from diloco.schema import ModelConfig


def llama_config(model_cfg: ModelConfig, **extra) -> LlamaConfig:
    """A checked model block (what diloco.config.validate returns, or a composed `model/*.yaml`, which has
    the same fields) as a LlamaConfig; `extra` goes to LlamaConfig as it is (attn_implementation=...)."""
    m = model_cfg
    # pad = eos = </s> (id 2) and bos = <s> (id 1), as in the Mistral-7B tokenizer and the bundled sample's.
    return LlamaConfig(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps,
        initializer_range=m.initializer_range,
        tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        use_cache=False,
        **extra,
    )


def build_model(model_cfg: ModelConfig, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama (training starts from scratch, as in the paper), seeded."""
    config = llama_config(model_cfg, attn_implementation=model_cfg.attn_implementation)
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
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of every state_dict entry's name, shape, dtype and bytes, in state_dict order: equal on
    two processes exactly when they hold bit-identical weights. One tensor at a time is copied to the
    CPU (bounded memory); CPU tensors are hashed in place."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()
