// TensorSpec: what a trainer tells strata about one model tensor when it
// registers it. Registration order is model order. Plain value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/types.h"

namespace strata {

struct TensorSpec {
  std::string name;            // unique, e.g. "layers.3.attn.qkv.weight"
  std::vector<int64_t> shape;  // every dimension > 0; empty = a scalar
  DType dtype = DType::kFloat32;  // dtype of the param and grad copies
  bool trainable = true;       // frozen tensors get no grad and no optimizer state
  std::string module;          // owning module, e.g. "layers.3.attn"; tensors of one module share a chunk where they fit
  // The optimizer's param group of a trainable tensor (whose hyperparameters
  // update it): chunks hold tensors of one group. Ignored for frozen tensors.
  uint32_t param_group = 0;

  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

}  // namespace strata
