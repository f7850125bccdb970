#include "offload/workloads/gpt_model.h"

#include <fmt/format.h>

namespace strata::offload {

std::vector<TensorSpec> GptTensorSpecs(const ModelShape& c, DType dtype) {
  const int64_t h = c.hidden;
  std::vector<TensorSpec> specs;
  specs.push_back({"embed.tokens.weight", {c.vocab, h}, dtype, true, "embed"});
  specs.push_back({"embed.positions.weight", {c.sequence, h}, dtype, false, "embed"});  // frozen
  for (uint32_t l = 0; l < c.layers; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    specs.push_back({p + "ln1.weight", {h}, dtype, true, p + "ln1"});
    specs.push_back({p + "ln1.bias", {h}, dtype, true, p + "ln1"});
    specs.push_back({p + "attn.qkv.weight", {3 * h, h}, dtype, true, p + "attn"});
    specs.push_back({p + "attn.qkv.bias", {3 * h}, dtype, true, p + "attn"});
    specs.push_back({p + "attn.proj.weight", {h, h}, dtype, true, p + "attn"});
    specs.push_back({p + "attn.proj.bias", {h}, dtype, true, p + "attn"});
    specs.push_back({p + "ln2.weight", {h}, dtype, true, p + "ln2"});
    specs.push_back({p + "ln2.bias", {h}, dtype, true, p + "ln2"});
    specs.push_back({p + "mlp.fc.weight", {4 * h, h}, dtype, true, p + "mlp"});
    specs.push_back({p + "mlp.fc.bias", {4 * h}, dtype, true, p + "mlp"});
    specs.push_back({p + "mlp.proj.weight", {h, 4 * h}, dtype, true, p + "mlp"});
    specs.push_back({p + "mlp.proj.bias", {h}, dtype, true, p + "mlp"});
  }
  specs.push_back({"final_ln.weight", {h}, dtype, true, "final_ln"});
  specs.push_back({"final_ln.bias", {h}, dtype, true, "final_ln"});
  return specs;
}

uint32_t GptForwardGroup(const std::string& name, uint32_t layers) {
  if (name.rfind("embed", 0) == 0) return 0;
  if (name.rfind("layers.", 0) == 0) return 1 + static_cast<uint32_t>(std::stoul(name.substr(7)));
  return layers + 1;
}

}  // namespace strata::offload
