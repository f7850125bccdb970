"""optimizer.overlap: each chunk group's update begun in backward (overlapped), as soon as its gradients are final.

In the last backward before a step, a grad chunk is final once every
trainable parameter in it has had its gradient added (autograd accumulates a
parameter's gradient once per backward). At the next moment boundary, the
chunk group's update begins on the pipeline's own thread, beside the rest of
backward, from a plan made before the step's norm is known; the step confirms
it, or puts the group back from the copy it kept and updates it again after a
clip, an overflow or a hyperparameter changed in between (Note [Overlapped
updates] in offload/training/overlap_updates.cc). The groups backward
completes last (in its last moment) are left to the step. A gradient that
comes into a chunk after its update began (a parameter reentrant
checkpointing accumulates twice) makes the step redo that group from the
whole gradient. A training forward before the step (more backwards than
gradient_accumulation_steps) puts the updated groups back first: it reads the
parameters of before the step, as without overlap.
"""

from . import _strata


class Overlap:
    """The updates begun beside this backward, and which grad chunks are complete."""

    def __init__(self, runtime, table, pipeline, optimizer, on):
        self.on = on
        self.updates = None  # made by start()
        self._made = (runtime.engine, pipeline, optimizer)
        self._params_of = {}  # grad chunk -> how many trainable parameters it holds
        for record in table.records:
            if record.trainable:
                self._params_of[record.grad_chunk] = self._params_of.get(record.grad_chunk, 0) + 1
        self.active = False   # this backward is the last before a step, with overlap on
        self._arrived = {}    # this backward's: grad chunk -> ids of the parameters whose gradient came in
        self._ready = []      # complete grad chunks whose update is still to begin
        self._begun = set()   # grad chunks whose update began since the last step
        self.failed = None    # why putting the groups back failed: training cannot go on

    def start(self, reducer):
        """Makes the updates' holder (optimizer.overlap's bytes of copies), with the data-parallel rank's GradReducer:
        there each update runs on its group's reduction, the gradients submitted to `reducer` as they complete."""
        if self.on:
            self.updates = _strata.OverlapUpdates(*self._made, reducer=reducer)
        self._made = None

    def begin_backward(self, before_step, saving):
        """A new backward: the one before a step begins updates (not while an asynchronous save reads the
        groups: a save waits for nothing beside backward). A second one before the same step (more backwards
        than gradient_accumulation_steps) adds into chunks whose update began: late gradients."""
        self.active = self.updates is not None and before_step and not saving
        self._arrived, self._ready = {}, []

    def arrived(self, record):
        """While active: `record`'s gradient is in its grad chunk."""
        chunk = record.grad_chunk
        if chunk in self._begun:
            self.updates.late(chunk)
            return
        arrived = self._arrived.setdefault(chunk, set())
        arrived.add(id(record))
        if len(arrived) == self._params_of[chunk]:
            self._ready.append(chunk)

    @property
    def pending(self):
        return bool(self._ready)

    def begin_ready(self):
        """Between two moments: the updates of the chunks completed since the last call begin."""
        for chunk in self._ready:
            if self.updates.begin(chunk):
                self._begun.add(chunk)
        self._ready.clear()

    def leave_ready(self):
        """Backward has ended: the groups it completed last are not begun. The step updates them as without overlap,
        at the kernel's full width and with no copy, as nothing of backward is left to hide them behind (Note
        [Overlapped updates] in offload/training/overlap_updates.cc)."""
        self._ready.clear()

    def late(self, chunk):
        """Data parallel: a late gradient on some rank reduces `chunk` again on every rank; its update is redone."""
        if chunk in self._begun:
            self.updates.late(chunk)

    def wait(self):
        """The updates in flight are done (before the optimizer's values change, or a chunk is read outside
        the pipeline)."""
        if self._begun:
            self.updates.wait()

    @property
    def begun(self):
        return bool(self._begun)

    def undo(self):
        """A training forward before the step (another backward before it): the groups updated are put back as
        they were, so that it reads the parameters of before the step; its backward begins them again."""
        try:
            self.updates.undo()
        except BaseException as error:
            self.failed = (f"putting back the chunk groups updated beside backward failed ({type(error).__name__}: "
                           f"{error}); some are as before the step and others updated")
            raise
        finally:
            self.stepped()

    def stepped(self):
        """The step took this step's updates."""
        self._begun = set()
        self._ready = []

    def discard(self):
        """After a backward or step that failed: the updates begun are forgotten once done (their copies are of
        a state no longer there)."""
        if self.updates is not None:
            self.updates.discard()
        self.stepped()
