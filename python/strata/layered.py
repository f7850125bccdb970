"""Layered gradient accumulation: every micro-batch through block i before any enters block i+1.

``engine.train_step(micro_batches, loss_fn)`` with accumulation "layered" runs
the step's M forwards on threads of their own, one at a time, that meet at the
pre-forward hook of each of the model's repeated blocks (``find_blocks``): the
forward that has reached the lowest block goes on, micro-batches in order on a
tie. So the code before, between and after the blocks (embeddings, masks, the
head, the loss) runs unchanged, each micro-batch's on its own thread, and each
block runs for all M micro-batches in a row: its chunks are pinned M times in
consecutive moments and move once. One backward over the M losses follows;
autograd runs the nodes made last first, and each forward thread numbers its
nodes from zero, so backward too goes block by block, the last first, and a
block's gradients arrive summed over the micro-batches, once (_number_ahead).

Only the order of work changes, never what is computed: a micro-batch's
forward runs as it would alone, and its parameters are pinned by the same
hooks, so the losses are the standard order's. The micro-batches' gradients
are summed in the standard order too (_number_ahead), and the parameters
come out the same bit for bit, but for a parameter read more than once in a
micro-batch (a tied embedding), and for a model that calls its blocks out of
order (with a warning: the chunks then move more than once too), whose sums
differ within rounding. Blocks a micro-batch skips (layer drop) change
nothing of this. Random draws (dropout) come in another order than in the
standard one.

The blocks run under activation checkpointing (``accumulation_checkpoint``,
on by default): each holds its inputs for all M micro-batches, and backward
recomputes the rest; a key/value cache passed to a block (a Hugging Face
model's ``use_cache``) is left out, as transformers' own gradient
checkpointing does, since the recomputation would write into it again. A
block the model checkpoints itself (transformers' gradient checkpointing) is
left to it. With
``accumulation_offload`` (a size) those inputs are
copied to host memory as each block begins (pinned beside a GPU, the copy on
torch's stream), and come back a block ahead of their recomputation
(_HeldInputs); a step whose inputs would take more is refused as its first
block begins, with the figures.
"""

import contextlib
import math
import threading
import warnings

import torch
import torch.utils.checkpoint

_DONE = math.inf  # where a finished forward stands
_CALLER = -1      # whose turn it is when every forward has finished


class _Stopped(Exception):
    """Raised in a parked forward to unwind it: another micro-batch's forward failed, or the step gave up on one
    that held its turn too long."""


class _Stuck(Exception):
    """A turn held longer than the wait timeout, seen by the caller."""


class LayeredTimeout(TimeoutError):
    """A layered step gave up on a forward that held its turn longer than the engine's wait timeout."""


def find_blocks(model, name=None):
    """The model's repeated blocks: the nn.ModuleList named `name`, or else the one of two or more modules
    of one type holding the most parameters. Returns (its name, it); raises ValueError naming what was
    looked for."""
    if name is not None:
        blocks = dict(model.named_modules()).get(name)
        if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
            found = "nothing" if blocks is None else f"a {type(blocks).__name__}"
            raise ValueError(f"config: accumulation_blocks {name!r} must name a non-empty torch.nn.ModuleList "
                             f"in the model (its blocks, as model.named_modules() names it); it names {found}")
        return name, blocks
    best = None
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > 0 and (best is None or size > best[0]):
                best = (size, module_name, module)
    if best is None:
        raise ValueError(
            f"layered accumulation: {type(model).__name__} has no repeated blocks (a torch.nn.ModuleList of two or "
            "more modules of one type, with parameters, such as GPT's blocks or a Hugging Face model's layers); name "
            "its blocks with the config's accumulation_blocks, or use accumulation \"standard\"")
    return best[1], best[2]


def _autocasts():
    """(device type, dtype) of each autocast on in the calling thread (torch 2.4's calls, or the older ones)."""
    if hasattr(torch, "get_autocast_dtype"):
        return [(kind, torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)]
    kinds = [("cuda", torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype),
             ("cpu", torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype)]
    return [(kind, dtype()) for kind, enabled, dtype in kinds if enabled]


