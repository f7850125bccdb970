"""The PyTorch adapter: an unmodified ``torch.nn.Module`` whose parameters,
gradients and optimizer states live in strata's chunks.

    engine = strata.initialize(model, config)
    loss = engine(batch)          # or model(batch): the hooks are on the model
    engine.backward(loss)
    engine.step()                 # optimizer step (every gradient_accumulation_steps micro-batches)
    losses = engine.train_step(micro_batches, loss_fn)  # or a whole step: standard or layered (strata.layered)
    engine.close()                # every tier's memory and files given back (or: with strata.initialize(...) as engine)

engine.optimizer is that step as a torch.optim.Optimizer (strata.optimizer): its
param_groups hold each group's lr, weight decay, ..., which a torch.optim.lr_scheduler
may drive.

How it works (one training iteration = forward and backward of every
micro-batch, then the step, is one iteration of the engine's pipeline):

- At ``initialize`` every parameter is registered (shared ones once, frozen
  ones as frozen; strata.params), its values are copied into its param chunk
  (and into the fp32 master chunk under bf16/fp16; strata.weights), and it
  becomes *held* (strata.state): its ``.data`` a placeholder of its shape
  with no storage, and reading its values outside forward and backward an
  error naming ``engine.gathered()``; ``model.state_dict()`` and
  ``model.load_state_dict()`` read and write the chunks.
- Forward and backward: hooks on the model (strata.hooks) begin a moment of
  the pipeline for each module and pin its parameters' chunks where the model
  computes (strata.moments); gradients are added into their grad chunks as
  autograd accumulates them, and data parallel, reduced over the ranks as the
  grad chunks complete (strata.grad_sync).
- Step: gradient norm over the grad chunks, then one host moment per chunk
  group (strata's optimizer, where the group's states are), grads zeroed.

Forwards without autograd (``torch.no_grad()``: evaluation, generation) pin
chunks directly, outside the pipeline, so they do not disturb the plan; an
``eval()`` forward with autograd on is a training-like pass and goes through it.

TrainingEngine is the façade over these parts: strata.runtime (the C++
engine, the group, the device), the parameter table, moments, hooks,
gradient sync, weights and checkpoints (strata.checkpoint).
"""

import contextlib
import json
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint

from . import _strata
from ._strata import parse_size
from .checkpoint import Checkpoints
from .config import accumulation_mode, load_config
from .grad_sync import GradSync
from .hooks import Hooks
from .layered import LayeredForwards, LayeredTimeout, autograd_order_problem, checked_loss, find_blocks, scaled_loss
from .moments import Moments
from .optimizer import Optimizer, keys_of, param_groups_of, write_groups
from .overlap import Overlap
from .params import ParamTable
from .runtime import CLOSED as _CLOSED, open_runtime
from .state import ModelState
from .weights import Weights


def initialize(model, config=None, weights=None, param_groups=None):
    """Moves `model`'s parameters into strata's chunks and returns the Engine that trains it.

    `config`: a dict, the path of a JSON file, or None for the defaults (see strata.load_config).
    `weights`: the parameters' initial values instead of the model's own (engine.load_weights: a
    safetensors file, a PyTorch state dict or its file), streamed into the chunks; the model may then
    be built on the meta device (`with torch.device("meta"): model = Net()`), never materialized.
    `param_groups`: the optimizer's param groups as torch.optim takes them (a list of dicts with 'params':
    nn.Parameters or their names, and the group's own lr, weight_decay, ...; the config's optimizer.* for the
    rest); every trainable parameter in exactly one. None: the config's optimizer.no_decay rule, or one group.
    engine.optimizer is the torch.optim.Optimizer over them (strata.optimizer).
    """
    return TrainingEngine(model, config, weights, param_groups)


_LOAD_FAILED = "a load failed part way"

# Set on every module of a model an engine took: its parameters are then
# placeholders whose values live in that engine's chunks.
_HELD = "_strata_held"


def _refuse_closed(module, args):
    """The forward pre-hook a closed engine leaves on its model."""
    raise RuntimeError(f"strata: this model cannot run: {_CLOSED}")


