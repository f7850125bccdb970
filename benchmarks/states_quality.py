"""What a states format costs in quality: the same model trained through strata with fp32 optimizer states and with
--states, from the same seeds on the same batches, and the gap between their losses (the mean of the last 20
steps). Two models: the demo's GPT on strata's own sources (examples/finetune.py's corpus and batches), and a
Hugging Face Llama built from its config, on the same bytes.

    python3 benchmarks/states_quality.py [--states bf16] [--model gpt|llama] [--steps 300] [--seeds 0]
        [--json OUT]

Each run keeps the model states on the emulated device's host (no budget pressure: the format's effect alone).
The gap between two fp32 runs from different seeds is printed beside it, as the scale of run-to-run noise.
"""

import argparse
import json
import os
import statistics
import sys

import torch

import strata

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import finetune  # noqa: E402
from gpt import GPT  # noqa: E402

LAST = 20  # the steps whose mean loss is compared


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--states", default="bf16", help="the optimizer.states format against fp32 (default bf16)")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0", help="model seeds, comma-separated; each trains both formats")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", help="write the losses and gaps here")
    args = p.parse_args(argv)
    if args.steps < LAST:
        p.error(f"--steps {args.steps}: at least {LAST}, the steps whose mean is compared")
    return args


def build_model(args, seed):
    torch.manual_seed(seed)
    if args.model == "llama":
        import transformers
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                          num_attention_heads=4, max_position_embeddings=128)
        return transformers.LlamaForCausalLM(config)
    return GPT(vocab=256, hidden=384, layers=8, heads=6, seq=128)  # the demo's defaults


def losses_of(args, states, seed, batches):
    model = build_model(args, seed)
    engine = strata.initialize(model, {"optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.01,
                                                     "states": states},
                                       "device": {"backend": "emulated"}, "log": {"level": "error"}})
    losses = []
    for tokens in batches:
        if args.model == "llama":
            loss = engine(input_ids=tokens, labels=tokens).loss
        else:
            loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def main(argv=None):
    args = parse_args(argv)
    batches = finetune.make_batches(finetune.corpus(), args.steps, 4, 128, 0)
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for states in ("fp32", args.states):
            runs[f"{states}/seed{seed}"] = losses_of(args, states, seed, batches)
    tail = {name: statistics.fmean(losses[-LAST:]) for name, losses in runs.items()}
    print(f"{args.model}, {args.steps} steps, lr {args.lr}: mean loss of the last {LAST} steps")
    gaps = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        fp32, other = tail[f"fp32/seed{seed}"], tail[f"{args.states}/seed{seed}"]
        gaps[seed] = (other - fp32) / fp32
        print(f"  seed {seed}: fp32 {fp32:.4f}, {args.states} {other:.4f}: {100 * gaps[seed]:+.2f}%")
    fp32_tails = [tail[name] for name in tail if name.startswith("fp32/")]
    if len(fp32_tails) > 1:
        print(f"  fp32 across seeds: {100 * (max(fp32_tails) - min(fp32_tails)) / min(fp32_tails):.2f}% apart")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "losses": runs, "tail": tail, "gap": gaps}, f, indent=1)


if __name__ == "__main__":
    main()