def _thread_settings():
    """What a forward thread takes from the caller's: grad mode, autocast, the default device, the CUDA device and
    stream. (Other thread-local settings, such as a saved_tensors_hooks context around train_step, do not carry.)"""
    grad = torch.is_grad_enabled()
    autocasts = _autocasts()
    default_device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    stream = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stream = torch.cuda.current_stream()

    def apply(stack):
        stack.enter_context(torch.set_grad_enabled(grad))
        if default_device is not None and default_device.type != "cpu":
            torch.set_default_device(default_device)
        if stream is not None:
            torch.cuda.set_device(stream.device)
            stack.enter_context(torch.cuda.stream(stream))
        for kind, dtype in autocasts:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
    return apply


class LayeredForwards:
    """The forwards of one step's micro-batches, run block by block; the hooks that make them meet."""

    def __init__(self, hooks, blocks, checkpoint, offload_bytes, device, timeout_s):
        self._hooks = hooks          # strata.hooks.Hooks: each forward's own state is swapped in with its turn
        self._blocks = blocks
        self._timeout_s = timeout_s  # the longest one forward may hold its turn (the engine's wait timeout)
        self._checkpoint = checkpoint
        self._offload_bytes = offload_bytes  # host memory the blocks' held inputs may take (0: held where they are)
        self._device = device        # where the model computes
        self.held = _HeldInputs(device)
        self._local = threading.local()  # .index: the micro-batch a forward thread runs
        self._turns = threading.Condition()
        self._turn = _CALLER
        self._passes = 0             # turns passed on so far: what a waiter sees as progress
        self._given_up = {}          # micro-batch -> its thread, for forwards that held their turn too long
        self._at = []                # micro-batch -> the block its forward waits at (-1: not begun, _DONE)
        self._last = []              # micro-batch -> the last block its forward entered
        self._states = []            # micro-batch -> its forward's state in the hooks
        self._numbers = []           # micro-batch -> the autograd number its forward took last, at a block
        self._round = (None, 0)      # the block running, and the highest number a forward waiting at it took
        self._stop = False           # a forward failed: the others unwind
        self.out_of_order = False    # a forward skipped back to an earlier block, or entered one twice
        self.boundary_bytes = 0      # the blocks' inputs held for backward, this step
        self.offloaded_bytes = 0     # of which on the host
        self._handles = []
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._park_hook(index), prepend=True))
            self._handles.append(block.register_forward_hook(self._leave_hook))

    def close(self):
        """The engine closes: the blocks' hooks taken off and the held inputs let go. Raises RuntimeError, changing
        nothing, while a forward given up on still runs: it may yet call into the engine."""
        stuck = self.stuck_threads()
        if stuck:
            raise RuntimeError(f"a layered forward given up on is still running ({', '.join(stuck)}): the engine's "
                               "tiers can be given back once it ends")
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.held.clear()

    def stuck_threads(self):
        """The names of the forward threads given up on that still run, after waiting up to the wait timeout."""
        for thread in self._given_up.values():
            thread.join(self._timeout_s)
        return [thread.name for thread in self._given_up.values() if thread.is_alive()]

    def run(self, model, micro_batches, loss_fn, scale):
        """loss_fn(model, micro_batch) for every micro-batch, block by block; returns the losses in order, and
        each multiplied by `scale` for backward (on its own thread: see _number_ahead)."""
        if self._hooks.layered:
            raise RuntimeError("engine.train_step: called inside a layered step's loss_fn; a step cannot hold another")
        count = len(micro_batches)
        self._at, self._last = [-1] * count, [-1] * count
        self._states = [([], [], False) for _ in range(count)]
        self._numbers = [0] * count
        self._round = (None, 0)
        self._stop, self.out_of_order, self.boundary_bytes, self.offloaded_bytes = False, False, 0, 0
        self.held.clear()
        self.held.fetched_ahead = 0
        losses, scaled, errors = [None] * count, [None] * count, [None] * count
        settings = _thread_settings()
        self._hooks.recover()  # what a forward that raised left behind; each thread's root hook leaves it alone
        caller_state = self._hooks.forward_state()
        self._hooks.layered = True
        originals = self._wrap_blocks() if self._checkpoint else []
        threads = [threading.Thread(target=self._forward, daemon=True, name=f"strata-layered-{m}",
                                    args=(m, model, micro_batch, loss_fn, settings, scale, (losses, scaled, errors)))
                   for m, micro_batch in enumerate(micro_batches)]
        started, stuck = 0, None
        try:
            with self._turns:
                self._turn = 0
            for thread in threads:
                thread.start()
                started += 1
            self._wait_turn(_CALLER)
        except _Stuck as error:
            stuck = self._stuck_message(error.args[0], threads)
            self._unwind(started, threads, error.args[0])
        except BaseException:
            # Interrupted (or a thread that did not start): the forwards unwind, one at a time, before the caller
            # goes on; none may run beside what it does next.
            self._unwind(started, threads)
            raise
        finally:
            for m, thread in enumerate(threads[:started]):
                if m not in self._given_up:
                    thread.join(self._timeout_s)  # each has passed its last turn on: it ends
                    if thread.is_alive():  # yet it did not: given up on, refused by the hooks as _unwind does
                        self._given_up[m] = thread
                        self._hooks.refuse(thread)
            self._hooks.layered = False
            self._hooks.set_forward_state(caller_state)
            for block, original in originals:
                if original is None:
                    del block.forward
                else:
                    block.forward = original
        if stuck is not None:
            raise LayeredTimeout(stuck)
        failed = [error for error in errors if error is not None]
        if failed:
            raise failed[0]
        if self.out_of_order:
            warnings.warn("strata: layered accumulation: a forward went back to an earlier block, or entered one "
                          "twice: the blocks' chunks moved more than once, and gradients summed in another order "
                          "than the standard one's (within rounding)", stacklevel=3)
        return losses, scaled

    # --- each forward's thread ---------------------------------------------------------------------------

    def _forward(self, m, model, micro_batch, loss_fn, settings, scale, out):
        losses, scaled, errors = out
        self._local.index = m
        try:
            self._wait_turn(m)
            if not self._stop:
                with contextlib.ExitStack() as stack:
                    settings(stack)
                    _number_ahead(len(self._at) - 1 - m)
                    self._hooks.set_forward_state(self._states[m])
                    losses[m] = checked_loss(loss_fn(model, micro_batch), m)
                    scaled[m] = scaled_loss(losses[m], scale)
        except _Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 (raised by the caller, first micro-batch first)
            errors[m] = error
            self._stop = True
        finally:
            self._local.index = None
            if m not in self._given_up:  # one given up on ends when it may, after its step: it touches nothing
                self._at[m] = _DONE
                self._pass_on(m)

    def _park_hook(self, index):
        def hook(module, args):
            m = getattr(self._local, "index", None)
            if m is None:  # not a layered forward (a recomputation in backward, another forward)
                return None
            if m in self._given_up:
                raise _Stopped()
            if index <= self._last[m]:
                self.out_of_order = True
            self._last[m] = self._at[m] = index
            self._states[m] = self._hooks.forward_state()
            self._numbers[m] = _number_ahead(1)
            self._pass_on()
            self._wait_turn(m)
            self._hooks.set_forward_state(self._states[m])
            if self._stop:
                raise _Stopped()
            # Every forward at this block starts it from the same number, less its micro-batch, and apart from
            # the code before it (whatever blocks each one skipped).
            count = len(self._at)
            if self._round[0] != index:  # the first forward to run this block: all that will are waiting at it
                self._round = (index, max(n for n, at in zip(self._numbers, self._at) if at == index))
            start = self._round[1] + count + (count - 1 - m)
            _number_ahead(start - self._numbers[m] - 1)
            return None
        return hook

    def _leave_hook(self, module, args, output):
        if getattr(self._local, "index", None) is not None:
            _number_ahead(len(self._at))  # the code after the block apart from it, as before it
        return None

    def _pass_on(self, holder=None):
        """The turn goes to the forward at the lowest block (the first micro-batch on a tie), or to the caller;
        from `holder` only while it holds it (a forward that stopped waiting on its own does not)."""
        with self._turns:
            if holder is not None and self._turn != holder:
                self._turns.notify_all()
                return
            waiting = [(at, m) for m, at in enumerate(self._at) if at != _DONE and m not in self._given_up]
            self._turn = min(waiting)[1] if waiting else _CALLER
            self._passes += 1
            self._turns.notify_all()

    def _wait_turn(self, m):
        """Waits for `m`'s turn (a micro-batch, or _CALLER). In the caller, raises _Stuck(micro-batch) when one
        forward holds its turn longer than the wait timeout; a forward waits for as long as the others progress,
        and stops (_Stopped) after two wait timeouts without any: the caller would have given up after one, so
        it is gone."""
        with self._turns:
            idle = 0
            while self._turn != m:
                passes = self._passes
                progressed = self._turns.wait_for(lambda: self._turn == m or self._passes != passes, self._timeout_s)
                idle = 0 if progressed else idle + 1
                if idle and m == _CALLER:  # the caller alone gives up on a forward: it knows the step's threads
                    raise _Stuck(self._turn)
                if idle == 2:
                    raise _Stopped()

    def _unwind(self, started, threads, stuck=None):
        """The step ends early: every forward begun unwinds in its turn (raising _Stopped where it waits), those
        not begun never start, and one that holds its turn past the wait timeout (`stuck`, or found so here) is
        given up on: the turn passes on without it, and strata's hooks refuse it from then on (its thread is a
        daemon, left to end when it may)."""
        while True:
            with self._turns:
                self._stop = True
                for m in range(started, len(self._at)):
                    self._at[m] = _DONE
                if stuck is not None:
                    self._given_up[stuck] = threads[stuck]
                    self._hooks.refuse(threads[stuck])
                if stuck is not None or self._turn >= started:
                    self._pass_on()
            try:
                self._wait_turn(_CALLER)
                return
            except _Stuck as error:
                stuck = error.args[0]

    def _stuck_message(self, m, threads):
        block = self._last[m]
        where = f"in block {block} of the model's blocks" if block >= 0 else "before the first block"
        state = "its thread is still running" if threads[m].is_alive() else "its thread ended without passing on"
        return (f"layered accumulation: micro-batch {m}'s forward has held its turn {where} for more than "
                f"{self._timeout_s:g} s with nothing passed on ({state}): a deadlock in the model or its loss_fn, or "
                "a block slower than the engine's wait timeout (the larger of device.copy_timeout_ms and "
                "nvme.io_timeout_ms; raise it for such a block). The step's other forwards were stopped; the engine "
                "cannot train on")

    # --- checkpointing ------------------------------------------------------------------------------------

    def _wrap_blocks(self):
        """Each block's forward under activation checkpointing while the step's forwards run; returns what to
        put back: (block, its own forward attribute or None)."""
        originals = []
        for index, block in enumerate(self._blocks):
            if getattr(block, "gradient_checkpointing", False) and block.training:
                continue  # checkpointed by the model itself (transformers' gradient_checkpointing_enable())
            original = block.__dict__.get("forward")
            inner = block.forward

            def forward(*args, _inner=inner, _index=index, **kwargs):
                if getattr(self._local, "index", None) is None:
                    return _inner(*args, **kwargs)
                return self._checkpointed(_inner, _index, args, kwargs)
            block.forward = forward
            originals.append((block, original))
        return originals

    def _checkpointed(self, inner, index, args, kwargs):
        """Block `index`'s forward, checkpointed: its positional tensor inputs held for backward, on the host with
        accumulation_offload (back on the device ahead of the recomputation: _HeldInputs)."""
        m, given = self._local.index, args
        size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        if self._offload_bytes:
            # The step's held inputs, as this first block's are for every block and micro-batch.
            need = max(self.boundary_bytes + size, size * len(self._blocks) * len(self._at))
            if need > self._offload_bytes:
                raise ValueError(
                    f"layered accumulation: the blocks' inputs held on the host for backward take {need} bytes "
                    f"({len(self._at)} micro-batches x {len(self._blocks)} blocks x {size} bytes), more than "
                    f"accumulation_offload's {self._offload_bytes}: raise it to at least {need}, or give fewer "
                    "micro-batches a step")
            args = self.held.keep(index, m, args)
            self.offloaded_bytes += size
        self.boundary_bytes += size

        def run(*held, **named):
            if getattr(self._local, "index", None) is not None:
                held = given  # the step's forward: on the inputs as given (the host copies are for backward)
            elif self._offload_bytes:  # the recomputation
                held = self.held.back(index, m, held)
            return inner(*(a.to(self._device, non_blocking=True) if isinstance(a, torch.Tensor) else a
                           for a in held), **named)
        kwargs = _without_cache(kwargs)
        # Recomputed whole: stopped early, its modules' post-hooks would not run (their pins stay).
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


