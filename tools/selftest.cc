#include "tools/selftest.h"

#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "src/base/logging.h"

namespace strata {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The expected bytes of one tensor copy at one version.
void FillPattern(std::byte* dst, uint64_t size_bytes, uint64_t seed, uint32_t tensor, ChunkKind kind,
                 uint32_t version) {
  uint64_t base = SplitMix64(seed ^ (uint64_t{tensor} << 20) ^ (uint64_t{static_cast<uint8_t>(kind)} << 52) ^
                             (uint64_t{version} << 56));
  for (uint64_t i = 0; i < size_bytes; i += 8) {
    uint64_t word = SplitMix64(base + i);
    std::memcpy(dst + i, &word, std::min<uint64_t>(8, size_bytes - i));
  }
}

// Host-side view of an access: direct on the host tier (and on an emulated
// device), through a copy on a real device.
class HostView {
 public:
  static Result<HostView> Of(Device& device, const TensorAccess& access, uint32_t timeout_ms) {
    HostView view;
    view.device_ = &device;
    view.access_ = &access;
    view.timeout_ms_ = timeout_ms;
    if (access.tier() == Tier::kHost || device.host_accessible()) {
      view.data_ = static_cast<std::byte*>(access.data());
      return view;
    }
    STRATA_ASSIGN_OR_RETURN(view.bounce_, device.AllocatePinnedHost(access.size_bytes(), -1));
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> event,
                            device.CopyAsync(CopyStream::kDeviceToHost, view.bounce_.data(), access.data(),
                                             access.size_bytes()));
    STRATA_RETURN_IF_ERROR(event->Wait(timeout_ms));
    view.data_ = view.bounce_.bytes();
    return view;
  }
  std::byte* data() const { return data_; }
  // Pushes host-side changes back to the device when the view is a copy.
  Status Commit() {
    if (!bounce_) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> event,
                            device_->CopyAsync(CopyStream::kHostToDevice, access_->data(), bounce_.data(),
                                               access_->size_bytes()));
    return event->Wait(timeout_ms_);
  }

 private:
  Device* device_ = nullptr;
  const TensorAccess* access_ = nullptr;
  uint32_t timeout_ms_ = 0;
  Buffer bounce_;
  std::byte* data_ = nullptr;
};

class Checker {
 public:
  Checker(Engine& engine, const SelftestConfig& config, SelftestReport& report)
      : engine_(engine), config_(config), report_(report) {
    versions_.assign(engine.tensors().size() * kNumChunkKinds, 0);
    for (const ChunkInfo& chunk : engine.chunks()) blocks_.push_back(chunk.dtype == DType::kInt8Block);
  }

  // Whether the tensor has that copy as elements: 8-bit moments (optimizer.states int8) are codes and block
  // scales, which Engine::Access refuses; their chunks move as every chunk does, checked through the others.
  bool Has(TensorId tensor, ChunkKind kind) const {
    const std::optional<ChunkId> chunk = engine_.ChunkOf(tensor, kind);
    return chunk.has_value() && !blocks_[chunk->value()];
  }

  // Writes version+1 of the pattern into a tensor copy on `tier`.
  Status Write(TensorId tensor, ChunkKind kind, Tier tier) {
    STRATA_ASSIGN_OR_RETURN(TensorAccess access, engine_.Access(tensor, kind, tier));
    STRATA_ASSIGN_OR_RETURN(HostView view, HostView::Of(engine_.device(), access, kTimeoutMs));
    uint32_t& version = versions_[tensor.value() * kNumChunkKinds + static_cast<int>(kind)];
    ++version;
    FillPattern(view.data(), access.size_bytes(), config_.seed, tensor.value(), kind, version);
    return view.Commit();
  }

  // Checks a tensor copy on `tier` against the pattern it should hold
  // (zeros before its first write).
  Status Verify(TensorId tensor, ChunkKind kind, Tier tier) {
    STRATA_ASSIGN_OR_RETURN(TensorAccess access, engine_.Access(tensor, kind, tier));
    STRATA_ASSIGN_OR_RETURN(HostView view, HostView::Of(engine_.device(), access, kTimeoutMs));
    uint32_t version = versions_[tensor.value() * kNumChunkKinds + static_cast<int>(kind)];
    expected_.resize(access.size_bytes());
    if (version == 0) {
      std::memset(expected_.data(), 0, expected_.size());
    } else {
      FillPattern(expected_.data(), expected_.size(), config_.seed, tensor.value(), kind, version);
    }
    report_.copies_checked++;
    report_.bytes_checked += access.size_bytes();
    if (std::memcmp(expected_.data(), view.data(), expected_.size()) != 0) {
      report_.mismatches++;
      if (report_.first_mismatch.empty()) {
        report_.first_mismatch = fmt::format("tensor '{}' {} on {} (version {})", engine_.tensors()[tensor.value()].name,
                                             ChunkKindName(kind), TierName(tier), version);
      }
    }
    return Status::Ok();
  }

