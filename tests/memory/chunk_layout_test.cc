#include "memory/chunk_layout.h"

#include <set>

#include "memory/placement.h"
#include "memory/tier_pool.h"
#include "src/base/alignment.h"
#include "test_util.h"

namespace strata::memory {
namespace {

TensorSpec T(std::string name, std::vector<int64_t> shape, std::string module, DType dtype = DType::kFloat32,
             bool trainable = true) {
  return {std::move(name), std::move(shape), dtype, trainable, std::move(module)};
}

TEST(ChunkLayoutTest, TensorsOfOneModuleShareAChunk) {
  std::vector<TensorSpec> tensors = {T("a.w", {100, 10}, "a"), T("a.b", {100}, "a"), T("b.w", {900}, "b"),
                                     T("b.b", {90}, "b")};
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 1200, 0, 0));
  // a (1000 + 100 aligned) fills most of a 1200-element chunk; b does not fit and starts the next.
  EXPECT_EQ(layout.placement(TensorId(0)).group, layout.placement(TensorId(1)).group);
  EXPECT_EQ(layout.placement(TensorId(2)).group, layout.placement(TensorId(3)).group);
  EXPECT_NE(layout.placement(TensorId(0)).group, layout.placement(TensorId(2)).group);
}

// A chunk's update uses one param group's hyperparameters: the tensors of a
// module in two groups go into two chunks; frozen tensors ignore their group.
TEST(ChunkLayoutTest, ParamGroupsNeverShareAChunk) {
  std::vector<TensorSpec> tensors = {T("a.w", {100}, "a"), T("a.b", {10}, "a"), T("b.w", {100}, "b"),
                                     T("b.b", {10}, "b"), T("c.w", {10}, "c", DType::kFloat32, false),
                                     T("c.b", {10}, "c", DType::kFloat32, false)};
  tensors[1].param_group = tensors[3].param_group = 1;
  tensors[5].param_group = 2;  // frozen: no optimizer group
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 1024, 0, 0));
  for (const ChunkGroup& group : layout.groups()) {
    for (TensorId t : group.tensors) {
      const TensorSpec& spec = tensors[t.value()];
      EXPECT_EQ(group.param_group, spec.trainable ? spec.param_group : 0) << spec.name;
    }
  }
  EXPECT_EQ(layout.placement(TensorId(0)).group, layout.placement(TensorId(2)).group);  // group 0 packs together
  EXPECT_EQ(layout.placement(TensorId(1)).group, layout.placement(TensorId(3)).group);
  EXPECT_NE(layout.placement(TensorId(0)).group, layout.placement(TensorId(1)).group);
  EXPECT_EQ(layout.placement(TensorId(4)).group, layout.placement(TensorId(5)).group);
  EXPECT_EQ(layout.groups().size(), 3u);
}

TEST(ChunkLayoutTest, OffsetsAreAlignedAndTensorsDoNotOverlap) {
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 20; ++i) tensors.push_back(T("t" + std::to_string(i), {7 * i + 3}, "m"));
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 256, 0, 0));
  std::map<uint32_t, uint64_t> end_of_group;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const TensorPlacement& p = layout.placement(TensorId(i));
    EXPECT_EQ(p.offset_elems % kTensorAlignmentElems, 0u);
    EXPECT_GE(p.offset_elems, end_of_group[p.group]);
    end_of_group[p.group] = p.offset_elems + p.num_elems;
    EXPECT_LE(p.offset_elems + p.num_elems, layout.chunk(*layout.ChunkOf(TensorId(i), ChunkKind::kParam)).capacity_elems);
  }
}

TEST(ChunkLayoutTest, OversizedTensorGetsItsOwnChunk) {
  std::vector<TensorSpec> tensors = {T("small", {64}, "m"), T("huge", {5000}, "m"), T("small2", {64}, "m")};
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 1024, 0, 0));
  const ChunkDesc& huge = layout.chunk(*layout.ChunkOf(TensorId(1), ChunkKind::kParam));
  EXPECT_GE(huge.capacity_elems, 5000u);
  EXPECT_EQ(layout.groups()[huge.group].tensors.size(), 1u);
  // The small tensors around it still share the regular chunk.
  EXPECT_EQ(layout.placement(TensorId(0)).group, layout.placement(TensorId(2)).group);
}

