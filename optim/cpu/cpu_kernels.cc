// Run-time dispatch of the CPU kernels, and their oneTBB parallel drivers.
#include "optim/cpu/cpu_kernels.h"

#include <cpuid.h>

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "optim/state_codec.h"
#include "src/base/half.h"

namespace strata::optim {
namespace {

// Blocks of 64 Ki elements (1 MiB of the four fp32 arrays Adam streams):
// enough work to hide the scheduling, small enough to balance over the
// cores. Block starts are multiples of every vector width, so each element
// takes the same path (vector or tail) as in one call over everything:
// parallel results are identical to serial ones.
constexpr size_t kBlockElems = size_t{1} << 16;

size_t NumBlocks(size_t n) { return (n + kBlockElems - 1) / kBlockElems; }

// F16C from CPUID leaf 1 (Clang 14's __builtin_cpu_supports does not know it).
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
    case CpuIsa::kAvx512: return CpuSupports(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f");
  }
  return false;
}

bool CpuHasVbmi() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
  return vbmi;
}

CpuIsa BestCpuIsa() {
  static const CpuIsa best = CpuSupports(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                             : CpuSupports(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                          : CpuIsa::kScalar;
  return best;
}

Result<CpuIsa> CpuIsaFromSetting(const char* setting) {
  if (setting == nullptr || *setting == '\0') return BestCpuIsa();
  const std::string_view name(setting);
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name != CpuIsaName(isa)) continue;
    if (!CpuSupports(isa)) {
      return NotSupported("{}={}: this CPU lacks it (the widest it runs is {}); unset it or name a narrower one",
                          kCpuIsaVariable, name, CpuIsaName(BestCpuIsa()));
    }
    return isa;
  }
  return InvalidArgument("{}={}: not a kernel version; one of scalar, avx2, avx512 (or unset: the widest the CPU runs)",
                         kCpuIsaVariable, name);
}

CpuIsa ActiveCpuIsa() {
  static const CpuIsa active = [] {
    Result<CpuIsa> isa = CpuIsaFromSetting(std::getenv(kCpuIsaVariable));
    return isa.ok() ? *isa : BestCpuIsa();
  }();
  return active;
}