 private:
  static constexpr uint32_t kTimeoutMs = 60'000;
  Engine& engine_;
  const SelftestConfig& config_;
  SelftestReport& report_;
  std::vector<uint32_t> versions_;  // [tensor][kind]
  std::vector<bool> blocks_;       // [chunk]: moments of 8-bit blocks
  std::vector<std::byte> expected_;
};

constexpr ChunkKind kAllKinds[] = {ChunkKind::kParam, ChunkKind::kGrad, ChunkKind::kMaster, ChunkKind::kExpAvg,
                                   ChunkKind::kExpAvgSq};

}  // namespace

// Note [The self-check]
// It registers the tensors of a decoder-only transformer (token and frozen
// position embeddings, then per layer: layer norms, attention and MLP
// weights and biases), sizes the device and host budgets to a fraction of
// the model states so that chunks must cycle device <-> host <-> NVMe, then
// runs forward-like (params on device, module order) and backward-like
// (grads on device, reverse order, written with a new pattern) passes and
// checks every tensor of every kind against its expected pattern.
Result<SelftestReport> RunSelftest(const SelftestConfig& config, Options options, EngineSeams seams) {
  auto start = std::chrono::steady_clock::now();
  std::vector<TensorSpec> specs = offload::GptTensorSpecs(GptShapeOf(config), options.compute_dtype);

  // Size the budgets from the exact footprint of the layout the engine will build.
  const memory::SearchBounds bounds =
      memory::SearchBoundsFor(specs, {options.chunk.search_min_elems, options.chunk.search_max_elems},
                              options.device.budget_bytes, options.host.budget_bytes,
                              options.optimizer.state_dtype);
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout,
                          memory::ChunkLayout::Build(specs, options.chunk.size_elems, bounds.min_elems,
                                                     bounds.max_elems, {}, options.optimizer.state_dtype));
  uint64_t total = layout.report().total_bytes;
  uint64_t largest = 0;
  for (const memory::ChunkDesc& chunk : layout.chunks()) largest = std::max(largest, chunk.size_bytes());
  auto budget = [&](double fraction, size_t current) {
    if (fraction <= 0) return current;
    // At least two of the largest chunks, so an access never waits on itself.
    return std::max<size_t>(static_cast<size_t>(fraction * static_cast<double>(total)), 2 * largest);
  };
  if (config.device_fraction > 0) {
    options.device.budget_bytes = budget(config.device_fraction, options.device.budget_bytes);
    options.device.budget_auto = false;
  }
  options.host.budget_bytes = budget(config.host_fraction, options.host.budget_bytes);
  if (!options.nvme.dirs.empty() || seams.storage) {
    options.nvme.capacity_bytes = budget(config.nvme_fraction, options.nvme.capacity_bytes);
  }

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(options, std::move(seams)));
  for (const TensorSpec& spec : specs) STRATA_RETURN_IF_ERROR(engine->RegisterTensor(spec).status());
  STRATA_RETURN_IF_ERROR(engine->Finalize());

  SelftestReport report;
  report.tensors = specs.size();
  report.backends = engine->DescribeBackends();
  Checker checker(*engine, config, report);
  const auto num_tensors = static_cast<uint32_t>(specs.size());

  // Initialization: every copy of every tensor written on the host tier, in
  // model order; the host fills up and pushes the oldest chunks to NVMe.
  for (ChunkKind kind : kAllKinds) {
    for (uint32_t t = 0; t < num_tensors; ++t) {
      if (checker.Has(TensorId(t), kind)) STRATA_RETURN_IF_ERROR(checker.Write(TensorId(t), kind, Tier::kHost));
    }
  }
  for (uint32_t iteration = 0; iteration < config.iterations; ++iteration) {
    // Forward: params on the device in model order, checked where they arrive.
    for (uint32_t t = 0; t < num_tensors; ++t) STRATA_RETURN_IF_ERROR(checker.Verify(TensorId(t), ChunkKind::kParam, Tier::kDevice));
    // Backward: grads written on the device in reverse order.
    for (uint32_t t = num_tensors; t-- > 0;) {
      if (checker.Has(TensorId(t), ChunkKind::kGrad)) {
        STRATA_RETURN_IF_ERROR(checker.Write(TensorId(t), ChunkKind::kGrad, Tier::kDevice));
      }
    }
    // Update: master and moments rewritten on the host, params on the device.
    for (uint32_t t = 0; t < num_tensors; ++t) {
      for (ChunkKind kind : {ChunkKind::kMaster, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
        if (checker.Has(TensorId(t), kind)) STRATA_RETURN_IF_ERROR(checker.Write(TensorId(t), kind, Tier::kHost));
      }
      if (checker.Has(TensorId(t), ChunkKind::kGrad)) {
        STRATA_RETURN_IF_ERROR(checker.Write(TensorId(t), ChunkKind::kParam, Tier::kDevice));
      }
    }
  }
  // Everything home (host, then NVMe), then every byte of every copy checked.
  STRATA_RETURN_IF_ERROR(engine->OffloadAll());
  for (ChunkKind kind : kAllKinds) {
    for (uint32_t t = 0; t < num_tensors; ++t) {
      if (checker.Has(TensorId(t), kind)) STRATA_RETURN_IF_ERROR(checker.Verify(TensorId(t), kind, Tier::kHost));
    }
  }

  report.layout = engine->layout();
  report.stats = engine->stats();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

std::string FormatSelftestReport(const SelftestReport& r) {
  std::string out;
  out += fmt::format("strata selftest: {}\n", r.backends);
  out += fmt::format("layout: {} tensors, {} chunk groups, chunk size {} elements ({}), padding waste {:.2f}%, {} of model states\n",
                     r.tensors, r.layout.num_groups, r.layout.chunk_size_elems,
                     r.layout.chunk_size_searched ? "searched" : "configured", 100 * r.layout.padding_waste_fraction,
                     FormatSize(r.layout.total_bytes));
  out += "chunks per kind:";
  for (int k = 0; k < kNumChunkKinds; ++k) {
    out += fmt::format(" {} {}", ChunkKindName(static_cast<ChunkKind>(k)), r.layout.chunks_of_kind[k]);
  }
  out += "\n\n";
  out += fmt::format("{:<8} {:>12} {:>12} {:>12}\n", "tier", "capacity", "in use", "peak");
  for (int t = 0; t < kNumTiers; ++t) {
    if (!r.stats.tier_present[t]) {
      out += fmt::format("{:<8} {:>12}\n", TierName(static_cast<Tier>(t)), "absent");
      continue;
    }
    const TierUsage& u = r.stats.tiers[t];
    out += fmt::format("{:<8} {:>12} {:>12} {:>12}\n", TierName(static_cast<Tier>(t)), FormatSize(u.capacity_bytes),
                       FormatSize(u.used_bytes), FormatSize(u.peak_bytes));
  }
  out += fmt::format("\n{:<16} {:>8} {:>12} {:>10}\n", "move", "chunks", "bytes", "GB/s");
  for (int from = 0; from < kNumTiers; ++from) {
    for (int to = 0; to < kNumTiers; ++to) {
      const LinkStats& link = r.stats.links[from][to];
      if (link.moves == 0) continue;
      out += fmt::format("{:<16} {:>8} {:>12} {:>10.2f}\n",
                         fmt::format("{} -> {}", TierName(static_cast<Tier>(from)), TierName(static_cast<Tier>(to))),
                         link.moves, FormatSize(link.bytes), link.gbps());
    }
  }
  out += fmt::format("evictions {}, chunks materialized {}\n\n", r.stats.evictions, r.stats.materializations);
  out += fmt::format("verified {} tensor copies, {}: {} mismatches{} ({:.2f} s)\n", r.copies_checked,
                     FormatSize(r.bytes_checked), r.mismatches,
                     r.first_mismatch.empty() ? "" : " — first: " + r.first_mismatch, r.seconds);
  out += r.mismatches == 0 ? "selftest PASSED\n" : "selftest FAILED\n";
  return out;
}

std::string SelftestReportJson(const SelftestReport& r) {
  nlohmann::json j;
  j["backends"] = r.backends;
  j["tensors"] = r.tensors;
  j["copies_checked"] = r.copies_checked;
  j["bytes_checked"] = r.bytes_checked;
  j["mismatches"] = r.mismatches;
  j["seconds"] = r.seconds;
  j["passed"] = r.mismatches == 0;
  j["layout"] = {{"chunk_size_elems", r.layout.chunk_size_elems},
                 {"searched", r.layout.chunk_size_searched},
                 {"padding_waste_fraction", r.layout.padding_waste_fraction},
                 {"total_bytes", r.layout.total_bytes},
                 {"groups", r.layout.num_groups}};
  for (int t = 0; t < kNumTiers; ++t) {
    if (!r.stats.tier_present[t]) continue;
    const TierUsage& u = r.stats.tiers[t];
    j["tiers"][std::string(TierName(static_cast<Tier>(t)))] = {
        {"capacity_bytes", u.capacity_bytes}, {"used_bytes", u.used_bytes}, {"peak_bytes", u.peak_bytes}};
  }
  for (int from = 0; from < kNumTiers; ++from) {
    for (int to = 0; to < kNumTiers; ++to) {
      const LinkStats& link = r.stats.links[from][to];
      if (link.moves == 0) continue;
      j["links"][fmt::format("{}_to_{}", TierName(static_cast<Tier>(from)), TierName(static_cast<Tier>(to)))] = {
          {"moves", link.moves}, {"bytes", link.bytes}, {"seconds", link.seconds}, {"gbps", link.gbps()}};
    }
  }
  j["evictions"] = r.stats.evictions;
  return j.dump(2);
}

}  // namespace strata
