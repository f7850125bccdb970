#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace strata::optim {

Status ValidateLossScalerConfig(const LossScalerConfig& c) {
  if (!(std::isfinite(c.init_scale) && c.init_scale > 0)) {
    return InvalidArgument("loss scaler: init_scale {} must be a finite number > 0", c.init_scale);
  }
  if (!(c.growth_factor > 1 && std::isfinite(c.growth_factor))) {
    return InvalidArgument("loss scaler: growth_factor {} must be > 1", c.growth_factor);
  }
  if (!(c.backoff_factor > 0 && c.backoff_factor < 1)) {
    return InvalidArgument("loss scaler: backoff_factor {} must be in (0, 1)", c.backoff_factor);
  }
  if (c.growth_interval < 1) {
    return InvalidArgument("loss scaler: growth_interval {} must be at least 1 step", c.growth_interval);
  }
  if (!(c.min_scale > 0 && c.min_scale <= c.init_scale && c.init_scale <= c.max_scale &&
        std::isfinite(c.max_scale))) {
    return InvalidArgument("loss scaler: need 0 < min_scale ({}) <= init_scale ({}) <= max_scale ({}) < inf",
                           c.min_scale, c.init_scale, c.max_scale);
  }
  return Status::Ok();
}

LossScaler::LossScaler(const LossScalerConfig& config) : config_(config), scale_(config.init_scale) {}

Status LossScaler::Restore(float scale, int64_t good_steps, int64_t overflows) {
  if (!std::isfinite(scale) || !(scale > 0) || good_steps < 0 || overflows < 0) {
    return InvalidArgument("loss scaler: cannot restore scale {}, good steps {}, overflows {}: expected a finite "
                           "scale > 0 and counts >= 0",
                           scale, good_steps, overflows);
  }
  scale_ = scale;
  good_steps_ = good_steps;
  overflows_ = overflows;
  return Status::Ok();
}

void LossScaler::Update(bool found_non_finite) {
  if (found_non_finite) {
    scale_ = std::max(config_.min_scale, scale_ * config_.backoff_factor);
    good_steps_ = 0;
    ++overflows_;
    return;
  }
  if (++good_steps_ >= config_.growth_interval) {
    scale_ = std::min(config_.max_scale, scale_ * config_.growth_factor);
    good_steps_ = 0;
  }
}

}  // namespace strata::optim
