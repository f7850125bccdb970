"""One rank of the data-parallel checkpoint test (run by test_checkpoint.py under mpirun, or alone).

save: TinyGPT from seed 0 trains 3 steps on this rank's share of each batch, saves a checkpoint under
ROOT, trains 3 more (save-async: the save written while they run, waited for by close()). load: TinyGPT from seed 1 loads ROOT and trains the same 3 more. Either way rank 0
writes the last 3 steps' mean losses over the ranks and the final fp32 masters to OUT.
"""

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import strata  # noqa: E402
from models import TinyGPT, batches  # noqa: E402


def main(phase, root, nvme_dir, out, shard_params):
    torch.manual_seed(0 if phase == "save" else 1)
    config = {"optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
              "device": {"backend": "emulated", "budget": 96 * 1024}, "host": {"budget": 192 * 1024},
              "nvme": {"dirs": [nvme_dir], "capacity": "16MiB"}, "chunk": {"size_elems": 4096},
              "non_model_memory": 0, "log": {"level": "error"},
              "comm": {"timeout_ms": 20000, "shard_params": shard_params}}
    engine = strata.initialize(TinyGPT(), config)
    data = list(batches(6, batch=8))
    share = 8 // engine.world_size

    def train(steps):
        losses = []
        for tokens in steps:
            mine = tokens[engine.rank * share:(engine.rank + 1) * share]
            loss = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(loss)
            engine.step()
            total = engine.comm.all_reduce_sum([loss.item()])[0] if engine.world_size > 1 else loss.item()
            losses.append(total / engine.world_size)
        return losses

    if phase.startswith("save"):
        train(data[:3])
        assert engine.save_checkpoint(root, asynchronous=phase == "save-async") is None or phase == "save"
    else:
        engine.load_checkpoint(root)
    losses = train(data[3:])
    final = engine.state_dict(master=True)
    engine.close()
    if engine.rank == 0:
        torch.save({"losses": losses, "final": final}, out)
    del engine
    gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:])
