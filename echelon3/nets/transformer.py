"""A small transformer classifier: an image's rows as a sequence of tokens.

A digits image (8 x 8) is 8 tokens of 8 pixels: each row is embedded, a learned
position is added, ``depth`` pre-norm :class:`TransformerBlock` s attend over the
rows, and the mean token is classified. The blocks are the natural shard units
(``fsdp.units: [TransformerBlock]``) and activation-checkpointing units.
"""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class RowTransformer(nn.Module):
    """Classifies ``rows x cols`` inputs (flat or not) as ``rows`` tokens of ``cols`` values."""

    def __init__(self, rows: int = 8, cols: int = 8, dim: int = 32, heads: int = 4,
                 depth: int = 3, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.rows, self.cols = rows, cols
        self.embed = nn.Linear(cols, dim)
        self.position = nn.Parameter(torch.zeros(rows, dim))
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, dropout=dropout)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(len(x), self.rows, self.cols)) + self.position
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))