TEST(ChunkLayoutTest, StateChunksMirrorParamChunkAndFollowPrecision) {
  std::vector<TensorSpec> tensors = {T("w", {1000}, "m", DType::kBFloat16), T("frozen", {300}, "m", DType::kBFloat16, false),
                                     T("w32", {200}, "n", DType::kFloat32)};
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 2048, 0, 0));
  // bf16 trainable: all five kinds, fp32 master.
  for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad, ChunkKind::kMaster, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
    std::optional<ChunkId> id = layout.ChunkOf(TensorId(0), kind);
    ASSERT_TRUE(id.has_value()) << ChunkKindName(kind);
    const ChunkDesc& chunk = layout.chunk(*id);
    EXPECT_EQ(chunk.dtype, ChunkKindDType(kind, DType::kBFloat16));
    EXPECT_EQ(chunk.capacity_elems, layout.chunk(*layout.ChunkOf(TensorId(0), ChunkKind::kParam)).capacity_elems);
  }
  EXPECT_EQ(layout.chunk(*layout.ChunkOf(TensorId(0), ChunkKind::kMaster)).dtype, DType::kFloat32);
  // Frozen: param only, and never in a trainable tensor's chunk.
  EXPECT_FALSE(layout.ChunkOf(TensorId(1), ChunkKind::kGrad).has_value());
  EXPECT_NE(layout.placement(TensorId(1)).group, layout.placement(TensorId(0)).group);
  // fp32 trainable: no separate master.
  EXPECT_TRUE(layout.ChunkOf(TensorId(2), ChunkKind::kExpAvg).has_value());
  EXPECT_FALSE(layout.ChunkOf(TensorId(2), ChunkKind::kMaster).has_value());
  EXPECT_EQ(layout.report().chunks_of_kind[static_cast<int>(ChunkKind::kParam)], 3u);
  EXPECT_EQ(layout.report().chunks_of_kind[static_cast<int>(ChunkKind::kMaster)], 1u);
}

TEST(ChunkLayoutTest, Bf16MomentsTakeHalfTheBytesAndTheMasterStaysFp32) {
  std::vector<TensorSpec> tensors = {T("w", {1000}, "m", DType::kBFloat16), T("w32", {200}, "n", DType::kFloat32)};
  ASSERT_OK_AND_ASSIGN(ChunkLayout fp32, ChunkLayout::Build(tensors, 2048, 0, 0));
  ASSERT_OK_AND_ASSIGN(ChunkLayout bf16, ChunkLayout::Build(tensors, 2048, 0, 0, {}, DType::kBFloat16));
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      const ChunkDesc& moment = bf16.chunk(*bf16.ChunkOf(TensorId(t), kind));
      EXPECT_EQ(moment.dtype, DType::kBFloat16);
      EXPECT_EQ(2 * moment.size_bytes(), fp32.chunk(*fp32.ChunkOf(TensorId(t), kind)).size_bytes());
    }
  }
  EXPECT_EQ(bf16.chunk(*bf16.ChunkOf(TensorId(0), ChunkKind::kMaster)).dtype, DType::kFloat32);
  EXPECT_EQ(bf16.chunk(*bf16.ChunkOf(TensorId(1), ChunkKind::kParam)).dtype, DType::kFloat32);
  EXPECT_LT(bf16.report().total_bytes, fp32.report().total_bytes);
  // Where host memory bounds the chunk size, groups of bf16 moments may be larger: 12 bytes an element
  // against 16 for these bf16 parameters.
  const uint64_t device = uint64_t{1} << 40, host = uint64_t{64} << 20;
  const SearchBounds wide = SearchBoundsFor(tensors, {}, device, host, DType::kBFloat16);
  const SearchBounds narrow = SearchBoundsFor(tensors, {}, device, host);
  EXPECT_NEAR(static_cast<double>(wide.max_elems) / static_cast<double>(narrow.max_elems), 16.0 / 12.0, 0.01);
}


