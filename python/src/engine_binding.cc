// The engine in Python: registering tensors, the chunks they are packed into,
// pinned chunk accesses (ChunkAccess, whose bytes Python sees through the
// buffer protocol where the host can address them), and the engine's stats.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "python/src/binding.h"
#include "strata/buffer.h"
#include "strata/engine.h"

namespace strata::python {

namespace {

py::dict TierUsageDict(const TierUsage& usage) {
  py::dict d;
  d["capacity_bytes"] = usage.capacity_bytes;
  d["used_bytes"] = usage.used_bytes;
  d["peak_bytes"] = usage.peak_bytes;
  return d;
}

// Engine::stats() as a dict: tiers (present ones) and links ("host->device", ...).
py::dict StatsDict(const MemoryStats& stats) {
  py::dict tiers, links;
  for (int t = 0; t < kNumTiers; ++t) {
    if (!stats.tier_present[t]) continue;
    tiers[py::str(std::string(TierName(static_cast<Tier>(t))))] = TierUsageDict(stats.tiers[t]);
  }
  for (int from = 0; from < kNumTiers; ++from) {
    for (int to = 0; to < kNumTiers; ++to) {
      const LinkStats& link = stats.links[from][to];
      if (link.moves == 0) continue;
      py::dict d;
      d["moves"] = link.moves;
      d["bytes"] = link.bytes;
      d["seconds"] = link.seconds;
      const std::string name =
          std::string(TierName(static_cast<Tier>(from))) + "->" + std::string(TierName(static_cast<Tier>(to)));
      links[py::str(name)] = d;
    }
  }
  py::dict d;
  d["tiers"] = tiers;
  d["links"] = links;
  d["evictions"] = stats.evictions;
  d["compactions"] = stats.compactions;
  d["drops"] = stats.drops;
  d["fence_waits"] = stats.fence_waits;
  return d;
}

// Engine::chunks() as a list of dicts (see the docstring of Engine.chunks below).
py::list ChunksList(const Engine& engine) {
  py::list chunks;
  for (const ChunkInfo& chunk : engine.chunks()) {
    py::dict d;
    d["id"] = chunk.id.value();
    d["kind"] = std::string(ChunkKindName(chunk.kind));
    d["dtype"] = std::string(DTypeName(chunk.dtype));
    d["group"] = chunk.group;
    d["param_group"] = chunk.param_group;
    d["size_bytes"] = chunk.size_bytes;
    d["used_bytes"] = chunk.used_bytes;
    d["home"] = std::string(TierName(ValueOrThrow(engine.ChunkHome(chunk.id))));
    std::vector<uint32_t> tensors;
    for (TensorId t : chunk.tensors) tensors.push_back(t.value());
    d["tensors"] = tensors;
    d["tensor_offsets"] = chunk.tensor_offsets_bytes;
    d["sharded"] = chunk.sharded;
    d["shard_offset"] = chunk.shard_offset_bytes;
    d["transient"] = chunk.transient;
    chunks.append(d);
  }
  return chunks;
}

using EngineClass = py::class_<Engine, std::unique_ptr<Engine>>;

// Making an engine, registering and finalizing its tensors, closing it.
void BindEngineLifetime(EngineClass& cls) {
  cls
      .def(py::init([](const Options& options, Communicator* comm, std::optional<uint64_t> available_host_bytes) {
             EngineSeams seams;
             seams.comm = comm;
             seams.available_host_bytes = available_host_bytes;
             return ValueOrThrow(Engine::Create(options, std::move(seams)));
           }),
           py::arg("options"), py::arg("comm") = nullptr, py::arg("available_host_bytes") = py::none(),
           py::keep_alive<1, 3>(),
           "with `comm`: one rank of a data-parallel group (options and tensors checked alike on every rank); "
           "available_host_bytes: the host memory host.budget auto takes at most half of (None: this machine's "
           "available memory)")
      .def(
          "register_tensor",
          [](Engine& engine, const std::string& name, const std::vector<int64_t>& shape, const std::string& dtype,
             bool trainable, const std::string& module, uint32_t param_group) {
            const DType parsed = ValueOrThrow(ParseDType(dtype));
            return ValueOrThrow(engine.RegisterTensor({name, shape, parsed, trainable, module, param_group})).value();
          },
          py::arg("name"), py::arg("shape"), py::arg("dtype") = "fp32", py::arg("trainable") = true,
          py::arg("module") = "", py::arg("param_group") = 0,
          "registers a tensor (model order) in the optimizer's param group `param_group`; returns its id")
      .def(
          "finalize", [](Engine& engine) { ThrowIfError(engine.Finalize()); },
          "packs the registered tensors into chunks and gives each a home tier")
      .def(
          "close", [](Engine& engine) { ThrowIfError(Unlocked([&] { return engine.Close(); })); },
          "gives every tier's memory and NVMe files back now (ValueError, releasing nothing, while a chunk is "
          "pinned); idempotent; after it the engine's calls raise, saying it is closed")
      .def_property_readonly("closed", &Engine::closed);
}

}  // namespace

void BindEngine(py::module_& m) {
  EngineClass cls(m, "Engine", "the engine: tensors in chunks on three tiers");
  BindEngineLifetime(cls);
  cls
      .def("chunks", &ChunksList,
           "after finalize: every chunk (id, kind, dtype, group, size_bytes, used_bytes, home, tensors, "
           "tensor_offsets in the group's whole chunk; sharded and shard_offset: a data-parallel rank's master and "
           "state chunks hold bytes [shard_offset, shard_offset + used_bytes) of it; transient: a param chunk "
           "gathered from the ranks' master shards, comm.shard_params)")
      .def_property_readonly("host_staging_bytes", &Engine::host_staging_bytes)
      .def(
          "access_chunk",
          [](Engine& engine, uint32_t chunk, const std::string& tier) {
            const Tier parsed = ValueOrThrow(ParseTier(tier));
            return Held(engine, ValueOrThrow(Unlocked([&] { return engine.AccessChunk(ChunkId(chunk), parsed); })));
          },
          py::arg("chunk"), py::arg("tier"), py::keep_alive<0, 1>(),
          "pins a chunk on a tier (device or host), moving it there first")
      .def(
          "read_chunk",
          [](Engine& engine, uint32_t chunk) {
            const uint64_t size = engine.chunks().at(chunk).size_bytes;
            Buffer buffer = AllocateAlignedHost(size, 4096);
            ThrowIfError(Unlocked([&] { return engine.ReadChunk(ChunkId(chunk), buffer.data()); }));
            return py::bytearray(reinterpret_cast<const char*>(buffer.data()), size);
          },
          py::arg("chunk"), "a copy of a chunk's bytes from wherever it lives (nothing moves)")
      .def(
          "chunk_tier",
          [](const Engine& engine, uint32_t chunk) -> py::object {
            const Result<Tier> tier = engine.ChunkTier(ChunkId(chunk));
            if (!tier.ok()) return py::none();  // free: no payload yet
            return py::str(std::string(TierName(*tier)));
          },
          py::arg("chunk"), "where a chunk is now (None before it has a payload)")
      .def(
          "stats", [](const Engine& engine) { return StatsDict(engine.stats()); },
          "tiers (capacity, used, peak bytes) and links (moves, bytes, seconds)")
      .def("describe_backends", &Engine::DescribeBackends)
      .def(
          "device_arena",
          [](const Engine& engine) {
            const Buffer& arena = engine.device_arena();
            return py::make_tuple(reinterpret_cast<uintptr_t>(arena.data()), arena.size_bytes());
          },
          "(address, size_bytes) of the device tier's one arena, in which every chunk pinned on the device lies")
      .def(
          "record_fence",
          [](Engine& engine, uintptr_t stream) {
            return Fence{ValueOrThrow(engine.device().RecordFence(stream))};
          },
          py::arg("stream"),
          "a Fence: completes once the work queued so far on the framework's CUDA stream `stream` (its "
          "handle: torch.cuda.Stream.cuda_stream) has run; recorded without waiting, complete at once on the "
          "emulated device");
}

void BindFence(py::module_& m) {
  py::class_<Fence>(m, "Fence", "the framework's work on its stream up to a point (Engine.record_fence)")
      .def_property_readonly("done", [](const Fence& f) { return f.event->Done(); });
}

void BindChunkAccess(py::module_& m) {
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
      .def_property_readonly("tier", [](const PyAccess& a) { return std::string(TierName(a.access.tier())); })
      .def_property_readonly("address", [](const PyAccess& a) { return reinterpret_cast<uintptr_t>(a.access.data()); })
      .def_property_readonly("size_bytes", [](const PyAccess& a) { return a.access.size_bytes(); })
      .def_property_readonly("valid", [](const PyAccess& a) { return a.access.valid(); })
      .def_readonly("host_addressable", &PyAccess::host_addressable)
      .def("release", [](PyAccess& a) { a.access.Release(); }, "unpins the chunk")
      .def(
          "release_after", [](PyAccess& a, const Fence& fence) { a.access.ReleaseAfter(fence.event); },
          py::arg("fence"),
          "unpins the chunk, whose device bytes the framework's kernels queued before `fence` may still use: "
          "strata moves, reads or overwrites them only once the fence has completed");
}

}  // namespace strata::python