class _HeldInputs:
    """The blocks' inputs a layered step holds on the host (accumulation_offload), and their way back.

    Backward recomputes the blocks from the last; as block b's recomputation
    begins, block b-1's inputs of every micro-batch are copied back to the
    device (beside a GPU on a stream of their own, which the recomputation
    waits for), so that they are there when its turn comes: the copies hide
    behind block b's backward. On the emulated device the copy is a clone."""

    def __init__(self, device):
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._host = {}  # block -> {micro-batch: its positional inputs, tensors copied to the host}, until fetched
        self._back = {}  # (block, micro-batch) -> the same on the device, copied ahead
        self.fetched_ahead = 0  # recomputations this step that found their inputs back ahead

    def clear(self):
        """Forgets the step's inputs (once its backward is done, or failed)."""
        self._host.clear()
        self._back.clear()

    def keep(self, block, m, args):
        """Forward: `args` with their tensors copied to the host, kept for the way back."""
        held = tuple(_on_host(a) if isinstance(a, torch.Tensor) else a for a in args)
        self._host.setdefault(block, {})[m] = held
        return held

    def back(self, block, m, held):
        """Block `block`'s recomputation for micro-batch m: its inputs, on the device if copied ahead; copies
        the block before's ahead."""
        ahead = self._back.pop((block, m), None)
        if ahead is not None:
            self.fetched_ahead += 1
            if self._stream is not None:
                current = torch.cuda.current_stream(self._device)
                current.wait_stream(self._stream)
                for a in ahead:
                    if isinstance(a, torch.Tensor):
                        a.record_stream(current)
            # As the copy the forward made: a tensor autograd records the block's operations on.
            held = tuple(a.requires_grad_(h.requires_grad) if isinstance(a, torch.Tensor) else a
                         for a, h in zip(ahead, held))
        before = self._host.pop(block - 1, None)
        if before is not None:
            self._fetch(block - 1, before)
        return held

    def _fetch(self, block, inputs):
        """Copies `inputs` ({micro-batch: held}) of `block` back to the device: on the copy stream beside a GPU,
        a clone on the emulated device."""
        if self._stream is None:
            copy, context = (lambda a: a.detach().clone()), contextlib.nullcontext()
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            copy = lambda a: a.detach().to(self._device, non_blocking=True)  # noqa: E731
            context = torch.cuda.stream(self._stream)
        with context:
            for m, held in inputs.items():
                self._back[(block, m)] = tuple(copy(a) if isinstance(a, torch.Tensor) else a for a in held)


