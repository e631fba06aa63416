"""A GPT decoder, as nanoGPT's model.py builds it: token and position embeddings, pre-norm blocks of causal
self-attention (torch's scaled_dot_product_attention, is_causal) and a 4x MLP, a final LayerNorm and a head tied to
the token embedding; weights drawn as GPT-2's (normal 0.02, the residual projections 0.02 / sqrt(2 x layers)).

  --model gpt-tiny    4 layers, 4 heads, width 128, context 64 (about nanoGPT's CPU configuration)
  --model gpt-small   6 layers, 6 heads, width 384, context 256 (its GPU one)

No dropout: every forward is a function of the weights and the batch alone, so a run replays at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GptSize:
    layers: int
    heads: int
    width: int
    context: int  # the longest sequence it takes (its position embedding's rows)


SIZES = {"gpt-tiny": GptSize(4, 4, 128, 64), "gpt-small": GptSize(6, 6, 384, 256)}


class SelfAttention(nn.Module):
    def __init__(self, size: GptSize):
        super().__init__()
        self.heads = size.heads
        self.qkv = nn.Linear(size.width, 3 * size.width)
        self.proj = nn.Linear(size.width, size.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = (part.view(n, t, self.heads, c // self.heads).transpose(1, 2)
                   for part in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, t, c))


class Block(nn.Module):
    def __init__(self, size: GptSize):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(size.width), SelfAttention(size)
        self.ln2 = nn.LayerNorm(size.width)
        self.mlp = nn.Sequential(nn.Linear(size.width, 4 * size.width), nn.GELU(), nn.Linear(4 * size.width, size.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    """Token ids N x T (T at most the context) in, logits N x T x vocab out."""

    def __init__(self, size: GptSize, vocab: int):
        super().__init__()
        self.size = size
        self.tokens, self.positions = nn.Embedding(vocab, size.width), nn.Embedding(size.context, size.width)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.ln_f = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * size.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
