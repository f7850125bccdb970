"""The registered parameters: each one's tensor id, and where its copies (param, grad, master) lie in the chunks."""

import re

import torch

from . import _strata


class Param:
    """One registered parameter: where its copies live, and whether it is pinned now."""

    __slots__ = ("param", "name", "tensor_id", "shape", "numel", "trainable", "chunk", "offset", "grad_chunk",
                 "grad_offset", "master_chunk", "master_offset", "pins", "for_backward", "grad_arrived", "stepped",
                 "placeholder", "plain_class", "held_class")

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
        # Outside forward and backward (strata.state): .data is the placeholder (the real shape, no storage of its
        # own) and the parameter's class held_class, whose reads raise; materialized, its own class again.
        self.placeholder = None
        self.plain_class = self.held_class = None


def module_of(model, name):
    """Where the parameter or buffer `name` of `model` lies, for a message: "module <path> (<class>)"."""
    path = name.rpartition(".")[0]
    return f"module {path or '(the model itself)'} ({type(model.get_submodule(path)).__name__})"


def _refuse_sparse(model):
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            where = f"{module_name}.weight" if module_name else "weight"
            raise ValueError(f"strata.initialize: {module_of(model, where)} has sparse=True: its weight would get "
                             "sparse gradients, which strata's gradient chunks do not take (nor does torch.optim's "
                             "AdamW); set sparse=False")


class ParamTable:
    """Every parameter of a model registered with the engine (shared ones once, frozen ones as frozen), in
    model order, and the engine's chunks once it has packed them."""

    def __init__(self, model, engine, precision, group_of=None):
        self.records = []    # Param, in model order
        self.by_param = {}   # id(nn.Parameter) -> Param
        self._register(model, engine, precision, group_of or {})
        engine.finalize()
        self.chunks = engine.chunks()                                  # the engine's chunk dicts, by id
        self.chunk_info = {chunk["id"]: chunk for chunk in self.chunks}
        self._locate()

    def _register(self, model, engine, precision, group_of):
        owner = {}
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                owner.setdefault(id(p), (module_name, f"{module_name}.{name}" if module_name else name))
        if not owner:
            raise ValueError(f"strata.initialize: the model ({type(model).__name__}) has no parameters: nothing to "
                             "train")
        _refuse_sparse(model)
        for _, p in model.named_parameters():
            module_name, full_name = owner[id(p)]
            if not p.dtype.is_floating_point:
                raise ValueError(f"strata.initialize: parameter {full_name} of {module_of(model, full_name)} has "
                                 f"dtype {p.dtype}; strata trains floating-point parameters only (a quantized "
                                 "weight: dequantize it first, or keep it as a buffer)")
            shape = list(p.shape) if p.dim() > 0 else []
            tensor_id = engine.register_tensor(full_name, shape, precision, p.requires_grad, module_name,
                                               group_of.get(id(p), 0))
            record = Param(p, full_name, tensor_id)
            self.records.append(record)
            self.by_param[id(p)] = record

    def _locate(self):
        where = {}  # (tensor id, kind) -> (chunk, offset in the group's whole chunk)
        for chunk in self.chunks:
            for tensor, offset in zip(chunk["tensors"], chunk["tensor_offsets"]):
                where[(tensor, chunk["kind"])] = (chunk["id"], offset)
        for record in self.records:
            record.chunk, record.offset = where[(record.tensor_id, "param")]
            if record.trainable:
                record.grad_chunk, record.grad_offset = where[(record.tensor_id, "grad")]
            if (record.tensor_id, "master") in where:
                record.master_chunk, record.master_offset = where[(record.tensor_id, "master")]

    def replace_meta(self, record, holders, device, dtype):
        """A meta-device parameter (its values come from the weights) replaced, in every (module, name) of
        `holders`, by one on the compute device that autograd can hook (its storage is dropped at once after)."""
        old = record.param
        new = torch.nn.Parameter(torch.empty(old.shape, device=device, dtype=dtype), requires_grad=old.requires_grad)
        for module, name in holders:
            module._parameters[name] = new
        del self.by_param[id(old)]
        self.by_param[id(new)] = record
        record.param = new

    def checked(self, call, *args):
        """`call(*args)`, with a CorruptionError saying what the chunk holds."""
        try:
            return call(*args)
        except _strata.CorruptionError as error:
            raise _strata.CorruptionError(f"{error} [{self._describe_chunks(str(error))}]") from None

    def _describe_chunks(self, message):
        names = {record.tensor_id: record.name for record in self.records}
        described = []
        for chunk_id in sorted({int(m) for m in re.findall(r"chunk (\d+)", message)}):
            if chunk_id < len(self.chunks):
                chunk = self.chunks[chunk_id]
                tensors = ", ".join(names.get(t, str(t)) for t in chunk["tensors"][:4])
                more = "" if len(chunk["tensors"]) <= 4 else f" and {len(chunk['tensors']) - 4} more"
                described.append(f"chunk {chunk_id} holds the {chunk['kind']} of {tensors}{more}")
        return "; ".join(described) or "no chunk named"
