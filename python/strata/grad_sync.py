"""Data parallel: the gradients' reduction over the ranks, and the parameter gathers of comm.shard_params.

A grad chunk's reduce-scatter starts as soon as all its parameters'
gradients are in, in the last backward before a step, and runs beside the
rest of backward (on the GradReducer's thread). Every rank submits the grad
chunks in one fixed order (the last group first, as backward completes
them), each once it and all before it in that order are complete; at the
step the rest follow in the same order. So the ranks' collectives line up
even when a parameter is used on some ranks only.
"""

import atexit
import weakref

from . import _strata

_deferred_reducers = []


def _close_reducer(reducer):
    """Closes an engine's reducer when the engine is collected or at exit. The garbage collector may
    run this on the reducer's own thread (inside a collective of a Python communicator), which the
    close would have to join: that reducer (and its engine) is kept and closed at exit instead."""
    if reducer.on_own_thread():
        _deferred_reducers.append(reducer)
        atexit.register(reducer.close)  # after MPI's atexit was registered, so before it runs
        return
    reducer.close()


class GradSync:
    """The reducer of a data-parallel rank (none alone), and which grad chunks this backward has submitted."""

    def __init__(self, runtime, table):
        self._runtime = runtime
        self._table = table
        self.reducer = None                 # made by start() when data parallel; None again once closed
        self.closed_gathers = (0, 0, 0)     # the reducer's gather counts once close() has stopped it
        self._comm_mark = 0                 # the group's total bytes when the last step began its collectives
        self._params_of = {}                # grad chunk -> how many trainable parameters it holds
        for record in table.records:
            if record.trainable:
                self._params_of[record.grad_chunk] = self._params_of.get(record.grad_chunk, 0) + 1
        self._order = sorted(self._params_of, key=lambda c: -table.chunk_info[c]["group"])  # the fixed order
        self._position = {chunk: i for i, chunk in enumerate(self._order)}
        # This backward's round (begin_backward resets it).
        self.reducing = False               # this backward submits complete grad chunks to the reducer
        self._arrived = {}                  # grad chunk -> ids of the parameters whose gradient came in
        self._submitted = 0                 # how many of the fixed order this backward has submitted
        self._late = set()                  # submitted grad chunks a gradient arrived in after (reduced again)

    def start(self):
        """Makes the reducer (data parallel); the first step's bytes are counted from here."""
        if not self._runtime.parallel:
            return
        self.reducer = _strata.GradReducer(self._runtime.engine, self._runtime.comm)
        # At exit, before MPI is finalized: no reduction left in flight.
        weakref.finalize(self, _close_reducer, self.reducer)
        self._comm_mark = self.comm_total()

    def begin_backward(self, before_step):
        """A new backward; the one before a step (`before_step`) reduces (and one more before the step,
        should there be one, again)."""
        self._arrived, self._submitted, self._late = {}, 0, set()
        self.reducing = self.reducer is not None and before_step

    def arrived(self, record):
        """While reducing: `record`'s gradient is in its grad chunk; the chunks complete in order are submitted."""
        self._arrived.setdefault(record.grad_chunk, set()).add(id(record))
        if self._position[record.grad_chunk] < self._submitted:
            # A gradient after its chunk was submitted (a parameter used
            # again, as reentrant checkpointing can make happen).
            self._late.add(record.grad_chunk)
        self.submit_complete()

    def submit_complete(self, everything=False):
        """Submits grad chunks in the fixed order while they are complete (all of them, at the step)."""
        order = self._order
        while self._submitted < len(order) and (
                everything or len(self._arrived.get(order[self._submitted], ())) ==
                self._params_of[order[self._submitted]]):
            self._runtime.synchronize()  # the reducer copies the chunk on its own stream
            self._table.checked(self.reducer.submit, order[self._submitted])
            self._submitted += 1

    def reduce_rest(self, stepped, late_chunk=lambda chunk: None):
        """Before the step: the grad chunks not yet submitted, in the fixed order; one vote over the ranks
        for which parameters any backward reached (the rest are skipped) and which submitted chunks a late
        gradient reached on any rank (reduced again); returns the summed `stepped`."""
        self.submit_complete(everything=True)
        self._table.checked(self.reducer.drain)  # the communicator is the step's again
        late = [float(c in self._late) for c in self._order]
        votes = self._runtime.comm.all_reduce_sum(stepped + late)
        for chunk, vote in zip(self._order, votes[len(stepped):]):
            if vote > 0:
                self._table.checked(self.reducer.submit, chunk)
                late_chunk(chunk)
        self._submitted, self._late, self.reducing = 0, set(), False
        return votes[:len(stepped)]

    def comm_total(self):
        """The group's total bytes so far (0 alone)."""
        return self._runtime.comm.stats()["total_bytes"] if self._runtime.parallel else 0

    def step_bytes(self, mark):
        """The bytes from the last step's mark to `mark` (this step's), which becomes the mark.

        A step's bytes run from here to here next step: every collective begun in between is done by
        then (gathers queued ahead by this step's updates are the next forward's, and counted there);
        the reductions in backward and the unused-parameter vote are counted too."""
        sent, self._comm_mark = mark - self._comm_mark, mark
        return sent

    def drain(self):
        """Waits for the reducer's collectives (gathers queued ahead), so that the caller's may begin."""
        if self.reducer is not None:
            self._table.checked(self.reducer.drain)

    def drained_comm(self):
        """The group's communicator once every reduction of this backward is submitted and done (None alone)."""
        if self.reducer is not None:
            if self.reducing:  # after the backward before a step: its chunks all go, in the fixed order
                self.submit_complete(everything=True)
            self._table.checked(self.reducer.drain)
        return self._runtime.comm

    def gather(self, access):
        """Parameters sharded: fills a pinned transient param chunk from every rank's master shard."""
        self._table.checked(self.reducer.gather, access)

    def release_gathered(self):
        """Gathered parameter chunks (and gathers ahead) are of the masters before a load: let go."""
        if self.reducer is not None:
            self.reducer.release_gathered()

    def gather_counts(self):
        """(all-gathers that communicated, of them queued ahead, of those filled ahead), kept past close()."""
        r = self.reducer
        return (r.gathers, r.gathered_ahead, r.filled_ahead) if r is not None else self.closed_gathers

    def close(self):
        """Waits for what is queued and stops the reducer's thread; no reducer after."""
        if self.reducer is not None:
            self.closed_gathers = self.gather_counts()
            self.reducer.close()
            self.reducer = None
