"""Small models and a plain-PyTorch reference loop for the adapter's tests."""

import copy
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT  # noqa: E402

# A small GPT: 2 layers of 32, 64 tokens, sequences of 16.
TinyGPT = functools.partial(GPT, vocab=64, hidden=32, layers=2, heads=2, seq=16)

def batches(steps, batch=4, seq=16, vocab=64, seed=1):
    """Learnable sequences: a random first token, then t -> (5t + 3) mod vocab."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
        for _ in range(seq):
            tokens.append((tokens[-1] * 5 + 3) % vocab)
        out.append(torch.stack(tokens, dim=1))
    return out


def torch_losses(model, data, lr=1e-2, weight_decay=0.01, accumulation=1, optimizer="adamw"):
    """Losses of plain PyTorch training: torch.optim on the model as it is (`optimizer`: adamw, adam or sgd, or an
    optimizer made on the model's parameters already)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif optimizer == "adamw":
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


def bf16_states_losses(model, data, lr=1e-2, weight_decay=0.01):
    """torch's fused AdamW (whose bits strata's fp32 kernel gives), each moment rounded to the nearest bf16 after
    every step: what Note [bf16 states] says strata computes."""
    adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    losses = []
    for tokens in data:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        adamw.step()
        adamw.zero_grad()
        for state in adamw.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())
        losses.append(loss.item())
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


def holds_no_storage(p):
    """Whether a parameter is held (strata.state): its .data strata's placeholder, one element of storage shared
    by every parameter."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.data.untyped_storage().nbytes() == p.element_size() and type(p) is not torch.nn.Parameter


def relative_errors(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def mixed_precision_losses(model, data, lr=1e-2, weight_decay=0.01):
    """The bf16 recipe in plain PyTorch: torch.optim.AdamW on fp32 masters, a bf16 copy computes."""
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay)
    model = model.to(torch.bfloat16)
    losses = []
    for tokens in data:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
    return losses


# TinyGPT's parameters take 120KiB in 2048-element chunks: the device holds
# less than them, the host less than the optimizer states, the rest is on NVMe.
DEVICE_BUDGET = 96 * 1024
HOST_BUDGET = 192 * 1024


def three_tiers(tmp_path, **extra):
    config = {
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "device": {"backend": "emulated", "budget": DEVICE_BUDGET},
        "host": {"budget": HOST_BUDGET},
        "nvme": {"dirs": [str(tmp_path)], "capacity": "16MiB"},
        "chunk": {"size_elems": 2048},
        "non_model_memory": 0,
        "log": {"level": "error"},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def with_lora(model, r):
    """`model` with PEFT LoRA adapters of rank `r` on its q and v projections, their B matrices drawn at random
    instead of PEFT's zeros (so that A's gradients are not zero from the start)."""
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model
