"""The PyTorch adapter on a CUDA GPU against plain PyTorch (run by scripts/gpu_check.sh where the bundle holds
the Python package): Hugging Face models built from their configs, trained through strata with the device
budget below their model states (chunks on device and host), and in plain PyTorch with the same AdamW; a
learning-rate schedule over two param groups; PEFT LoRA; layered gradient accumulation (engine.train_step);
model.state_dict() of the held model; StrataTrainer against a plain Trainer. Prints one
line per check and a table; exit status 1 when a check is out of its tolerance.

    python3 scripts/gpu_adapter_check.py [--steps 10] [--json OUT] [--device emulated]

(--device emulated: the same checks on the CPU, with strata's emulated device, to try the script without a GPU.)
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import torch

import strata

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
from models import with_lora  # noqa: E402

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # losses, relative (fp32 also all parameters as one vector)
DEVICE = {"backend": "cuda", "torch": "cuda"}


def llama(hidden=256, layers=4, **extra):
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden + 64,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=256, attn_implementation="eager", **extra)
    return transformers.LlamaForCausalLM(config)


def gpt2():
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=512, n_embd=256, n_layer=4, n_head=8,
                                                                n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                attn_pdrop=0.0))


def lora_llama():
    return with_lora(llama(), r=8)


def token_batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (4, 128), generator=generator).to(DEVICE["torch"]) for _ in range(steps)]


def plain_training(model, data, precision, lr, groups=None, schedule=None, micro=False):
    """torch.optim.AdamW on the model (bf16: on fp32 masters of a bf16 copy, the mixed-precision recipe).
    micro: each batch's sequences one a micro-batch, their gradients summed in that order (as layered
    accumulation sums them: a whole-batch backward sums in another order, which Adam's steps amplify)."""
    model = model.to(DEVICE["torch"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = trainable
    if precision == "bf16":
        masters = [p.detach().clone().float().requires_grad_() for p in trainable]
        model = model.to(torch.bfloat16)
        trainable = [p for p in model.parameters() if p.requires_grad]
    if groups is None:
        optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01)
    else:
        index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
        optimizer = torch.optim.AdamW([{**g, "params": [masters[index[id(p)]] for p in g["params"]]}
                                       for g in groups(model)], lr=lr)
    scheduler = schedule(optimizer) if schedule else None
    losses = []
    for tokens in data:
        parts = tokens.split(1) if micro else [tokens]
        step_losses = []
        for part in parts:  # the micro-batches' mean loss is the batch's: each sequence has as many labels
            loss = model(input_ids=part, labels=part).loss
            step_losses.append(loss.detach())
            (loss / len(parts)).backward()
        losses.append(torch.stack(step_losses).mean().item())
        if precision == "bf16":
            for master, p in zip(masters, trainable):
                master.grad, p.grad = p.grad.float(), None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler:
            scheduler.step()
        if precision == "bf16":
            with torch.no_grad():
                for master, p in zip(masters, trainable):
                    p.copy_(master)
    return losses, model


def strata_training(model, data, precision, lr, nvme, groups=None, schedule=None, layered=False):
    """layered: each step engine.train_step over the batch's sequences one a micro-batch, in the layered order."""
    states = sum(p.numel() for p in model.parameters()) * (16 if precision == "fp32" else 18)
    config = {"optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.01}, "precision": precision,
              "device": {"backend": DEVICE["backend"], "budget": states // 3}, "host": {"budget": 2 * states},
              "nvme": {"dirs": [nvme]}, "log": {"level": "error"}}
    engine = strata.initialize(model, config, param_groups=groups(model) if groups else None)
    scheduler = schedule(engine.optimizer) if schedule else None
    losses = []
    synchronize()
    start = time.perf_counter()
    for tokens in data:
        if layered:  # the micro-batches' mean loss is the batch's: each sequence has as many labels
            losses.append(engine.train_step(tokens.split(1), lambda m, t: m(input_ids=t, labels=t).loss,
                                            accumulation="layered").mean().item())
            continue
        loss = engine(input_ids=tokens, labels=tokens).loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.optimizer.step()  # = engine.step(), through the optimizer a scheduler counts the steps of
        if scheduler:
            scheduler.step()
    synchronize()
    return losses, engine, time.perf_counter() - start


def synchronize():
    if DEVICE["torch"] == "cuda":
        torch.cuda.synchronize()


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n]
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]


def warmup_cosine(optimizer):
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])


