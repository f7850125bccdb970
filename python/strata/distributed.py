"""Data parallelism: which launcher started this process, and the group it joins.

Under mpirun the group is MPI_COMM_WORLD (strata's MPI communicator). Under
torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) it
is torch.distributed's gloo backend, through TorchCommunicator: strata's
collectives carry host buffers, which gloo carries between the processes
torchrun started, on one node or many. On GPUs (comm.backend auto or nccl)
that group only bootstraps NCCL, which then carries every collective. Either
way the training script needs no change.
"""

import atexit
import collections
import datetime
import os
import sys

import torch

from . import _strata

_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun():
    """Whether torchrun (or another launcher setting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) started this process."""
    return all(key in os.environ for key in _TORCHRUN_KEYS)


def local_rank():
    """This process's rank on its node (LOCAL_RANK from torchrun, OMPI_COMM_WORLD_LOCAL_RANK from mpirun), or None."""
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if key in os.environ:
            return int(os.environ[key])
    return None


def wants_nccl(backend, world_size, device_backend):
    """Whether comm.backend `backend` means NCCL for a group of `world_size` on device.backend `device_backend`.

    auto: NCCL when there are several ranks, strata was built with NCCL, and each rank computes on a GPU
    (device.backend cuda, or auto with a GPU visible); host otherwise. nccl: always, a single rank included
    (ValueError on the emulated device, whose memory is the host's). host: never.
    """
    if backend == "nccl":
        if device_backend == "emulated":
            raise ValueError("comm.backend nccl needs a GPU per rank, but device.backend is emulated: set "
                             "device.backend to cuda or auto, or comm.backend to host")
        return True
    if backend == "auto":
        on_gpu = device_backend == "cuda" or (device_backend == "auto" and _strata.cuda_device_available())
        return world_size > 1 and on_gpu and _strata.nccl_available()
    return False


def nccl_communicator(bootstrap, device_index, timeout_ms, required=True):
    """NCCL over the ranks of `bootstrap` (None: this process alone), each on its GPU `device_index`.

    The bootstrap group only carries NCCL's unique id from rank 0 to the others; the caller keeps it.
    Ranks that share a GPU are a ValueError on every rank alike; unless `required` (comm.backend auto),
    they return None instead, to go on over the bootstrap group.
    """
    try:
        return _strata.nccl_communicator(bootstrap, device_index, timeout_ms)
    except ValueError as error:
        if required or "on the same GPU" not in str(error):
            raise
        if bootstrap is None or bootstrap.rank == 0:
            print(f"strata: comm.backend auto: collectives stay on {bootstrap.describe() if bootstrap else 'host'} "
                  f"({error})", file=sys.stderr)
        return None


def communicator(timeout_ms):
    """The data-parallel group this process is a rank of, or None when it runs alone."""
    if _strata.launched_by_mpi():
        return _strata.mpi_communicator(timeout_ms)
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        return TorchCommunicator(timeout_ms)
    return None


class TorchCommunicator(_strata.Communicator):
    """strata's collectives over torch.distributed's gloo backend.

    Joins the default process group (initializing it from the environment,
    env://, when the trainer has not); a trainer that already runs NCCL gets a
    gloo group of the same ranks beside it, since strata's buffers are in host
    memory. A collective that waits longer than `timeout_ms` raises in gloo,
    and strata turns that into a Timeout on every rank that waited.

    The work of the last few collectives is kept referenced here, with
    their tensors (see _run): gloo's worker thread lets go of a finished
    collective's work a moment after the caller's wait returns, and had it
    dropped the last reference, the work's destructor would free tensors
    that Python objects back, which needs the GIL. At interpreter shutdown (a
    reducer closed by an exit hook runs its last collectives then) Python
    stops such a thread inside that destructor: std::terminate ("terminate
    called without an active exception"). Kept here, the work is freed by
    the thread that holds the GIL.

    At exit (after the reducer's last collectives: atexit runs the hooks
    registered later first) the group is destroyed, and the default group
    too when this made it, as torch.distributed asks of a process.
    """

    _KEPT_COLLECTIVES = 4  # gloo runs a group's collectives on two threads; a few more than that

    def __init__(self, timeout_ms):
        import torch.distributed as dist
        self._dist = dist
        timeout = datetime.timedelta(milliseconds=timeout_ms)
        self._made_default = not dist.is_initialized()
        if self._made_default:
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        atexit.register(self._destroy_groups)
        rank, world = dist.get_rank(), dist.get_world_size()
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        super().__init__(rank, world, f"torch.distributed gloo via {where}, rank {rank} of {world}")
        self._kept = collections.deque(maxlen=self._KEPT_COLLECTIVES)

    def _destroy_groups(self):
        """The groups this made, destroyed unless the trainer destroyed them first."""
        if not self._dist.is_initialized():
            return
        groups = [self._group] + ([None] if self._made_default else [])
        for group in groups:
            try:
                self._dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # destroyed already (the default's destruction takes every group)
                pass

    def _run(self, collective, *args, keep=(), **kwargs):
        """`collective(*args, **kwargs)` on the group, waited for; its work and `keep` (the tensors it reads and
        writes) held past gloo's own references (see the class's note)."""
        work = collective(*args, group=self._group, async_op=True, **kwargs)
        self._kept.append((work, keep))
        work.wait()

    def _all_gather(self, send, recv):
        if len(send) == 0:
            return
        out = torch.frombuffer(recv, dtype=torch.uint8)
        slices, mine = list(out.chunk(self.world_size)), torch.frombuffer(send, dtype=torch.uint8)
        self._run(self._dist.all_gather, slices, mine, keep=(out, slices, mine))

    def _reduce_scatter_sum(self, send, recv, count, dtype):
        if count == 0:
            return
        # gloo has no reduce-scatter (and no bf16 sum): each rank's slices go
        # to their ranks (all-to-all, a reduce-scatter's bytes on the wire),
        # which sum them in rank order, in fp32, rounded once to `dtype`.
        dtype = getattr(torch, dtype)
        width = torch.empty(0, dtype=dtype).element_size()
        slices = torch.empty(self.world_size * count * width, dtype=torch.uint8)
        mine = torch.frombuffer(send, dtype=torch.uint8)
        self._run(self._dist.all_to_all_single, slices, mine, keep=(slices, mine))
        parts = slices.view(dtype).view(self.world_size, count).float()
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        torch.frombuffer(recv, dtype=dtype).copy_(total)

    def _all_reduce_sum(self, values):
        if len(values) == 0:
            return
        values = torch.frombuffer(values, dtype=torch.float64)
        self._run(self._dist.all_reduce, values, keep=(values,))

    def _broadcast(self, data, root):
        if len(data) == 0:
            return
        data = torch.frombuffer(data, dtype=torch.uint8)
        self._run(self._dist.broadcast, data, src=root, keep=(data,))

    def _barrier(self):
        self._run(self._dist.barrier)
