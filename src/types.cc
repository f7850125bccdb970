#include "strata/types.h"

namespace strata {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  return InvalidArgument("unknown dtype '{}': expected fp32, bf16 or fp16", name);
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

}  // namespace strata
