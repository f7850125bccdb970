// Randomized property test: random tensors (shapes, dtypes, frozen or not,
// modules), random accesses, writes and moves, budgets so small that chunks
// cycle through device, host and NVMe (real io_uring files). After every step
// every tensor copy of every kind must equal its shadow copy, read from
// wherever its chunk is without moving it. Prints its seed; replay with
// STRATA_TEST_SEED=<seed>.
#include <cstring>
#include <map>

#include "strata/engine.h"
#include "test_util.h"

namespace strata {
namespace {

constexpr ChunkKind kKinds[] = {ChunkKind::kParam, ChunkKind::kGrad, ChunkKind::kMaster, ChunkKind::kExpAvg,
                                ChunkKind::kExpAvgSq};

struct Model {
  std::vector<TensorSpec> tensors;
};

Model RandomModel(std::mt19937_64& rng) {
  Model model;
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  int tensors = 15 + static_cast<int>(rng() % 25);
  int module = 0;
  for (int i = 0; i < tensors; ++i) {
    if (rng() % 3 == 0) ++module;
    std::vector<int64_t> shape;
    int dims = static_cast<int>(rng() % 3);
    int64_t remaining = 1 + static_cast<int64_t>(rng() % (rng() % 8 == 0 ? 20000 : 3000));
    for (int d = 0; d < dims; ++d) {
      int64_t dim = 1 + static_cast<int64_t>(rng() % 7);
      shape.push_back(dim);
      remaining = std::max<int64_t>(1, remaining / dim);
    }
    shape.push_back(remaining);
    model.tensors.push_back({"t" + std::to_string(i), shape, dtypes[rng() % 3], rng() % 5 != 0,
                             "m" + std::to_string(module)});
  }
  return model;
}

class PropertyRun {
 public:
  explicit PropertyRun(uint64_t seed) : rng_(seed) {}

  void Run(int steps) {
    Model model = RandomModel(rng_);
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.chunk.size_elems = rng() % 2 ? 0 : 1024 + rng() % 8192;
    options.chunk.search_min_elems = 512;
    options.chunk.search_max_elems = 16384;
    options.nvme.dirs = {dir_.path()};
    options.log_level = LogLevel::kWarning;

    // Size the tiers from the layout: first build a probe engine with generous budgets.
    uint64_t total = 0, largest = 0;
    {
      Options probe_options = options;
      probe_options.nvme.dirs.clear();
      probe_options.host.budget_bytes = size_t{1} << 30;
      probe_options.device.budget_bytes = size_t{1} << 30;
      ASSERT_OK_AND_ASSIGN(auto probe, Engine::Create(probe_options));
      for (const TensorSpec& spec : model.tensors) ASSERT_OK(probe->RegisterTensor(spec).status());
      ASSERT_OK(probe->Finalize());
      for (const ChunkInfo& chunk : probe->chunks()) {
        total += chunk.size_bytes;
        largest = std::max(largest, chunk.size_bytes);
      }
    }
    options.device.budget_bytes = std::max<uint64_t>(2 * largest, total / 10);
    options.host.budget_bytes = std::max<uint64_t>(2 * largest, total / 5);
    options.nvme.capacity_bytes = 2 * total + 4 * largest;
    std::printf("[ model    ] %zu tensors, %s of chunks, device %s, host %s\n", model.tensors.size(),
                FormatSize(total).c_str(), FormatSize(options.device.budget_bytes).c_str(),
                FormatSize(options.host.budget_bytes).c_str());

    ASSERT_OK_AND_ASSIGN(engine_, Engine::Create(options));
    for (const TensorSpec& spec : model.tensors) ASSERT_OK(engine_->RegisterTensor(spec).status());
    ASSERT_OK(engine_->Finalize());
    chunks_ = engine_->chunks();
    for (uint32_t t = 0; t < model.tensors.size(); ++t) {
      for (ChunkKind kind : kKinds) {
        if (!engine_->ChunkOf(TensorId(t), kind)) continue;
        uint64_t elems = static_cast<uint64_t>(model.tensors[t].num_elements());
        DType dtype = chunks_[engine_->ChunkOf(TensorId(t), kind)->value()].dtype;
        shadow_[{t, kind}] = std::vector<std::byte>(elems * DTypeSizeBytes(dtype), std::byte{0});
        copies_.push_back({t, kind});
      }
    }

    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      ASSERT_NO_FATAL_FAILURE(Step());
      ASSERT_NO_FATAL_FAILURE(CheckEverything());
    }
    MemoryStats stats = engine_->stats();
    EXPECT_GT(stats.links[1][2].moves, 0u) << "nothing was evicted to NVMe: budgets too loose";
    EXPECT_GT(stats.links[2][1].moves + stats.links[2][0].moves, 0u) << "nothing came back from NVMe";
    EXPECT_GT(stats.links[0][1].moves, 0u);
  }

