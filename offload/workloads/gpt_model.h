// The GPT-shaped model strata's self-check, capacity plan and replay bench
// share: the tensors of a decoder-only transformer, and where each runs in a
// forward pass. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/tensor.h"
#include "strata/types.h"

namespace strata::offload {

// A GPT's shape, and the batch a step trains on.
struct ModelShape {
  uint32_t layers = 24;
  uint32_t hidden = 2048;
  uint32_t vocab = 50304;
  uint32_t sequence = 2048;  // tokens per sample; rows of the frozen position embedding
  uint32_t batch = 8;
  uint32_t heads = 0;  // 0: hidden / 64
};

// Token and frozen position embeddings, then per layer two layer norms and
// the attention and MLP weights and biases, then the final norm (the output
// head is tied to the token embedding).
std::vector<TensorSpec> GptTensorSpecs(const ModelShape& shape, DType dtype);

// Where a tensor of GptTensorSpecs runs in a forward pass: 0 the embedding,
// 1 + l layer l, layers + 1 the final norm (and the tied output head).
uint32_t GptForwardGroup(const std::string& tensor_name, uint32_t layers);

}  // namespace strata::offload
