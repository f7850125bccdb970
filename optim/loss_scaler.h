// Dynamic loss scaling for fp16/bf16 training, as torch.cuda.amp.GradScaler
// does it: the loss is multiplied by `scale` before backward so small
// gradients survive in 16 bits; a step whose gradients hold an inf or NaN is
// skipped and the scale backs off; after `growth_interval` good steps in a
// row the scale grows.
//
// A plain value type; not thread-safe.
#pragma once

#include <cstdint>

#include "strata/status.h"

namespace strata::optim {

struct LossScalerConfig {
  float init_scale = 65536.0f;    // 2^16, GradScaler's default
  float growth_factor = 2.0f;     // > 1
  float backoff_factor = 0.5f;    // in (0, 1)
  int64_t growth_interval = 2000;  // good steps before growing
  float min_scale = 1.0f;         // backing off stops here (> 0)
  float max_scale = 16777216.0f;  // 2^24: growing stops here
};

// InvalidArgument naming the field, its value and what is allowed.
Status ValidateLossScalerConfig(const LossScalerConfig& config);

class LossScaler {
 public:
  explicit LossScaler(const LossScalerConfig& config);

  float scale() const { return scale_; }
  int64_t good_steps() const { return good_steps_; }
  int64_t overflows() const { return overflows_; }
  // After each step: `found_non_finite` backs off (not below min_scale) and
  // restarts the count; otherwise counts a good step and grows (not above
  // max_scale) when the count reaches growth_interval.
  void Update(bool found_non_finite);
  // A saved state back: InvalidArgument for a scale that is not finite and
  // > 0 or negative counts, changing nothing.
  Status Restore(float scale, int64_t good_steps, int64_t overflows);

 private:
  LossScalerConfig config_;
  float scale_;
  int64_t good_steps_ = 0;
  int64_t overflows_ = 0;
};

}  // namespace strata::optim
