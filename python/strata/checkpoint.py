"""Checkpoints of the training state: the C++ save (at once, or on a thread of its own while training goes
on) and load, and the asynchronous save still to be waited for."""

import atexit
import functools
import os
import weakref

from . import _strata


def _finish_save(pending):
    """At exit: this rank's files of an asynchronous save nobody waited for are finished (rank 0's
    publishing too). Holds the save weakly, so that an engine dropped meanwhile is freed."""
    pending = pending()
    if pending is not None:
        pending.wait_local()


class Checkpoints:
    """The checkpoints of one engine and optimizer (see TrainingEngine.save_checkpoint for what they hold)."""

    def __init__(self, runtime, table, optimizer):
        self._runtime = runtime
        self._table = table
        self._optimizer = optimizer
        self.pending = None        # an asynchronous save still to be waited for (each step's update fences on it)
        self._pending_exit = None  # its exit hook
        self.save_delay_ms = 0     # tests: each chunk file of an asynchronous save opened this much later

    def save(self, path, keep_last, asynchronous, recycle):
        """Saves at once and returns the summary, or starts an asynchronous save and returns None."""
        engine, comm = self._runtime.engine, self._runtime.comm
        if not asynchronous:
            return self._table.checked(_strata.save_checkpoint, engine, self._optimizer, os.fspath(path), keep_last,
                                       comm, recycle)
        self.pending = self._table.checked(_strata.start_checkpoint, engine, self._optimizer, os.fspath(path),
                                           keep_last, comm, self.save_delay_ms, recycle)
        self._pending_exit = functools.partial(_finish_save, weakref.ref(self.pending))
        atexit.register(self._pending_exit)
        return None

    def wait(self):
        """Waits for the pending save (there is one) and returns its summary; raises its error."""
        pending, self.pending = self.pending, None
        atexit.unregister(self._pending_exit)
        return self._table.checked(pending.wait)

    def load(self, path, fall_back):
        return self._table.checked(_strata.load_checkpoint, self._runtime.engine, self._optimizer, os.fspath(path),
                                   fall_back, self._runtime.comm)
