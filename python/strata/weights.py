"""Parameter values in and out of the chunks: the model's own values at initialize, weights loaded from a
safetensors file or a state dict (planned and checked before anything is set), copies of the parameters
(state_dict), and the safetensors export."""

import inspect
import json
import os
from dataclasses import dataclass

import torch

from . import _strata
from .params import module_of
from .runtime import TORCH_DTYPES

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


def _checkpoint_files(directory):
    """The weight files of a directory save_pretrained wrote: its safetensors file, its shards (by the
    index), else its pytorch_model.bin."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, shard) for shard in shards]
    if os.path.isfile(os.path.join(directory, "pytorch_model.bin")):
        return [os.path.join(directory, "pytorch_model.bin")]
    raise ValueError(f"strata: load_weights: the directory {directory} holds none of model.safetensors, "
                     "model.safetensors.index.json (shards) or pytorch_model.bin: pass a weights file, or a "
                     "directory that save_pretrained wrote")


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


def _few(items):
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


@dataclass
class WeightsPlan:
    """What a load of weights sets, every check made and every tensor the C++ import does not read, read."""

    files: list          # the safetensors files the C++ import reads (those under their registered names)
    values: dict         # record -> flat values to write
    buffer_values: dict  # buffer name -> its value
    buffers: dict        # buffer name -> (its module, its name there)
    result: dict         # what load_weights returns: tensors, missing, unused


class Weights:
    """Writes and reads the parameters' values in their chunks, for one model."""

    def __init__(self, runtime, table, model, grad_sync):
        self._runtime = runtime
        self._table = table
        self._model = model
        self._grad_sync = grad_sync  # its drained communicator gathers the masters' shards

    # --- initialize ----------------------------------------------------------

    def model_values(self):
        """Each parameter's values as the model holds them (rank 0's on every rank), flat."""
        values = {}
        for record in self._table.records:
            if record.param.is_meta:
                raise ValueError(f"strata.initialize: parameter {record.name} of {module_of(self._model, record.name)} "
                                 "is on the meta device: pass weights= (a safetensors file, a state dict or its file) "
                                 "to initialize from")
            flat = record.param.detach().reshape(-1)
            if self._runtime.world_size > 1:  # every rank starts from rank 0's values
                flat = flat.to("cpu", copy=True).contiguous()
                self._runtime.broadcast(flat)
            values[record] = flat
        return values

    def place_buffers(self):
        """The model's buffers (running statistics and the like: rank 0's) on the compute device."""
        for buffer in self._model.buffers():
            if buffer.is_meta:  # its value comes with the weights
                continue
            if self._runtime.world_size > 1:
                values = buffer.data.to("cpu", copy=True).contiguous()
                self._runtime.broadcast(values)
                buffer.data = values
            buffer.data = buffer.data.to(self._runtime.device)

    def check_buffers(self):
        for name, buffer in self._model.named_buffers():
            if buffer.is_meta:
                raise ValueError(f"strata.initialize: buffer {name} of {module_of(self._model, name)} is on the meta "
                                 "device and the weights do not hold it (a buffer the model computes, such as rotary "
                                 "frequencies, must be made on a real device: build the model under "
                                 "accelerate.init_empty_weights(), which leaves buffers real, rather than "
                                 "torch.device('meta'))")

    def write(self, values):
        """Each record's flat values (any float dtype, on any device) into its param chunk and its master
        (this rank's part), converted chunk part by chunk part: nothing is staged whole."""
        info = self._table.chunk_info
        targets = {}
        for record, flat in values.items():
            if not info[record.chunk]["transient"]:  # else the master shard is the stored copy
                targets.setdefault(record.chunk, []).append((flat, record.offset, self._runtime.dtype))
            if record.master_chunk is not None:  # fp32, or a frozen parameter's dtype (comm.shard_params)
                master_dtype = TORCH_DTYPES[info[record.master_chunk]["dtype"]]
                targets.setdefault(record.master_chunk, []).append((flat, record.master_offset, master_dtype))
        with torch.no_grad():
            for chunk, entries in targets.items():
                access = self._runtime.engine.access_chunk(chunk, "host")
                try:
                    for flat, offset, dtype in entries:
                        held = _held_part(info[chunk], offset, flat.numel(), torch.finfo(dtype).bits // 8)
                        if held is not None:
                            lo, hi, at = held
                            view = torch.frombuffer(access, dtype=dtype, count=hi - lo, offset=at)
                            view.copy_(flat[lo:hi])
                finally:
                    access.release()

    # --- copies out ------------------------------------------------------------

    def state_dict(self, master):
        """Every parameter's values, read from wherever each chunk is (see TrainingEngine.state_dict)."""
        return {record.name: values for record, values in self.read(self._table.records, master)}

    def read(self, records, master=False):
        """Yields (record, a CPU copy of its values in its shape) for each of `records`, in model order: in the
        compute dtype, or the masters' (fp32; a frozen parameter's own) with master=True. Each chunk is read
        once from wherever it is, without moving it, and dropped after the last of `records` it holds (a chunk
        holds tensors in model order, so that beside the copies only a chunk or two is staged at a time)."""
        wanted = set(records)
        records = [record for record in self._table.records if record in wanted]
        sources = [self._source(record, master) for record in records]
        last = {chunk: i for i, (chunk, _, _) in enumerate(sources)}
        staged = {}
        for i, (record, (chunk, offset, dtype)) in enumerate(zip(records, sources)):
            if chunk not in staged:
                staged[chunk] = self._read_whole_chunk(chunk)
            view = torch.frombuffer(staged[chunk], dtype=dtype, count=record.numel, offset=offset)
            yield record, view.to(dtype if master else self._runtime.dtype, copy=True).reshape(record.shape)
            if last[chunk] == i:
                del staged[chunk]

    def _source(self, record, master):
        """(chunk, byte offset, dtype) of the copy of `record` that read() reads."""
        chunk = record.chunk
        # Parameters sharded: the gathered masters are the parameters.
        if record.master_chunk is not None and (master or self._table.chunk_info[chunk]["transient"]):
            # A frozen parameter's master is in its own dtype.
            return record.master_chunk, record.master_offset, TORCH_DTYPES[
                self._table.chunk_info[record.master_chunk]["dtype"]]
        return chunk, record.offset, self._runtime.dtype

    def _read_whole_chunk(self, chunk):
        """A chunk's bytes; a sharded chunk's gathered from every rank into the group's whole chunk."""
        info = self._table.chunk_info[chunk]
        data = self._runtime.engine.read_chunk(chunk)
        if not info["sharded"]:
            return data
        # Where each rank's shard lies in the whole chunk, then the shards.
        mine = torch.tensor([info["shard_offset"], info["used_bytes"]], dtype=torch.int64)
        comm = self._grad_sync.drained_comm()  # the reducer's collectives (gathers ahead after a step) done first
        spans = torch.frombuffer(bytearray(comm.all_gather(mine.numpy())), dtype=torch.int64).reshape(-1, 2).tolist()
        shards = comm.all_gather(data)
        whole = bytearray(max(offset + used for offset, used in spans))
        for rank, (offset, used) in enumerate(spans):
            start = rank * len(data)
            whole[offset:offset + used] = shards[start:start + used]
        return whole

    def export_safetensors(self, path, fp32):
        out = self._table.checked(_strata.export_safetensors, self._runtime.engine, os.fspath(path), fp32,
                                  self._runtime.comm)
        return {key: out[key] for key in ("path", "tensors", "bytes")}

    # --- loading -----------------------------------------------------------------

    def plan(self, source, strict):
        """A WeightsPlan for `source` (see TrainingEngine.load_weights); raises what load_weights refuses."""
        params, buffers = self._tensor_names()
        path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
        files = _checkpoint_files(path) if path is not None and os.path.isdir(path) else [path]
        safetensors = path is not None and all(file.endswith(".safetensors") for file in files)
        if safetensors:
            index = {}  # name -> (its file, its entry there)
            for file in files:
                index.update((name, (file, entry))
                             for name, entry in self._table.checked(_strata.safetensors_index, file).items())
            shapes = {name: tuple(entry["shape"]) for name, (_, entry) in index.items()}
        else:
            source = self._state_dict_of(source, files[0])
            shapes = {name: tuple(value.shape) for name, value in source.items()}
        chosen, result = self._fit(shapes, params, buffers, strict)
        if safetensors:  # a tied parameter under another of its names, and the buffers: read now
            values = {record: _read_safetensors_tensor(*index[name]).reshape(-1)
                      for record, name in chosen.items() if name != record.name}
            buffer_values = {name: _read_safetensors_tensor(*index[name]) for name in shapes if name in buffers}
        else:
            values = {record: source[name].detach().reshape(-1) for record, name in chosen.items()}
            buffer_values = {name: source[name] for name in shapes if name in buffers}
        return WeightsPlan(files if safetensors else [], values, buffer_values, buffers, result)

    @staticmethod
    def _state_dict_of(source, path):
        if path is not None:
            # Memory-mapped where torch can (2.1): tensors are then read as they are copied.
            mapped = {"mmap": True} if "mmap" in inspect.signature(torch.load).parameters else {}
            source = torch.load(path, map_location="cpu", weights_only=True, **mapped)
        if not isinstance(source, dict):
            raise TypeError(f"strata: load_weights takes a path or a state dict, got {type(source).__name__}")
        return source

    def _fit(self, shapes, params, buffers, strict):
        """Which name each record's values come under (its registered one first), and the result dict;
        ValueError when the weights do not fit this model."""
        def here(name):  # the shape this model has for `name`, or None
            if name in params:
                return params[name].shape
            return tuple(getattr(*buffers[name]).shape) if name in buffers else None
        wrong = [f"{name} is {list(shape)} there, {list(here(name))} here" for name, shape in shapes.items()
                 if here(name) is not None and shape != here(name)]
        chosen = {}  # record -> the name its values come under
        for name, record in params.items():
            if name in shapes and (record not in chosen or name == record.name):
                chosen[record] = name
        missing = [record.name for record in self._table.records if record not in chosen]
        unused = [name for name in shapes if name not in params and name not in buffers]
        if wrong or (strict and (missing or unused)):
            parts = wrong + ([f"it lacks {_few(missing)}"] if strict and missing else [])
            parts += [f"it has {_few(unused)} that the model does not"] if strict and unused else []
            if strict and missing and hasattr(self._model, "tie_weights"):
                parts.append("(a Hugging Face model built under accelerate.init_empty_weights() has its tied "
                             "weights untied: call model.tie_weights() before strata.initialize)")
            raise ValueError(f"strata: load_weights: the weights do not fit this model: {'; '.join(parts)}")
        return chosen, {"tensors": len(chosen), "missing": missing, "unused": unused}

    def _tensor_names(self):
        """Every name the model knows a registered parameter by (tied ones have several) -> its record,
        and every name of a buffer (a shared module's under each path) -> (its module, its name there)."""
        params, buffers = {}, {}
        by_param = self._table.by_param

        def walk(module, prefix):
            for leaf, p in module._parameters.items():
                if p is not None and id(p) in by_param:
                    params.setdefault(prefix + leaf, by_param[id(p)])
            for leaf, b in module._buffers.items():
                if b is not None:
                    buffers.setdefault(prefix + leaf, (module, leaf))
            for child, sub in module._modules.items():
                if sub is not None:
                    walk(sub, f"{prefix}{child}.")
        walk(self._model, "")
        return params, buffers

    def apply(self, plan):
        """Sets what `plan` holds: the C++ import from its file, the values read, the buffers."""
        for file in plan.files:  # those under their registered names straight from the files
            self._table.checked(_strata.import_safetensors, self._runtime.engine, file, False)
        self.write(plan.values)
        with torch.no_grad():
            for name, value in plan.buffer_values.items():
                module, leaf = plan.buffers[name]
                if module._buffers[leaf].is_meta:
                    module._buffers[leaf] = value.to(self._runtime.device, copy=True)
                else:
                    module._buffers[leaf].copy_(value)