def _refuse_held(model):
    for name, module in model.named_modules():
        if module.__dict__.get(_HELD, False):
            where = f"its module '{name}'" if name else "it"
            raise ValueError(
                f"strata.initialize: the model is already held by a strata engine ({where} was given to "
                "strata.initialize before): its parameters are placeholders whose values live in that engine's "
                "chunks. Train it through that engine (engine.state_dict() gives the values), or build a fresh model")


class _PhaseClock:
    """A step's phases: each lap's seconds under its name."""

    def __init__(self):
        self.start = self._last = time.perf_counter()
        self.phases = {}

    def lap(self, name):
        """The seconds since the last lap are `name`'s."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def split(self, name, parts):
        """A lap whose seconds `parts` (name: seconds) account for; what they leave is `name`_other's. A part
        named as an earlier lap adds to it (the step's wait for the overlapped updates after the adapter's)."""
        self.lap(name)
        self.phases[name + "_other"] = self.phases.pop(name) - sum(parts.values())
        for part, seconds in parts.items():
            self.phases[part] = self.phases.get(part, 0.0) + seconds

    def seconds(self):
        return time.perf_counter() - self.start


@dataclass
class _Progress:
    """Where training stands between the public calls."""

    micro_steps: int = 0                           # backwards since the last step
    last_step: dict = field(default_factory=dict)  # the last step's report (train_step's, with seconds)
    broken: str = None                             # why training cannot go on (a step or backward that failed part way)
    syncs_at_step: int = 0                         # the runtime's host synchronizations when the last step ended
    step_size: int = 0                             # a train_step's micro-batches while it runs, or after its step failed


class TrainingEngine:
    """A model whose states live in strata's tiers: forward, backward, step, stats."""

    def __init__(self, model, config=None, weights=None, param_groups=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        _refuse_held(model)
        self._closed = False
        self.config = load_config(config)
        self.module = model
        self.gradient_accumulation_steps = self.config.gradient_accumulation_steps
        runtime = self._runtime = open_runtime(self.config)
        self.precision, self.dtype, self.device = runtime.precision, runtime.dtype, runtime.device
        self.rank, self.world_size = runtime.rank, runtime.world_size
        group_options, group_of = param_groups_of(model, param_groups, self.config)
        table = self._table = ParamTable(model, runtime.engine, runtime.precision, group_of)
        in_group = [group_of.get(id(r.param), 0) for r in table.records]  # before _take replaces meta parameters
        # Everything that can refuse the configuration before the model is touched.
        self._pipeline = _strata.Pipeline(runtime.engine, device_bytes=runtime.plan_device_bytes())
        self._optimizer = _strata.Optimizer(self.config.options, len(group_options))
        _strata.check_step_room(runtime.engine, self._optimizer)
        self._progress = _Progress()
        self._layered = None  # strata.layered.LayeredForwards, made by the first layered train_step
        self.accumulation_blocks = None  # the name of the blocks a layered step found
        self._grad_sync = GradSync(runtime, table)
        overlap_on = parse_size(self.config.options.describe()["optimizer.overlap"]) > 0
        self._overlap = Overlap(runtime, table, self._pipeline, self._optimizer, overlap_on)
        self._moments = Moments(runtime, table, self._pipeline, self._grad_sync, self.config.non_model_memory)
        self._moments.overlap = self._overlap if self._overlap.on else None
        self._hooks = Hooks(runtime, table, self._moments, self._grad_sync, self._check_usable,
                            self._moments.overlap)
        self._weights = Weights(runtime, table, model, self._grad_sync)
        self._state = ModelState(runtime, table, self._weights)
        self._checkpoints = Checkpoints(runtime, table, self._optimizer)
        kind = self.config.options.describe()["optimizer.kind"]
        defaults = self._optimizer.group(0)  # the config's values, before any group's are set
        write_groups(self._optimizer, keys_of(kind), group_options)  # a bad value refused here, the model untouched
        self._take(model, weights)
        groups = [{**options, "params": [r.param for r, g in zip(table.records, in_group) if r.trainable and g == i]}
                  for i, options in enumerate(group_options)]
        self.optimizer = Optimizer(self, groups, self._optimizer, kind, defaults)

    def _take(self, model, weights):
        """The model's values into the chunks (or the weights'), its storage dropped, its hooks set."""
        if weights is None:
            self._weights.write(self._weights.model_values())
        self._hooks.take_storage(model, self._state.hold)
        for module in model.modules():  # its parameters are placeholders from here on
            module.__dict__[_HELD] = True
        self._weights.place_buffers()
        self._grad_sync.start()
        self._overlap.start(self._grad_sync.reducer)
        self._hooks.install(model)
        self._state.install(model, self._load)
        if weights is not None:
            self.load_weights(weights)
        self._weights.check_buffers()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        self.close()
        return False

    # --- training ------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def backward(self, loss, average=True):
        """Backward of `loss` (scaled by 1 / gradient_accumulation_steps, and by the loss scale under fp16).
        average=False leaves out the 1 / gradient_accumulation_steps: for a loss that is already its
        micro-batch's share of the step's (as the Hugging Face Trainer's is)."""
        self._check_usable()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward: loss must be a tensor with one element")
        scale = self._loss_scale(average)
        self._backward([scaled_loss(loss, scale)])

    def _loss_scale(self, average):
        """What a micro-batch's loss is multiplied by for its backward."""
        return self._optimizer.loss_scale / (self._steps_needed() if average else 1)

    def _backward(self, losses):
        """One backward of the micro-batches' scaled `losses` together (one, or a layered step's every one)."""
        before_step = self._progress.micro_steps + len(losses) >= self._steps_needed()
        self._grad_sync.begin_backward(before_step)
        self._overlap.begin_backward(before_step, saving=self._checkpoints.pending is not None)
        if self._overlap.active:
            # The values param_groups holds now (a scheduler stepped after the last step): the updates begun
            # in this backward use them; the step writes them again, and redoes the updates if they changed.
            self.optimizer.write_groups()
        self._moments.pin_error = None
        try:
            torch.autograd.backward(losses)
        except BaseException as error:
            self._hooks.recover()
            self._hooks.end_backward()
            self._overlap.discard()
            self._progress.broken = (f"a backward failed part way ({type(error).__name__}: {error}); the "
                                     "gradients are partial")
            pinning = self._moments.pin_error
            if isinstance(error, RuntimeError) and pinning is not None and str(pinning) in str(error):
                raise pinning from error  # as raised, not as the RuntimeError autograd made of it
            raise
        self._hooks.end_backward()
        self._overlap.leave_ready()  # the groups backward completed last are the step's
        self._progress.micro_steps += len(losses)

    def _steps_needed(self):
        """Backwards (micro-batches) a step takes: a train_step's micro-batches, or gradient_accumulation_steps."""
        return self._progress.step_size or self.gradient_accumulation_steps

    def train_step(self, micro_batches, loss_fn, accumulation=None, average=True):
        """One whole optimizer step over `micro_batches`: loss_fn(model, micro_batch) is each one's loss (a tensor
        of one element), the gradients are accumulated over them all, then the step (engine.optimizer.step()).
        Returns the losses, a tensor of one per micro-batch (detached: reading it waits for the device).
        last_step has the step's accumulation, micro_batches, moved_bytes (each link's, forward to step),
        boundary_bytes (the blocks' inputs a layered step held for backward), boundary_host_bytes (of which on
        the host: accumulation_offload) and boundary_fetched_ahead (recomputations whose inputs were back on the
        device ahead of them).

        `accumulation` (default: the config's): "standard" runs each micro-batch's forward and backward in turn;
        "layered" runs every micro-batch through each of the model's repeated blocks before any enters the next,
        then one backward over them all, block by block, so that each block's chunks move once a step, not once
        a micro-batch (strata.layered: the blocks found, the cost in held activations). Both give the same
        result, within rounding. average=False: each loss is already its share of the step's (not divided by the
        number of micro-batches). Between steps; gradient_accumulation_steps does not apply."""
        mode = accumulation_mode(self.config.accumulation if accumulation is None else accumulation,
                                 "engine.train_step: accumulation")
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("engine.train_step: micro_batches is empty; give at least one")
        self._check_usable()
        if self._progress.micro_steps:  # a forward alone (one that failed, an evaluation) may have run
            raise RuntimeError("engine.train_step: between steps only: backwards since the last step are in "
                               "(engine.step() finishes that step)")
        if mode == "layered" and (problem := autograd_order_problem()) is not None:
            warnings.warn(f"strata: layered accumulation runs the blocks' backward in autograd's order, and this "
                          f"PyTorch ({torch.__version__}) orders otherwise: {problem}. The step runs in the "
                          "standard order (the same result; the blocks' chunks move once a micro-batch)",
                          stacklevel=2)
            mode = "standard"
        forwards = self._layered_forwards() if mode == "layered" else None  # refuses a model without blocks
        self._progress.step_size = len(micro_batches)
        moved = self._moved_bytes()
        try:
            if forwards is not None:
                try:
                    losses, scaled = forwards.run(self.module, micro_batches, loss_fn, self._loss_scale(average))
                except LayeredTimeout as error:
                    self._progress.broken = f"a layered forward was given up on ({error})"
                    raise
                try:
                    self._backward(scaled)
                except torch.utils.checkpoint.CheckpointError as error:
                    raise RuntimeError(f"{error}\nstrata: a layered step checkpoints each block itself; where the "
                                       "model checkpoints its blocks too (non-reentrant), set the config's "
                                       "accumulation_checkpoint to false") from error
                finally:
                    forwards.held.clear()  # the inputs held on the host, and any copied back not used
            else:
                losses = self._standard_backwards(micro_batches, loss_fn, average)
            self.optimizer.step()
        finally:
            if not self._progress.micro_steps:  # else a step that failed: engine.step() may finish it
                self._progress.step_size = 0
        self._progress.last_step.update({
            "accumulation": mode, "micro_batches": len(micro_batches),
            "boundary_bytes": forwards.boundary_bytes if forwards else 0,
            "boundary_host_bytes": forwards.offloaded_bytes if forwards else 0,
            "boundary_fetched_ahead": forwards.held.fetched_ahead if forwards else 0,
            "moved_bytes": {link: count - moved.get(link, 0) for link, count in self._moved_bytes().items()}})
        return torch.stack([loss.detach() for loss in losses])

    def _standard_backwards(self, micro_batches, loss_fn, average):
        """Each micro-batch's forward and backward in turn; their losses. One that fails after a backward leaves
        the gradients partial: training cannot go on."""
        losses, scale = [], self._loss_scale(average)
        for m, micro_batch in enumerate(micro_batches):
            try:
                losses.append(checked_loss(loss_fn(self.module, micro_batch), m))
            except BaseException as error:
                if m > 0:
                    self._progress.broken = (f"a train_step failed at micro-batch {m} ({type(error).__name__}: "
                                             f"{error}); the gradients of the micro-batches before it are in")
                raise
            self._backward([scaled_loss(losses[-1], scale)])
        return losses

    def _moved_bytes(self):
        """Bytes moved over each link between tiers so far."""
        return {link: figures["bytes"] for link, figures in self._runtime.engine.stats()["links"].items()}

    def _layered_forwards(self):
        if self._layered is None:
            name, blocks = find_blocks(self.module, self.config.accumulation_blocks)
            self._layered = LayeredForwards(self._hooks, blocks, self.config.accumulation_checkpoint,
                                            self.config.accumulation_offload, self.device,
                                            self.config.wait_timeout_seconds())
            self.accumulation_blocks = name
        return self._layered

    def step(self):
        """The optimizer step once gradient_accumulation_steps backwards are in; returns whether it stepped. It goes
        through engine.optimizer.step(), where a torch.optim.lr_scheduler counts the optimizer's steps (it warns of
        a schedule stepped before its optimizer otherwise)."""
        self.optimizer.step()
        return self.optimizer._stepped

    def _step(self):
        """step()'s work: the update once gradient_accumulation_steps backwards are in; whether it ran."""
        self._check_usable()
        self._hooks.end_backward()
        if self._progress.micro_steps < self._steps_needed():
            return False
        if not self._moments.in_iteration:
            raise RuntimeError("engine.step: no training forward and backward since the last step")
        clock = _PhaseClock()
        try:
            self._overlap.wait()  # no overlapped update runs while the values change
        except BaseException as error:
            self._progress.broken = f"an overlapped update failed ({type(error).__name__}: {error})"
            self._overlap.discard()
            self._moments.end_iteration()
            raise
        clock.lap("overlap_wait")
        self.optimizer.write_groups()  # the values param_groups holds now (a bad one refused: nothing changed)
        records = self._table.records
        try:
            self._runtime.synchronize()
            self._moments.end_moment()
            stepped = [float(r.stepped) for r in records]
            if self._runtime.parallel:
                stepped = self._grad_sync.reduce_rest(stepped, self._overlap.late)
            skip = [r.tensor_id for r, s in zip(records, stepped) if r.trainable and s == 0]
            mark = self._grad_sync.comm_total()  # see GradSync.step_bytes
            clock.lap("backward_end")
            # An asynchronous save reads each group out before its update changes it.
            report = self._table.checked(
                _strata.train_step, self._runtime.engine, self._pipeline, self._optimizer, skip, self._runtime.comm,
                self._grad_sync.reducer, self._checkpoints.pending, self._runtime.stream(), self._overlap.updates)
            clock.split("train_step", report.pop("phases"))
            self._progress.last_step = report
        except BaseException as error:
            self._progress.broken = (f"a step failed part way ({type(error).__name__}: {error}); some chunk "
                                     "groups are updated and others not")
            self._overlap.discard()
            raise
        finally:
            self._overlap.stepped()  # train_step took them (or failed: the engine is broken)
            self._moments.end_iteration()
        clock.lap("end_iteration")
        for record in records:
            record.stepped = False
        self._progress.last_step["seconds"] = clock.seconds()
        self._progress.last_step["phases"] = clock.phases
        syncs = self._runtime.syncs[0]
        self._progress.last_step["host_syncs"] = syncs - self._progress.syncs_at_step
        self._progress.syncs_at_step = syncs
        if self._runtime.parallel:
            self._progress.last_step["comm_bytes"] = self._grad_sync.step_bytes(mark)
        self._progress.micro_steps = 0
        self._progress.step_size = 0
        return True

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"strata: {_CLOSED}")

    def _check_usable(self):
        self._check_open()
        if self._state.gathering is not None:
            raise RuntimeError("strata: engine.gathered() is open: the model cannot run forward, backward, a step, a "
                               "save or a load inside it (its parameters hold copies there); leave the block first")
        if self._progress.broken is None and self._overlap.failed is not None:
            self._progress.broken = self._overlap.failed
        if self._progress.broken is not None:
            raise RuntimeError(f"strata: training cannot go on: {self._progress.broken}. Start again from the "
                               "model's initial or saved state")

    def _check_between_steps(self, what, usable=True):
        self._check_open()
        if usable:
            self._check_usable()
        if self._moments.in_iteration or self._progress.micro_steps:
            raise RuntimeError(f"engine.{what}: between steps only (after step(), before the next training "
                               "forward): a backward is in progress")

    def _loadable(self):
        """A load is how an engine whose last load failed part way becomes usable again."""
        return self._progress.broken is None or not self._progress.broken.startswith(_LOAD_FAILED)

    # --- what it did -------------------------------------------------------------

    @property
    def last_step(self):
        """The last step's report (stats()'s "last_step"), without gathering the rest of stats()."""
        return dict(self._progress.last_step)

    def stats(self):
        """Tier usage and peaks, bytes moved per link, the pipeline's stall time, the last step (with its
        host_syncs: the times the adapter waited for the device since the step before; host_syncs in all;
        fence_waits: moves that waited for the GPU to finish with a chunk torch let go)."""
        self._check_open()
        stats = self._runtime.engine.stats()
        pipeline = json.loads(self._pipeline.stats_json())
        stats["pipeline"] = pipeline
        stats["stall_seconds"] = pipeline.get("stall_seconds", 0.0)
        stats["last_step"] = self.last_step
        stats["host_syncs"] = self._runtime.syncs[0]
        stats["steps"] = self._optimizer.steps_taken
        stats["loss_scale"] = self._optimizer.loss_scale
        stats["timeline"] = self._pipeline.timeline(self._runtime.engine)
        stats["chunk_tiers"] = self.chunk_tiers()
        if self._runtime.parallel:
            stats["comm"] = self.comm_stats()
        return stats

    def comm_stats(self):
        """Data parallel: what this rank's collectives carried, beside ZeRO-3's volume for this model.

        Bytes are those this rank sends under the ring algorithm. ZeRO-3 sends
        3 x the parameters in the compute dtype x (W - 1) / W a step (gathered
        in forward and in backward, gradients reduce-scattered; a frozen
        parameter has no gradient, so 2 x for it). By default
        strata keeps parameters whole on every rank, so a step sends the
        gradients (fp32) reduce-scattered and the updated parameters gathered
        once; with comm.shard_params each param chunk is gathered when a
        module needs it (in forward, and again in backward unless it is one
        of the last two gathered), as ZeRO-3 does.
        """
        self._check_open()
        out = self._runtime.comm.stats()
        width = torch.finfo(self.dtype).bits // 8
        model_bytes = sum(r.numel for r in self._table.records) * width
        trainable_bytes = sum(r.numel for r in self._table.records if r.trainable) * width
        out["model_bytes"] = model_bytes
        out["zero3_bytes_per_step"] = (2 * model_bytes + trainable_bytes) * (self.world_size - 1) // self.world_size
        out["last_step_bytes"] = self._progress.last_step.get("comm_bytes", 0)
        out["param_gathers"], out["param_gathers_ahead"], out["param_gathers_filled_ahead"] = \
            self._grad_sync.gather_counts()
        return out

    def chunk_tiers(self):
        """Bytes of each chunk kind on each tier now: {kind: {tier: bytes}}."""
        self._check_open()
        out = {}
        for chunk in self._table.chunks:
            kinds = out.setdefault(chunk["kind"], {})
            tier = self._runtime.engine.chunk_tier(chunk["id"])
            if tier is None:  # no payload yet: where it will be; a dropped gathered chunk is nowhere
                if chunk["transient"]:
                    continue
                tier = chunk["home"]
            kinds[tier] = kinds.get(tier, 0) + chunk["size_bytes"]
        return out

    # --- weights -------------------------------------------------------------------

    def state_dict(self, master=False):
        """A copy of every parameter (compute dtype; fp32 masters with master=True under bf16/fp16), by its
        registered name (a tied parameter once; model.state_dict() has torch's keys and the buffers).

        Read from wherever each chunk is, without moving it. Data parallel,
        each rank holds a shard of the masters: master=True gathers them, so
        every rank must call it (with comm.shard_params, always: the masters
        are the only stored copy of the parameters).
        """
        self._check_open()
        self._overlap.wait()  # read after the overlapped updates, not during them
        return self._weights.state_dict(master)

    def export_safetensors(self, path, fp32=False):
        """Writes every parameter to a safetensors file at `path` under its name in the model, in the
        compute dtype, or in fp32 (the fp32 masters under bf16/fp16), chunk by chunk from wherever each
        lies; the file is written beside `path` and renamed into place. Buffers are not included. Data
        parallel, every rank calls it (the masters' shards are gathered) and rank 0 writes. Returns a
        dict: path, tensors, bytes."""
        self._check_between_steps("export_safetensors")
        self._grad_sync.drain()
        return self._weights.export_safetensors(path, fp32)

    def load_weights(self, source, strict=True):
        """Sets the parameters (and buffers) from `source`: a safetensors file (read tensor by tensor
        straight into the chunks), a directory save_pretrained wrote (its model.safetensors, its shards by
        model.safetensors.index.json, or its pytorch_model.bin), a PyTorch state dict, or a file torch.load
        reads (memory-mapped, so that its tensors are read as they are copied). The parameters' fp32 masters
        are set from the values as given; optimizer states are left as they are (this is how a model
        starts, or takes new weights). Names are the model's: a tied parameter, or a shared module's
        buffer, may come under any of its names (model.state_dict() holds each). strict=True: every
        parameter must be in `source`, and nothing else but buffers; a shape that differs, or a tensor
        that cannot be read, is always an error; all are raised before anything is set. Between steps.
        Data parallel, each rank reads `source` itself and the ranks agree: all raise or none does. A
        load that fails once setting has begun leaves the model partly set: training then raises until
        a load succeeds. Returns a dict: tensors (parameters set), missing (parameters left as they
        were), unused (names not taken)."""
        return self._load("load_weights", lambda: self._weights.plan(source, strict), self._weights.apply).result

    def _load(self, what, plan, apply):
        """Sets parameter values between steps: `plan()` makes every check and read that can refuse, before
        anything is set, and returns what `apply(planned)` sets; data parallel, the ranks agree after each.
        Returns the plan."""
        self._check_between_steps(what, usable=self._loadable())
        self._grad_sync.drain()
        self.wait_checkpoint()
        planned, error = None, None
        try:
            planned = plan()
        except Exception as failed:  # noqa: BLE001 (agreed with the other ranks, then raised)
            error = failed
        self._runtime.agree(error, what)
        try:
            apply(planned)
        except BaseException as failed:
            error = failed
            self._progress.broken = (f"{_LOAD_FAILED} ({what}: {type(failed).__name__}: {failed}); load weights or "
                                     "a checkpoint that loads")
        finally:
            self._grad_sync.release_gathered()  # gathered parameters are of the masters before
        self._runtime.agree(error, what)
        self._progress.broken = None
        return planned

    @contextlib.contextmanager
    def gathered(self, params=None):
        """Inside `with engine.gathered():` every parameter (or those of `params`: a module, a parameter, or
        an iterable of them) holds its real values: .data is a full tensor on the compute device, in the compute
        dtype, free to read and to change in place (p.mul_(0.5), p.copy_(x), nn.init.*). On leaving, even by an
        exception, the parameters that changed are written into their chunks, and under bf16/fp16 into their
        fp32 masters the elements that changed (the others keep their fp32 values); the copies are dropped. It
        costs a copy of the parameters it holds, beside the budgets, and a second read of them to find what
        changed. Between steps; no forward, backward, step, save or load inside. Data parallel, every rank
        calls it and makes the same changes."""
        self._check_between_steps("gathered")
        self._grad_sync.drain()
        self.wait_checkpoint()
        records = self._state.records_of(params)
        self._state.gather(records)
        try:
            yield
        finally:
            self._state.gathering = None
            try:
                self._load("gathered", lambda: self._state.changes(records), self._weights.write)
            finally:
                self._state.put_back(records)

    # --- checkpoints -----------------------------------------------------------------

    def save_checkpoint(self, path, keep_last=0, asynchronous=False, recycle=True):
        """Saves the training state under `path` as path/step-<N> (N: steps taken) and points path/latest at it.

        The parameters, the fp32 masters and the optimizer moments are written from whichever tier holds
        them (NVMe-resident ones without moving them), with the step count and the loss scaler's state,
        each file with its size and CRC32C in a manifest. Crash-safe: the checkpoint is published by a
        rename once complete, so the last published one stays intact until then. keep_last > 0 keeps only
        the newest keep_last checkpoints; with recycle (the default) the files of those it removes wait
        under path/.spare (at most one checkpoint's bytes) for the next save to write over, which on
        ext4 ran about twice as fast as writing new files. Between steps. Data parallel, every rank calls
        it with the same `path`, a directory every rank sees: each saves its shards, rank 0 publishes.
        Returns a dict: path, step, bytes, files, recycled (this rank's; recycled: files written over a
        spare).

        asynchronous=True returns at once (None) and writes the state as it is now while training goes on:
        each chunk group's update in a later step waits until the save is done with that group. The next save,
        load, wait_checkpoint() or close() waits for it and raises its error; at exit this rank's files
        are finished (and rank 0's publishing), without the ranks agreeing on the outcome.
        """
        self._check_between_steps("save_checkpoint")
        self._grad_sync.drain()
        self.wait_checkpoint()
        self.optimizer.write_groups()  # the values the next step would use are the ones saved
        return self._checkpoints.save(path, keep_last, asynchronous, recycle)

    def wait_checkpoint(self):
        """Waits for the asynchronous save in flight, if any, and returns its dict (else None); raises its
        error. Data parallel, every rank calls it at the same point."""
        self._check_open()
        if self._checkpoints.pending is None:
            return None
        self._grad_sync.drain()  # the reducer's collectives (gathers queued ahead) before the save's agreement
        return self._checkpoints.wait()

    def load_checkpoint(self, path, fall_back=False):
        """Loads a checkpoint: `path` is a root (its latest) or one checkpoint's directory.

        The model must be the one saved (same parameters, shapes, dtypes and chunk size) and the loss
        scaling the same. Every file's size and CRC32C is checked as it is read: a damaged checkpoint
        raises naming the file, and with fall_back=True the next older checkpoint under the root is
        loaded instead (the dict's "skipped" says which failed and why). Between steps. Data parallel,
        every rank calls it; a checkpoint saved by any number of ranks loads (each rank reads what covers
        its shards), and the ranks load the same one or all raise. A load that fails once it has begun
        reading leaves the state partly overwritten: training then raises until a load succeeds.
        Returns a dict: path, step, bytes, files, skipped.
        """
        self._check_between_steps("load_checkpoint", usable=self._loadable())
        self._grad_sync.drain()
        self.wait_checkpoint()
        try:
            loaded = self._checkpoints.load(path, fall_back)
        except ValueError:  # another model or optimizer: refused before anything was read
            raise
        except BaseException as error:
            self._progress.broken = f"{_LOAD_FAILED} ({type(error).__name__}: {error}); load a checkpoint that loads"
            raise
        finally:
            self._grad_sync.release_gathered()  # gathered parameters and gathers ahead are of the masters before
        self.optimizer.read_groups()
        self._progress.broken = None
        return loaded

    # --- the group ---------------------------------------------------------------------

    def close(self):
        """Ends the engine and gives every tier's memory and NVMe files back, here and now rather than when the
        engine and its model are collected: waits for an asynchronous save (raising its error) and, data
        parallel, for the collectives in flight (the gathers queued ahead for a forward that will not come
        included), stops the reducer's thread, lets go of every chunk and takes the engine's hooks off the model.
        Idempotent; ``with strata.initialize(...) as engine:`` calls it on leaving. Every rank calls it. After
        it, the engine's calls and the model's forward raise, saying it was closed: the parameters' values went
        with the tiers (engine.state_dict() or export_safetensors() before close() keeps them)."""
        if self._closed:
            return
        try:
            self._grad_sync.drain()
            self.wait_checkpoint()
        finally:
            self._release()

    def _release(self):
        """close()'s teardown: the parts that hold chunks let go of them and are dropped (the pipeline's pins
        with it), then the C++ engine releases the tiers. Nothing here waits on a collective, and nothing is let
        go while a layered forward given up on still runs (it raises, the engine open)."""
        if self._layered is not None:
            self._layered.close()  # its blocks' hooks off, its held inputs let go
        self._closed = True
        self._progress.broken = self._progress.broken or "the engine was closed"
        failed = []
        for let_go in (self._grad_sync.close,     # the reducer's thread stopped
                       self._overlap.discard,     # the overlapped updates done, their copies dropped
                       lambda: self._hooks.remove(self.module),  # every pin of forward and backward let go
                       self._moments.end_iteration, self.optimizer.close,
                       self._pipeline.drain):  # its queued moves end while the tiers are there
            try:
                let_go()
            except Exception as error:  # noqa: BLE001 (the rest is let go all the same; the first is raised)
                failed.append(error)
        self.module.register_forward_pre_hook(_refuse_closed)
        # Every part that may hold a pin or a buffer goes now, the pipeline's pins with it; what the model
        # keeps (its state_dict hooks) reaches only the closed engine.
        self._pipeline = self._optimizer = self._overlap = self._moments = self._hooks = None
        self._layered = self._checkpoints = self._grad_sync = None
        try:
            self._runtime.engine.close()
        except ValueError as error:  # a chunk pinned by a ChunkAccess held outside the engine
            raise RuntimeError(f"strata: engine.close(): {error}; the tiers are given back once it is released "
                               "and the engine collected") from error
        if failed:
            raise failed[0]

    @property
    def comm(self):
        """The data-parallel group's communicator (None alone), free for the caller's own collectives.

        The gradient reductions begun in backward run on a thread of their
        own; after the backward before a step, the rest are submitted and
        all are waited for first, since one communicator carries one
        collective at a time, in the same order on every rank.
        """
        self._check_open()
        return self._grad_sync.drained_comm()

    @property
    def engine(self):
        """The C++ engine (strata._strata.Engine): chunks, tiers."""
        self._check_open()
        return self._runtime.engine