// Int8 states: a module's tensors of 8-bit moments share chunks only with
// their like, each starting on a block of 256 (260 bytes of codes and scale
// in the moments' chunks); its small tensors keep fp32 moments in chunks of
// their own; frozen ones are packed as ever. Sharded, the layout is refused.
TEST(ChunkLayoutTest, Int8MomentsStartOnBlocksAndSmallTensorsKeepFp32InChunksOfTheirOwn) {
  std::vector<TensorSpec> tensors = {T("a.w", {64, 72}, "a"),  T("a.b", {72}, "a"), T("a.v", {4096}, "a"),
                                     T("b.w", {4097}, "b"),    T("b.x", {8192}, "b"),
                                     T("c.w", {10}, "c", DType::kFloat32, false)};
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 20000, 0, 0, {}, DType::kInt8Block));
  const auto moment = [&](uint32_t t) { return layout.chunk(*layout.ChunkOf(TensorId(t), ChunkKind::kExpAvg)); };
  for (uint32_t t : {0u, 2u, 4u}) {  // 4608, 4096 and 8192 elements: 8-bit
    EXPECT_EQ(moment(t).dtype, DType::kInt8Block) << tensors[t].name;
    EXPECT_EQ(layout.placement(TensorId(t)).offset_elems % kInt8BlockElems, 0u) << tensors[t].name;
    EXPECT_EQ(layout.chunk(*layout.ChunkOf(TensorId(t), ChunkKind::kExpAvgSq)).dtype, DType::kInt8Block);
  }
  for (uint32_t t : {1u, 3u}) {  // too small; not in whole blocks
    EXPECT_EQ(moment(t).dtype, DType::kFloat32) << tensors[t].name;
    EXPECT_NE(layout.placement(TensorId(t)).group, layout.placement(TensorId(0)).group) << tensors[t].name;
  }
  EXPECT_EQ(layout.placement(TensorId(0)).group, layout.placement(TensorId(2)).group);
  EXPECT_EQ(layout.placement(TensorId(2)).group, layout.placement(TensorId(4)).group);  // room left: one chunk
  EXPECT_EQ(layout.placement(TensorId(1)).group, layout.placement(TensorId(3)).group);
  const ChunkDesc& blocks = moment(0);
  EXPECT_EQ(blocks.used_elems, 4608u + 4096u + 8192u);
  EXPECT_EQ(blocks.capacity_elems % kInt8BlockElems, 0u);
  EXPECT_EQ(blocks.size_bytes(), RoundUp(blocks.capacity_elems / kInt8BlockElems * 260, kSlotAlignmentBytes));
  EXPECT_EQ(ChunkBytes(DType::kInt8Block, blocks.used_elems), (4608u + 4096u + 8192u) / 256 * 260);

  ASSERT_OK_AND_ASSIGN(ChunkLayout fp32, ChunkLayout::Build(tensors, 20000, 0, 0));
  EXPECT_EQ(fp32.placement(TensorId(0)).group, fp32.placement(TensorId(1)).group);  // one module, one chunk
  EXPECT_EQ(fp32.chunk(*fp32.ChunkOf(TensorId(0), ChunkKind::kExpAvg)).dtype, DType::kFloat32);

  Result<ChunkLayout> sharded = ChunkLayout::Build(tensors, 20000, 0, 0, {0, 2}, DType::kInt8Block);
  ASSERT_FALSE(sharded.ok());
  EXPECT_NE(sharded.status().message().find("int8 optimizer states across 2 ranks"), std::string::npos)
      << sharded.status().message();
}
TEST(ChunkLayoutTest, SearchFindsLeastWaste) {
  // 10 modules of 3000 elements each: a 3008-element chunk (with alignment) wastes almost nothing.
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 10; ++i) tensors.push_back(T("m" + std::to_string(i), {3000}, "m" + std::to_string(i)));
  ASSERT_OK_AND_ASSIGN(ChunkLayout searched, ChunkLayout::Build(tensors, 0, 1024, 1 << 16));
  ASSERT_OK_AND_ASSIGN(ChunkLayout fixed, ChunkLayout::Build(tensors, 4096, 0, 0));
  EXPECT_TRUE(searched.report().searched);
  EXPECT_LT(searched.report().waste_fraction(), 0.02);
  EXPECT_LT(searched.report().waste_fraction(), fixed.report().waste_fraction());
  EXPECT_GT(fixed.report().waste_fraction(), 0.2);
}