// Note [torch.optim's arithmetic]
// The kernels compute what torch.optim's single-tensor Adam, AdamW and SGD
// compute on the CPU, operation for operation and rounding for rounding, so
// that from the same gradients they give the same bits (checked against
// torch 2.13 by python/tests/test_param_groups.py). Per element, with every
// constant a double rounded to fp32 once (torch's scalars are Python floats,
// rounded as they meet an fp32 tensor), fma(a, b, c) = a * b + c rounded once:
//   g  = g * multiplier                       (unscale, clip: grad.mul_)
//   g  = fma(w, wd, g)                        (Adam's L2: grad.add(param, alpha=wd))
//   w  = w * (1 - lr wd)                      (AdamW: param.mul_)
//   m  = fma(1 - beta1, g - m, m)             (exp_avg.lerp_: ATen's lerp is an fma)
//   v  = fma((1 - beta2) g, g, v * beta2)     (exp_avg_sq.mul_(beta2).addcmul_)
//   d  = sqrt(v) / sqrt(1 - beta2^t) + eps    (two roundings, not a reciprocal)
//   w  = w + ((-lr / (1 - beta1^t)) m) / d    (param.addcdiv_: the scalar meets m first)
// SGD: d = fma(w, wd, g); b = fma(d, 1 - dampening, b * momentum) (b = d on
// the first step); nesterov d = fma(b, momentum, d), else d = b;
// w = fma(d, -lr, w). Any other grouping is as right but not torch's: the
// decay and the step rounded into the weight once, an fma for the moments
// and a reciprocal of the correction left parameters 1.3e-6 apart from
// torch's after 20 steps of two groups under a cosine schedule (issue 23
// asks 1e-6; torch's own fused kernel is 7e-7 from its default there).
// Note [bf16 states]
// With ChunkTensors::state_dtype bf16 the moments (SGD: the momentum buffer)
// are kept in 2 bytes each instead of 4: Adam's update then moves 20 bytes
// a parameter instead of 28 (fp32 weights and gradients). Each step reads
// them into fp32 exactly, computes with the arithmetic above, updates the
// weights from the fp32 results and rounds the moments to the nearest bf16
// (ties to even) once, as they are stored. This is not what torch.optim
// does with bf16 state tensors (each of its operations on them rounds), and
// is closer to the fp32 states' update. The CUDA kernel (cuda/cuda_kernels.cu)
// does the same.
UpdateConstants MakeUpdateConstants(const OptimizerConfig& config, int64_t step, float grad_multiplier) {
  const auto f32 = [](double x) { return static_cast<float>(x); };
  UpdateConstants c;
  c.kind = config.kind;
  c.grad_multiplier = grad_multiplier;
  const bool decoupled = config.kind == OptimizerKind::kAdamW;
  c.decay_l2 = decoupled ? 0.0f : f32(config.weight_decay);
  c.decay_factor = decoupled ? f32(1.0 - config.lr * config.weight_decay) : 1.0f;
  const double t = static_cast<double>(step);
  const double correction1 = 1.0 - std::pow(config.beta1, t);
  const double correction2 = 1.0 - std::pow(config.beta2, t);
  c.one_minus_beta1 = f32(1.0 - config.beta1);
  c.beta2 = f32(config.beta2);
  c.one_minus_beta2 = f32(1.0 - config.beta2);
  c.neg_step_size = f32(-(config.lr / correction1));
  c.sqrt_correction2 = f32(std::sqrt(correction2));
  c.eps = f32(config.eps);
  c.lr = f32(config.lr);
  c.momentum = f32(config.momentum);
  c.one_minus_dampening = f32(1.0 - config.dampening);
  c.nesterov = config.nesterov;
  c.first_step = step == 1;
  if (config.kind != OptimizerKind::kSgd) {
    c.adam8bit = MakeAdam8bitConstants(config, step);
    c.adam8bit_arithmetic = config.int8_states;
  }
  return c;
}

Adam8bitConstants MakeAdam8bitConstants(const OptimizerConfig& config, int64_t step) {
  const auto f32 = [](double x) { return static_cast<float>(x); };
  Adam8bitConstants c;
  c.decoupled = config.kind == OptimizerKind::kAdamW;
  c.lr = f32(config.lr);
  c.weight_decay = f32(config.weight_decay);
  c.lr_decay = c.lr * c.weight_decay;
  c.one_minus_beta1 = f32(1.0 - config.beta1);
  c.one_minus_beta2 = f32(1.0 - config.beta2);
  const auto t = static_cast<float>(step);
  c.correction1 = 1.0f - std::pow(f32(config.beta1), t);
  c.sqrt_correction2 = std::sqrt(1.0f - std::pow(f32(config.beta2), t));
  c.eps = f32(config.eps);
  return c;
}

void Adam8bitUpdate(CpuIsa isa, const Adam8bitConstants& c, float* master, const float* grad,
                    uint8_t* const codes[2], float* const scales[2], size_t n) {
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::Adam8bitUpdate(c, master, grad, codes, scales, n);
    case CpuIsa::kAvx2: return avx2::Adam8bitUpdate(c, master, grad, codes, scales, n);
    case CpuIsa::kScalar: return scalar::Adam8bitUpdate(c, master, grad, codes, scales, n);
  }
}

