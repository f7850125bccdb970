"""The hooks on the model that move it through the pipeline: the per-module hot path.

Each hook here runs once per module (forward pre/post, backward begin), per
parameter (gradient hooks) or per tensor autograd saves, every micro-batch:
they do the least they can, and what is not per-module work (set-up,
recovery) stays out of them.

- Forward: each module with parameters of its own begins a moment of the
  pipeline; its parameters are materialized (see strata.moments; a parent's
  stay pinned through its children's moments, accessed again in each) and
  released when the module returns.
- Backward: the module's outputs carry an identity autograd function whose
  backward begins the call's backward moment and pins its parameters again
  (written for torch 1.13, which had no module backward pre-hook). As in
  forward, the calls enclosing it keep theirs pinned while their gradient is
  still to come (frozen ones: through the enclosing call's backward), since
  a parent's code between its children, or a checkpointed function
  recomputed, may read them; every other pin of the backward is let go first. So the
  device's pins are released last in, first out, and never leave room in
  pieces between the pins held (Note [Pins against pins] in
  memory/residency_compaction.cc); and a module called twice in one forward
  pins no more at once than calling it once. Parameters sharded, a trainable
  parameter stays pinned until its gradient arrives instead: pinned again,
  it would be gathered from every rank again. Tensors autograd saves that
  are parameters or views of them are saved as (parameter, shape, strides,
  offset) and rebuilt on the chunk's current address when backward unpacks
  them, pinning it on demand if it is not; a chunk may move between forward
  and backward without a stale pointer anywhere. A parameter whose gradient
  arrives after its call's moment (a weight tied to an earlier module's) is
  pinned on demand too.
- Gradients: when autograd has accumulated a parameter's gradient, it is
  added into the parameter's slot of its grad chunk and ``.grad`` is dropped.
"""

import functools
import threading
import weakref

import torch


class _PreBackward(torch.autograd.Function):
    """Identity on a module's output; its backward begins the module's backward moment."""

    @staticmethod
    def forward(ctx, hooks, module_index, lineage, tensor):
        ctx.hooks = hooks
        ctx.module_index = module_index
        ctx.lineage = lineage
        # Not a view: the caller may change the output in place (ReLU(inplace=True)).
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.hooks.pre_backward(ctx.module_index, ctx.lineage)
        return None, None, None, grad


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


def _grad_pre_hook(hooks, record):
    def hook(grad):
        # AccumulateGrad shapes .grad like the parameter: pin it if backward has not.
        if record.pins == 0:
            hooks.pin_for_backward(record)
        return None
    return hook


def _grad_hook(hooks, record):
    def hook(*_):
        hooks.grad_ready(record)
    return hook


def _meta_holders(model):
    """id(parameter) -> [(module, name)] of the model's meta-device parameters."""
    holders = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                holders.setdefault(id(p), []).append((module, name))
    return holders


