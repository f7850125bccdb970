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

// kInt8Block is not an element type but a chunk's: optimizer moments as
// blocks of kInt8BlockElems 8-bit codes, each followed by the block's fp32
// scale (Note [8-bit states] in optim/state_codec.cc; ChunkBytes).
enum class DType : uint8_t { kFloat32, kBFloat16, kFloat16, kInt8Block };

// Bytes an element takes; a kInt8Block chunk's codes (its scales: ChunkBytes).
constexpr size_t DTypeSizeBytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : dtype == DType::kInt8Block ? 1 : 2;
}
inline constexpr uint64_t kInt8BlockElems = 256;
inline constexpr uint64_t kInt8BlockBytes = kInt8BlockElems + sizeof(float);
// Tensors smaller than this keep fp32 states under int8 states (as
// bitsandbytes and torchao do: their scales would be a large share of their
// bytes).
inline constexpr uint64_t kMinQuantizedElems = 4096;
// Whether a tensor of `numel` elements gets 8-bit states under int8 states:
// at least kMinQuantizedElems, in whole blocks; else its states stay fp32.
constexpr bool QuantizesStates(uint64_t numel) {
  return numel >= kMinQuantizedElems && numel % kInt8BlockElems == 0;
}
// Bytes that `elems` elements of a chunk of `dtype` take, counted from the
// chunk's start (so also where element `elems` starts): a kInt8Block chunk
// rounds up to whole blocks, which its tensors start on.
constexpr uint64_t ChunkBytes(DType dtype, uint64_t elems) {
  if (dtype == DType::kInt8Block) return (elems + kInt8BlockElems - 1) / kInt8BlockElems * kInt8BlockBytes;
  return elems * DTypeSizeBytes(dtype);
}
// The elements whose bytes a chunk's first `bytes` hold (ChunkBytes' inverse
// on whole elements, and whole blocks for kInt8Block).
constexpr uint64_t ChunkElems(DType dtype, uint64_t bytes) {
  if (dtype == DType::kInt8Block) return bytes / kInt8BlockBytes * kInt8BlockElems;
  return bytes / DTypeSizeBytes(dtype);
}
std::string_view DTypeName(DType dtype);
// Accepts "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16": the
// element types (not "int8", which only chunks of moments hold).
Result<DType> ParseDType(std::string_view name);
// ParseDType, or "int8" for kInt8Block: a chunk's dtype (a checkpoint's).
Result<DType> ParseChunkDType(std::string_view name);
// The optimizer's moments' formats (optimizer.states, the benchmarks'
// flags): "fp32", "bf16" or "int8"; InvalidArgument naming them otherwise.
Result<DType> ParseStatesDType(std::string_view name);

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