// Layers of 64 x 64 and a bias: 130 KiB of fp32 params.
std::vector<TensorSpec> SmallMlp(DType dtype = DType::kFloat32) {
  std::vector<TensorSpec> tensors;
  for (int l = 0; l < 8; ++l) {
    const std::string module = "fc" + std::to_string(l);
    tensors.push_back(T(module + ".weight", {64, 64}, module, dtype));
    tensors.push_back(T(module + ".bias", {64}, module, dtype));
  }
  return tensors;
}

constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(ChunkSearchBoundsTest, DerivedBoundsLetTheDeviceHoldSixParamAndGradChunks) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const uint64_t device_bytes = 256 << 10;
    const SearchBounds bounds = SearchBoundsFor(SmallMlp(dtype), {}, device_bytes, 4 * kGiB);
    const uint64_t pair_bytes = 2 * DTypeSizeBytes(dtype);  // param and grad
    EXPECT_LE(6 * bounds.max_elems * pair_bytes, device_bytes) << DTypeName(dtype);
    EXPECT_GT(6 * (bounds.max_elems + kTensorAlignmentElems) * pair_bytes, device_bytes) << DTypeName(dtype);
    // A 64th of it, aligned up.
    EXPECT_EQ(bounds.min_elems,
              (bounds.max_elems / 64 + kTensorAlignmentElems - 1) / kTensorAlignmentElems * kTensorAlignmentElems);
    ASSERT_OK_AND_ASSIGN(ChunkLayout layout,
                         ChunkLayout::Build(SmallMlp(dtype), 0, bounds.min_elems, bounds.max_elems));
    EXPECT_LE(layout.report().chunk_size_elems, bounds.max_elems);
  }
}

TEST(ChunkSearchBoundsTest, ATensorLargerThanAChunkIsSetAsideFirst) {
  std::vector<TensorSpec> tensors = SmallMlp();
  tensors.push_back(T("embedding.weight", {20000}, "embedding"));  // 80 KB: larger than a 256 KiB device's sixth
  const uint64_t device_bytes = 256 << 10;
  const SearchBounds bounds = SearchBoundsFor(tensors, {}, device_bytes, 4 * kGiB);
  EXPECT_EQ(bounds.max_elems, (device_bytes - 20000 * 8) / 48 / kTensorAlignmentElems * kTensorAlignmentElems);
}

TEST(ChunkSearchBoundsTest, TheHostHoldsFourGroupsAndTheWidestBoundsCap) {
  // fp32: param, grad, exp_avg and exp_avg_sq: 16 bytes an element.
  EXPECT_EQ(SearchBoundsFor(SmallMlp(), {}, kGiB, 1 << 20).max_elems, (1u << 20) / 64);
  const SearchBounds wide = SearchBoundsFor({T("huge", {1 << 30}, "m")}, {}, 1024 * kGiB, 1024 * kGiB);
  EXPECT_EQ(wide.max_elems, kWidestSearchMaxElems);
  EXPECT_EQ(wide.min_elems, kWidestSearchMinElems);
}

TEST(ChunkSearchBoundsTest, ASmallModelIsOneChunkUnderLargeBudgets) {
  const SearchBounds bounds = SearchBoundsFor(SmallMlp(), {}, kGiB, 4 * kGiB);
  EXPECT_EQ(bounds.min_elems, 8u * (4096 + 64));
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(SmallMlp(), 0, bounds.min_elems, bounds.max_elems));
  EXPECT_EQ(layout.groups().size(), 1u);
}

TEST(ChunkSearchBoundsTest, GivenBoundsAreKeptAndTheOtherNeverCrossesThem) {
  const SearchBounds both = SearchBoundsFor(SmallMlp(), {1000, 3000}, 256 << 10, 4 * kGiB);
  EXPECT_EQ(both.min_elems, 1000u);
  EXPECT_EQ(both.max_elems, 3000u);
  const SearchBounds large_min = SearchBoundsFor(SmallMlp(), {1 << 20, 0}, 256 << 10, 4 * kGiB);
  EXPECT_EQ(large_min.min_elems, 1u << 20);
  EXPECT_EQ(large_min.max_elems, 1u << 20);
  const SearchBounds small_max = SearchBoundsFor(SmallMlp(), {0, 64}, kGiB, 4 * kGiB);
  EXPECT_EQ(small_max.max_elems, 64u);
  EXPECT_LE(small_max.min_elems, 64u);
}

