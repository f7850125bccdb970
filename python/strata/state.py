"""The model's own PyTorch API on a model strata holds: its parameters outside forward and backward,
``model.state_dict()``, ``model.load_state_dict()`` and ``engine.gathered()``.

Held parameters. A parameter's values live in strata's chunks; the model
holds no storage for them. Outside forward and backward each parameter is
*held*: its ``.data`` is a placeholder with the real shape, dtype and device
whose storage is one element shared by every parameter, and its class is a
subclass of its own whose ``__torch_function__`` answers metadata (shape,
dtype, device, numel, requires_grad, grad, hash) and refuses everything that
reads or writes values (``p.sum()``, ``print(p)``, ``p.tolist()``,
``torch.save(p)``, ``p.data``, ``p.copy_(x)``, ``F.linear(x, p)``) with an
error naming ``engine.gathered()`` and ``model.state_dict()``. While a
module computes, strata.moments sets the parameter's own class back and
``.data`` to its chunk view: the forward and backward hot path pays two
attribute stores per parameter and no ``__torch_function__`` per op (a
subclass that stayed on would pay one Python call per op that touches a
parameter). Swapping the class keeps the parameter object, its autograd
node and its hooks; the placeholder keeps the compute dtype and device, so
autograd keeps the parameter's AccumulateGrad node across the swaps.

model.state_dict(): torch walks the modules and stores ``param.detach()``
for each parameter, under its names (a tied one under each); a held
parameter's detach is a *marker* (a held tensor that knows its parameter),
and the post-hook of the outermost state_dict call replaces every marker by
the values read from wherever the chunks are (strata.weights: each chunk
read once, dropped after its last parameter). The outermost call is told by
the pre-hooks: a call nested in another is the call of a direct child, with
its prefix. keep_vars=True gives the parameters themselves, as torch does.

model.load_state_dict(): torch's own code walks the keys, checks shapes and
words its errors; a held parameter's ``copy_`` there records the values
instead of writing them. Torch decides whether the load fails only after
its hooks have run (every module's load is made as if strict, and strict
is applied at the end), so the call is wrapped: the values are written into
the chunks (and fp32 masters) only once torch has returned, through the
engine's load (every check first, the ranks agreeing); buffers, which torch
copies as it goes, are set back and copied again with the parameters, so a
load that fails changes nothing.
"""

import functools
import weakref

import torch

from .runtime import CLOSED

Tensor = torch.Tensor

# What a held tensor answers: metadata, its identity, its gradient.
_METADATA = frozenset(
    [getattr(Tensor, name).__get__ for name in (
        "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda",
        "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "output_nr", "_version",
        "_base", "itemsize", "nbytes") if hasattr(Tensor, name)]
    + [Tensor.grad.__set__, Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.element_size,
       Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, Tensor.__len__, Tensor.__hash__,
       Tensor.register_hook])

_DETACH = frozenset([Tensor.detach, torch.detach])


def _function_name(func):
    owner = getattr(func, "__self__", None)  # a property's __get__ / __set__: the property's name
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__") and owner is not None:
        return f"Tensor.{getattr(owner, '__name__', '?')}"
    return name


def _nested(outer, module, prefix):
    """Whether a state_dict call of `module` under `prefix` is the one torch makes for a child of `outer`'s."""
    parent, parent_prefix = outer
    return prefix.startswith(parent_prefix) and parent._modules.get(prefix[len(parent_prefix):-1]) is module


class _Load:
    """What a model.load_state_dict() sets once torch has accepted it."""

    def __init__(self, values, buffers, result):
        self.values = values    # record -> flat values torch copied into the parameter
        self.buffers = buffers  # [(buffer, the value torch copied into it)]
        self.result = result    # torch's (missing_keys, unexpected_keys)


