"""The PyTorch adapter: an unmodified ``torch.nn.Module`` whose parameters,
gradients and optimizer states live in strata's chunks.

    engine = strata.initialize(model, config)
    loss = engine(batch)          # or model(batch): the hooks are on the model
    engine.backward(loss)
    engine.step()                 # optimizer step (every gradient_accumulation_steps micro-batches)

How it works (one training iteration = forward and backward of every
micro-batch, then the step, is one iteration of the engine's pipeline):

- At ``initialize`` every parameter is registered (shared ones once, frozen
  ones as frozen), its values are copied into its param chunk (and into the
  fp32 master chunk under bf16/fp16), and its ``.data`` becomes an empty
  placeholder: the model holds no parameter storage of its own.
- Forward: each module with parameters of its own begins a moment of the
  pipeline; its parameters' ``.data`` become views of their chunk on the
  device tier (pinned while the module runs; a parent's stay pinned through
  its children's moments, accessed again in each) and go back to the
  placeholder when the module returns.
- Backward: the module's outputs carry an identity autograd function whose
  backward begins the module's backward moment and pins its parameters again
  (torch 1.13 has no module backward pre-hook). Tensors autograd saves that
  are parameters or views of them are saved as (parameter, shape, strides,
  offset) and rebuilt on the chunk's current address when backward unpacks
  them, pinning it on demand if it is not; a chunk may move between forward
  and backward without a stale pointer anywhere.
- Gradients: when autograd has accumulated a parameter's gradient, it is
  added into the parameter's slot of its grad chunk and ``.grad`` is dropped.
- Step: gradient norm over the grad chunks, then one host moment per chunk
  group (strata's optimizer, where the group's states are), grads zeroed.

Forwards without autograd (``torch.no_grad()``: evaluation, generation) pin
chunks directly, outside the pipeline, so they do not disturb the plan; an
``eval()`` forward with autograd on is a training-like pass and goes through it.
"""

import atexit
import functools
import inspect
import json
import os
import re
import time
import weakref

import torch