TEST(ChunkLayoutTest, RejectsBadTensors) {
  EXPECT_EQ(ChunkLayout::Build({}, 1024, 0, 0).status().code(), StatusCode::kInvalidArgument);
  Status dup = ChunkLayout::Build({T("x", {4}, "m"), T("x", {4}, "m")}, 1024, 0, 0).status();
  EXPECT_NE(dup.message().find("registered twice"), std::string::npos);
  Status zero = ChunkLayout::Build({T("x", {4, 0}, "m")}, 1024, 0, 0).status();
  EXPECT_NE(zero.message().find("dimension 0"), std::string::npos);
  EXPECT_EQ(ChunkLayout::Build({T("", {4}, "m")}, 1024, 0, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkLayout::Build({T("x", {4}, "m")}, 0, 100, 10).status().code(), StatusCode::kInvalidArgument);
}

// Shards tile [0, n) in rank order, each starting aligned, for sizes that
// divide evenly and sizes that leave the last ranks short or empty.
TEST(ChunkLayoutTest, ShardsTileTheGroupInRankOrder) {
  for (uint64_t n : {1ull, 31ull, 32ull, 4096ull, 4097ull, 100000ull}) {
    for (int world : {1, 2, 3, 4, 7}) {
      uint64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRange s = ShardOf(n, r, world);
        EXPECT_EQ(s.begin, next) << n << " " << world << " " << r;
        EXPECT_LE(s.end - s.begin, s.elems);
        EXPECT_EQ(s.elems % kTensorAlignmentElems, 0u);
        EXPECT_EQ(s.elems, ShardOf(n, 0, world).elems) << "every rank's shard is the same size";
        next = s.end;
      }
      EXPECT_EQ(next, n) << n << " " << world;
    }
  }
}

