"""One rank of the data-parallel tests (run by test_data_parallel.py under mpirun).

Trains TinyGPT with strata on this rank's share of every batch. Rank 0
writes the per-step mean loss over the ranks, the parameters at the start
and at the end (the fp32 masters, gathered from every rank's shard, under
bf16), and each rank its bytes of each chunk kind and its communication.
DP_SHARD_PARAMS=true in the environment shards the parameters too (comm.shard_params);
DP_FREEZE=NAME freezes the parameters whose names start with NAME;
DP_TRAIN_STEP=standard|layered trains each batch by engine.train_step, in
`accumulation` micro-batches of that order; DP_DEVICE_BUDGET sets the device's bytes, DP_OVERLAP
optimizer.overlap, DP_CLIP gradient_clipping and DP_STATES optimizer.states. DP_NO_CLOSE=1
leaves the engine to the exit hooks, as a script that never closes it does.
With a step to die at, the last rank kills itself there (or hangs, with
DP_WORKER_HANG set) and every other rank writes the error its step raised.
"""

import gc
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import strata  # noqa: E402
from models import batches, pair  # noqa: E402


def main(out, nvme_dir, steps, batch, precision, die_at_step, accumulation):
    model, _ = pair()
    for name, param in model.named_parameters():
        if os.environ.get("DP_FREEZE") and name.startswith(os.environ["DP_FREEZE"]):
            param.requires_grad_(False)
    config = {"optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
              "device": {"backend": "emulated", "budget": int(os.environ.get("DP_DEVICE_BUDGET", 96 * 1024))}, "host": {"budget": 192 * 1024},
              "nvme": {"dirs": [nvme_dir], "capacity": "16MiB"}, "chunk": {"size_elems": 4096},
              "precision": precision, "non_model_memory": 0, "log": {"level": "error"},
              "comm": {"timeout_ms": 2000, "shard_params": os.environ.get("DP_SHARD_PARAMS", "false")},
              "gradient_accumulation_steps": accumulation}
    config["optimizer"]["overlap"] = int(os.environ.get("DP_OVERLAP", 0))
    config["optimizer"]["states"] = os.environ.get("DP_STATES", "fp32")
    if os.environ.get("DP_CLIP"):
        config["gradient_clipping"] = float(os.environ["DP_CLIP"])
    engine = strata.initialize(model, config)
    initial = engine.state_dict(master=True)  # every rank: the masters are gathered
    share = batch // engine.world_size
    losses = []
    grad_chunks = [c["id"] for c in engine.engine.chunks() if c["kind"] == "grad"]
    reduced_in_backward = []  # per step: grad chunks whose reduction began before step()
    overlapped = []  # per step: groups updated in backward (confirmed, redone)
    for step, tokens in enumerate(batches(steps, batch=batch)):
        mine = tokens[engine.rank * share:(engine.rank + 1) * share]
        if os.environ.get("DP_TRAIN_STEP"):  # the whole step, its micro-batches in that order
            loss = engine.train_step(mine.chunk(accumulation), lambda m, t: m(t[:, :-1], t[:, 1:]),
                                     accumulation=os.environ["DP_TRAIN_STEP"]).mean()
            losses.append(engine.comm.all_reduce_sum([loss.item()])[0] / engine.world_size)
            continue
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        if step == die_at_step and engine.rank == engine.world_size - 1:
            if os.environ.get("DP_WORKER_HANG"):  # hangs instead (torchrun's agent would kill the others)
                time.sleep(120)
            os.kill(os.getpid(), signal.SIGKILL)  # the last rank dies before its step's collectives
        if engine._grad_sync.reducer is not None and (step + 1) % accumulation == 0:
            reduced_in_backward.append(sum(engine._grad_sync.reducer.submitted(c) for c in grad_chunks))
        start = time.monotonic()
        try:
            engine.step()
        except RuntimeError as error:  # what a surviving rank sees
            with open(f"{out}.rank{engine.rank}.error", "w") as f:
                json.dump({"error": str(error), "seconds": time.monotonic() - start}, f)
            # torchrun's agent ends every worker once one exits: a survivor the load made slower
            # than this one would be ended before it wrote its error. Wait (a while) for theirs.
            others = [f"{out}.rank{r}.error" for r in range(engine.world_size - 1)]
            deadline = time.monotonic() + 30
            while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(3)
        losses.append(engine.comm.all_reduce_sum([loss.item()])[0] / engine.world_size)
        overlapped.append([engine.last_step.get("overlap_groups", 0), engine.last_step.get("redone_groups", 0)])
    final = engine.state_dict(master=True)
    final_compute = engine.state_dict()  # sharded params: read from the gathered masters too
    with torch.no_grad():  # an evaluation forward: chunks pinned outside the pipeline (and gathered)
        eval_tokens = next(iter(batches(1, batch=batch)))
        eval_loss = engine(eval_tokens[:, :-1], eval_tokens[:, 1:]).item()
    tiers_of_kind = engine.chunk_tiers()
    bytes_of_kind = {kind: sum(tiers.values()) for kind, tiers in tiers_of_kind.items()}
    stored_of_kind = {kind: tiers.get("host", 0) + tiers.get("nvme", 0) for kind, tiers in tiers_of_kind.items()}
    with open(f"{out}.rank{engine.rank}.json", "w") as f:
        json.dump({"bytes_of_kind": bytes_of_kind, "stored_of_kind": stored_of_kind,
                   "chunks": engine.engine.chunks(), "comm": engine.stats().get("comm"),
                   "grad_chunks": len(grad_chunks), "reduced_in_backward": reduced_in_backward,
                   "overlapped": overlapped,
                   "device_index": int(engine.config.options.describe()["device.index"])}, f)
    if not os.environ.get("DP_NO_CLOSE"):
        engine.close()  # the collectives in flight done and the reducer stopped before the process ends
    if engine.rank == 0:
        torch.save({"initial": initial, "final": final, "final_compute": final_compute}, out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump({"losses": losses, "world": engine.world_size, "eval_loss": eval_loss}, f)
    if not os.environ.get("DP_NO_CLOSE"):  # freed here, on the main thread, as a tidy script does
        del engine
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "fp32",
         int(sys.argv[6]) if len(sys.argv) > 6 else -1, int(sys.argv[7]) if len(sys.argv) > 7 else 1)
