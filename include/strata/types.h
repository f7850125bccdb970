// Vocabulary types shared by every layer: data types, chunk kinds, tiers and
// the typed ids that keep a ChunkId from being passed where a TensorId belongs.
// Plain values; thread-safe to copy.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

// An integer id that does not convert to or from other ids.
template <typename Tag>
class Id {
 public:
  constexpr Id() = default;
  constexpr explicit Id(uint32_t value) : value_(value) {}
  constexpr uint32_t value() const { return value_; }
  constexpr auto operator<=>(const Id&) const = default;

 private:
  uint32_t value_ = 0;
};

using ChunkId = Id<struct ChunkIdTag>;
using TensorId = Id<struct TensorIdTag>;

enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16 };

constexpr size_t DTypeSizeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
std::string_view DTypeName(DType dtype);
// Accepts "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16".
Result<DType> ParseDType(std::string_view name);

// What a chunk holds. State kinds mirror the layout of their param chunk.
enum class ChunkKind : uint8_t { kParam, kGrad, kMaster, kExpAvg, kExpAvgSq };
inline constexpr int kNumChunkKinds = 5;
std::string_view ChunkKindName(ChunkKind kind);
// Master and optimizer moments: what only the update touches (and what
// data-parallel ranks shard), as against the params and grads compute uses.
constexpr bool IsOptimizerState(ChunkKind kind) { return kind != ChunkKind::kParam && kind != ChunkKind::kGrad; }

// Memory tiers, fastest first. Eviction moves a chunk one tier down.
enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
std::string_view TierName(Tier tier);
Result<Tier> ParseTier(std::string_view name);

// Severity of a log message, least first; kOff silences all.
enum class LogLevel : uint8_t { kDebug, kInfo, kWarning, kError, kOff };

// "64MiB", "1.5GiB", "4096", "2GB" -> bytes. Binary (KiB, MiB, GiB, TiB) and
// decimal (KB, MB, GB, TB) suffixes; plain numbers are bytes.
Result<size_t> ParseSize(std::string_view text);
// 1536 -> "1.5KiB".
std::string FormatSize(size_t bytes);

}  // namespace strata

template <typename Tag>
struct std::hash<strata::Id<Tag>> {
  size_t operator()(strata::Id<Tag> id) const noexcept { return std::hash<uint32_t>()(id.value()); }
};