// Note [8-bit states in chunks]
// A chunk of int8 moments (DType::kInt8Block) holds, for each block of
// kStateBlockElems elements, the block's codes and then its fp32 scale:
// ChunkBytes(kInt8Block, n) bytes for n elements, so that a range of whole
// blocks is one run of bytes, as a range of elements of any other chunk is
// (the pipeline moves, keeps and saves chunks by bytes). The layout starts
// every tensor of such a chunk on a block and puts tensors whose states stay
// fp32 (QuantizesStates) in chunks of their own, so a tensor's blocks are
// torchao's. The update of a block is the reference's (Adam8bitUpdate) on
// fp32 gradients: others are widened first, and each is multiplied by the
// step's grad_multiplier (1/loss scale times the clip coefficient, one
// rounding, as the fp32 kernel takes it; torch's unscale and clip, where
// both apply, round twice); a compute copy (bf16/fp16 params) is rounded
// from the updated weights.
// The small tensors' fp32 moments are updated with the same arithmetic
// (scalar::Adam8bitFp32States), as torchao's step updates them.
namespace {

void Adam8bitRange(CpuIsa isa, const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end) {
  alignas(64) float widened[kStateBlockElems];
  const bool blocks = chunk.state_dtype == DType::kInt8Block;
  auto* const first = reinterpret_cast<std::byte*>(chunk.state[0]);
  auto* const second = reinterpret_cast<std::byte*>(chunk.state[1]);
  for (size_t at = begin; at < end; at += kStateBlockElems) {
    const size_t count = std::min(kStateBlockElems, end - at);  // whole blocks but for fp32 states' tail
    const float* grad = static_cast<const float*>(chunk.grad) + at;
    if (chunk.grad_dtype != DType::kFloat32 || c.grad_multiplier != 1.0f) {
      const auto* from = static_cast<const std::byte*>(chunk.grad) + at * DTypeSizeBytes(chunk.grad_dtype);
      WidenGrad(isa, from, chunk.grad_dtype, c.grad_multiplier, widened, count);
      grad = widened;
    }
    if (blocks) {
      const size_t block = ChunkBytes(DType::kInt8Block, at);
      uint8_t* const codes[2] = {reinterpret_cast<uint8_t*>(first + block),
                                 reinterpret_cast<uint8_t*>(second + block)};
      float* const scales[2] = {reinterpret_cast<float*>(first + block + kStateBlockElems),
                                reinterpret_cast<float*>(second + block + kStateBlockElems)};
      Adam8bitUpdate(isa, c.adam8bit, chunk.master + at, grad, codes, scales, kStateBlockElems);
    } else {
      float* const states[2] = {chunk.state[0] + at, chunk.state[1] + at};
      scalar::Adam8bitFp32States(c.adam8bit, chunk.master + at, grad, states, count);
    }
    if (chunk.param_dtype == DType::kBFloat16) {
      ConvertToBf16(isa, chunk.master + at, static_cast<uint16_t*>(chunk.param) + at, count);
    } else if (chunk.param_dtype == DType::kFloat16) {
      ConvertToFp16(isa, chunk.master + at, static_cast<uint16_t*>(chunk.param) + at, count);
    }
  }
}

}  // namespace

void UpdateRange(CpuIsa isa, const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end) {
  if (chunk.state_dtype == DType::kInt8Block || (c.adam8bit_arithmetic && chunk.state_dtype == DType::kFloat32)) {
    return Adam8bitRange(isa, c, chunk, begin, end);
  }
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::UpdateRange(c, chunk, begin, end);
    case CpuIsa::kAvx2: return avx2::UpdateRange(c, chunk, begin, end);
    case CpuIsa::kScalar: return scalar::UpdateRange(c, chunk, begin, end);
  }
}

void UpdateParallel(const UpdateConstants& c, std::span<const ChunkTensors> chunks) {
  // Every block of every chunk is one task: many small chunks spread over
  // the cores as well as one large one does.
  std::vector<std::pair<uint32_t, size_t>> blocks;  // (chunk, first element)
  for (size_t k = 0; k < chunks.size(); ++k) {
    for (size_t begin = 0; begin < chunks[k].n; begin += kBlockElems) blocks.emplace_back(k, begin);
  }
  const CpuIsa isa = ActiveCpuIsa();
  tbb::parallel_for(size_t{0}, blocks.size(), [&](size_t b) {
    const auto [k, begin] = blocks[b];
    UpdateRange(isa, c, chunks[k], begin, std::min(chunks[k].n, begin + kBlockElems));
  });
}