// With a shard spec, the state kinds hold the rank's range (master included
// under bf16) and the param and grad chunks stay whole; the sizes are the
// same on every rank, so the ranks' layouts line up chunk by chunk.
TEST(ChunkLayoutTest, ShardedLayoutKeepsTheRanksRangeOfTheStates) {
  std::vector<TensorSpec> tensors = {T("a", {3000}, "m", DType::kBFloat16), T("b", {1000}, "m", DType::kBFloat16)};
  ASSERT_OK_AND_ASSIGN(ChunkLayout whole, ChunkLayout::Build(tensors, 8192, 0, 0));
  for (int r = 0; r < 3; ++r) {
    ASSERT_OK_AND_ASSIGN(ChunkLayout mine, ChunkLayout::Build(tensors, 8192, 0, 0, {r, 3}));
    ASSERT_EQ(mine.chunks().size(), whole.chunks().size());
    for (size_t c = 0; c < whole.chunks().size(); ++c) {
      const ChunkDesc &full = whole.chunks()[c], &part = mine.chunks()[c];
      if (!IsOptimizerState(full.kind)) {
        EXPECT_FALSE(part.sharded);
        EXPECT_EQ(part.capacity_elems, full.capacity_elems);
        continue;
      }
      const ShardRange range = ShardOf(full.used_elems, r, 3);
      EXPECT_TRUE(part.sharded);
      EXPECT_EQ(part.capacity_elems, range.elems);
      EXPECT_EQ(part.shard_begin_elems, range.begin);
      EXPECT_EQ(part.used_elems, range.end - range.begin);
    }
    EXPECT_LT(mine.report().total_bytes, whole.report().total_bytes);
  }
  EXPECT_EQ(ChunkLayout::Build(tensors, 8192, 0, 0, {3, 3}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkLayout::Build(tensors, 8192, 0, 0, {0, 0}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::memory

namespace strata::memory {
namespace {

// Parameters sharded (ZeRO-3): every group's param chunk is transient
// (stored nowhere, not in total_bytes) and every group has a master shard,
// fp32 params too, a frozen group's in its param dtype. One rank, or the
// option off, lays out as before.
TEST(ChunkLayoutTest, ShardedParamsMakeEveryParamChunkTransientAndGiveEveryGroupAMasterShard) {
  std::vector<TensorSpec> tensors = {T("a", {3000}, "m"), T("b", {1000}, "m"),
                                     T("frozen", {500}, "f", DType::kBFloat16, /*trainable=*/false)};
  ASSERT_OK_AND_ASSIGN(ChunkLayout plain, ChunkLayout::Build(tensors, 8192, 0, 0, {0, 2}));
  ASSERT_OK_AND_ASSIGN(ChunkLayout alone, ChunkLayout::Build(tensors, 8192, 0, 0, {0, 1, /*params=*/true}));
  for (const ChunkDesc& c : alone.chunks()) EXPECT_FALSE(c.transient);
  EXPECT_EQ(alone.report().chunks_of_kind, ChunkLayout::Build(tensors, 8192, 0, 0).value().report().chunks_of_kind);
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK_AND_ASSIGN(ChunkLayout mine, ChunkLayout::Build(tensors, 8192, 0, 0, {r, 2, /*params=*/true}));
    const ChunkGroup& trainable = mine.groups()[0];
    const ChunkGroup& frozen = mine.groups()[1];
    ASSERT_TRUE(trainable.trainable);
    ASSERT_FALSE(frozen.trainable);
    const ChunkDesc& param = mine.chunk(*trainable.chunk_of_kind[static_cast<int>(ChunkKind::kParam)]);
    EXPECT_TRUE(param.transient);
    EXPECT_FALSE(param.sharded);
    EXPECT_EQ(param.used_elems, 4008u);  // whole: 3000, aligned to 3008, + 1000
    ASSERT_TRUE(trainable.chunk_of_kind[static_cast<int>(ChunkKind::kMaster)].has_value());
    const ChunkDesc& master = mine.chunk(*trainable.chunk_of_kind[static_cast<int>(ChunkKind::kMaster)]);
    EXPECT_TRUE(master.sharded);
    EXPECT_EQ(master.dtype, DType::kFloat32);
    EXPECT_EQ(master.shard_begin_elems, ShardOf(4008, r, 2).begin);
    // A frozen group's params are sharded too: its master shard is in the param dtype, and there is no grad.
    const ChunkDesc& frozen_param = mine.chunk(*frozen.chunk_of_kind[static_cast<int>(ChunkKind::kParam)]);
    EXPECT_TRUE(frozen_param.transient);
    ASSERT_TRUE(frozen.chunk_of_kind[static_cast<int>(ChunkKind::kMaster)].has_value());
    const ChunkDesc& frozen_master = mine.chunk(*frozen.chunk_of_kind[static_cast<int>(ChunkKind::kMaster)]);
    EXPECT_TRUE(frozen_master.sharded);
    EXPECT_EQ(frozen_master.dtype, DType::kBFloat16);
    EXPECT_EQ(frozen_master.shard_begin_elems, ShardOf(512, r, 2).begin);
    EXPECT_FALSE(frozen.chunk_of_kind[static_cast<int>(ChunkKind::kGrad)].has_value());
    // Stored: less than with whole params, by each param chunk less its master shard.
    EXPECT_EQ(mine.report().total_bytes + param.size_bytes() - master.size_bytes() + frozen_param.size_bytes() -
                  frozen_master.size_bytes(),
              plain.report().total_bytes);
    // A frozen group's master shard is its parameters, not an optimizer
    // state: with no host room for states (the static policy's share), it
    // is still homed on the host, the trainable master on NVMe.
    const std::vector<std::optional<Tier>> no_states =
        AssignHomes(mine.chunks(), uint64_t{1} << 30, uint64_t{1} << 30, /*max_host_state_bytes=*/0);
    EXPECT_EQ(no_states[frozen_master.id.value()], Tier::kHost);
    EXPECT_EQ(no_states[master.id.value()], Tier::kNvme);
    // A transient chunk is homed on the host without taking any of it.
    const std::vector<std::optional<Tier>> homes = AssignHomes(mine.chunks(), 0, uint64_t{1} << 30);
    EXPECT_EQ(homes[param.id.value()], Tier::kHost);
    for (const ChunkDesc& c : mine.chunks()) {
      if (!c.transient) {
        EXPECT_EQ(homes[c.id.value()], Tier::kNvme) << c.id.value();
      }
    }
  }
}

}  // namespace
}  // namespace strata::memory