def check(name, build, precision, steps, lr=1e-3, groups=None, schedule=None, layered=False):
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    data = token_batches(steps)
    theirs, plain = plain_training(reference, data, precision, lr, groups, schedule, micro=layered)
    with tempfile.TemporaryDirectory() as nvme:
        ours, engine, seconds = strata_training(model, data, precision, lr, nvme, groups, schedule, layered)
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        row = {"check": name, "precision": precision, "steps": steps, "loss_error": loss_error,
               "strata_s_per_step": seconds / steps,
               "device_peak": engine.stats()["tiers"]["device"]["peak_bytes"]}
        if precision == "fp32":
            values = model.state_dict()  # the held model's own state_dict: values gathered from the chunks
            pairs = [(values[k].float().to(v.device).reshape(-1), v.float().reshape(-1))
                     for k, v in plain.state_dict().items() if k in values and v.is_floating_point()]
            ours_all, theirs_all = torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
            row["param_error"] = ((ours_all - theirs_all).norm() / theirs_all.norm()).item()
            # Reported, not checked: a tensor whose gradient is rounding noise (GPT-2's key bias, which the
            # softmax cancels) takes Adam steps decided by last bits, in torch's own fused/unfused kernels too.
            row["worst_tensor_error"] = max(((a - b).norm() / b.norm()).item() for a, b in pairs)
        engine.close()
    row["ok"] = loss_error <= TOLERANCE[precision] and row.get("param_error", 0) <= TOLERANCE[precision]
    print(json.dumps(row), flush=True)
    return row


def check_trainer(steps):
    """StrataTrainer against a plain Trainer (the set-up of python/tests/test_hf_trainer.py: a tiny Llama, warm-up
    and cosine, two groups, accumulation 2, clipping), on the GPU: the logged losses and learning rates."""
    import test_hf_trainer as setup
    import transformers
    from strata.hf import StrataTrainer
    on_gpu = {"use_cpu": False} if DEVICE["torch"] == "cuda" else {}
    with tempfile.TemporaryDirectory() as root:
        plain = transformers.Trainer(model=setup.llama(), args=setup.arguments(f"{root}/plain", max_steps=steps,
                                                                                **on_gpu),
                                     train_dataset=setup.sequences())
        plain.train()
        config = setup.strata_config(f"{root}/nvme")
        config["device"]["backend"] = DEVICE["backend"]
        ours = StrataTrainer(model=setup.llama(), args=setup.arguments(f"{root}/ours", max_steps=steps, **on_gpu),
                             train_dataset=setup.sequences(), strata_config=config)
        start = time.perf_counter()
        ours.train()
        seconds = time.perf_counter() - start
        mine, theirs = setup.logged(ours), setup.logged(plain)
    loss_error = max(abs(mine[s][0] - theirs[s][0]) / abs(theirs[s][0]) for s in theirs)
    same_lr = mine.keys() == theirs.keys() and all(mine[s][1] == theirs[s][1] for s in theirs)
    row = {"check": "StrataTrainer vs Trainer (tiny Llama)", "precision": "fp32", "steps": steps,
           "loss_error": loss_error, "same_learning_rates": same_lr, "strata_s_per_step": seconds / steps,
           "ok": loss_error <= TOLERANCE["fp32"] and same_lr}
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--device", choices=["cuda", "emulated"], default="cuda")
    args = parser.parse_args()
    if args.device == "emulated":
        DEVICE.update(backend="emulated", torch="cpu")
    elif not torch.cuda.is_available():
        print("gpu_adapter_check: no CUDA device", file=sys.stderr)
        return 1
    where = torch.cuda.get_device_name() if args.device == "cuda" else "the emulated device"
    print(f"torch {torch.__version__}, {where}, strata {strata.__version__}", flush=True)
    rows = []
    for precision in ("fp32", "bf16"):
        rows.append(check("llama", llama, precision, args.steps))
        rows.append(check("gpt2", gpt2, precision, args.steps))
    rows.append(check("llama, 2 groups, warm-up + cosine", llama, "fp32", args.steps, groups=two_groups,
                      schedule=warmup_cosine))
    rows.append(check("llama + LoRA", lora_llama, "fp32", args.steps))
    for precision in ("fp32", "bf16"):  # issue 25: 4 micro-batches a step, each block for all of them in a row
        rows.append(check("llama, layered accumulation", llama, precision, args.steps, layered=True))
    rows.append(check_trainer(2 * args.steps))
    print("\n| check | precision | steps | loss rel. error | params rel. error | worst tensor | strata s/step | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['precision']} | {r['steps']} | {r['loss_error']:.2e} | "
              f"{r.get('param_error', float('nan')):.2e} | {r.get('worst_tensor_error', float('nan')):.2e} | "
              f"{r['strata_s_per_step']:.3f} | {r['ok']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
