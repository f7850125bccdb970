// The data-parallel group in Python: strata's Communicator (subclassable, so
// that a transport written in Python plugs into the seam) and the ways to
// make one (MPI, NCCL), with what this build carries.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "python/src/binding.h"
#include "strata/comm.h"
#include "strata/device.h"

namespace strata::python {

namespace {

// A communicator written in Python (strata.distributed.TorchCommunicator:
// torch.distributed under torchrun). Each collective calls the subclass's
// method (_all_gather, _reduce_scatter_sum, _all_reduce_sum, _broadcast,
// _barrier) with writable memoryviews of the C++ buffers, the GIL held. A
// Python exception is a Timeout when its message says it timed out, else a
// CommError, either naming it; and it breaks the communicator, so that every
// later call fails at once (the seam's contract).
class PyCommunicator : public Communicator {
 public:
  PyCommunicator(int rank, int world, std::string description)
      : rank_(rank), world_(world), description_(std::move(description)) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string Describe() const override { return description_; }
  Status Barrier() override {
    return Call("barrier", "_barrier", [](const py::function& f) { f(); });
  }

 protected:
  Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return Call("all-gather", "_all_gather", [&](const py::function& f) {
      f(View(send, bytes_per_rank), View(recv, bytes_per_rank * static_cast<size_t>(world_)));
    });
  }
  // `dtype` as torch names it: float32, bfloat16 or float16.
  Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    const size_t bytes = count_per_rank * DTypeSizeBytes(dtype);
    const char* name = dtype == DType::kFloat32    ? "float32"
                       : dtype == DType::kBFloat16 ? "bfloat16"
                                                   : "float16";
    return Call("reduce-scatter", "_reduce_scatter_sum", [&](const py::function& f) {
      f(View(send, bytes * static_cast<size_t>(world_)), View(recv, bytes), count_per_rank, name);
    });
  }
  Status DoAllReduceSum(std::span<double> values) override {
    return Call("all-reduce", "_all_reduce_sum",
                [&](const py::function& f) { f(View(values.data(), values.size_bytes())); });
  }
  Status DoBroadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_) {
      return InvalidArgument("broadcast: root {} is not a rank of this group of {}", root, world_);
    }
    return Call("broadcast", "_broadcast", [&](const py::function& f) { f(View(data, bytes), root); });
  }

 private:
  static py::memoryview View(const void* data, size_t bytes) {
    return py::memoryview::from_memory(const_cast<void*>(data), static_cast<py::ssize_t>(bytes), /*readonly=*/false);
  }

  template <typename Invoke>
  Status Call(const char* op, const char* method, Invoke invoke) {
    if (!broken_.empty()) return CommError("{} on rank {}: the group is broken: {}", op, rank_, broken_);
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(this, method);
    if (!f) {
      broken_ = fmt::format("the Python communicator does not define {}()", method);
      return NotSupported("{} on rank {}: {}", op, rank_, broken_);
    }
    try {
      invoke(f);
      return Status::Ok();
    } catch (py::error_already_set& error) {  // the exception's type and message, not its traceback
      broken_ = py::str(error.type().attr("__name__")).cast<std::string>() + ": " +
                py::str(error.value()).cast<std::string>();
    } catch (const std::exception& error) {  // a failed conversion, say: the group is as broken
      broken_ = error.what();
    }
    if (broken_.find("imed out") != std::string::npos || broken_.find("imeout") != std::string::npos) {
      return Timeout("{} on rank {} timed out: {}", op, rank_, broken_);
    }
    return CommError("{} on rank {}: {}", op, rank_, broken_);
  }

  const int rank_;
  const int world_;
  const std::string description_;
  std::string broken_;
};

// Communicator::stats() as a dict: calls, bytes and seconds of each kind, and the total bytes.
py::dict CommStatsDict(const CommStats& s) {
  py::dict d;
  const std::pair<const char*, const CollectiveStats*> each[] = {
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
}

}  // namespace

void BindCommunicator(py::module_& m) {
  py::class_<Communicator, PyCommunicator, std::unique_ptr<Communicator>>(
      m, "Communicator",
      "a data-parallel group's collectives (strata/comm.h); subclass it in Python to bring another transport "
      "(define _all_gather, _reduce_scatter_sum, _all_reduce_sum, _broadcast and _barrier)")
      .def(py::init<int, int, std::string>(), py::arg("rank"), py::arg("world_size"), py::arg("description"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def("describe", &Communicator::Describe)
      .def(
          "stats", [](const Communicator& c) { return CommStatsDict(c.stats()); },
          "what this rank's collectives carried: calls, bytes sent (ring algorithm) and seconds of each kind")
      .def("barrier", [](Communicator& c) { ThrowIfError(Unlocked([&] { return c.Barrier(); })); })
      .def(
          "broadcast",
          [](Communicator& c, py::buffer buffer, int root) {
            py::buffer_info info = buffer.request(/*writable=*/true);
            const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
            ThrowIfError(Unlocked([&] { return c.Broadcast(info.ptr, bytes, root); }));
          },
          py::arg("buffer"), py::arg("root") = 0, "root's bytes of `buffer` (writable) into every rank's")
      .def(
          "all_gather",
          [](Communicator& c, py::buffer buffer) {
            py::buffer_info info = buffer.request();
            const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
            std::string all(bytes * static_cast<size_t>(c.world_size()), '\0');
            ThrowIfError(Unlocked([&] { return c.AllGather(info.ptr, all.data(), bytes); }));
            return py::bytes(all);
          },
          py::arg("buffer"), "every rank's `buffer` (the same size on each), in rank order, as bytes")
      .def(
          "all_reduce_sum",
          [](Communicator& c, std::vector<double> values) {
            ThrowIfError(Unlocked([&] { return c.AllReduceSum(values); }));
            return values;
          },
          py::arg("values"), "the element-wise sum of `values` (a list of numbers) over the ranks");
}

void BindTransports(py::module_& m) {
  m.def(
      "mpi_communicator",
      [](uint32_t timeout_ms) { return ValueOrThrow(CreateMpiCommunicator({.timeout_ms = timeout_ms})); },
      py::arg("timeout_ms") = 60'000, "MPI_COMM_WORLD (this process was started by mpirun)");
  m.def("launched_by_mpi", &LaunchedByMpi, "whether mpirun started this process");
  m.def(
      "nccl_communicator",
      [](Communicator* bootstrap, int device_index, uint32_t timeout_ms) {
        // Released: a Python bootstrap (gloo) takes the GIL for its broadcast.
        return ValueOrThrow(
            Unlocked([&] { return CreateNcclCommunicator(bootstrap, device_index, {.timeout_ms = timeout_ms}); }));
      },
      py::arg("bootstrap"), py::arg("device_index"), py::arg("timeout_ms") = 60'000,
      "NCCL over bootstrap's ranks (None: one rank), on CUDA device device_index; bootstrap carries NCCL's id only");
  m.def("cuda_device_available", &CudaDeviceAvailable, "whether strata was built with CUDA and a GPU is visible");
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
}

}  // namespace strata::python
