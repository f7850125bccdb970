#include "strata/types.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "src/base/strings.h"

namespace strata {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kInt8Block: return "int8";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  return InvalidArgument("unknown dtype '{}': expected fp32, bf16 or fp16", name);
}

Result<DType> ParseChunkDType(std::string_view name) {
  if (name == "int8") return DType::kInt8Block;
  Result<DType> dtype = ParseDType(name);
  if (!dtype.ok()) return InvalidArgument("unknown chunk dtype '{}': expected fp32, bf16, fp16 or int8", name);
  return dtype;
}

Result<DType> ParseStatesDType(std::string_view name) {
  if (name == "fp32") return DType::kFloat32;
  if (name == "bf16") return DType::kBFloat16;
  if (name == "int8") return DType::kInt8Block;
  return InvalidArgument("unknown states format '{}': expected fp32, bf16 or int8", name);
}

std::string_view ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParam: return "param";
    case ChunkKind::kGrad: return "grad";
    case ChunkKind::kMaster: return "master";
    case ChunkKind::kExpAvg: return "exp_avg";
    case ChunkKind::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

Result<Tier> ParseTier(std::string_view name) {
  if (name == "device") return Tier::kDevice;
  if (name == "host") return Tier::kHost;
  if (name == "nvme") return Tier::kNvme;
  return InvalidArgument("unknown tier '{}': expected device, host or nvme", name);
}

Result<size_t> ParseSize(std::string_view text) {
  std::string trimmed = Trim(text);
  size_t split = 0;
  while (split < trimmed.size() && (std::isdigit(static_cast<unsigned char>(trimmed[split])) || trimmed[split] == '.')) {
    ++split;
  }
  std::string number = trimmed.substr(0, split);
  std::string suffix = Trim(trimmed.substr(split));
  static const std::pair<const char*, double> kSuffixes[] = {
      {"", 1},      {"B", 1},         {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40},
      {"KB", 1e3}, {"MB", 1e6},     {"GB", 1e9},     {"TB", 1e12},    {"K", 0x1p10},   {"M", 0x1p20},
      {"G", 0x1p30}, {"T", 0x1p40}};
  double scale = 0;
  for (const auto& [name, factor] : kSuffixes) {
    if (suffix == name) scale = factor;
  }
  char* end = nullptr;
  double value = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  if (scale == 0 || number.empty() || end != number.c_str() + number.size() || value < 0) {
    return InvalidArgument("'{}' is not a size: expected bytes like 4096, 64MiB, 1.5GiB or 2GB", text);
  }
  double bytes = std::round(value * scale);
  if (bytes > 0x1p62) return InvalidArgument("'{}' is too large a size", text);
  return static_cast<size_t>(bytes);
}

std::string FormatSize(size_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{}B", bytes);
  return fmt::format("{:.4g}{}", value, kUnits[unit]);
}

}  // namespace strata
