"""Tiny real models for tests: built from configs with seeded random weights, never downloaded."""

from __future__ import annotations

import torch
import torch.nn as nn
import transformers


def tiny_llama(layers: int = 2, seed: int = 0, dtype=torch.float32, intermediate_size: int = 160) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=intermediate_size,  # 160: not a multiple of 128, exercises padded groups
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


class Block(nn.Module):
    """An MLP block: three instances of it share one compiled graph."""

    def __init__(self, dim: int = 64, hidden: int = 96):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def token_ids(batch: int = 2, length: int = 12, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