# A block's keyword arguments that carry a key/value cache (Hugging Face's names): the recomputation in backward
# would add to it a second time.
_CACHES = ("past_key_values", "past_key_value", "layer_past")


def _without_cache(kwargs):
    """`kwargs` with no cache for the block to write into, as transformers' own gradient checkpointing does: a
    training step reads none."""
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    for name in _CACHES:
        if kwargs.get(name) is not None:
            kwargs = {**kwargs, name: None}
    return kwargs


def _on_host(tensor):
    """A copy of `tensor` in host memory (pinned beside a GPU), out of autograd's graph but requiring grad as it
    does (the block's recomputation records its operations on it)."""
    pinned = tensor.is_cuda
    with torch.no_grad():
        held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned).copy_(tensor, non_blocking=pinned)
    return held.requires_grad_(tensor.requires_grad)


def _sequence_number(node):
    """The autograd number of `node` (a tensor's grad_fn): the one private PyTorch call strata makes. Each
    thread numbers the nodes it makes from zero, one after another, and backward runs the highest number
    first among the nodes ready; the layered order rests on both, which autograd_order_problem() checks on
    the PyTorch that runs before any layered step trusts them."""
    return node._sequence_nr()


def _probe_autograd_order(number_of):
    """What keeps autograd's numbering from being the layered order's (autograd_order_problem), or None."""
    with torch.enable_grad():
        if not callable(getattr(torch.zeros((), requires_grad=True).add(0).grad_fn, "_sequence_nr", None)):
            return "its autograd nodes have no _sequence_nr"
    x = torch.zeros((), requires_grad=True)
    made = [{}, {}]  # on each of two fresh threads: the nodes, their numbers, or what went wrong

    def make(into):  # as each forward runs: on a thread of its own
        try:
            with torch.enable_grad():
                into["outputs"] = [x.add(0), x.mul(2), x.mul(3)]
                into["numbers"] = [number_of(out.grad_fn) for out in into["outputs"]]
        except Exception as error:  # noqa: BLE001 (reported as the probe's finding)
            into["error"] = f"{type(error).__name__}: {error}"

    for into in made:
        thread = threading.Thread(target=make, args=(into,), name="strata-autograd-probe", daemon=True)
        thread.start()
        thread.join(60)
        if "error" in into:
            return f"making autograd nodes on a thread raised {into['error']}"
        if "numbers" not in into:
            return "a thread making three autograd nodes did not finish within 60 s"
    numbers = made[0]["numbers"]
    if numbers != [numbers[0], numbers[0] + 1, numbers[0] + 2]:
        return f"three nodes made in a row on one thread were numbered {numbers}, not one after another"
    if made[1]["numbers"] != numbers:
        return f"two fresh threads numbered their first nodes {numbers} and {made[1]['numbers']}, not alike"
    ran = []
    outputs = made[0]["outputs"]
    for out in outputs:
        out.grad_fn.register_prehook(lambda grads, number=number_of(out.grad_fn): ran.append(number))
    torch.autograd.backward(outputs, [torch.ones(())] * 3)
    if ran != sorted(numbers, reverse=True):
        return f"backward ran three ready nodes numbered {numbers} in the order {ran}, not the highest first"
    return None