void UpdateParallel(const UpdateConstants& c, const ChunkTensors& chunk, const BlockWork& work) {
  if (!work.before && !work.after) return UpdateParallel(c, std::span<const ChunkTensors>(&chunk, 1));
  const CpuIsa isa = ActiveCpuIsa();
  tbb::parallel_for(size_t{0}, (chunk.n + kBlockElems - 1) / kBlockElems, [&](size_t block) {
    const size_t begin = block * kBlockElems, end = std::min(chunk.n, begin + kBlockElems);
    if (work.before) work.before(begin, end);
    UpdateRange(isa, c, chunk, begin, end);
    if (work.after) work.after(begin, end);
  });
}

void ZeroParallel(void* dst, size_t bytes) {
  constexpr size_t kZeroBlockBytes = size_t{1} << 20;  // a task's share: large enough to hide the scheduling
  auto* const out = static_cast<std::byte*>(dst);
  tbb::parallel_for(size_t{0}, (bytes + kZeroBlockBytes - 1) / kZeroBlockBytes, [&](size_t block) {
    const size_t begin = block * kZeroBlockBytes;
    std::memset(out + begin, 0, std::min(kZeroBlockBytes, bytes - begin));
  });
}

double SumSquaresRange(CpuIsa isa, const void* grad, DType dtype, size_t begin, size_t end) {
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::SumSquaresRange(grad, dtype, begin, end);
    case CpuIsa::kAvx2: return avx2::SumSquaresRange(grad, dtype, begin, end);
    case CpuIsa::kScalar: return scalar::SumSquaresRange(grad, dtype, begin, end);
  }
  return 0;
}

void WidenGrad(CpuIsa isa, const void* grad, DType dtype, float multiplier, float* out, size_t n) {
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::WidenGrad(grad, dtype, multiplier, out, n);
    case CpuIsa::kAvx2: return avx2::WidenGrad(grad, dtype, multiplier, out, n);
    case CpuIsa::kScalar: return scalar::WidenGrad(grad, dtype, multiplier, out, n);
  }
}

void ConvertToBf16(CpuIsa isa, const float* src, uint16_t* dst, size_t n) {
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::ConvertToBf16(src, dst, n);
    case CpuIsa::kAvx2: return avx2::ConvertToBf16(src, dst, n);
    case CpuIsa::kScalar: return scalar::ConvertToBf16(src, dst, n);
  }
}

void ConvertToFp16(CpuIsa isa, const float* src, uint16_t* dst, size_t n) {
  switch (isa) {
    case CpuIsa::kAvx512: return avx512::ConvertToFp16(src, dst, n);
    case CpuIsa::kAvx2: return avx2::ConvertToFp16(src, dst, n);
    case CpuIsa::kScalar: return scalar::ConvertToFp16(src, dst, n);
  }
}

void GradStats::Add(const void* grad, DType grad_dtype, size_t n) {
  // Per-block sums added in block order: the total does not depend on how
  // oneTBB scheduled the blocks, so a rerun gives the same norm bit for bit.
  std::vector<double> partial(NumBlocks(n));
  const CpuIsa isa = ActiveCpuIsa();
  tbb::parallel_for(size_t{0}, partial.size(), [&](size_t block) {
    const size_t begin = block * kBlockElems;
    partial[block] = SumSquaresRange(isa, grad, grad_dtype, begin, std::min(n, begin + kBlockElems));
  });
  for (double p : partial) sum_squares += p;
}

bool GradStats::finite() const { return std::isfinite(sum_squares); }

}  // namespace strata::optim