class ModelState:
    """The held parameters of one model, and its state_dict, load_state_dict and gathered() on them."""

    def __init__(self, runtime, table, weights):
        self._runtime = runtime
        self._table = table
        self._weights = weights
        # Every placeholder is a view of this one element (NaN, should anything read it behind torch's back).
        self._nothing = torch.full((), float("nan"), dtype=runtime.dtype, device=runtime.device)
        # Weakly: the held classes live as long as the model's parameters do, which must not keep the engine
        # alive (a tensor does not show the garbage collector its reference to its class).
        state = weakref.ref(self)

        def torch_function(cls, func, types, args=(), kwargs=None):
            if state() is None:
                raise RuntimeError("strata: this parameter was held by a strata engine that is gone: its values "
                                   "went with it")
            return state()._torch_function(func, args, kwargs)
        handler = self._handler = classmethod(torch_function)
        self._held_classes = {}   # a parameter's own class -> its held subclass
        self._marker_class = type("HeldValues", (Tensor,), {"__torch_function__": handler})
        self._saving = []         # (module, prefix) of the state_dict calls running, outermost first
        self._loading = None      # while torch's load_state_dict runs: record -> the flat values it copied
        self.gathering = None     # while engine.gathered() is open: the records whose values it holds

    # --- held parameters ---------------------------------------------------------------

    def hold(self, record):
        """The parameter's storage dropped: its .data the placeholder, its class the held one."""
        p = record.param
        if record.placeholder is None:
            record.placeholder = self._nothing.expand(record.shape)
            record.plain_class = type(p)
            record.held_class = self._held_classes.get(type(p))
            if record.held_class is None:
                record.held_class = self._held_classes[type(p)] = type(
                    f"Held{type(p).__name__}", (type(p),), {"__torch_function__": self._handler})
        p.data = record.placeholder
        p.__class__ = record.held_class

    def _torch_function(self, func, args, kwargs):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        record = self._held_record(args, kwargs)
        if func in _DETACH:
            return self._marker(record)
        if func == Tensor.copy_ and self._loading is not None and args[0] is record.param:
            if args[1].is_meta:  # as copy_ itself refuses
                raise NotImplementedError("Cannot copy out of meta tensor; no data!")
            self._loading[record] = args[1].detach().reshape(-1)  # torch's load_state_dict (see the module's doc)
            return args[0]
        raise RuntimeError(
            f"strata: parameter '{record.name}' is held by a strata engine: outside forward and backward its values "
            f"live in strata's chunks, not in the tensor, so {_function_name(func)} cannot run on it. Read or change "
            "them inside `with engine.gathered():` (all parameters, or engine.gathered(module)), or copy them all "
            "out with model.state_dict()")

    def _held_record(self, args, kwargs):
        """The record of the first held tensor among a torch function's arguments."""
        for value in (*args, *kwargs.values()):
            for item in (value if isinstance(value, (list, tuple)) else (value,)):
                if type(item) is self._marker_class:
                    return item.strata_record
                record = self._table.by_param.get(id(item)) if isinstance(item, Tensor) else None
                if record is not None and record.param is item:
                    return record
        raise AssertionError("strata: a held tensor's __torch_function__ ran without one")

    def _marker(self, record):
        marker = Tensor._make_subclass(self._marker_class, record.placeholder, False)
        marker.strata_record = record
        return marker

    # --- model.state_dict() ----------------------------------------------------------------

    def install(self, model, load):
        """The state_dict hooks on every module of `model`, and its load_state_dict through `load` (the engine's:
        load(what, plan, apply))."""
        def ends(module, destination, prefix, local_metadata):  # a function: torch marks it
            self._state_dict_ends(module, destination, prefix)

        for module in model.modules():
            module.register_state_dict_pre_hook(self._state_dict_begins)
            post = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
            post(ends)
            module.load_state_dict = functools.partial(self._load_state_dict, module, load)

    def _check_open(self):
        if self._runtime.engine.closed:
            raise RuntimeError(f"strata: {CLOSED}")

    def _state_dict_begins(self, module, prefix, keep_vars):
        self._check_open()
        if self._saving and not _nested(self._saving[-1], module, prefix):
            self._saving.clear()  # what a state_dict call that raised left
        self._saving.append((module, prefix))

    def _state_dict_ends(self, module, destination, prefix):
        if self._saving and self._saving[-1][0] is module:
            self._saving.pop()
        if self._saving:
            return
        markers = {key: value.strata_record for key, value in destination.items()
                   if type(value) is self._marker_class}
        values = dict(self._weights.read(set(markers.values())))
        for key, record in markers.items():
            destination[key] = values[record]

    # --- model.load_state_dict() -----------------------------------------------------------

    def _load_state_dict(self, module, load, state_dict, strict=True, assign=False):
        """torch's Module.load_state_dict on `module`, its parameters' values written once it has returned."""
        self._check_open()
        return load("load_state_dict", lambda: self._plan_load(module, state_dict, strict, assign),
                    self._apply_load).result

    def _plan_load(self, module, state_dict, strict, assign):
        if assign:
            raise ValueError("strata: load_state_dict(assign=True) would put the state dict's tensors in place of "
                             "parameters strata holds; use assign=False (the default): the values are copied into "
                             "strata's chunks")
        swapping = getattr(torch.__future__, "get_swap_module_params_on_conversion", None)  # torch >= 2.3
        if swapping is not None and swapping():
            raise ValueError("strata: load_state_dict with torch.__future__.set_swap_module_params_on_conversion"
                             "(True) would swap parameters strata holds; set it to False around the load")
        buffers = list({id(b): b for b in module.buffers()}.values())
        before = [b.clone() for b in buffers]
        self._loading = {}
        try:
            result = type(module).load_state_dict(module, state_dict, strict)
        finally:
            values, self._loading = self._loading, None
            with torch.no_grad():  # torch copied buffers as it went: set back until the load is accepted
                loaded = [(b, b.clone()) for b, old in zip(buffers, before) if not torch.equal(b, old)]
                for b, old in zip(buffers, before):
                    b.copy_(old)
        return _Load(values, loaded, result)

    def _apply_load(self, plan):
        self._weights.write(plan.values)
        with torch.no_grad():
            for buffer, value in plan.buffers:
                buffer.copy_(value)

    # --- engine.gathered() -------------------------------------------------------------------

    def records_of(self, params):
        """The records of `params`: None (every parameter), a module (its parameters), a parameter, or an
        iterable of modules and parameters."""
        if params is None:
            return list(self._table.records)
        items = [params] if isinstance(params, (torch.nn.Module, Tensor)) else list(params)
        records = {}
        for item in items:
            for p in item.parameters() if isinstance(item, torch.nn.Module) else [item]:
                record = self._table.by_param.get(id(p)) if isinstance(p, Tensor) else None
                if record is None or record.param is not p:
                    raise ValueError(f"engine.gathered: {type(p).__name__} {tuple(getattr(p, 'shape', ()))} is not "
                                     "a parameter of the model this engine holds; give its modules or parameters")
                records[record] = None
        return list(records)

    def gather(self, records):
        """Each record's values, read from the chunks, become its parameter's .data (a copy on the compute
        device, in the compute dtype)."""
        done = []
        try:
            for record, values in self._weights.read(records):
                record.param.__class__ = record.plain_class
                record.param.data = values.to(self._runtime.device)
                done.append(record)
        except BaseException:
            self.put_back(done)
            raise
        self.gathering = records

    def changes(self, records):
        """The values to write for the gathered `records` that changed: the parameter's as edited, or under
        bf16/fp16 its master with the elements that changed set to them (the others keep their fp32 bits).
        ValueError, before anything is written, for a parameter whose .data was given another shape or dtype."""
        wrong = [f"{r.name} is {list(r.param.data.shape)} {r.param.data.dtype}, not {list(r.shape)} "
                 f"{self._runtime.dtype}" for r in records
                 if tuple(r.param.data.shape) != r.shape or r.param.data.dtype != self._runtime.dtype]
        if wrong:
            raise ValueError(f"engine.gathered: a parameter's .data was replaced by one of another shape or dtype "
                             f"({'; '.join(wrong)}): nothing was written back")
        changed = {}
        for record, before in self._weights.read(records):
            now = record.param.data.detach().to("cpu")
            if not torch.equal(now, before):
                changed[record] = (now, now != before)
        masters = dict(self._weights.read([r for r in changed if r.master_chunk is not None], master=True))
        values = {}
        for record, (now, edited) in changed.items():
            master = masters.get(record)
            if master is not None:
                master[edited] = now[edited].to(master.dtype)
                now = master
            values[record] = now.reshape(-1)
        return values

    def put_back(self, records):
        """The gathered parameters held again (their copies dropped)."""
        self.gathering = None
        for record in records:
            record.param.grad = None
            self.hold(record)