_AUTOGRAD_ORDER = []  # the probe's finding, once made


def autograd_order_problem():
    """None where this PyTorch numbers and runs autograd's nodes as the layered order needs (checked once,
    by making and running a few), else what differs: a layered step then runs in the standard order."""
    if not _AUTOGRAD_ORDER:
        _AUTOGRAD_ORDER.append(_probe_autograd_order(_sequence_number))
    return _AUTOGRAD_ORDER[0]


def _number_ahead(count):
    """Makes `count` autograd nodes on this thread, whose numbers the forward's nodes then follow; returns the
    last number taken.

    Autograd numbers the nodes each thread makes from zero, and backward runs
    the highest number first among those ready (so, on each thread, the reverse
    of the order made). The forwards run the same code, and each begins each
    block from the same number less its micro-batch's index: micro-batch m's
    node at a place in a block has a higher number than micro-batch m+1's at
    the same place, so that in backward it runs first, and a block's
    gradients come into autograd's sum in micro-batch order, as the standard
    order adds them into the grad chunk: the sum is the same bit for bit (a
    parameter read twice in a micro-batch, such as a tied embedding, sums in
    another order). M numbers between a block and the code before it keep
    them apart: else the last nodes before micro-batch 0's block would run
    among the first of micro-batch M-1's, pinning the block before in the
    middle of the one after."""
    number = -1
    with torch.enable_grad():
        x = torch.zeros((), requires_grad=True)
        for _ in range(count):
            number = _sequence_number(x.add(0).grad_fn)
    return number


def scaled_loss(loss, scale):
    """`loss` times `scale`, for its backward (itself when the scale is 1)."""
    return loss if scale == 1.0 else loss * scale


def checked_loss(loss, m):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else (
            f"a tensor of {loss.numel()} elements" if loss.numel() != 1 else "a tensor that does not require grad")
        raise ValueError(f"engine.train_step: loss_fn(model, micro_batch) must return the micro-batch's loss, a tensor "
                         f"of one element that requires grad; micro-batch {m} returned {what}")
    return loss