 private:
  uint64_t rng() { return rng_(); }
  Tier RandomMemoryTier() { return rng() % 2 ? Tier::kDevice : Tier::kHost; }

  void Step() {
    auto [tensor, kind] = copies_[rng() % copies_.size()];
    switch (rng() % 10) {
      case 0: case 1: case 2: case 3: {  // write random bytes
        ASSERT_OK_AND_ASSIGN(TensorAccess access, engine_->Access(TensorId(tensor), kind, RandomMemoryTier()));
        std::vector<std::byte>& shadow = shadow_[{tensor, kind}];
        ASSERT_EQ(access.size_bytes(), shadow.size());
        testing::FillRandom(shadow.data(), shadow.size(), rng_);
        std::memcpy(access.data(), shadow.data(), shadow.size());  // the emulated device is host-addressable
        break;
      }
      case 4: case 5: {  // read through an access
        ASSERT_OK_AND_ASSIGN(TensorAccess access, engine_->Access(TensorId(tensor), kind, RandomMemoryTier()));
        const std::vector<std::byte>& shadow = shadow_[{tensor, kind}];
        ASSERT_EQ(std::memcmp(access.data(), shadow.data(), shadow.size()), 0);
        break;
      }
      case 6: case 7: {  // a synchronous move anywhere
        ChunkId chunk(static_cast<uint32_t>(rng() % chunks_.size()));
        ASSERT_OK(engine_->MoveChunk(chunk, static_cast<Tier>(rng() % kNumTiers)));
        break;
      }
      case 8: {  // several asynchronous moves at once
        std::vector<std::shared_future<Status>> moves;
        for (int i = 0; i < 4; ++i) {
          ChunkId chunk(static_cast<uint32_t>(rng() % chunks_.size()));
          moves.push_back(engine_->MoveChunkAsync(chunk, static_cast<Tier>(rng() % kNumTiers)));
        }
        for (auto& move : moves) ASSERT_OK(move.get());
        break;
      }
      case 9:
        ASSERT_OK(engine_->OffloadAll());
        break;
    }
  }

  void CheckEverything() {
    for (const ChunkInfo& chunk : chunks_) {
      Buffer bytes = AllocateAlignedHost(chunk.size_bytes, 4096);
      ASSERT_OK(engine_->ReadChunk(chunk.id, bytes.data()));
      for (size_t i = 0; i < chunk.tensors.size(); ++i) {
        TensorId tensor = chunk.tensors[i];
        auto it = shadow_.find({tensor.value(), chunk.kind});
        ASSERT_NE(it, shadow_.end());
        uint64_t offset = chunk.tensor_offsets_bytes[i];
        ASSERT_EQ(std::memcmp(bytes.bytes() + offset, it->second.data(), it->second.size()), 0)
            << "tensor " << tensor.value() << " " << ChunkKindName(chunk.kind) << " in chunk " << chunk.id.value();
      }
    }
  }

  std::mt19937_64 rng_;
  testing::ScratchDir dir_{"property"};
  std::unique_ptr<Engine> engine_;
  std::vector<ChunkInfo> chunks_;
  std::vector<std::pair<uint32_t, ChunkKind>> copies_;
  std::map<std::pair<uint32_t, ChunkKind>, std::vector<std::byte>> shadow_;
};

TEST(ResidencyPropertyTest, RandomAccessesAcrossAllTiersKeepEveryTensorEqualToItsShadow) {
  uint64_t seed = testing::TestSeed();
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE("run " + std::to_string(run) + " of seed " + std::to_string(seed));
    PropertyRun property(seed + static_cast<uint64_t>(run));
    property.Run(250);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace strata