from . import _strata, distributed
from .config import load_config

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors dtype names (those torch holds).
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _read_safetensors_tensor(path, entry):
    """One tensor of a safetensors file (an entry of _strata.safetensors_index), read alone."""
    if entry["dtype"] not in _SAFETENSORS_DTYPES:  # before reading its bytes
        raise ValueError(f"strata: {path}: dtype {entry['dtype']} is not one torch holds")
    with open(path, "rb") as f:
        f.seek(entry["offset"])
        raw = bytearray(f.read(entry["bytes"]))
    return torch.frombuffer(raw, dtype=_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _held_part(chunk, offset, numel, itemsize):
    """The part of a tensor (at byte `offset` of its group's whole chunk) that `chunk` holds.

    (lo, hi, at): its elements [lo, hi), found at byte `at` of the chunk; None
    when the chunk holds none of it (a data-parallel rank's shard of the
    masters holds only its own range of the group).
    """
    begin = chunk["shard_offset"]
    lo = max(0, (begin - offset) // itemsize)
    hi = min(numel, (begin + chunk["used_bytes"] - offset) // itemsize)
    if hi <= lo:
        return None
    return lo, hi, offset + lo * itemsize - begin


class _Param:
    """One registered parameter: where its copies live, and whether it is pinned now."""

    __slots__ = ("param", "name", "tensor_id", "shape", "numel", "trainable", "chunk", "offset", "grad_chunk",
                 "grad_offset", "master_chunk", "master_offset", "pins", "for_backward", "grad_arrived", "stepped")

    def __init__(self, param, name, tensor_id):
        self.param = param
        self.name = name
        self.tensor_id = tensor_id
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.trainable = param.requires_grad
        self.chunk = self.offset = None
        self.grad_chunk = self.grad_offset = None
        self.master_chunk = self.master_offset = None
        self.pins = 0               # materializations alive (forward nesting, backward)
        self.for_backward = False   # one of the pins is backward's
        self.grad_arrived = False   # since it was pinned for backward
        self.stepped = False        # a gradient arrived since the last step


class _CudaBytes:
    """A chunk pinned in GPU memory, as CUDA array interface bytes (kept alive by the tensor)."""

    def __init__(self, access):
        self.access = access

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.access.size_bytes,), "typestr": "|u1", "data": (self.access.address, False),
                "version": 2}


class _PreBackward(torch.autograd.Function):
    """Identity on a module's output; its backward begins the module's backward moment."""

    @staticmethod
    def forward(ctx, engine, module_index, tensor):
        ctx.engine = engine
        ctx.module_index = module_index
        # Not a view: the caller may change the output in place (ReLU(inplace=True)).
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.engine._pre_backward(ctx.module_index)
        return None, None, grad


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _grad_pre_hook(engine, record):
    def hook(grad):
        # AccumulateGrad shapes .grad like the parameter: pin it if backward has not.
        if record.pins == 0:
            engine._pin_for_backward(record)
        return None
    return hook


def _grad_hook(engine, record):
    def hook(*_):
        engine._grad_ready(record)
    return hook


_deferred_reducers = []


def _finish_save(pending):
    """At exit: this rank's files of an asynchronous save nobody waited for are finished (rank 0's
    publishing too). Holds the save weakly, so that an engine dropped meanwhile is freed."""
    pending = pending()
    if pending is not None:
        pending.wait_local()


def _close_reducer(reducer):
    """Closes an engine's reducer when the engine is collected or at exit. The garbage collector may
    run this on the reducer's own thread (inside a collective of a Python communicator), which the
    close would have to join: that reducer (and its engine) is kept and closed at exit instead."""
    if reducer.on_own_thread():
        _deferred_reducers.append(reducer)
        atexit.register(reducer.close)  # after MPI's atexit was registered, so before it runs
        return
    reducer.close()


def initialize(model, config=None, weights=None):
    """Moves `model`'s parameters into strata's chunks and returns the Engine that trains it.

    `config`: a dict, the path of a JSON file, or None for the defaults (see strata.load_config).
    `weights`: the parameters' initial values instead of the model's own (engine.load_weights: a
    safetensors file, a PyTorch state dict or its file), streamed into the chunks; the model may then
    be built on the meta device (`with torch.device("meta"): model = Net()`), never materialized.
    """
    return TrainingEngine(model, config, weights)


_LOAD_FAILED = "a checkpoint load failed part way"


class TrainingEngine:
    """A model whose states live in strata's tiers: forward, backward, step, stats."""

    def __init__(self, model, config=None, weights=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = load_config(config)
        options = self.config.options.describe()
        self.precision = options["precision"]
        self.dtype = _TORCH_DTYPES[self.precision]
        self.module = model
        self.gradient_accumulation_steps = self.config.gradient_accumulation_steps
        # Data parallel when mpirun or torchrun started the process: each rank
        # trains on its own batches, gradients are averaged over the ranks in step().
        timeout_ms = int(options["comm.timeout_ms"])
        self._comm = distributed.communicator(timeout_ms)
        self.rank = self._comm.rank if self._comm else 0
        self.world_size = self._comm.world_size if self._comm else 1
        # One GPU per process on a node: device.index left at 0 follows the
        # local rank, unless this process sees fewer GPUs (one each, as
        # SLURM's --gpus-per-task=1 or a per-process CUDA_VISIBLE_DEVICES gives).
        local = distributed.local_rank()
        if self.world_size > 1 and local is not None and int(options["device.index"]) == 0 and (
                options["device.backend"] == "emulated" or local < torch.cuda.device_count()):
            self.config.options.set("device.index", str(local))
        # On GPUs the host group (MPI or gloo) only bootstraps NCCL, which carries the collectives.
        self._bootstrap = None
        on_nccl = False
        if distributed.wants_nccl(options["comm.backend"], self.world_size, options["device.backend"]):
            nccl = distributed.nccl_communicator(self._comm, int(self.config.options.describe()["device.index"]),
                                                 timeout_ms, required=options["comm.backend"] == "nccl")
            if nccl is not None:  # None: ranks share a GPU (comm.backend auto), so the host group carries on
                self._bootstrap, self._comm, on_nccl = self._comm, nccl, True
        # Gradients take the data-parallel path with several ranks, and on NCCL with one (how that backend
        # runs on a single GPU); a single rank otherwise (mpirun -np 1) takes the plain one, which holds no
        # reduction buffers.
        self._parallel = self._comm is not None and (self.world_size > 1 or on_nccl)
        self._engine = _strata.Engine(self.config.options, self._comm)
        self._emulated = "emulated" in self._engine.describe_backends()
        # Where the model computes: the CPU for the emulated device (its memory is the host's).
        self.device = torch.device("cpu") if self._emulated else torch.device(
            "cuda", int(self.config.options.describe()["device.index"]))
        self._params = []
        self._by_param = {}  # id(nn.Parameter) -> _Param
        self._register(model)
        # Everything that can refuse the configuration before the model is touched.
        self._pipeline = _strata.Pipeline(self._engine)
        self._optimizer = _strata.Optimizer(self.config.options)
        self._copy_in(from_model=weights is None)
        for buffer in model.buffers():
            if buffer.is_meta:  # its value comes with the weights, below
                continue
            if self.world_size > 1:  # running statistics and the like: rank 0's too
                values = buffer.data.to("cpu", copy=True).contiguous()
                self._broadcast(values)
                buffer.data = values
            buffer.data = buffer.data.to(self.device)

        self._held = {}            # chunk id -> [ChunkAccess, params pinned in it]
        self._moment_chunks = {}   # chunk id -> ChunkAccess, grad chunks of the open moment
        self._in_iteration = False
        self._in_moment = False
        self._direct = False       # an evaluation forward: chunks pinned outside the pipeline
        self._active = []          # forward: stack of module indices running
        self._backward_params = []
        self._backward_pending = set()  # module indices whose outputs wait for their backward
        self._end_queued = False
        self._saved_hooks = []     # saved_tensors_hooks contexts entered by running modules
        self._saved_bytes = 0      # activations autograd holds (non-model memory estimate)
        self._micro_steps = 0
        self._timeline = []        # tier bytes at each moment of the current iteration
        self._last_timeline = []
        self._last_step = {}
        # Data parallel: a grad chunk's reduce-scatter starts as soon as all
        # its parameters' gradients are in, in the last backward before a
        # step, and runs beside the rest of backward.
        # Every rank submits the grad chunks in one fixed order (the last
        # group first, as backward completes them), each once it and all
        # before it in that order are complete; at the step the rest follow
        # in the same order. So the ranks' collectives line up even when a
        # parameter is used on some ranks only.
        self._reducer = _strata.GradReducer(self._engine, self._comm) if self._parallel else None
        self._closed_gathers = (0, 0, 0)  # the reducer's gather counts once close() has stopped it
        if self._reducer is not None:  # at exit, before MPI is finalized: no reduction left in flight
            weakref.finalize(self, _close_reducer, self._reducer)
        self._grad_chunk_params = {}  # grad chunk -> its trainable parameters
        for record in self._params:
            if record.trainable:
                self._grad_chunk_params[record.grad_chunk] = self._grad_chunk_params.get(record.grad_chunk, 0) + 1
        self._reduce_order = sorted(self._grad_chunk_params, key=lambda c: -self._chunk_info[c]["group"])
        self._reduce_position = {chunk: i for i, chunk in enumerate(self._reduce_order)}
        self._arrived = {}  # grad chunk -> ids of the parameters whose gradient came in this backward
        self._submitted = 0        # how many of _reduce_order this backward has submitted
        self._late = set()         # submitted grad chunks a gradient arrived in after (reduced again at the step)
        self._reducing = False     # this backward submits complete grad chunks to the reducer
        self._comm_mark = self._comm.stats()["total_bytes"] if self._parallel else 0
        self._broken = None        # why training cannot go on (a step or backward that failed part way)
        self._pending = None       # an asynchronous save still to be waited for
        self._pending_exit = None  # its exit hook
        self._save_delay_ms = 0    # tests: each chunk of an asynchronous save read out this much later
        self._hooks = []
        self._install_hooks(model)
        if weights is not None:
            self.load_weights(weights)
        for name, buffer in model.named_buffers():
            if buffer.is_meta:
                raise ValueError(f"strata.initialize: buffer {name} is on the meta device and the weights do not "
                                 "hold it (a buffer the model computes, such as rotary frequencies, must be made "
                                 "on a real device)")

    # --- set-up ------------------------------------------------------------

    def _register(self, model):
        owner = {}
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                owner.setdefault(id(p), (module_name, f"{module_name}.{name}" if module_name else name))
        if not owner:
            raise ValueError("strata.initialize: the model has no parameters")
        for _, p in model.named_parameters():
            module_name, full_name = owner[id(p)]
            if not p.dtype.is_floating_point:
                raise ValueError(f"strata.initialize: parameter {full_name} has dtype {p.dtype}; "
                                 "strata trains floating-point parameters only")
            shape = list(p.shape) if p.dim() > 0 else []
            tensor_id = self._engine.register_tensor(full_name, shape, self.precision, p.requires_grad, module_name)
            record = _Param(p, full_name, tensor_id)
            self._params.append(record)
            self._by_param[id(p)] = record
        self._engine.finalize()

        where = {}  # (tensor id, kind) -> (chunk, offset in the group's whole chunk)
        self._chunks = self._engine.chunks()
        self._chunk_info = {chunk["id"]: chunk for chunk in self._chunks}
        for chunk in self._chunks:
            for tensor, offset in zip(chunk["tensors"], chunk["tensor_offsets"]):
                where[(tensor, chunk["kind"])] = (chunk["id"], offset)
        for record in self._params:
            record.chunk, record.offset = where[(record.tensor_id, "param")]
            if record.trainable:
                record.grad_chunk, record.grad_offset = where[(record.tensor_id, "grad")]
            if (record.tensor_id, "master") in where:
                record.master_chunk, record.master_offset = where[(record.tensor_id, "master")]

    def _copy_in(self, from_model=True):
        """Writes the model's values into their chunks (unless the weights will) and drops its storage."""
        if from_model:
            values = {}
            for record in self._params:
                if record.param.is_meta:
                    raise ValueError(f"strata.initialize: parameter {record.name} is on the meta device: pass "
                                     "weights= (a safetensors file, a state dict or its file) to initialize from")
                flat = record.param.detach().reshape(-1)
                if self.world_size > 1:  # every rank starts from rank 0's values
                    flat = flat.to("cpu", copy=True).contiguous()
                    self._broadcast(flat)
                values[record] = flat
            self._write_values(values)
        self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self._accumulators = []
        holders = {}  # id(parameter) -> [(module, name)] of the meta-device parameters
        for module in self.module.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    holders.setdefault(id(p), []).append((module, name))
        for record in self._params:
            if record.param.is_meta:
                self._replace_meta(record, holders[id(record.param)])
            self._hook_param(record)

    def _replace_meta(self, record, holders):
        """A meta-device parameter (its values come from the weights) replaced, in every module holding it,
        by one on the compute device that autograd can hook (its storage is dropped at once after)."""
        old = record.param
        new = torch.nn.Parameter(torch.empty(old.shape, device=self.device, dtype=self.dtype),
                                 requires_grad=old.requires_grad)
        for module, name in holders:
            module._parameters[name] = new
        del self._by_param[id(old)]
        self._by_param[id(new)] = record
        record.param = new

    def _write_values(self, values):
        """Each record's flat values (any float dtype, on any device) into its param chunk and its master
        (this rank's part), converted chunk part by chunk part: nothing is staged whole."""
        targets = {}
        for record, flat in values.items():
            if not self._chunk_info[record.chunk]["transient"]:  # else the master shard is the stored copy
                targets.setdefault(record.chunk, []).append((flat, record.offset, self.dtype))
            if record.master_chunk is not None:  # fp32, or a frozen parameter's dtype (comm.shard_params)
                master_dtype = _TORCH_DTYPES[self._chunk_info[record.master_chunk]["dtype"]]
                targets.setdefault(record.master_chunk, []).append((flat, record.master_offset, master_dtype))
        with torch.no_grad():
            for chunk, entries in targets.items():
                access = self._engine.access_chunk(chunk, "host")
                try:
                    for flat, offset, dtype in entries:
                        held = _held_part(self._chunk_info[chunk], offset, flat.numel(), torch.finfo(dtype).bits // 8)
                        if held is not None:
                            lo, hi, at = held
                            view = torch.frombuffer(access, dtype=dtype, count=hi - lo, offset=at)
                            view.copy_(flat[lo:hi])
                finally:
                    access.release()

    def _hook_param(self, record):
        # The AccumulateGrad node holds its hooks in C++, out of the garbage
        # collector's sight: they reach the engine through a weak reference.
        engine = weakref.proxy(self)
        with torch.enable_grad():
            p = record.param
            # In the compute dtype and on the compute device first: a change
            # of either would drop the AccumulateGrad node (and its hook) made below.
            p.data = p.data.to(device=self.device, dtype=self.dtype)
            if record.trainable:
                # The AccumulateGrad node, kept alive so that its hook stays
                # (made while .data has the parameter's shape: autograd checks
                # gradients against it).
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(_grad_hook(engine, record))
                p.register_hook(_grad_pre_hook(engine, record))
                self._accumulators.append(accumulator)
        p.data = self._placeholder
        p.grad = None

    def _install_hooks(self, model):
        self._modules = []
        self._module_params = []
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_hook))
        for module in model.modules():
            own = [self._by_param[id(p)] for _, p in module.named_parameters(recurse=False)]
            if not own:
                continue
            index = len(self._modules)
            self._modules.append(module)
            self._module_params.append(own)
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward_hook(index)))
            self._hooks.append(module.register_forward_hook(self._post_forward_hook(index)))
        self._hooks.append(model.register_forward_hook(self._root_post_hook))
        # A forward that raises skips the post-hooks: its pins and saved-tensor
        # hooks are let go as the exception leaves the model.
        original, engine = model.forward, weakref.proxy(self)

        def forward(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException:
                engine._recover()
                engine._saved_bytes = 0  # its graph is gone
                raise
        model.forward = forward

    # --- the public API ----------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def backward(self, loss):
        """Backward of `loss` (scaled by 1 / gradient_accumulation_steps, and by the loss scale under fp16)."""
        self._check_usable()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward: loss must be a tensor with one element")
        scale = self._optimizer.loss_scale / self.gradient_accumulation_steps
        self._arrived, self._submitted, self._late = {}, 0, set()
        # The backward before a step reduces (and one more before the step, should there be one, again).
        self._reducing = self._reducer is not None and self._micro_steps + 1 >= self.gradient_accumulation_steps
        try:
            (loss if scale == 1.0 else loss * scale).backward()
        except BaseException as error:
            self._recover()
            self._end_backward()
            self._broken = f"a backward failed part way ({type(error).__name__}: {error}); the gradients are partial"
            raise
        self._end_backward()
        self._micro_steps += 1

    def step(self):
        """The optimizer step once gradient_accumulation_steps backwards are in; returns whether it stepped."""
        self._check_usable()
        self._end_backward()
        if self._micro_steps < self.gradient_accumulation_steps:
            return False
        if not self._in_iteration:
            raise RuntimeError("engine.step: no training forward and backward since the last step")
        start = time.perf_counter()
        self._synchronize()
        self._end_moment()
        try:
            stepped = [float(r.stepped) for r in self._params]
            if self._parallel:
                stepped = self._reduce_rest(stepped)
            skip = [r.tensor_id for r, s in zip(self._params, stepped) if r.trainable and s == 0]
            # A step's bytes run from here to here next step: every collective begun in between is done by
            # then (gathers queued ahead by this step's updates are the next forward's, and counted there).
            mark = self._comm.stats()["total_bytes"] if self._parallel else 0
            # An asynchronous save reads each group out before its update changes it.
            self._last_step = self._checked(_strata.train_step, self._engine, self._pipeline, self._optimizer, skip,
                                            self._comm, self._reducer, self._pending)
        except BaseException as error:
            self._broken = (f"a step failed part way ({type(error).__name__}: {error}); some chunk groups are "
                            "updated and others not")
            raise
        finally:
            self._record_tiers()
            self._end_iteration()
        for record in self._params:
            record.stepped = False
        self._last_step["seconds"] = time.perf_counter() - start
        if self._parallel:  # since the last step: the reductions in backward and the unused-parameter vote too
            self._last_step["comm_bytes"], self._comm_mark = mark - self._comm_mark, mark
        self._micro_steps = 0
        return True

    def _check_usable(self):
        if self._broken is not None:
            raise RuntimeError(f"strata: training cannot go on: {self._broken}. Start again from the model's "
                               "initial or saved state")

    def stats(self):
        """Tier usage and peaks, bytes moved per link, the pipeline's stall time, the last step."""
        stats = self._engine.stats()
        pipeline = json.loads(self._pipeline.stats_json())
        stats["pipeline"] = pipeline
        stats["stall_seconds"] = pipeline.get("stall_seconds", 0.0)
        stats["last_step"] = dict(self._last_step)
        stats["steps"] = self._optimizer.steps_taken
        stats["loss_scale"] = self._optimizer.loss_scale
        stats["timeline"] = list(self._last_timeline)
        stats["chunk_tiers"] = self.chunk_tiers()
        if self._parallel:
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
        out = self._comm.stats()
        width = torch.finfo(self.dtype).bits // 8
        model_bytes = sum(r.numel for r in self._params) * width
        trainable_bytes = sum(r.numel for r in self._params if r.trainable) * width
        out["model_bytes"] = model_bytes
        out["zero3_bytes_per_step"] = (2 * model_bytes + trainable_bytes) * (self.world_size - 1) // self.world_size
        out["last_step_bytes"] = self._last_step.get("comm_bytes", 0)
        gathers = self._gather_counts() if self._reducer else self._closed_gathers
        out["param_gathers"], out["param_gathers_ahead"], out["param_gathers_filled_ahead"] = gathers
        return out

    def _gather_counts(self):
        r = self._reducer
        return (r.gathers, r.gathered_ahead, r.filled_ahead)

    def chunk_tiers(self):
        """Bytes of each chunk kind on each tier now: {kind: {tier: bytes}}."""
        out = {}
        for chunk in self._chunks:
            kinds = out.setdefault(chunk["kind"], {})
            tier = self._engine.chunk_tier(chunk["id"])
            if tier is None:  # no payload yet: where it will be; a dropped gathered chunk is nowhere
                if chunk["transient"]:
                    continue
                tier = chunk["home"]
            kinds[tier] = kinds.get(tier, 0) + chunk["size_bytes"]
        return out

    def state_dict(self, master=False):
        """A copy of every parameter (compute dtype; fp32 masters with master=True under bf16/fp16).

        Read from wherever each chunk is, without moving it. Data parallel,
        each rank holds a shard of the masters: master=True gathers them, so
        every rank must call it (with comm.shard_params, always: the masters
        are the only stored copy of the parameters).
        """
        copies = {}
        out = {}
        for record in self._params:
            chunk, offset, dtype = record.chunk, record.offset, self.dtype
            # Parameters sharded: the gathered masters are the parameters.
            if record.master_chunk is not None and (master or self._chunk_info[chunk]["transient"]):
                chunk, offset = record.master_chunk, record.master_offset
                dtype = _TORCH_DTYPES[self._chunk_info[chunk]["dtype"]]  # a frozen parameter's is its own
            if chunk not in copies:
                copies[chunk] = self._read_whole_chunk(chunk)
            view = torch.frombuffer(copies[chunk], dtype=dtype, count=record.numel, offset=offset)
            out[record.name] = view.to(self.dtype if not master else dtype, copy=True).reshape(record.shape)
        return out

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
        self._drain()
        self.wait_checkpoint()
        if not asynchronous:
            return self._checked(_strata.save_checkpoint, self._engine, self._optimizer, os.fspath(path),
                                 keep_last, self._comm, recycle)
        self._pending = self._checked(_strata.start_checkpoint, self._engine, self._optimizer, os.fspath(path),
                                      keep_last, self._comm, self._save_delay_ms, recycle)
        self._pending_exit = functools.partial(_finish_save, weakref.ref(self._pending))
        atexit.register(self._pending_exit)
        return None

    def export_safetensors(self, path, fp32=False):
        """Writes every parameter to a safetensors file at `path` under its name in the model, in the
        compute dtype, or in fp32 (the fp32 masters under bf16/fp16), chunk by chunk from wherever each
        lies; the file is written beside `path` and renamed into place. Buffers are not included. Data
        parallel, every rank calls it (the masters' shards are gathered) and rank 0 writes. Returns a
        dict: path, tensors, bytes."""
        self._check_between_steps("export_safetensors")
        self._drain()
        out = self._checked(_strata.export_safetensors, self._engine, os.fspath(path), fp32, self._comm)
        return {key: out[key] for key in ("path", "tensors", "bytes")}

    def load_weights(self, source, strict=True):
        """Sets the parameters (and buffers) from `source`: a safetensors file (read tensor by tensor
        straight into the chunks), a PyTorch state dict, or a file torch.load reads (memory-mapped where
        torch can, 2.1 on, so that its tensors are read as they are copied). The parameters' fp32 masters
        are set from the values as given; optimizer states are left as they are (this is how a model
        starts, or takes new weights). Names are the model's: a tied parameter, or a shared module's
        buffer, may come under any of its names (model.state_dict() holds each). strict=True: every
        parameter must be in `source`, and nothing else but buffers; a shape that differs, or a tensor
        that cannot be read, is always an error; all are raised before anything is set. Between steps.
        Data parallel, each rank reads `source` itself and the ranks agree: all raise or none does. A
        load that fails once setting has begun leaves the model partly set: training then raises until
        a load succeeds. Returns a dict: tensors (parameters set), missing (parameters left as they
        were), unused (names not taken)."""
        self._check_between_steps("load_weights",
                                  usable=self._broken is None or not self._broken.startswith(_LOAD_FAILED))
        self._drain()
        self.wait_checkpoint()
        params, buffers = self._tensor_names()
        error = None
        try:  # everything that can refuse, before anything is set
            plan = self._plan_weights(source, params, buffers, strict)
        except Exception as failed:  # noqa: BLE001 (agreed with the other ranks, then raised)
            error = failed
        self._agree(error, "load_weights")
        path, _, values, result = plan
        try:
            if path is not None:  # those under their registered names straight from the file
                self._checked(_strata.import_safetensors, self._engine, path, False)
            self._write_values(values)
            with torch.no_grad():
                for name, value in result.pop("buffer_values").items():
                    module, leaf = buffers[name]
                    if module._buffers[leaf].is_meta:
                        module._buffers[leaf] = value.to(self.device, copy=True)
                    else:
                        module._buffers[leaf].copy_(value)
        except BaseException as failed:
            error = failed
            self._broken = f"{_LOAD_FAILED} ({type(failed).__name__}: {failed}); load weights or a checkpoint that loads"
        finally:
            if self._reducer is not None:  # gathered parameters are of the masters before
                self._reducer.release_gathered()
        self._agree(error, "load_weights")
        self._broken = None
        return result

    def _plan_weights(self, source, params, buffers, strict):
        """What load_weights sets, every check made and every tensor not imported by C++ read: (the
        safetensors path the C++ import reads, or None; record -> name; record -> flat values to write;
        the result dict, with the buffers' values)."""
        path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
        safetensors = path is not None and path.endswith(".safetensors")
        if safetensors:
            index = self._checked(_strata.safetensors_index, path)
            shapes = {name: tuple(entry["shape"]) for name, entry in index.items()}
        else:
            if path is not None:
                # Memory-mapped where torch can (2.1): tensors are then read as they are copied.
                mapped = {"mmap": True} if "mmap" in inspect.signature(torch.load).parameters else {}
                source = torch.load(path, map_location="cpu", weights_only=True, **mapped)
            if not isinstance(source, dict):
                raise TypeError(f"strata: load_weights takes a path or a state dict, got {type(source).__name__}")
            shapes = {name: tuple(value.shape) for name, value in source.items()}

        def here(name):  # the shape this model has for `name`, or None
            if name in params:
                return params[name].shape
            return tuple(getattr(*buffers[name]).shape) if name in buffers else None
        wrong = [f"{name} is {list(shape)} there, {list(here(name))} here" for name, shape in shapes.items()
                 if here(name) is not None and shape != here(name)]
        chosen = {}  # record -> the name its values come under (its registered one first)
        for name, record in params.items():
            if name in shapes and (record not in chosen or name == record.name):
                chosen[record] = name
        missing = [record.name for record in self._params if record not in chosen]
        unused = [name for name in shapes if name not in params and name not in buffers]
        if wrong or (strict and (missing or unused)):
            def few(items):
                return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
            parts = wrong + ([f"it lacks {few(missing)}"] if strict and missing else [])
            parts += [f"it has {few(unused)} that the model does not"] if strict and unused else []
            raise ValueError(f"strata: load_weights: the weights do not fit this model: {'; '.join(parts)}")
        if safetensors:  # a tied parameter under another of its names, and the buffers: read now
            values = {record: _read_safetensors_tensor(path, index[name]).reshape(-1)
                      for record, name in chosen.items() if name != record.name}
            buffer_values = {name: _read_safetensors_tensor(path, index[name]) for name in shapes if name in buffers}
        else:
            values = {record: source[name].detach().reshape(-1) for record, name in chosen.items()}
            buffer_values = {name: source[name] for name in shapes if name in buffers}
        result = {"tensors": len(chosen), "missing": missing, "unused": unused, "buffer_values": buffer_values}
        return (path if safetensors else None), chosen, values, result

    def _agree(self, error, what):
        """Raises `error` (this rank's, or None) on every rank when any rank has one (data parallel: a
        rank whose file is missing, say), so that no rank goes on alone."""
        if self.world_size > 1:
            failed = self._comm.all_reduce_sum([0.0 if error is None else 1.0])[0]
            if error is None and failed:
                error = RuntimeError(f"strata: {what} failed on another rank (its own error says why)")
        if error is not None:
            raise error

    def _tensor_names(self):
        """Every name the model knows a registered parameter by (tied ones have several) -> its record,
        and every name of a buffer (a shared module's under each path) -> (its module, its name there)."""
        params, buffers = {}, {}

        def walk(module, prefix):
            for leaf, p in module._parameters.items():
                if p is not None and id(p) in self._by_param:
                    params.setdefault(prefix + leaf, self._by_param[id(p)])
            for leaf, b in module._buffers.items():
                if b is not None:
                    buffers.setdefault(prefix + leaf, (module, leaf))
            for child, sub in module._modules.items():
                if sub is not None:
                    walk(sub, f"{prefix}{child}.")
        walk(self.module, "")
        return params, buffers

    def wait_checkpoint(self):
        """Waits for the asynchronous save in flight, if any, and returns its dict (else None); raises its
        error. Data parallel, every rank calls it at the same point."""
        if self._pending is None:
            return None
        self._drain()  # the reducer's collectives (gathers queued ahead) before the save's agreement
        pending, self._pending = self._pending, None
        atexit.unregister(self._pending_exit)
        return self._checked(pending.wait)

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
        # A load is how an engine whose last load failed part way becomes usable again.
        self._check_between_steps("load_checkpoint",
                                  usable=self._broken is None or not self._broken.startswith(_LOAD_FAILED))
        self._drain()
        self.wait_checkpoint()
        try:
            loaded = self._checked(_strata.load_checkpoint, self._engine, self._optimizer, os.fspath(path),
                                   fall_back, self._comm)
        except ValueError:  # another model or optimizer: refused before anything was read
            raise
        except BaseException as error:
            self._broken = f"{_LOAD_FAILED} ({type(error).__name__}: {error}); load a checkpoint that loads"
            raise
        finally:
            if self._reducer is not None:  # gathered parameters and gathers ahead are of the masters before the load
                self._reducer.release_gathered()
        self._broken = None
        return loaded

    def _drain(self):
        """Waits for the reducer's collectives (gathers queued ahead), so that the caller's may begin."""
        if self._reducer is not None:
            self._checked(self._reducer.drain)

    def _check_between_steps(self, what, usable=True):
        if usable:
            self._check_usable()
        if self._in_iteration or self._micro_steps:
            raise RuntimeError(f"engine.{what}: between steps only (after step(), before the next training "
                               "forward): a backward is in progress")

    def _read_whole_chunk(self, chunk):
        """A chunk's bytes; a sharded chunk's gathered from every rank into the group's whole chunk."""
        info = self._chunk_info[chunk]
        data = self._engine.read_chunk(chunk)
        if not info["sharded"]:
            return data
        # Where each rank's shard lies in the whole chunk, then the shards.
        mine = torch.tensor([info["shard_offset"], info["used_bytes"]], dtype=torch.int64)
        comm = self.comm  # the reducer's collectives (gathers ahead after a step) done first
        spans = torch.frombuffer(bytearray(comm.all_gather(mine.numpy())), dtype=torch.int64).reshape(-1, 2).tolist()
        shards = comm.all_gather(data)
        whole = bytearray(max(offset + used for offset, used in spans))
        for rank, (offset, used) in enumerate(spans):
            start = rank * len(data)
            whole[offset:offset + used] = shards[start:start + used]
        return whole

    def _broadcast(self, tensor):
        """Rank 0's values of a contiguous CPU tensor into every rank's."""
        self._comm.broadcast(tensor.view(-1).view(torch.uint8).numpy(), 0)

    def close(self):
        """Ends data-parallel training: waits for the collectives in flight (the gathers queued ahead for a
        forward that will not come included) and stops the reducer's thread, here and now rather than when
        the engine is collected or at exit. Waits for an asynchronous save first (raising its error). Every
        rank calls it; the engine trains no more after."""
        try:
            self._drain()
            self.wait_checkpoint()
        finally:
            if self._reducer is not None:
                self._broken = self._broken or "the engine was closed"
                self._closed_gathers = self._gather_counts()
                self._reducer.close()
                self._reducer = None

    @property
    def comm(self):
        """The data-parallel group's communicator (None alone), free for the caller's own collectives.

        The gradient reductions begun in backward run on a thread of their
        own; after the backward before a step, the rest are submitted and
        all are waited for first, since one communicator carries one
        collective at a time, in the same order on every rank.
        """
        if self._reducer is not None:
            if self._reducing:  # after the backward before a step: its chunks all go, in the fixed order
                self._submit_complete(everything=True)
            self._checked(self._reducer.drain)
        return self._comm

    @property
    def engine(self):
        """The C++ engine (strata._strata.Engine): chunks, tiers."""
        return self._engine

    # --- moments -----------------------------------------------------------

    def _non_model_bytes(self):
        if self.config.non_model_memory is not None:
            return self.config.non_model_memory
        if not self._emulated and torch.cuda.is_available():
            return torch.cuda.memory_allocated()
        return self._saved_bytes

    def _begin_moment(self):
        """Ends the open moment and begins the next; chunks still pinned are accessed again in it."""
        if not self._in_iteration:
            self._pipeline.begin_iteration()
            self._in_iteration = True
            self._timeline = []
        self._end_moment()
        self._pipeline.begin_moment(self._non_model_bytes())
        self._in_moment = True
        for chunk, entry in self._held.items():
            again = self._checked(self._pipeline.access, self._engine, chunk)
            if again.address != entry[0].address:
                raise RuntimeError(f"strata: chunk {chunk} moved while pinned")
            entry[0].release()
            entry[0] = again
        self._record_tiers()

    def _record_tiers(self):
        tiers = self._engine.stats()["tiers"]
        self._timeline.append({tier: usage["used_bytes"] for tier, usage in tiers.items()})

    def _synchronize(self):
        """On a GPU: the kernels queued on torch's stream are done before a chunk they use is let go."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _end_moment(self):
        if not self._in_moment:
            return
        self._synchronize()
        for access in self._moment_chunks.values():
            access.release()
        self._moment_chunks.clear()
        self._in_moment = False
        self._pipeline.end_moment()

    def _end_iteration(self):
        self._end_moment()
        if self._in_iteration:
            self._in_iteration = False
            self._last_timeline = self._timeline
            self._pipeline.end_iteration()

    def _pin_chunk(self, chunk):
        if self._direct:
            access = self._engine.access_chunk(chunk, "device")
        else:
            if not self._in_moment:
                self._begin_moment()
            access = self._checked(self._pipeline.access, self._engine, chunk)
        if self._chunk_info[chunk]["transient"]:
            # Parameters sharded: the whole chunk from every rank's shard. The
            # ranks pin chunks in the same order (the same modules run), so
            # their gathers line up; the reducer keeps the last two gathered,
            # so a chunk's next module sends nothing.
            try:
                self._checked(self._reducer.gather, access)
            except BaseException:
                access.release()
                raise
        return access

    def _checked(self, call, *args):
        """`call(*args)`, with a CorruptionError saying what the chunk holds."""
        try:
            return call(*args)
        except _strata.CorruptionError as error:
            raise _strata.CorruptionError(f"{error} [{self._describe_chunks(str(error))}]") from None

    def _describe_chunks(self, message):
        names = {record.tensor_id: record.name for record in self._params}
        described = []
        for chunk_id in sorted({int(m) for m in re.findall(r"chunk (\d+)", message)}):
            if chunk_id < len(self._chunks):
                chunk = self._chunks[chunk_id]
                tensors = ", ".join(names.get(t, str(t)) for t in chunk["tensors"][:4])
                more = "" if len(chunk["tensors"]) <= 4 else f" and {len(chunk['tensors']) - 4} more"
                described.append(f"chunk {chunk_id} holds the {chunk['kind']} of {tensors}{more}")
        return "; ".join(described) or "no chunk named"

    def _view(self, access, dtype, count, offset):
        """`count` elements at byte `offset` of a pinned chunk, as a tensor where the chunk is."""
        if self._emulated or access.tier != "device":
            return torch.frombuffer(access, dtype=dtype, count=count, offset=offset)
        size = count * torch.tensor([], dtype=dtype).element_size()
        return torch.as_tensor(_CudaBytes(access), device=self.device)[offset:offset + size].view(dtype)

    # --- parameters --------------------------------------------------------

    def _materialize(self, record):
        if record.pins == 0:
            entry = self._held.get(record.chunk)
            if entry is None:
                entry = self._held[record.chunk] = [self._pin_chunk(record.chunk), 0]
            entry[1] += 1
            view = self._view(entry[0], self.dtype, record.numel, record.offset)
            record.param.data = view.view(record.shape)
        record.pins += 1

    def _release(self, record):
        record.pins -= 1
        if record.pins > 0:
            return
        record.param.data = self._placeholder
        entry = self._held[record.chunk]
        entry[1] -= 1
        if entry[1] == 0:
            self._synchronize()
            entry[0].release()
            del self._held[record.chunk]

    # --- forward hooks -----------------------------------------------------

    def _root_pre_hook(self, module, args):
        self._check_usable()
        self._recover()  # what a forward that raised left behind
        # Without autograd there is no backward: chunks are pinned outside the pipeline.
        self._direct = not torch.is_grad_enabled()
        if self._direct:
            self._end_moment()

    def _root_post_hook(self, module, args, output):
        if not self._active:
            self._direct = False
        return None

    def _recover(self):
        """Lets go of every pin of forwards that did not return, and of their saved-tensor hooks."""
        while self._saved_hooks:
            self._saved_hooks.pop()[1].__exit__(None, None, None)
        self._active = []
        self._direct = False
        for record in self._params:
            if record.pins > 0 and not record.for_backward:
                record.pins = 1
                self._release(record)

    def _pre_forward_hook(self, index):
        def hook(module, args):
            if not self._direct:
                self._begin_moment()
                if torch.is_grad_enabled():
                    context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                    context.__enter__()
                    self._saved_hooks.append((index, context))
            self._active.append(index)
            for record in self._module_params[index]:
                self._materialize(record)
        return hook

    def _post_forward_hook(self, index):
        def hook(module, args, output):
            # A parameter, or a view of one, returned by the module outlives
            # it: copied while its chunk is still pinned.
            output = _map_tensors(output, self._unalias)
            if self._active and self._active[-1] == index:
                self._active.pop()
            for record in self._module_params[index]:
                self._release(record)
            if self._saved_hooks and self._saved_hooks[-1][0] == index:
                self._saved_hooks.pop()[1].__exit__(None, None, None)
            if self._direct or not torch.is_grad_enabled():
                return output
            self._backward_pending.add(index)

            def wrap(t):
                if t.requires_grad and t.is_floating_point():
                    return _PreBackward.apply(self, index, t)
                return t
            return _map_tensors(output, wrap)
        return hook

    def _unalias(self, t):
        base = t._base if t._base is not None else t
        return t.clone() if id(base) in self._by_param else t

    # --- saved tensors ------------------------------------------------------

    def _pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        record = self._by_param.get(id(base))
        if record is None or base is not record.param:
            self._saved_bytes += tensor.numel() * tensor.element_size()
            return tensor
        return (record, tensor.size(), tensor.stride(), tensor.storage_offset() - record.param.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            self._saved_bytes = max(0, self._saved_bytes - packed.numel() * packed.element_size())
            return packed
        record, size, stride, offset = packed
        if record.pins == 0:
            self._pin_for_backward(record)
        data = record.param.data
        return data.as_strided(size, stride, data.storage_offset() + offset)

    # --- backward ------------------------------------------------------------

    def _pin_for_backward(self, record):
        if record.for_backward:
            return
        self._materialize(record)
        record.for_backward = True
        record.grad_arrived = False
        self._backward_params.append(record)

    def _pre_backward(self, index):
        if index not in self._backward_pending:
            return  # another output of the same module: its moment has begun
        self._backward_pending.discard(index)
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._begin_moment()
        # Parameters whose gradient is in, or frozen ones of modules done, are let go.
        own = self._module_params[index]
        keep = []
        for record in self._backward_params:
            done = record.grad_arrived if record.trainable else record not in own
            if done:
                record.for_backward = False
                self._release(record)
            else:
                keep.append(record)
        self._backward_params = keep
        for record in own:
            self._pin_for_backward(record)

    def _grad_ready(self, record):
        grad = record.param.grad
        if grad is None:
            return
        record.param.grad = None
        access = self._grad_access(record.grad_chunk)
        target = self._view(access, self.dtype, record.numel, record.grad_offset)
        with torch.no_grad():
            target.add_(grad.reshape(-1))
        record.grad_arrived = True
        record.stepped = True
        if self._reducing:
            self._arrived.setdefault(record.grad_chunk, set()).add(id(record))
            if self._reduce_position[record.grad_chunk] < self._submitted:
                # A gradient after its chunk was submitted (a parameter used
                # again, as reentrant checkpointing can make happen).
                self._late.add(record.grad_chunk)
            self._submit_complete()

    def _submit_complete(self, everything=False):
        """Submits grad chunks in the fixed order while they are complete (all of them, at the step)."""
        order = self._reduce_order
        while self._submitted < len(order) and (
                everything or len(self._arrived.get(order[self._submitted], ())) ==
                self._grad_chunk_params[order[self._submitted]]):
            self._synchronize()  # the reducer copies the chunk on its own stream
            self._checked(self._reducer.submit, order[self._submitted])
            self._submitted += 1

    def _reduce_rest(self, stepped):
        """Before the step: the grad chunks not yet submitted, in the fixed order; one vote over the ranks
        for which parameters any backward reached (the rest are skipped) and which submitted chunks a late
        gradient reached on any rank (reduced again); returns the summed `stepped`."""
        self._submit_complete(everything=True)
        self._checked(self._reducer.drain)  # the communicator is the step's again
        late = [float(c in self._late) for c in self._reduce_order]
        votes = self._comm.all_reduce_sum(stepped + late)
        for chunk, vote in zip(self._reduce_order, votes[len(stepped):]):
            if vote > 0:
                self._checked(self._reducer.submit, chunk)
        self._submitted, self._late, self._reducing = 0, set(), False
        return votes[:len(stepped)]

    def _grad_access(self, chunk):
        if self._direct:
            raise RuntimeError("strata: a gradient arrived during an evaluation forward (model.eval() or no_grad)")
        if not self._in_moment:
            self._begin_moment()
        access = self._moment_chunks.get(chunk)
        if access is None:
            access = self._moment_chunks[chunk] = self._checked(self._pipeline.access, self._engine, chunk)
        return access

    def _end_backward(self):
        self._end_queued = False
        for record in self._backward_params:
            record.for_backward = False
            self._release(record)
        self._backward_params = []
        self._backward_pending.clear()
        self._saved_bytes = 0
