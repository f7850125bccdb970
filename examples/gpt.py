"""A GPT-style decoder for the examples and the adapter's tests: plain PyTorch, nothing of strata."""

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


class Block(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        # No bias: the keys' would get only rounding noise as gradient (softmax
        # ignores a shift of every score), which Adam turns into full steps.
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (y.view(shape).transpose(1, 2) for y in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(torch.nn.Module):
    """A decoder with tied input/output embeddings and a position table held by the root itself.

    `checkpoint`: recompute each block in backward (torch.utils.checkpoint): True for the
    reentrant form, "non_reentrant" for the other.
    """

    def __init__(self, vocab=256, hidden=384, layers=8, heads=6, seq=128, checkpoint=False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two modules
        self.checkpoint = checkpoint
        torch.nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's: logits near 0 at the start

    def forward(self, tokens, targets=None):
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint != "non_reentrant")
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
