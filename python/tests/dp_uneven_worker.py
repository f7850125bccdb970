"""One rank of the uneven data-parallel test (run by test_data_parallel.py under mpirun).

Rank 0 runs every layer; the last rank skips the middle one (a layer of
another size) on even steps, as a conditional layer would. Each rank logs
the mean loss through engine.comm between backward and step, while its
gradient reductions may still be in flight. Rank 0 writes the losses and
every rank its final parameters. With DP_SHARD_PARAMS=true (parameters
sharded) the ranks' gathers differ and each rank writes the error it raised.
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import strata  # noqa: E402


class Uneven(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 64)
        self.l2 = torch.nn.Linear(64, 64, bias=False)
        self.l3 = torch.nn.Linear(64, 64)

    def forward(self, x, middle):
        h = torch.tanh(self.l1(x))
        if middle:
            h = torch.tanh(self.l2(h))
        return self.l3(h).pow(2).mean()


def uses_middle(rank, world, step):
    return rank != world - 1 or step % 2 == 1


def data(step, rank):
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * step + rank))


def main(out, steps):
    torch.manual_seed(0)
    model = Uneven()
    config = {"optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
              "device": {"backend": "emulated", "budget": 1 << 20}, "host": {"budget": 8 << 20},
              "chunk": {"size_elems": 4224}, "non_model_memory": 0, "log": {"level": "error"},
              "comm": {"timeout_ms": 5000, "shard_params": os.environ.get("DP_SHARD_PARAMS", "false")}}
    engine = strata.initialize(model, config)
    losses = []
    start = time.monotonic()
    for step in range(steps):
        try:
            loss = engine(data(step, engine.rank), uses_middle(engine.rank, engine.world_size, step))
            engine.backward(loss)
            losses.append(engine.comm.all_reduce_sum([loss.item()])[0] / engine.world_size)
            engine.step()
        except (RuntimeError, ValueError) as error:
            with open(f"{out}.rank{engine.rank}.error", "w") as f:
                json.dump({"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}, f)
            sys.exit(3)
    torch.save(engine.state_dict(), f"{out}.rank{engine.rank}.pt")
    if engine.rank == 0:
        with open(out + ".json", "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
