"""A decoder-only language model: token and position embeddings, ``n_layer`` pre-norm
causal blocks, a final norm and a head that shares the token embedding's weight.

``forward(idx)`` returns the logits (B, T, vocab_size); ``forward(idx, targets)`` returns
``(logits, loss)``, the mean cross entropy over the tokens whose target is not
:data:`IGNORE_INDEX` (-100, torch's and transformers' default). So ``loss: from_output``
trains it on its own loss, and ``echelon3 export`` / ``run`` get the logits. The blocks
(:class:`GPTBlock`) are the natural shard units (``fsdp.units: [GPTBlock]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # a target of this value is no token to predict (padding)


class CausalSelfAttention(nn.Module):
    """Multi-head attention in which a token attends to itself and the tokens before it."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.out_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(
            2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class GPTBlock(nn.Module):
    """Pre-norm causal attention and a 4x GELU MLP, each added to the residual stream."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.norm2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """``idx``: (B, T) token ids, T at most ``block_size``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(n_embd, n_head, dropout, bias)
                                    for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix embeds and predicts tokens
        self.apply(self._init)
        # Residual projections scaled down with depth, so the stream's variance stays put.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than block_size "
                             f"{self.block_size}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None):
        """``idx`` (B, T) extended by ``max_new_tokens`` sampled tokens (the context cut to
        the last ``block_size``); ``temperature`` 0 picks the most likely token, ``top_k``
        samples among the k most likely, ``generator`` seeds the draw."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :].float()
            if temperature == 0:
                step = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                step = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, step], dim=1)
        return idx
