"""The pipeline's moments, and the chunks pinned in them for the parameters the model computes with.

One training iteration (forward and backward of every micro-batch, then the
step) is one iteration of the engine's pipeline; each module's forward and
backward begins a moment of it. A parameter being computed with is
*materialized*: its ``.data`` is a view of its chunk, pinned where the model
computes, and its class its own; released, it is held again: its placeholder
and the class whose reads raise (strata.state). Forwards without autograd
(``direct``) pin chunks outside the pipeline, so that they do not disturb its plan.

``materialize`` and ``release`` are on the hot path (every parameter of every
module, each micro-batch): they touch a dict and a counter unless the chunk
must be pinned or let go, and set the parameter's class and ``.data``.
"""

import torch


class Moments:
    """The open iteration and moment of the pipeline, and what is pinned in them."""

    def __init__(self, runtime, table, pipeline, grad_sync, non_model_memory):
        self._runtime = runtime
        self._table = table
        self._pipeline = pipeline
        self._grad_sync = grad_sync                # gathers a sharded parameter chunk as it is pinned
        self._non_model_memory = non_model_memory  # bytes from the configuration, or None: measured
        self.held = {}            # chunk id -> [ChunkAccess, params materialized in it]
        self.moment_chunks = {}   # chunk id -> ChunkAccess, grad chunks of the open moment
        self.in_iteration = False
        self.in_moment = False
        self.direct = False       # an evaluation forward: chunks pinned outside the pipeline
        self.saved_bytes = 0      # activations autograd holds (non-model memory estimate)
        self.pin_error = None     # the last MemoryError pinning a chunk in backward (engine.backward re-raises it)
        self.overlap = None       # strata.overlap.Overlap: updates begun between moments

    # --- moments -------------------------------------------------------------

    def _non_model_bytes(self):
        if self._non_model_memory is not None:
            return self._non_model_memory
        if self._runtime.emulated:
            return 0  # activations live in process memory: the emulated device's tier holds chunks only
        if torch.cuda.is_available():
            # What memory_allocated() returns, read without it: it flattens every allocator statistic into a new
            # dict first, about 0.4 ms a call, and a step begins a moment per module (0.12 s a step at 0.94B).
            return torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"]
        return self.saved_bytes

    def begin_moment(self):
        """Ends the open moment and begins the next; chunks still pinned are accessed again in it."""
        if not self.in_iteration:
            self._pipeline.begin_iteration()
            self.in_iteration = True
        self.end_moment()
        if self.overlap is not None and self.overlap.pending:
            self.overlap.begin_ready()
        self._pipeline.begin_moment(self._non_model_bytes())
        self.in_moment = True
        engine = self._runtime.engine
        for chunk, entry in self.held.items():
            again = self._table.checked(self._pipeline.access, engine, chunk)
            if again.address != entry[0].address:
                raise RuntimeError(f"strata: chunk {chunk} moved while pinned")
            entry[0].release()
            entry[0] = again

    def end_moment(self):
        if not self.in_moment:
            return
        self._runtime.let_go(self.moment_chunks.values())
        self.moment_chunks.clear()
        self.in_moment = False
        self._pipeline.end_moment()

    def end_iteration(self):
        self.end_moment()
        if self.in_iteration:
            self.in_iteration = False
            self._pipeline.end_iteration()

    # --- pins ----------------------------------------------------------------

    def _pin_chunk(self, chunk):
        if self.direct:
            access = self._runtime.engine.access_chunk(chunk, "device")
        else:
            if not self.in_moment:
                self.begin_moment()
            try:
                access = self._table.checked(self._pipeline.access, self._runtime.engine, chunk)
            except MemoryError as error:
                self.pin_error = error  # autograd may pass it on as a RuntimeError (a saved tensor's unpack hook)
                raise
        if self._table.chunk_info[chunk]["transient"]:
            # Parameters sharded: the whole chunk from every rank's shard. The
            # ranks pin chunks in the same order (the same modules run), so
            # their gathers line up; the reducer keeps the last two gathered,
            # so a chunk's next module sends nothing.
            try:
                self._grad_sync.gather(access)
            except BaseException:
                access.release()
                raise
        return access

    def grad_access(self, chunk):
        """A grad chunk pinned for the open moment (begun if none is), released as the moment ends."""
        if self.direct:
            raise RuntimeError("strata: a gradient arrived during an evaluation forward (model.eval() or no_grad)")
        if not self.in_moment:
            self.begin_moment()
        access = self.moment_chunks.get(chunk)
        if access is None:
            access = self.moment_chunks[chunk] = self._table.checked(self._pipeline.access, self._runtime.engine,
                                                                     chunk)
        return access

    def materialize(self, record):
        """Hot path: the parameter's .data becomes a view of its chunk, pinned (once per chunk) until released."""
        if record.pins == 0:
            entry = self.held.get(record.chunk)
            if entry is None:
                entry = self.held[record.chunk] = [self._pin_chunk(record.chunk), 0]
            entry[1] += 1
            view = self._runtime.view(entry[0], self._runtime.dtype, record.numel, record.offset)
            record.param.__class__ = record.plain_class  # first: the held class refuses .data
            record.param.data = view.view(record.shape)
        record.pins += 1

    def release(self, record):
        """Hot path: undoes one materialize; the last lets the chunk go once no parameter in it is materialized."""
        record.pins -= 1
        if record.pins > 0:
            return
        record.param.data = record.placeholder
        record.param.__class__ = record.held_class
        entry = self.held[record.chunk]
        entry[1] -= 1
        if entry[1] == 0:
            self._runtime.let_go((entry[0],))
            del self.held[record.chunk]
