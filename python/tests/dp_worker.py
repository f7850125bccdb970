"""One rank of the data-parallel equivalence test (run by test_data_parallel.py under mpirun).

Trains TinyGPT with strata on this rank's share of every batch and, on rank 0,
writes the per-step mean loss over the ranks and the final parameters.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import strata  # noqa: E402
from models import batches, pair  # noqa: E402


def main(out, nvme_dir, steps, batch):
    model, _ = pair()
    config = {"optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
              "device": {"backend": "emulated", "budget": 96 * 1024}, "host": {"budget": 192 * 1024},
              "nvme": {"dirs": [nvme_dir], "capacity": "16MiB"}, "chunk": {"size_elems": 2048},
              "non_model_memory": 0, "log": {"level": "error"}}
    engine = strata.initialize(model, config)
    share = batch // engine.world_size
    losses = []
    for tokens in batches(steps, batch=batch):
        mine = tokens[engine.rank * share:(engine.rank + 1) * share]
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(engine.comm.all_reduce_sum([loss.item()])[0] / engine.world_size)
    if engine.rank == 0:
        torch.save(engine.state_dict(), out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump({"losses": losses, "world": engine.world_size}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
