// Persistence in Python: checkpoints (saved at once or on a thread of their
// own, loaded, verified) and safetensors (export, import, index), each
// returning what it did as a dict.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "optim/optimizer.h"
#include "python/src/binding.h"
#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/safetensors.h"

namespace strata::python {

namespace {

// What was saved, loaded or verified (strata/checkpoint.h), as a dict.
py::dict CheckpointDict(const offload::CheckpointSummary& s) {
  py::dict d;
  d["path"] = s.path;
  d["step"] = s.step;
  d["bytes"] = s.bytes;
  d["files"] = s.files;
  d["recycled"] = s.recycled;
  d["rewritten"] = s.rewritten;
  d["skipped"] = s.skipped;
  return d;
}

// What a safetensors export or import did (strata/safetensors.h), as a dict.
py::dict InterchangeDict(const offload::InterchangeSummary& s) {
  py::dict d;
  d["path"] = s.path;
  d["tensors"] = s.tensors;
  d["bytes"] = s.bytes;
  d["missing"] = s.missing;
  d["unused"] = s.unused;
  return d;
}

// The files an asynchronous save writes through: delay_ms > 0 (tests) stands
// in for a slow drive, each chunk file opened that much later. One wrapper
// per delay, kept for the process so that it outlives every save using it
// (the map is guarded by the GIL, held here).
FileSystem& StartFiles(uint32_t delay_ms) {
  if (delay_ms == 0) return PosixFileSystem();
  static std::map<uint32_t, std::unique_ptr<FaultInjectingFileSystem>> slow_by_delay;
  std::unique_ptr<FaultInjectingFileSystem>& slow = slow_by_delay[delay_ms];
  if (slow == nullptr) {
    slow = std::make_unique<FaultInjectingFileSystem>(PosixFileSystem());
    slow->SetOpenHook([delay_ms](const std::string& path) {
      if (path.find("/chunk-") != std::string::npos) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      return Status::Ok();
    });
  }
  return *slow;
}

void BindPendingCheckpoint(py::module_& m) {
  py::class_<offload::PendingCheckpoint>(
      m, "PendingCheckpoint", "a save written on a thread of its own while training goes on (start_checkpoint)")
      .def(
          "wait",
          [](offload::PendingCheckpoint& p) {
            return CheckpointDict(ValueOrThrow(Unlocked([&] { return p.Wait(); })));
          },
          "waits for the save and returns what save_checkpoint would (data parallel: every rank calls it)")
      .def("wait_local",
           [](offload::PendingCheckpoint& p) {
             py::gil_scoped_release unlocked;
             p.WaitLocal();
           },
           "waits for this rank's files alone, no collective (rank 0's publishes): the end of a process")
      .def_property_readonly("done", &offload::PendingCheckpoint::done, "whether this rank's part is finished");
}

}  // namespace

void BindCheckpoint(py::module_& m) {
  m.def(
      "save_checkpoint",
      [](Engine& engine, const optim::Optimizer& optimizer, const std::string& root, uint32_t keep_last,
         Communicator* comm, bool recycle) {
        return CheckpointDict(ValueOrThrow(Unlocked([&] {
          return offload::SaveCheckpoint(engine, optimizer, root, {.keep_last = keep_last, .recycle = recycle}, comm);
        })));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("root"), py::arg("keep_last") = 0, py::arg("comm") = nullptr,
      py::arg("recycle") = true,
      "saves every chunk but the gradients, and the optimizer's state, as root/step-<N>, then points root/latest "
      "at it");
  BindPendingCheckpoint(m);
  m.def(
      "start_checkpoint",
      [](Engine& engine, const optim::Optimizer& optimizer, const std::string& root, uint32_t keep_last,
         Communicator* comm, uint32_t delay_ms, bool recycle) {
        const offload::CheckpointOptions options{.keep_last = keep_last, .recycle = recycle};
        FileSystem& files = StartFiles(delay_ms);
        return ValueOrThrow(
            Unlocked([&] { return offload::StartCheckpoint(engine, optimizer, root, options, comm, files); }));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("root"), py::arg("keep_last") = 0, py::arg("comm") = nullptr,
      py::arg("delay_ms_per_chunk") = 0, py::arg("recycle") = true, py::keep_alive<0, 1>(), py::keep_alive<0, 5>(),
      "save_checkpoint on a thread of its own: the state as it is now, written while training goes on "
      "(pass it to train_step as its fence); wait() for the outcome");
  m.def(
      "load_checkpoint",
      [](Engine& engine, optim::Optimizer& optimizer, const std::string& path, bool fall_back, Communicator* comm) {
        return CheckpointDict(ValueOrThrow(Unlocked(
            [&] { return offload::LoadCheckpoint(engine, optimizer, path, {.fall_back = fall_back}, comm); })));
      },
      py::arg("engine"), py::arg("optimizer"), py::arg("path"), py::arg("fall_back") = false, py::arg("comm") = nullptr,
      "loads a checkpoint (a root's latest, or one checkpoint's directory), checking every file's size and CRC32C");
  m.def(
      "verify_checkpoint",
      [](const std::string& path) {
        return CheckpointDict(ValueOrThrow(Unlocked([&] { return offload::VerifyCheckpoint(path); })));
      },
      py::arg("path"), "checks every file of a checkpoint against its manifest (size, CRC32C)");
}

void BindSafetensors(py::module_& m) {
  m.def(
      "export_safetensors",
      [](Engine& engine, const std::string& path, bool fp32, Communicator* comm) {
        return InterchangeDict(
            ValueOrThrow(Unlocked([&] { return offload::ExportSafetensors(engine, path, {.fp32 = fp32}, comm); })));
      },
      py::arg("engine"), py::arg("path"), py::arg("fp32") = false, py::arg("comm") = nullptr,
      "writes every registered tensor's parameters to a safetensors file (compute dtype, or fp32 masters)");
  m.def(
      "import_safetensors",
      [](Engine& engine, const std::string& path, bool strict) {
        return InterchangeDict(
            ValueOrThrow(Unlocked([&] { return offload::ImportSafetensors(engine, path, {.strict = strict}); })));
      },
      py::arg("engine"), py::arg("path"), py::arg("strict") = true,
      "sets the parameters (and this rank's masters) from a safetensors file, chunk group by chunk group");
  m.def(
      "safetensors_index",
      [](const std::string& path) {
        const auto entries = ValueOrThrow(Unlocked([&] { return offload::ReadSafetensorsIndex(path); }));
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
}

}  // namespace strata::python
