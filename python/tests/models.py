"""Small models and a plain-PyTorch reference loop for the adapter's tests."""

import copy
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
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """A decoder with tied input/output embeddings and a position table held by the root itself."""

    def __init__(self, vocab=64, hidden=32, layers=2, heads=2, seq=16, checkpoint=False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two modules
        self.checkpoint = checkpoint

    def forward(self, tokens, targets=None):
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps, batch=4, seq=16, vocab=64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=generator) for _ in range(steps)]


def torch_losses(model, data, lr=1e-2, weight_decay=0.01, accumulation=1, optimizer="adamw"):
    """Losses of plain PyTorch training: torch.optim on the model as it is."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    losses = []
    for i, tokens in enumerate(data):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        (loss / accumulation if accumulation > 1 else loss).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


def strata_losses(engine, data):
    losses = []
    for tokens in data:
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def pair(seed=0, **kwargs):
    """Two identical models (same seed): one for strata, one for the reference."""
    torch.manual_seed(seed)
    model = TinyGPT(**kwargs)
    return model, copy.deepcopy(model)


def relative_errors(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]
