"""What the adapter runs on: the C++ engine, the data-parallel group, and where the model computes.

``open_runtime`` joins the group the launcher started (if any), picks this
rank's GPU and makes the engine; the ``Runtime`` it returns is read by every
other part of the adapter and never changes after.
"""

from dataclasses import dataclass, field

import torch

from . import _strata, distributed

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _CudaBytes:
    """GPU memory strata owns (the device tier's arena), as CUDA array interface bytes."""

    def __init__(self, address, size_bytes):
        self.address, self.size_bytes = address, size_bytes

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size_bytes,), "typestr": "|u1", "data": (self.address, False), "version": 2}


# What every call on a closed engine (and its model's forward and state_dict) raises.
CLOSED = ("the engine was closed (engine.close()): its memory and files were given back, the parameters' values "
          "with them; engine.state_dict() or export_safetensors() before close() keeps them. Make a new engine "
          "with strata.initialize")

_ITEM_BYTES = {dtype: torch.tensor([], dtype=dtype).element_size() for dtype in TORCH_DTYPES.values()}


@dataclass(frozen=True, eq=False)
class Runtime:
    """The engine, the group and the compute device of one TrainingEngine."""

    engine: object        # _strata.Engine
    comm: object          # the data-parallel group's collectives (NCCL's on GPUs), or None alone
    bootstrap: object     # the host group NCCL was bootstrapped over (kept alive beside it), or None
    parallel: bool        # gradients take the data-parallel path (see open_runtime)
    rank: int
    world_size: int
    precision: str        # fp32, bf16 or fp16: the compute dtype's name
    dtype: torch.dtype    # the compute dtype
    device: torch.device  # where the model computes: the CPU for the emulated device (its memory is the host's)
    emulated: bool        # the device is the host-emulated one
    # synchronize()'s calls so far, on every device: where a GPU's host waits for it (engine.stats()'s host_syncs)
    syncs: list = field(default_factory=lambda: [0])
    # On a GPU: a uint8 tensor over the device tier's arena, in which every chunk pinned there lies, and its
    # address; a view of a chunk is a slice of it (making a tensor from a pointer costs tens of microseconds)
    arena: object = None
    arena_address: int = 0

    def synchronize(self):
        """On a GPU: waits for the kernels queued on torch's stream (where a value they make is read)."""
        self.syncs[0] += 1
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def let_go(self, accesses):
        """Unpins `accesses` without waiting for the device: on a GPU strata moves, reads or overwrites their
        chunks only once the kernels queued on torch's stream so far have run (Note [Fences] in
        memory/residency.cc); where the model computes on the host, those are done already."""
        if self.device.type != "cuda":
            for access in accesses:
                access.release()
            return
        try:
            fence = self.engine.record_fence(self.stream())
        except RuntimeError:
            self.synchronize()  # no fence: let go only once the stream has run what it queued on them
            for access in accesses:
                access.release()
            raise
        for access in accesses:
            access.release_after(fence)

    def stream(self):
        """torch's current stream on the GPU, as a cudaStream_t (0 where the model computes on the host)."""
        if self.device.type != "cuda":
            return 0
        if _raw_stream is not None:
            return _raw_stream(self.device.index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def plan_device_bytes(self):
        """What the pipeline's plan may fill on the device, chunks and the framework's memory together (Note [The
        device model] in offload/schedule/planner.cc): on a GPU, the device tier's capacity (device.budget) and nine
        tenths of the memory free beside it now (the rest is the caching allocator's slack); 0 (device.budget)
        where the model computes on the host, whose activations take no device memory."""
        if self.device.type != "cuda":
            return 0
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        return self.arena.numel() + int(0.9 * free_bytes)  # the arena is the device tier's capacity

    def view(self, access, dtype, count, offset):
        """`count` elements at byte `offset` of a pinned chunk, as a tensor where the chunk is."""
        if self.emulated or access.tier != "device":
            return torch.frombuffer(access, dtype=dtype, count=count, offset=offset)
        start = access.address - self.arena_address + offset
        return self.arena[start:start + count * _ITEM_BYTES[dtype]].view(dtype)

    def broadcast(self, tensor):
        """Rank 0's values of a contiguous CPU tensor into every rank's."""
        self.comm.broadcast(tensor.view(-1).view(torch.uint8).numpy(), 0)

    def agree(self, error, what):
        """Raises `error` (this rank's, or None) on every rank when any rank has one (data parallel: a
        rank whose file is missing, say), so that no rank goes on alone."""
        if self.world_size > 1:
            failed = self.comm.all_reduce_sum([0.0 if error is None else 1.0])[0]
            if error is None and failed:
                error = RuntimeError(f"strata: {what} failed on another rank (its own error says why)")
        if error is not None:
            raise error


def open_runtime(config):
    """Joins the launcher's group, if any, and makes the engine for `config` (whose device.index it may set)."""
    options = config.options.describe()
    precision = options["precision"]
    # Data parallel when mpirun or torchrun started the process: each rank
    # trains on its own batches, gradients are averaged over the ranks in step().
    timeout_ms = int(options["comm.timeout_ms"])
    comm = distributed.communicator(timeout_ms)
    rank = comm.rank if comm else 0
    world_size = comm.world_size if comm else 1
    _follow_local_rank(config, options, world_size)
    # On GPUs the host group (MPI or gloo) only bootstraps NCCL, which carries the collectives.
    bootstrap = None
    on_nccl = False
    if distributed.wants_nccl(options["comm.backend"], world_size, options["device.backend"]):
        nccl = distributed.nccl_communicator(comm, int(config.options.describe()["device.index"]),
                                             timeout_ms, required=options["comm.backend"] == "nccl")
        if nccl is not None:  # None: ranks share a GPU (comm.backend auto), so the host group carries on
            bootstrap, comm, on_nccl = comm, nccl, True
    # Gradients take the data-parallel path with several ranks, and on NCCL with one (how that backend
    # runs on a single GPU); a single rank otherwise (mpirun -np 1) takes the plain one, which holds no
    # reduction buffers.
    parallel = comm is not None and (world_size > 1 or on_nccl)
    engine = _strata.Engine(config.options, comm)
    emulated = is_emulated(engine.describe_backends())
    device = torch.device("cpu") if emulated else torch.device("cuda", int(config.options.describe()["device.index"]))
    arena, arena_address = None, 0
    if not emulated:
        arena_address, size_bytes = engine.device_arena()
        arena = torch.as_tensor(_CudaBytes(arena_address, size_bytes), device=device)
    return Runtime(engine=engine, comm=comm, bootstrap=bootstrap, parallel=parallel, rank=rank,
                   world_size=world_size, precision=precision, dtype=TORCH_DTYPES[precision], device=device,
                   emulated=emulated, arena=arena, arena_address=arena_address)


# torch's current raw stream of a device, where torch has the call (an int, without making a Stream object).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def is_emulated(backends):
    """Whether the engine's device is the host-emulated one, from Engine.describe_backends() (its device part:
    the NVMe directories' names come later and may hold any word)."""
    return backends.startswith("device: emulated")


def _follow_local_rank(config, options, world_size):
    """One GPU per process on a node: device.index left at 0 follows the
    local rank, unless this process sees fewer GPUs (one each, as
    SLURM's --gpus-per-task=1 or a per-process CUDA_VISIBLE_DEVICES gives)."""
    local = distributed.local_rank()
    if world_size > 1 and local is not None and int(options["device.index"]) == 0 and (
            options["device.backend"] == "emulated" or local < torch.cuda.device_count()):
        config.options.set("device.index", str(local))
