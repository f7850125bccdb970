// strata._strata: the C++ engine's Python binding (pybind11).
//
// The engine's options, set key by key from their text form with the
// engine's own parsing and checks, so that a bad key or value is the same
// error, naming the key, in Python as on the command line; the engine
// (register, finalize, chunks, pinned chunk accesses whose bytes Python sees
// through the buffer protocol, stats); the pipeline's moments; the optimizer
// and one training step over them (offload/train_step.h). The PyTorch side
// is python/strata/training.py. Errors: InvalidArgument -> ValueError,
// OutOfMemory -> MemoryError, Corruption -> CorruptionError (a
// RuntimeError), the rest -> RuntimeError; the message is the engine's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <memory>
#include <stdexcept>

#include <string>
#include <thread>
#include <vector>

#include "offload/persist/checkpoint.h"
#include "offload/persist/safetensors.h"
#include "offload/schedule/pipeline.h"
#include "offload/training/train_step.h"
#include "optim/optimizer.h"
#include "strata/buffer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/options.h"
#include "strata/status.h"

namespace py = pybind11;

namespace {

// strata._strata.CorruptionError (a RuntimeError): stored bytes that do not match their CRC.
PyObject* corruption_error = nullptr;

// Raises the Python exception for a failed status (see the top).
void ThrowIfError(const strata::Status& status) {
  if (status.ok()) return;
  PyObject* type = status.code() == strata::StatusCode::kInvalidArgument ? PyExc_ValueError
                   : status.code() == strata::StatusCode::kOutOfMemory   ? PyExc_MemoryError
                   : status.code() == strata::StatusCode::kCorruption    ? corruption_error
                                                                         : PyExc_RuntimeError;
  PyErr_SetString(type, status.ToString().c_str());
  throw py::error_already_set();
}

template <typename T>
T ValueOrThrow(strata::Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

py::dict TierUsageDict(const strata::TierUsage& usage) {
  py::dict d;
  d["capacity_bytes"] = usage.capacity_bytes;
  d["used_bytes"] = usage.used_bytes;
  d["peak_bytes"] = usage.peak_bytes;
  return d;
}

// Engine::stats() as a dict: tiers (present ones) and links ("host->device", ...).
py::dict StatsDict(const strata::MemoryStats& stats) {
  py::dict tiers, links;
  for (int t = 0; t < strata::kNumTiers; ++t) {
    if (!stats.tier_present[t]) continue;
    tiers[py::str(std::string(strata::TierName(static_cast<strata::Tier>(t))))] = TierUsageDict(stats.tiers[t]);
  }
  for (int from = 0; from < strata::kNumTiers; ++from) {
    for (int to = 0; to < strata::kNumTiers; ++to) {
      const strata::LinkStats& link = stats.links[from][to];
      if (link.moves == 0) continue;
      py::dict d;
      d["moves"] = link.moves;
      d["bytes"] = link.bytes;
      d["seconds"] = link.seconds;
      const std::string name = std::string(strata::TierName(static_cast<strata::Tier>(from))) + "->" +
                               std::string(strata::TierName(static_cast<strata::Tier>(to)));
      links[py::str(name)] = d;
    }
  }
  py::dict d;
  d["tiers"] = tiers;
  d["links"] = links;
  d["evictions"] = stats.evictions;
  d["compactions"] = stats.compactions;
  d["drops"] = stats.drops;
  return d;
}

// Runs `f` with the GIL released (the engine's waits must not block other
// Python threads); errors are raised after, with the GIL held again.
template <typename F>
auto Unlocked(F f) {
  py::gil_scoped_release unlocked;
  return f();
}

// A pinned chunk as Python holds it: its bytes are seen through the buffer
// protocol only where the host can address them (the host tier, or the
// emulated device); elsewhere (CUDA memory) and once released, the buffer is
// empty, so that a view of it fails in Python instead of reading a stray address.
struct PyAccess {
  strata::ChunkAccess access;
  bool host_addressable = false;
};

std::unique_ptr<PyAccess> Held(strata::Engine& engine, strata::ChunkAccess access) {
  const bool host = access.tier() == strata::Tier::kHost || engine.device().host_accessible();
  return std::make_unique<PyAccess>(PyAccess{std::move(access), host});
}

// A communicator written in Python (strata.distributed.TorchCommunicator:
// torch.distributed under torchrun). Each collective calls the subclass's
// method (_all_gather, _reduce_scatter_sum, _all_reduce_sum, _broadcast,
// _barrier) with writable memoryviews of the C++ buffers, the GIL held. A
// Python exception is a Timeout when its message says it timed out, else a
// CommError, either naming it; and it breaks the communicator, so that every
// later call fails at once (the seam's contract).
class PyCommunicator : public strata::Communicator {
 public:
  PyCommunicator(int rank, int world, std::string description)
      : rank_(rank), world_(world), description_(std::move(description)) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string Describe() const override { return description_; }
  strata::Status Barrier() override {
    return Call("barrier", "_barrier", [](const py::function& f) { f(); });
  }

 protected:
  strata::Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return Call("all-gather", "_all_gather", [&](const py::function& f) {
      f(View(send, bytes_per_rank), View(recv, bytes_per_rank * static_cast<size_t>(world_)));
    });
  }
  // `dtype` as torch names it: float32, bfloat16 or float16.
  strata::Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank,
                                    strata::DType dtype) override {
    const size_t bytes = count_per_rank * strata::DTypeSizeBytes(dtype);
    const char* name = dtype == strata::DType::kFloat32    ? "float32"
                       : dtype == strata::DType::kBFloat16 ? "bfloat16"
                                                           : "float16";
    return Call("reduce-scatter", "_reduce_scatter_sum", [&](const py::function& f) {
      f(View(send, bytes * static_cast<size_t>(world_)), View(recv, bytes), count_per_rank, name);
    });
  }
  strata::Status DoAllReduceSum(std::span<double> values) override {
    return Call("all-reduce", "_all_reduce_sum",
                [&](const py::function& f) { f(View(values.data(), values.size_bytes())); });
  }
  strata::Status DoBroadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_) {
      return strata::InvalidArgument("broadcast: root {} is not a rank of this group of {}", root, world_);
    }
    return Call("broadcast", "_broadcast", [&](const py::function& f) { f(View(data, bytes), root); });
  }

 private:
  static py::memoryview View(const void* data, size_t bytes) {
    return py::memoryview::from_memory(const_cast<void*>(data), static_cast<py::ssize_t>(bytes), /*readonly=*/false);
  }

  template <typename Invoke>
  strata::Status Call(const char* op, const char* method, Invoke invoke) {
    if (!broken_.empty()) return strata::CommError("{} on rank {}: the group is broken: {}", op, rank_, broken_);
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(this, method);
    if (!f) {
      broken_ = fmt::format("the Python communicator does not define {}()", method);
      return strata::NotSupported("{} on rank {}: {}", op, rank_, broken_);
    }
    try {
      invoke(f);
      return strata::Status::Ok();
    } catch (py::error_already_set& error) {  // the exception's type and message, not its traceback
      broken_ = py::str(error.type().attr("__name__")).cast<std::string>() + ": " +
                py::str(error.value()).cast<std::string>();
    } catch (const std::exception& error) {  // a failed conversion, say: the group is as broken
      broken_ = error.what();
    }
    if (broken_.find("imed out") != std::string::npos || broken_.find("imeout") != std::string::npos) {
      return strata::Timeout("{} on rank {} timed out: {}", op, rank_, broken_);
    }
    return strata::CommError("{} on rank {}: {}", op, rank_, broken_);
  }

  const int rank_;
  const int world_;
  const std::string description_;
  std::string broken_;
};