class Hooks:
    """The hooks of one model, and the state of the forwards and backward running through them."""

    def __init__(self, runtime, table, moments, grad_sync, check_usable, overlap=None):
        self._runtime = runtime
        self._overlap = overlap  # strata.overlap.Overlap: told of each gradient that arrives
        self._table = table
        self._moments = moments
        self._grad_sync = grad_sync
        self._check_usable = check_usable  # raises when training cannot go on (the engine's)
        self._module_params = []     # module index -> records of its own parameters (modules that have some)
        self._handles = []           # the torch hook handles
        self._accumulators = []      # AccumulateGrad nodes, kept alive so that their hooks stay
        self._active = []            # forward: stack of (module index, lineage) of the calls running
        self._saved_hooks = []       # (module index, saved_tensors_hooks context) entered by running modules
        self._backward_params = []   # (record, the call that pinned it as its own, or None: on demand)
        self._backward_pending = set()  # forward calls whose outputs wait for their backward
        self._lineage = ()           # the call whose backward moment is open, after its enclosing calls
        self._calls = 0              # forward calls so far: each one's number
        self._end_queued = False     # end_backward is queued on autograd's engine
        self._own_forward = None     # a forward set on the model instance before install() wrapped it
        self.layered = False         # the forwards of a layered step run (strata.layered): each has its own state
        self._refused = set()        # idents of threads whose forward a layered step gave up on
        # Parameters sharded (comm.shard_params): a param chunk pinned again is gathered again.
        self._sharded = any(chunk["transient"] for chunk in table.chunks if chunk["kind"] == "param")

    # --- set-up ----------------------------------------------------------------

    def take_storage(self, model, hold):
        """Every parameter's gradient hooks are set (a meta-device one is replaced first), then `hold(record)`
        drops its storage (strata.state): the model holds no parameter storage of its own after."""
        holders = _meta_holders(model)
        for record in self._table.records:
            if record.param.is_meta:
                self._table.replace_meta(record, holders[id(record.param)], self._runtime.device,
                                         self._runtime.dtype)
            self._hook_param(record)
            record.param.grad = None
            hold(record)

    def _hook_param(self, record):
        # The AccumulateGrad node holds its hooks in C++, out of the garbage
        # collector's sight: they reach the hooks through a weak reference.
        hooks = weakref.proxy(self)
        with torch.enable_grad():
            p = record.param
            # In the compute dtype and on the compute device first: a change
            # of either would drop the AccumulateGrad node (and its hook) made below.
            p.data = p.data.to(device=self._runtime.device, dtype=self._runtime.dtype)
            if record.trainable:
                # The AccumulateGrad node, kept alive so that its hook stays
                # (made while .data has the parameter's shape: autograd checks
                # gradients against it).
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                accumulator.register_hook(_grad_hook(hooks, record))
                p.register_hook(_grad_pre_hook(hooks, record))
                self._accumulators.append(accumulator)

    def install(self, model):
        """The forward hooks on every module with parameters of its own, and recovery around model.forward."""
        self._handles.append(model.register_forward_pre_hook(self._root_pre_hook))
        for module in model.modules():
            own = [self._table.by_param[id(p)] for _, p in module.named_parameters(recurse=False)]
            if not own:
                continue
            index = len(self._module_params)
            self._module_params.append(own)
            self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_forward_hook(index)))
        self._handles.append(model.register_forward_hook(self._root_post_hook))
        # A forward that raises skips the post-hooks: its pins and saved-tensor
        # hooks are let go as the exception leaves the model.
        original, hooks = model.forward, weakref.proxy(self)
        self._own_forward = model.__dict__.get("forward")  # the model's own, put back by remove()

        @functools.wraps(original)  # its signature, which callers inspect (the HF Trainer: which inputs to keep)
        def forward(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException:
                hooks.forward_raised()
                raise
        model.forward = forward

    def remove(self, model):
        """The engine closes: every pin of forward and backward let go, the hooks and the forward wrapper taken
        off `model` (the parameters' gradient hooks stay, reaching nothing once this is collected)."""
        self.recover()
        self.end_backward()
        for handle in self._handles:
            handle.remove()
        self._handles, self._accumulators = [], []
        if self._own_forward is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = self._own_forward

    def refuse(self, thread):
        """`thread`'s forward was given up on (strata.layered): from now on every hook it reaches raises before
        touching anything, and the forward that raises leaves the others' state alone."""
        self._refused.add(thread.ident)

    def _check_refused(self):
        if self._refused and threading.get_ident() in self._refused:
            raise RuntimeError("strata: this forward was given up on by its layered step (it held its turn past the "
                               "engine's wait timeout); it runs no further through the engine")

    def forward_raised(self):
        if self._refused and threading.get_ident() in self._refused:
            return
        self.recover()
        self._moments.saved_bytes = 0  # its graph is gone

    # --- forward -----------------------------------------------------------------

    def _root_pre_hook(self, module, args):
        self._check_usable()
        if not self.layered:  # the layered step recovers once, before its forwards: each holds pins of its own
            self.recover()  # what a forward that raised left behind
        # Without autograd there is no backward: chunks are pinned outside the pipeline.
        self._moments.direct = not torch.is_grad_enabled()
        if self._moments.direct:
            self._moments.end_moment()
            if self._overlap is not None:
                self._overlap.wait()  # it pins chunks outside the pipeline: not while an update holds them
        elif self._overlap is not None and self._overlap.begun:
            self._moments.end_moment()
            self._overlap.undo()  # a training forward before the step reads the parameters of before it

    def _root_post_hook(self, module, args, output):
        if not self._active:
            self._moments.direct = False
        return None

    def forward_state(self):
        """The state of the forward running: its calls, their saved-tensor hooks and whether it pins outside the
        pipeline (a layered step's forwards take turns, each with its own)."""
        return self._active, self._saved_hooks, self._moments.direct

    def set_forward_state(self, state):
        self._active, self._saved_hooks, self._moments.direct = state

    def recover(self):
        """Lets go of every pin of forwards that did not return, and of their saved-tensor hooks."""
        while self._saved_hooks:
            try:
                self._saved_hooks.pop()[1].__exit__(None, None, None)
            except RuntimeError:
                # Entered by a forward that ran inside backward (activation checkpointing's recomputation):
                # autograd ran it on a copy of this thread's state, gone with that backward.
                pass
        self._active = []
        self._moments.direct = False
        for record in self._table.records:
            if record.pins > 0 and not record.for_backward:
                record.pins = 1
                self._moments.release(record)

    def _pre_forward_hook(self, index):
        moments, own = self._moments, self._module_params[index]

        def hook(module, args):
            self._check_refused()
            if not moments.direct:
                if self._lineage:
                    # A forward inside backward (a checkpointed function's
                    # recomputation) may read the open call's parameters and
                    # its enclosing calls'; the calls it makes are enclosed
                    # by the latter only (a reentrant checkpoint recomputes
                    # as the gradient of its output arrives, which may be
                    # after the backward of the open call is over).
                    self._next_moment(self._lineage)
                else:
                    moments.begin_moment()
                if torch.is_grad_enabled():
                    context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                    context.__enter__()
                    self._saved_hooks.append((index, context))
            self._calls += 1
            self._active.append((index, (self._active[-1][1] if self._active else self._lineage[:-1]) + (self._calls,)))
            for record in own:
                moments.materialize(record)
        return hook

    def _post_forward_hook(self, index):
        moments, own = self._moments, self._module_params[index]

        def hook(module, args, output):
            self._check_refused()
            # A parameter, or a view of one, returned by the module outlives
            # it: copied while its chunk is still pinned.
            output = _map_tensors(output, self._unalias)
            if self._active and self._active[-1][0] == index:
                lineage = self._active.pop()[1]
            else:  # its pre-hook's entry is gone (a forward that raised was recovered from)
                self._calls += 1
                lineage = (self._calls,)
            for record in own:
                moments.release(record)
            if self._saved_hooks and self._saved_hooks[-1][0] == index:
                self._saved_hooks.pop()[1].__exit__(None, None, None)
            if moments.direct or not torch.is_grad_enabled():
                return output
            self._backward_pending.add(lineage[-1])

            def wrap(t):
                if t.requires_grad and t.is_floating_point():
                    return _PreBackward.apply(self, index, lineage, t)
                return t
            return _map_tensors(output, wrap)
        return hook

    def _unalias(self, t):
        base = t._base if t._base is not None else t
        return t.clone() if id(base) in self._table.by_param else t

    # --- saved tensors -------------------------------------------------------------

    def _pack(self, tensor):
        base = tensor._base if tensor._base is not None else tensor
        record = self._table.by_param.get(id(base))
        if record is None or base is not record.param:
            self._moments.saved_bytes += tensor.numel() * tensor.element_size()
            return tensor
        return (record, tensor.size(), tensor.stride(), tensor.storage_offset() - record.param.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            self._moments.saved_bytes = max(0, self._moments.saved_bytes - packed.numel() * packed.element_size())
            return packed
        record, size, stride, offset = packed
        if record.pins == 0:
            self.pin_for_backward(record)
        data = record.param.data
        return data.as_strided(size, stride, data.storage_offset() + offset)

    # --- backward --------------------------------------------------------------------

    def pin_for_backward(self, record, call=None):
        """Pins `record` until the backward lets it go: as `call`'s own parameter, or on demand (None)."""
        if record.for_backward:
            return
        self._moments.materialize(record)
        record.for_backward = True
        record.grad_arrived = False
        self._backward_params.append((record, call))

    def _let_go(self, keep, ending=False):
        """Lets go of the backward's pins but the own parameters of the calls in `keep` whose gradient is still
        to come (frozen ones: all), from the first that goes on, so that those left were pinned first. Returns
        the kept ones after it, to be pinned again once the moment's gradient chunks are let go too.

        Parameters sharded, pinning a parameter again gathers it from every rank again: until the backward is
        `ending`, trainable parameters whose gradient is still to come are kept too (an output head tied to
        the embedding, a weight whose gradient autograd accumulates after the next module's backward began),
        and the pins kept stay as they are."""
        sharded = self._sharded and not ending

        def kept(pin):
            record, call = pin
            return not record.grad_arrived and (call in keep or (sharded and record.trainable))

        pins = self._backward_params
        first = 0
        while first < len(pins) and kept(pins[first]):
            first += 1
        tail = pins[first:]
        del pins[first:]
        gone = [pin for pin in tail if not (sharded and kept(pin))]
        if sharded:
            pins.extend(pin for pin in tail if kept(pin))
        for record, _ in gone:
            record.for_backward = False
            self._moments.release(record)
        return [] if sharded else [pin for pin in gone if kept(pin)]

    def _next_moment(self, keep):
        """Begins the next moment in backward, with the pins `_let_go(keep)` keeps."""
        again = self._let_go(keep)
        self._moments.begin_moment()
        for record, call in again:
            self.pin_for_backward(record, call)

    def pre_backward(self, index, lineage):
        """A module call's backward begins (the first of its outputs' gradients): its moment, and its parameters."""
        call = lineage[-1]
        if call not in self._backward_pending:
            return  # another output of the same call: its moment has begun
        self._backward_pending.discard(call)
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self._next_moment(lineage[:-1])
        self._lineage = lineage
        for record in self._module_params[index]:
            self.pin_for_backward(record, call)

    def grad_ready(self, record):
        """Autograd accumulated `record`'s gradient: added into its slot of its grad chunk, .grad dropped."""
        grad = record.param.grad
        if grad is None:
            return
        record.param.grad = None
        access = self._moments.grad_access(record.grad_chunk)
        target = self._runtime.view(access, self._runtime.dtype, record.numel, record.grad_offset)
        with torch.no_grad():
            target.add_(grad.reshape(-1))
        record.grad_arrived = True
        record.stepped = True
        if self._grad_sync.reducing:
            self._grad_sync.arrived(record)
        if self._overlap is not None and self._overlap.active:
            self._overlap.arrived(record)

    def end_backward(self):
        """Every pin backward holds is let go (autograd's callback as a backward ends, and before a step)."""
        self._end_queued = False
        self._let_go((), ending=True)
        self._lineage = ()
        self._backward_pending.clear()
        self._moments.saved_bytes = 0
