// The CPU optimizer kernels: one update of a range of a chunk, the gradient
// sum of squares, and the fp32 -> bf16/fp16 conversions, in three versions:
//   scalar   optim/cpu/cpu_reference.cc: the reference for the others
//   avx2     optim/cpu/cpu_avx2.cc (AVX2 + FMA + F16C), 8 lanes
//   avx512   optim/cpu/cpu_avx512.cc (AVX-512F + FMA + F16C), 16 lanes
// The vector versions are one template (optim/cpu/cpu_kernels_impl.h, with
// their tolerance against the reference); the dispatcher only calls a
// version the CPU supports: the widest, or the one the environment variable
// STRATA_CPU_ISA names (scalar, avx2 or avx512), so that one machine can run
// the paths of a narrower one.
//
// Pure functions over caller-owned arrays; thread-safe on disjoint ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "optim/optimizer.h"
#include "strata/status.h"

namespace strata::optim {

enum class CpuIsa : uint8_t { kScalar, kAvx2, kAvx512 };
std::string_view CpuIsaName(CpuIsa isa);
bool CpuSupports(CpuIsa isa);
// The widest version this CPU runs.
CpuIsa BestCpuIsa();
// The version a setting of STRATA_CPU_ISA names: InvalidArgument for a name
// that is none of scalar, avx2 and avx512, NotSupported for one this CPU
// lacks. nullptr or "" is BestCpuIsa().
Result<CpuIsa> CpuIsaFromSetting(const char* setting);
inline constexpr const char* kCpuIsaVariable = "STRATA_CPU_ISA";
// The version the kernels run: the one STRATA_CPU_ISA names, read once, else
// BestCpuIsa(). A setting CpuIsaFromSetting refuses is BestCpuIsa() here;
// Optimizer::Create returns its error, so no engine trains with it.
CpuIsa ActiveCpuIsa();

// Adam and AdamW whose states are 8-bit (Note [8-bit states] in
// optim/state_codec.cc): the arithmetic of torchao's 8-bit Adam, in fp32,
// with no multiply-add fused. Its per-step constants, computed as torchao
// computes them (in fp32, from fp32 lr and step):
struct Adam8bitConstants {
  bool decoupled = true;  // AdamW's decay (else Adam's, into the gradient)
  float lr = 0, weight_decay = 0;
  float lr_decay = 0;  // lr * weight_decay
  float one_minus_beta1 = 0, one_minus_beta2 = 0;
  float correction1 = 1;       // 1 - beta1^t
  float sqrt_correction2 = 1;  // sqrt(1 - beta2^t)
  float eps = 0;
};
// The per-step constants of every kernel, computed once per step.
struct UpdateConstants {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float grad_multiplier = 1.0f;  // 1 / loss_scale * clip coefficient
  float decay_l2 = 0.0f;         // weight_decay when it goes into the gradient, else 0
  float decay_factor = 1.0f;     // 1 - lr * weight_decay when decoupled (w *= decay_factor), else 1
  // Adam (see Note [torch.optim's arithmetic] in cpu_kernels.cc)
  float one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float neg_step_size = 0;     // -lr / (1 - beta1^t)
  float sqrt_correction2 = 0;  // sqrt(1 - beta2^t)
  float eps = 0;
  // SGD
  float lr = 0, momentum = 0, one_minus_dampening = 1;
  bool nesterov = false;
  bool first_step = false;  // SGD's momentum buffer starts as the first gradient
  // Adam's with int8 states (ChunkTensors::state_dtype kInt8Block), and
  // with fp32 ones too under OptimizerConfig::int8_states
  Adam8bitConstants adam8bit;
  bool adam8bit_arithmetic = false;
};
UpdateConstants MakeUpdateConstants(const OptimizerConfig& config, int64_t step, float grad_multiplier);

Adam8bitConstants MakeAdam8bitConstants(const OptimizerConfig& config, int64_t step);
// One step over `n` elements (whole blocks of kStateBlockElems) of fp32
// weights and gradients, the moments' codes and scales updated in place
// (state 0 the first moment), with `isa`'s kernels: each version gives the
// reference's bits. The engine's chunks run it through UpdateRange.
void Adam8bitUpdate(CpuIsa isa, const Adam8bitConstants& c, float* master, const float* grad,
                    uint8_t* const codes[2], float* const scales[2], size_t n);

// Updates elements [begin, end) of `chunk` on the calling thread. `begin`
// should be a multiple of 16 so every element takes the same path (vector
// or tail) however the chunk is split; with int8 states, `begin` and `end`
// are on whole blocks of kStateBlockElems (Note [8-bit states in chunks]).
void UpdateRange(CpuIsa isa, const UpdateConstants& constants, const ChunkTensors& chunk, size_t begin, size_t end);
// The same over whole chunks with ActiveCpuIsa(), split over oneTBB's threads
// across and within chunks (blocks of 64 Ki elements from all of them).
void UpdateParallel(const UpdateConstants& constants, std::span<const ChunkTensors> chunks);
// One chunk, with `work` done beside each block (BlockWork).
void UpdateParallel(const UpdateConstants& constants, const ChunkTensors& chunk, const BlockWork& work = {});

// Zeroes `bytes` at `dst`, split over oneTBB's threads in blocks of 1 MiB:
// the grads after their update, at every core's share of the memory
// bandwidth rather than one core's.
void ZeroParallel(void* dst, size_t bytes);

// Sum of squares of grad[begin, end) in fp64.
double SumSquaresRange(CpuIsa isa, const void* grad, DType dtype, size_t begin, size_t end);

// out[i] = grad[i] (fp32, bf16 or fp16) * multiplier, one rounding.
void WidenGrad(CpuIsa isa, const void* grad, DType dtype, float multiplier, float* out, size_t n);

// fp32 -> 16 bits with the rounding of src/base/half.h.
void ConvertToBf16(CpuIsa isa, const float* src, uint16_t* dst, size_t n);
void ConvertToFp16(CpuIsa isa, const float* src, uint16_t* dst, size_t n);

// Per-version entry points, behind the dispatch above.
namespace scalar {
void UpdateRange(const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end);
// Adam8bitUpdate's arithmetic on moments kept in fp32 (the small tensors'
// under int8 states: torchao's step updates them so).
void Adam8bitFp32States(const Adam8bitConstants& c, float* master, const float* grad, float* const states[2],
                        size_t n);
// One step over `n` elements (whole blocks) of fp32 weights and gradients,
// the moments' codes and scales updated in place (state 0 the first moment).
void Adam8bitUpdate(const Adam8bitConstants& c, float* master, const float* grad, uint8_t* const codes[2],
                    float* const scales[2], size_t n);
double SumSquaresRange(const void* grad, DType dtype, size_t begin, size_t end);
void WidenGrad(const void* grad, DType dtype, float multiplier, float* out, size_t n);
void ConvertToBf16(const float* src, uint16_t* dst, size_t n);
void ConvertToFp16(const float* src, uint16_t* dst, size_t n);
}  // namespace scalar
namespace avx2 {
void UpdateRange(const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end);
void Adam8bitUpdate(const Adam8bitConstants& c, float* master, const float* grad, uint8_t* const codes[2],
                    float* const scales[2], size_t n);
double SumSquaresRange(const void* grad, DType dtype, size_t begin, size_t end);
void WidenGrad(const void* grad, DType dtype, float multiplier, float* out, size_t n);
void ConvertToBf16(const float* src, uint16_t* dst, size_t n);
void ConvertToFp16(const float* src, uint16_t* dst, size_t n);
// The codes of `n` values (a multiple of 16) already divided by their scale
// (EncodeScaled of optim/state_codec.h, bit for bit), as the 8-bit update
// makes them.
void EncodeScaled(const float* scaled, size_t n, bool is_signed, uint8_t* codes);
}  // namespace avx2
namespace avx512 {
void UpdateRange(const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end);
void Adam8bitUpdate(const Adam8bitConstants& c, float* master, const float* grad, uint8_t* const codes[2],
                    float* const scales[2], size_t n);
double SumSquaresRange(const void* grad, DType dtype, size_t begin, size_t end);
void WidenGrad(const void* grad, DType dtype, float multiplier, float* out, size_t n);
void ConvertToBf16(const float* src, uint16_t* dst, size_t n);
void ConvertToFp16(const float* src, uint16_t* dst, size_t n);
// The codes of `n` values (a multiple of 16) already divided by their scale
// (EncodeScaled of optim/state_codec.h, bit for bit), as the 8-bit update
// makes them.
void EncodeScaled(const float* scaled, size_t n, bool is_signed, uint8_t* codes);
// values[i] = map[codes[i]] by eight float permutes a 16 (n a multiple of 16):
// the 8-bit update's decode where the CPU lacks VBMI.
void MapCodesByPermutes(const float* map, const uint8_t* codes, float* values, size_t n);
}  // namespace avx512
// AVX-512 VBMI and BW, with which the avx512 kernels decode 8-bit states
// (Note [Decoding by byte planes] in optim/cpu/cpu_avx512_vbmi.cc).
bool CpuHasVbmi();
namespace avx512_vbmi {
// values[i] = the map's value at codes[i], from its byte planes
// (StateTables::planes), for n a multiple of 64.
void MapCodes(const uint8_t* planes, const uint8_t* codes, float* values, size_t n);
}  // namespace avx512_vbmi

}  // namespace strata::optim