// A GradReducer as Python holds it. Closing (or collecting) it waits for its
// queued reductions with the GIL released: a Python communicator's jobs need
// the GIL to finish, and MPI's may wait out their timeout.
class PyGradReducer {
 public:
  explicit PyGradReducer(std::unique_ptr<strata::offload::GradReducer> reducer) : reducer_(std::move(reducer)) {}
  ~PyGradReducer() { Close(); }
  strata::offload::GradReducer& get() {
    if (!reducer_) throw std::runtime_error("GradReducer: closed");
    return *reducer_;
  }
  bool open() const { return reducer_ != nullptr; }
  void Close() {
    if (!reducer_) return;
    // On the reducer's own thread (Python's garbage collector run inside a
    // Python collective) it cannot be joined: python/strata/training.py
    // closes it at exit instead; a wrapper collected there anyway leaks it.
    if (reducer_->OnOwnThread()) {
      static_cast<void>(reducer_.release());  // leaked on purpose: no thread may join it
      return;
    }
    py::gil_scoped_release unlocked;
    reducer_.reset();
  }

 private:
  std::unique_ptr<strata::offload::GradReducer> reducer_;
};

}  // namespace

PYBIND11_MODULE(_strata, m) {
  m.doc() = "strata's C++ engine (the Python package is strata)";
  corruption_error = PyErr_NewExceptionWithDoc("strata._strata.CorruptionError",
                                               "stored bytes (an NVMe slot) that do not match their CRC32C",
                                               PyExc_RuntimeError, nullptr);
  m.attr("CorruptionError") = py::handle(corruption_error);

  py::class_<strata::Options>(m, "Options", "the engine's settings; every key of `strata options`")
      .def(py::init<>())
      .def(
          "set", [](strata::Options& options, const std::string& key, const std::string& value) {
            ThrowIfError(strata::SetOption(options, key, value));
          },
          py::arg("key"), py::arg("value"), "sets one key from its text form; ValueError naming the key when bad")
      .def(
          "validate", [](const strata::Options& options) { ThrowIfError(strata::ValidateOptions(options)); },
          "checks the relations between keys; ValueError naming them")
      .def(
          "describe",
          [](const strata::Options& options) {
            py::dict values;
            for (const auto& [key, value] : strata::DescribeOptions(options)) values[py::str(key)] = value;
            return values;
          },
          "every key and its value, as text");

  py::class_<strata::Communicator, PyCommunicator, std::unique_ptr<strata::Communicator>>(
      m, "Communicator",
      "a data-parallel group's collectives (strata/comm.h); subclass it in Python to bring another transport "
      "(define _all_gather, _reduce_scatter_sum, _all_reduce_sum, _broadcast and _barrier)")
      .def(py::init<int, int, std::string>(), py::arg("rank"), py::arg("world_size"), py::arg("description"))
      .def_property_readonly("rank", &strata::Communicator::rank)
      .def_property_readonly("world_size", &strata::Communicator::world_size)
      .def("describe", &strata::Communicator::Describe)
      .def(
          "stats",
          [](const strata::Communicator& c) {
            const strata::CommStats& s = c.stats();
            py::dict d;
            const std::pair<const char*, const strata::CollectiveStats*> each[] = {
                {"all_gather", &s.all_gather}, {"reduce_scatter", &s.reduce_scatter},
                {"all_reduce", &s.all_reduce}, {"broadcast", &s.broadcast}};
            for (const auto& [name, stats] : each) {
              py::dict one;
              one["calls"] = stats->calls;
              one["bytes"] = stats->bytes;
              one["seconds"] = stats->seconds;
              d[name] = one;
            }
            d["total_bytes"] = s.total_bytes();
            return d;
          },
          "what this rank's collectives carried: calls, bytes sent (ring algorithm) and seconds of each kind")
      .def("barrier", [](strata::Communicator& c) { ThrowIfError(Unlocked([&] { return c.Barrier(); })); })
      .def(
          "broadcast",
          [](strata::Communicator& c, py::buffer buffer, int root) {
            py::buffer_info info = buffer.request(/*writable=*/true);
            const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
            ThrowIfError(Unlocked([&] { return c.Broadcast(info.ptr, bytes, root); }));
          },
          py::arg("buffer"), py::arg("root") = 0, "root's bytes of `buffer` (writable) into every rank's")
      .def(
          "all_gather",
          [](strata::Communicator& c, py::buffer buffer) {
            py::buffer_info info = buffer.request();
            const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
            std::string all(bytes * static_cast<size_t>(c.world_size()), '\0');
            ThrowIfError(Unlocked([&] { return c.AllGather(info.ptr, all.data(), bytes); }));
            return py::bytes(all);
          },
          py::arg("buffer"), "every rank's `buffer` (the same size on each), in rank order, as bytes")
      .def(
          "all_reduce_sum",
          [](strata::Communicator& c, std::vector<double> values) {
            ThrowIfError(Unlocked([&] { return c.AllReduceSum(values); }));
            return values;
          },
          py::arg("values"), "the element-wise sum of `values` (a list of numbers) over the ranks");
  m.def(
      "mpi_communicator",
      [](uint32_t timeout_ms) { return ValueOrThrow(strata::CreateMpiCommunicator({.timeout_ms = timeout_ms})); },
      py::arg("timeout_ms") = 60'000, "MPI_COMM_WORLD (this process was started by mpirun)");
  m.def("launched_by_mpi", &strata::LaunchedByMpi, "whether mpirun started this process");
  m.def(
      "nccl_communicator",
      [](strata::Communicator* bootstrap, int device_index, uint32_t timeout_ms) {
        // Released: a Python bootstrap (gloo) takes the GIL for its broadcast.
        return ValueOrThrow(Unlocked(
            [&] { return strata::CreateNcclCommunicator(bootstrap, device_index, {.timeout_ms = timeout_ms}); }));
      },
      py::arg("bootstrap"), py::arg("device_index"), py::arg("timeout_ms") = 60'000,
      "NCCL over bootstrap's ranks (None: one rank), on CUDA device device_index; bootstrap carries NCCL's id only");
  m.def("cuda_device_available", &strata::CudaDeviceAvailable,
        "whether strata was built with CUDA and a GPU is visible");
  m.def(
      "nccl_available",
      [] {
#if defined(STRATA_WITH_NCCL)
        return true;
#else
        return false;
#endif
      },
      "whether strata was built with NCCL");

  py::class_<strata::Engine, std::unique_ptr<strata::Engine>>(m, "Engine",
                                                               "the engine: tensors in chunks on three tiers")
      .def(py::init([](const strata::Options& options, strata::Communicator* comm) {
             strata::EngineSeams seams;
             seams.comm = comm;
             return ValueOrThrow(strata::Engine::Create(options, std::move(seams)));
           }),
           py::arg("options"), py::arg("comm") = nullptr, py::keep_alive<1, 3>(),
           "with `comm`: one rank of a data-parallel group (options and tensors checked alike on every rank)")
      .def(
          "register_tensor",
          [](strata::Engine& engine, const std::string& name, const std::vector<int64_t>& shape,
             const std::string& dtype, bool trainable, const std::string& module) {
            const strata::DType parsed = ValueOrThrow(strata::ParseDType(dtype));
            return ValueOrThrow(engine.RegisterTensor({name, shape, parsed, trainable, module})).value();
          },
          py::arg("name"), py::arg("shape"), py::arg("dtype") = "fp32", py::arg("trainable") = true,
          py::arg("module") = "", "registers a tensor (model order); returns its id")
      .def(
          "finalize", [](strata::Engine& engine) { ThrowIfError(engine.Finalize()); },
          "packs the registered tensors into chunks and gives each a home tier")
      .def(
          "chunks",
          [](const strata::Engine& engine) {
            py::list chunks;
            for (const strata::ChunkInfo& chunk : engine.chunks()) {
              py::dict d;
              d["id"] = chunk.id.value();
              d["kind"] = std::string(strata::ChunkKindName(chunk.kind));
              d["dtype"] = std::string(strata::DTypeName(chunk.dtype));
              d["group"] = chunk.group;
              d["size_bytes"] = chunk.size_bytes;
              d["used_bytes"] = chunk.used_bytes;
              d["home"] = std::string(strata::TierName(ValueOrThrow(engine.ChunkHome(chunk.id))));
              std::vector<uint32_t> tensors;
              for (strata::TensorId t : chunk.tensors) tensors.push_back(t.value());
              d["tensors"] = tensors;
              d["tensor_offsets"] = chunk.tensor_offsets_bytes;
              d["sharded"] = chunk.sharded;
              d["shard_offset"] = chunk.shard_offset_bytes;
              d["transient"] = chunk.transient;
              chunks.append(d);
            }
            return chunks;
          },
          "after finalize: every chunk (id, kind, dtype, group, size_bytes, used_bytes, home, tensors, "
          "tensor_offsets in the group's whole chunk; sharded and shard_offset: a data-parallel rank's master and "
          "state chunks hold bytes [shard_offset, shard_offset + used_bytes) of it; transient: a param chunk gathered "
          "from the ranks' master shards, comm.shard_params)")
      .def_property_readonly("host_staging_bytes", &strata::Engine::host_staging_bytes)
      .def(
          "access_chunk",
          [](strata::Engine& engine, uint32_t chunk, const std::string& tier) {
            const strata::Tier parsed = ValueOrThrow(strata::ParseTier(tier));
            return Held(engine,
                        ValueOrThrow(Unlocked([&] { return engine.AccessChunk(strata::ChunkId(chunk), parsed); })));
          },
          py::arg("chunk"), py::arg("tier"), py::keep_alive<0, 1>(),
          "pins a chunk on a tier (device or host), moving it there first")
      .def(
          "read_chunk",
          [](strata::Engine& engine, uint32_t chunk) {
            const uint64_t size = engine.chunks().at(chunk).size_bytes;
            strata::Buffer buffer = strata::AllocateAlignedHost(size, 4096);
            ThrowIfError(Unlocked([&] { return engine.ReadChunk(strata::ChunkId(chunk), buffer.data()); }));
            return py::bytearray(reinterpret_cast<const char*>(buffer.data()), size);
          },
          py::arg("chunk"), "a copy of a chunk's bytes from wherever it lives (nothing moves)")
      .def(
          "chunk_tier",
          [](const strata::Engine& engine, uint32_t chunk) -> py::object {
            const strata::Result<strata::Tier> tier = engine.ChunkTier(strata::ChunkId(chunk));
            if (!tier.ok()) return py::none();  // free: no payload yet
            return py::str(std::string(strata::TierName(*tier)));
          },
          py::arg("chunk"), "where a chunk is now (None before it has a payload)")
      .def("stats", [](const strata::Engine& engine) { return StatsDict(engine.stats()); },
           "tiers (capacity, used, peak bytes) and links (moves, bytes, seconds)")
      .def("describe_backends", &strata::Engine::DescribeBackends);

  py::class_<PyAccess, std::unique_ptr<PyAccess>>(
      m, "ChunkAccess", py::buffer_protocol(),
      "a chunk pinned on a tier until release(); its bytes through the buffer protocol where the host can "
      "address them (else an empty buffer; `address` is the device pointer)")
      .def_buffer([](PyAccess& a) {
        const bool readable = a.access.valid() && a.host_addressable;
        return py::buffer_info(readable ? a.access.data() : nullptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(readable ? a.access.size_bytes() : 0)}, {1}, false);
      })
      .def_property_readonly("chunk", [](const PyAccess& a) { return a.access.id().value(); })
      .def_property_readonly("tier", [](const PyAccess& a) { return std::string(strata::TierName(a.access.tier())); })
      .def_property_readonly("address", [](const PyAccess& a) { return reinterpret_cast<uintptr_t>(a.access.data()); })
      .def_property_readonly("size_bytes", [](const PyAccess& a) { return a.access.size_bytes(); })
      .def_property_readonly("valid", [](const PyAccess& a) { return a.access.valid(); })
      .def_readonly("host_addressable", &PyAccess::host_addressable)
      .def("release", [](PyAccess& a) { a.access.Release(); }, "unpins the chunk");

  py::class_<strata::optim::Optimizer, std::unique_ptr<strata::optim::Optimizer>>(
      m, "Optimizer", "strata's optimizer over chunk groups, from the optimizer.* and loss_scale.* keys")
      .def(py::init([](const strata::Options& options) {
             const strata::optim::OptimizerConfig config =
                 ValueOrThrow(strata::optim::OptimizerConfigFromOptions(options));
             return ValueOrThrow(
                 strata::optim::Optimizer::Create(config, strata::optim::LossScalerConfigFromOptions(options)));
           }),
           py::arg("options"))
      .def_property_readonly("loss_scale", &strata::optim::Optimizer::loss_scale)
      .def_property_readonly("steps_taken", &strata::optim::Optimizer::steps_taken);

  py::class_<strata::offload::Pipeline, std::unique_ptr<strata::offload::Pipeline>>(
      m, "Pipeline", "the prefetch pipeline: moments of an iteration, traced, planned and replayed")
      .def(py::init([](strata::Engine& engine) {
             return ValueOrThrow(strata::offload::Pipeline::Create(engine, strata::offload::PipelineOptionsOf(engine.options())));
           }),
           py::arg("engine"), py::keep_alive<1, 2>())
      .def("begin_iteration", [](strata::offload::Pipeline& p) { ThrowIfError(p.BeginIteration()); })
      .def(
          "begin_moment",
          [](strata::offload::Pipeline& p, uint64_t non_model_bytes) {
            ThrowIfError(Unlocked([&] { return p.BeginMoment(non_model_bytes); }));
          },
          py::arg("non_model_bytes") = 0)
      .def(
          "access",
          [](strata::offload::Pipeline& p, strata::Engine& engine, uint32_t chunk) {
            return Held(engine, ValueOrThrow(Unlocked([&] { return p.Access(strata::ChunkId(chunk)); })));
          },
          py::arg("engine"), py::arg("chunk"), py::keep_alive<0, 1>(),
          "pins a chunk where the moment computes (the pipeline's engine); waits for its planned transfer")
      .def("end_moment", [](strata::offload::Pipeline& p) { ThrowIfError(p.EndMoment()); })
      .def("end_iteration",
           [](strata::offload::Pipeline& p) {
             ThrowIfError(Unlocked([&] { return p.EndIteration(); }));
           })
      .def("stats_json", &strata::offload::Pipeline::StatsJson);

  m.def(
      "train_step",
      [](strata::Engine& engine, strata::offload::Pipeline& pipeline, strata::optim::Optimizer& optimizer,
         const std::vector<uint32_t>& skip_tensors, strata::Communicator* comm, PyGradReducer* reducer,
         strata::offload::PendingCheckpoint* fence) {
        std::vector<bool> skip(engine.tensors().size(), false);
        for (uint32_t t : skip_tensors) skip.at(t) = true;
        const strata::offload::TrainStepReport report = ValueOrThrow(Unlocked(
            [&] {
              return strata::offload::RunTrainStep(engine, pipeline, optimizer, skip, comm,
                                                   reducer != nullptr ? &reducer->get() : nullptr, fence);
            }));
        py::dict d;
        d["skipped"] = report.plan.skip;
        d["step"] = report.plan.step;
        d["grad_norm"] = report.plan.grad_norm;
        d["loss_scale"] = report.plan.loss_scale;
        d["stats_seconds"] = report.stats_seconds;
        d["update_seconds"] = report.update_seconds;
        d["groups"] = report.groups;
        d["comm_bytes"] = report.comm_bytes;
        d["comm_wait_seconds"] = report.comm_wait_seconds;
        return d;
      },
      py::arg("engine"), py::arg("pipeline"), py::arg("optimizer"), py::arg("skip_tensors") = std::vector<uint32_t>{},
      py::arg("comm") = nullptr, py::arg("reducer") = nullptr, py::arg("fence") = nullptr,
      "the optimizer step over every trainable chunk group, in host moments of the open iteration; "
      "skip_tensors (ids) are left as they are; with fence (a PendingCheckpoint) each group's update waits "
      "until the save has read the group");

  py::class_<PyGradReducer, std::unique_ptr<PyGradReducer>>(
      m, "GradReducer",
      "data parallel: the gradient reduce-scatter of each chunk group on a thread of its own, submitted as the "
      "group's gradients complete in backward (offload/grad_reducer.h)")
      .def(py::init([](strata::Engine& engine, strata::Communicator& comm) {
             return std::make_unique<PyGradReducer>(std::make_unique<strata::offload::GradReducer>(engine, comm));
           }),
           py::arg("engine"), py::arg("comm"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def(
          "submit",
          [](PyGradReducer& r, uint32_t chunk) {
            ThrowIfError(Unlocked([&] { return r.get().Submit(strata::ChunkId(chunk)); }));
          },
          py::arg("chunk"), "copies a grad chunk and queues its reduce-scatter")
      .def(
          "submitted", [](PyGradReducer& r, uint32_t chunk) { return r.get().submitted(strata::ChunkId(chunk)); },
          py::arg("chunk"))
      .def("drain", [](PyGradReducer& r) { ThrowIfError(Unlocked([&] { return r.get().Drain(); })); },
           "waits for every queued reduction")
      .def(
          "gather",
          [](PyGradReducer& r, const PyAccess& into) {
            ThrowIfError(Unlocked([&] { return r.get().Gather(into.access.id(), into.access); }));
          },
          py::arg("into"),
          "parameters sharded: fills a pinned transient param chunk from every rank's master shard (nothing is "
          "sent for one of the last two chunks gathered)")
      .def("release_gathered",
           [](PyGradReducer& r) {
             ThrowIfError(Unlocked([&] {
               r.get().ReleaseGathered();  // waits for the gathers queued ahead, which a Python communicator runs
               return strata::Status::Ok();
             }));
           },
           "lets the kept gathered chunks go and drops those gathered ahead")
      .def_property_readonly("gathers", [](PyGradReducer& r) { return r.get().gathers(); },
                             "parameter all-gathers that communicated")
      .def_property_readonly("gathered_ahead", [](PyGradReducer& r) { return r.get().gathered_ahead(); },
                             "of them, those queued ahead of their need (the last step's sequence)")
      .def_property_readonly("filled_ahead", [](PyGradReducer& r) { return r.get().filled_ahead(); },
                             "of those, the ones whose device chunk was filled ahead too (the access copied nothing)")
      .def("close", &PyGradReducer::Close,
           "waits for what is queued and stops the reducer's thread (also when it is collected); later calls raise")
      .def("on_own_thread", [](PyGradReducer& r) { return r.open() && r.get().OnOwnThread(); },
           "whether the caller runs on the reducer's thread (a Python communicator's collective, or the garbage "
           "collector inside one), where the reducer cannot be closed")
      .def_property_readonly("wait_seconds", [](PyGradReducer& r) { return r.get().wait_seconds(); });

  // Checkpoints (offload/checkpoint.h): what was saved, loaded or verified, as a dict.
  const auto summary = [](const strata::offload::CheckpointSummary& s) {
    py::dict d;
    d["path"] = s.path;
    d["step"] = s.step;
    d["bytes"] = s.bytes;
    d["files"] = s.files;
    d["recycled"] = s.recycled;
    d["rewritten"] = s.rewritten;
    d["skipped"] = s.skipped;
    return d;
  };
  m.def(
      "save_checkpoint",
      [summary](strata::Engine& engine, const strata::optim::Optimizer& optimizer, const std::string& root,
                uint32_t keep_last, strata::Communicator* comm, bool recycle) {
        return summary(ValueOrThrow(Unlocked([&] {
          return strata::offload::SaveCheckpoint(engine, optimizer, root, {.keep_last = keep_last, .recycle = recycle},
                                                 comm);
        })));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("root"), py::arg("keep_last") = 0, py::arg("comm") = nullptr,
      py::arg("recycle") = true,
      "saves every chunk but the gradients, and the optimizer's state, as root/step-<N>, then points root/latest "
      "at it");
  py::class_<strata::offload::PendingCheckpoint>(
      m, "PendingCheckpoint", "a save written on a thread of its own while training goes on (start_checkpoint)")
      .def(
          "wait",
          [summary](strata::offload::PendingCheckpoint& p) {
            return summary(ValueOrThrow(Unlocked([&] { return p.Wait(); })));
          },
          "waits for the save and returns what save_checkpoint would (data parallel: every rank calls it)")
      .def("wait_local",
           [](strata::offload::PendingCheckpoint& p) {
             py::gil_scoped_release unlocked;
             p.WaitLocal();
           },
           "waits for this rank's files alone, no collective (rank 0's publishes): the end of a process")
      .def_property_readonly("done", &strata::offload::PendingCheckpoint::done,
                             "whether this rank's part is finished");
  m.def(
      "start_checkpoint",
      [](strata::Engine& engine, const strata::optim::Optimizer& optimizer, const std::string& root,
         uint32_t keep_last, strata::Communicator* comm, uint32_t delay_ms, bool recycle) {
        strata::offload::CheckpointOptions options{.keep_last = keep_last, .recycle = recycle};
        strata::FileSystem* files = &strata::PosixFileSystem();
        if (delay_ms > 0) {  // tests: a slow drive's stand-in, each file write delayed; outlives every save
          static strata::FaultInjectingFileSystem slow(strata::PosixFileSystem());
          slow.SetDelayMs(delay_ms);
          files = &slow;
        }
        return ValueOrThrow(
            Unlocked([&] { return strata::offload::StartCheckpoint(engine, optimizer, root, options, comm, *files); }));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("root"), py::arg("keep_last") = 0, py::arg("comm") = nullptr,
      py::arg("delay_ms_per_chunk") = 0, py::arg("recycle") = true, py::keep_alive<0, 1>(), py::keep_alive<0, 5>(),
      "save_checkpoint on a thread of its own: the state as it is now, written while training goes on "
      "(pass it to train_step as its fence); wait() for the outcome");
  m.def(
      "load_checkpoint",
      [summary](strata::Engine& engine, strata::optim::Optimizer& optimizer, const std::string& path, bool fall_back,
                strata::Communicator* comm) {
        return summary(ValueOrThrow(Unlocked([&] {
          return strata::offload::LoadCheckpoint(engine, optimizer, path, {.fall_back = fall_back}, comm);
        })));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("path"), py::arg("fall_back") = false, py::arg("comm") = nullptr,
      "loads a checkpoint (a root's latest, or one checkpoint's directory), checking every file's size and CRC32C");
  m.def(
      "verify_checkpoint",
      [summary](const std::string& path) {
        return summary(ValueOrThrow(Unlocked([&] { return strata::offload::VerifyCheckpoint(path); })));
      },
      py::arg("path"), "checks every file of a checkpoint against its manifest (size, CRC32C)");

  // safetensors (offload/interchange.h).
  const auto interchanged = [](const strata::offload::InterchangeSummary& s) {
    py::dict d;
    d["path"] = s.path;
    d["tensors"] = s.tensors;
    d["bytes"] = s.bytes;
    d["missing"] = s.missing;
    d["unused"] = s.unused;
    return d;
  };
  m.def(
      "export_safetensors",
      [interchanged](strata::Engine& engine, const std::string& path, bool fp32, strata::Communicator* comm) {
        return interchanged(ValueOrThrow(
            Unlocked([&] { return strata::offload::ExportSafetensors(engine, path, {.fp32 = fp32}, comm); })));
      },
      py::arg("engine"), py::arg("path"), py::arg("fp32") = false, py::arg("comm") = nullptr,
      "writes every registered tensor's parameters to a safetensors file (compute dtype, or fp32 masters)");
  m.def(
      "import_safetensors",
      [interchanged](strata::Engine& engine, const std::string& path, bool strict) {
        return interchanged(ValueOrThrow(
            Unlocked([&] { return strata::offload::ImportSafetensors(engine, path, {.strict = strict}); })));
      },
      py::arg("engine"), py::arg("path"), py::arg("strict") = true,
      "sets the parameters (and this rank's masters) from a safetensors file, chunk group by chunk group");
  m.def(
      "safetensors_index",
      [](const std::string& path) {
        const auto entries = ValueOrThrow(Unlocked([&] { return strata::offload::ReadSafetensorsIndex(path); }));
        py::dict out;
        for (const auto& [name, entry] : entries) {
          py::dict d;
          d["dtype"] = entry.dtype;
          d["shape"] = entry.shape;
          d["offset"] = entry.offset;
          d["bytes"] = entry.bytes;
          out[py::str(name)] = d;
        }
        return out;
      },
      py::arg("path"), "a safetensors file's tensors: name -> dtype, shape, offset (from the file's start), bytes");

  m.def(
      "parse_size", [](const std::string& text) { return ValueOrThrow(strata::ParseSize(text)); }, py::arg("text"),
      "'64MiB', '1.5GiB', '4096', '2GB' -> bytes; ValueError otherwise");

  m.def(
      "option_keys",
      [] {
        std::vector<std::string> keys;
        for (const strata::OptionDoc& doc : strata::OptionDocs()) keys.push_back(doc.key);
        return keys;
      },
      "every documented option key");
}
