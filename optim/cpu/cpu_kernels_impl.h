// The vector kernels, written once over a `Vec` type that each instruction
// set file defines before including this (optim/cpu/cpu_avx2.cc: 8 lanes,
// optim/cpu/cpu_avx512.cc: 16). The math is the reference's
// (optim/cpu/cpu_reference.cc) with fused multiply-adds; elements past the last
// whole vector go to the reference itself.
//
// Tolerance against the reference (tests/optim/cpu/cpu_kernels_test.cc):
// |x - ref| <= 1e-6 + 1e-5 |ref| for the fp32 states (fused multiply-adds
// round differently); 16-bit outputs are exactly the round-to-nearest-even of
// the version's own fp32 result, bit for bit.
//
// Everything here has internal linkage and calls only intrinsics and the
// reference: no inline function with external linkage is compiled with the
// wider instruction set, so the linker can never hand a wide copy of one to
// code running on a CPU without it.
//
// Vec provides: F (the register), kLanes, Set, Load, Store, LoadBf16,
// LoadFp16, StoreBf16, StoreFp16 (src/base/half.h's rounding, bit for bit),
// Add, Sub, Mul, Div, Sqrt, MulAdd(a, b, c) = a*b + c, NegMulAdd(a, b, c) =
// c - a*b, and Squares: an fp64 accumulator with Add(F) and Total(). For
// 8-bit states: I (32-bit integer lanes), StoreCodes (a byte a lane),
// MapBlock (a code map's values at a block's codes), CodesByRuns
// (RunEncoder's codes, where the version has them), GatherInts, Bucket
// (ThresholdEncoder's), CodeOfEntry (a code from a bucket's entry), ZeroIfNan,
// and Largest: the largest magnitude, NaN-aware.

namespace {

using F = Vec::F;
constexpr size_t kLanes = Vec::kLanes;

// How far ahead the update loops ask for their inputs, in elements: 2 KiB
// of each fp32 stream. The hardware prefetchers alone keep too few misses in
// flight while the core waits on the update's divide and square root: on
// the development VM (2 cores, 64M parameters) the fp32 AdamW update went
// from 43.5 to 51.9 GB/s with it, the streaming bound from 50.7 to 52.2.
constexpr size_t kPrefetchElems = 512;

inline void Prefetch(const void* address) { _mm_prefetch(static_cast<const char*>(address), _MM_HINT_T0); }

// The address of element `index` of an array of `element_bytes`-wide
// elements (the gradient's dtype decides the width).
inline const void* Ahead(const void* array, size_t index, size_t element_bytes) {
  return static_cast<const char*>(array) + index * element_bytes;
}

// What the update writes besides fp32 master and states.
enum class ParamOut { kNone, kBf16, kFp16 };

template <DType G>
inline F LoadGrad(const void* grad, size_t i) {
  if constexpr (G == DType::kFloat32) {
    return Vec::Load(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBFloat16) {
    return Vec::LoadBf16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return Vec::LoadFp16(static_cast<const uint16_t*>(grad) + i);
  }
}

// State arrays: fp32, or bf16 (Note [bf16 states] in cpu_kernels.cc).
template <DType S>
inline F LoadState(const float* state, size_t i) {
  if constexpr (S == DType::kFloat32) {
    return Vec::Load(state + i);
  } else {
    return Vec::LoadBf16(reinterpret_cast<const uint16_t*>(state) + i);
  }
}

template <DType S>
inline void StoreState(float* state, size_t i, F x) {
  if constexpr (S == DType::kFloat32) {
    Vec::Store(state + i, x);
  } else {
    Vec::StoreBf16(reinterpret_cast<uint16_t*>(state) + i, x);
  }
}

template <ParamOut O>
inline void StoreParam(void* param, size_t i, F weight) {
  if constexpr (O == ParamOut::kBf16) {
    Vec::StoreBf16(static_cast<uint16_t*>(param) + i, weight);
  } else if constexpr (O == ParamOut::kFp16) {
    Vec::StoreFp16(static_cast<uint16_t*>(param) + i, weight);
  }
}

// Adam and AdamW over whole vectors from `begin`; returns where it stopped.
template <DType G, ParamOut O, DType S>
size_t AdamVectors(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  const F grad_multiplier = Vec::Set(c.grad_multiplier), decay_l2 = Vec::Set(c.decay_l2);
  const F decay_factor = Vec::Set(c.decay_factor), one_minus_beta1 = Vec::Set(c.one_minus_beta1);
  const F beta2 = Vec::Set(c.beta2), one_minus_beta2 = Vec::Set(c.one_minus_beta2);
  const F neg_step_size = Vec::Set(c.neg_step_size), sqrt_correction2 = Vec::Set(c.sqrt_correction2);
  const F eps = Vec::Set(c.eps);
  float* const master = t.master;
  float* const exp_avg = t.state[0];
  float* const exp_avg_sq = t.state[1];
  const void* const grad_in = t.grad;
  void* const param = t.param;
  constexpr size_t grad_bytes = DTypeSizeBytes(G), state_bytes = DTypeSizeBytes(S);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    if (i + kPrefetchElems < end) {
      Prefetch(master + i + kPrefetchElems);
      Prefetch(Ahead(exp_avg, i + kPrefetchElems, state_bytes));
      Prefetch(Ahead(exp_avg_sq, i + kPrefetchElems, state_bytes));
      Prefetch(Ahead(grad_in, i + kPrefetchElems, grad_bytes));
    }
    // The reference's operations (Note [torch.optim's arithmetic] in cpu_kernels.cc).
    const F master_in = Vec::Load(master + i);
    const F grad = Vec::MulAdd(master_in, decay_l2, Vec::Mul(LoadGrad<G>(grad_in, i), grad_multiplier));
    const F weight = Vec::Mul(master_in, decay_factor);
    const F m_in = LoadState<S>(exp_avg, i);
    const F m = Vec::MulAdd(one_minus_beta1, Vec::Sub(grad, m_in), m_in);
    const F v = Vec::MulAdd(Vec::Mul(one_minus_beta2, grad), grad, Vec::Mul(LoadState<S>(exp_avg_sq, i), beta2));
    const F denom = Vec::Add(Vec::Div(Vec::Sqrt(v), sqrt_correction2), eps);
    const F updated = Vec::Add(weight, Vec::Div(Vec::Mul(neg_step_size, m), denom));
    StoreState<S>(exp_avg, i, m);
    StoreState<S>(exp_avg_sq, i, v);
    Vec::Store(master + i, updated);
    StoreParam<O>(param, i, updated);
  }
  return i;
}

// SGD with momentum (or without: no state) over whole vectors from `begin`.
template <DType G, ParamOut O, DType S>
size_t SgdVectors(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  const F grad_multiplier = Vec::Set(c.grad_multiplier), decay_l2 = Vec::Set(c.decay_l2);
  const F lr = Vec::Set(c.lr), momentum = Vec::Set(c.momentum);
  const F one_minus_dampening = Vec::Set(c.one_minus_dampening);
  float* const master = t.master;
  float* const buffer = t.state[0];
  const void* const grad_in = t.grad;
  void* const param = t.param;
  constexpr size_t grad_bytes = DTypeSizeBytes(G), state_bytes = DTypeSizeBytes(S);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    if (i + kPrefetchElems < end) {
      Prefetch(master + i + kPrefetchElems);
      if (buffer != nullptr) Prefetch(Ahead(buffer, i + kPrefetchElems, state_bytes));
      Prefetch(Ahead(grad_in, i + kPrefetchElems, grad_bytes));
    }
    F weight = Vec::Load(master + i);
    F d = Vec::MulAdd(weight, decay_l2, Vec::Mul(LoadGrad<G>(grad_in, i), grad_multiplier));
    if (buffer != nullptr) {
      // b = d on the first step, else momentum b + (1 - dampening) d
      const F b =
          c.first_step ? d : Vec::MulAdd(d, one_minus_dampening, Vec::Mul(LoadState<S>(buffer, i), momentum));
      StoreState<S>(buffer, i, b);
      d = c.nesterov ? Vec::MulAdd(b, momentum, d) : b;
    }
    weight = Vec::NegMulAdd(lr, d, weight);
    Vec::Store(master + i, weight);
    StoreParam<O>(param, i, weight);
  }
  return i;
}

template <DType G, ParamOut O, DType S>
size_t UpdateVectors(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  return c.kind == OptimizerKind::kSgd ? SgdVectors<G, O, S>(c, t, begin, end)
                                       : AdamVectors<G, O, S>(c, t, begin, end);
}

template <DType G, DType S>
size_t UpdateVectorsForStates(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  if (t.param == nullptr) return UpdateVectors<G, ParamOut::kNone, S>(c, t, begin, end);
  if (t.param_dtype == DType::kBFloat16) return UpdateVectors<G, ParamOut::kBf16, S>(c, t, begin, end);
  return UpdateVectors<G, ParamOut::kFp16, S>(c, t, begin, end);
}

template <DType G>
size_t UpdateVectorsForGrad(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  if (t.state_dtype == DType::kBFloat16) return UpdateVectorsForStates<G, DType::kBFloat16>(c, t, begin, end);
  return UpdateVectorsForStates<G, DType::kFloat32>(c, t, begin, end);
}

template <DType G>
double SumSquaresVectors(const void* grad, size_t begin, size_t end, size_t* stopped) {
  Vec::Squares squares;
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) squares.Add(LoadGrad<G>(grad, i));
  *stopped = i;
  return squares.Total();
}

// out[i] = grad[i] * multiplier over whole vectors; returns where it stopped.
template <DType G>
size_t WidenVectors(const void* grad, float multiplier, float* out, size_t n) {
  const F times = Vec::Set(multiplier);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Vec::Store(out + i, Vec::Mul(LoadGrad<G>(grad, i), times));
  return i;
}

// The code of each lane of `scaled` (Note [Encoding by thresholds] in
// optim/state_codec.cc): its bucket's entry, and the boundary there if the
// lane reaches it.
inline Vec::I EncodeLanes(F scaled, const StateTables& tables) {
  if (Vec::I code; Vec::CodesByRuns(scaled, tables, code)) return code;  // else a lane near a boundary: the lookup
  using E = ThresholdEncoder;
  const Vec::I bucket = Vec::Bucket(scaled, E::kLowBits, E::kMinExponent << E::kBucketBits, E::kBucketsPerSign);
  return Vec::ZeroIfNan(Vec::CodeOfEntry(Vec::GatherInts(tables.entry, bucket), scaled, E::kNoBoundary - 1), scaled);
}

// A block's values into its codes and scale (QuantizeBlocks), `largest`
// the largest magnitude among them (NaN if one is NaN).
inline void EncodeBlock(const float* values, float largest, const StateTables& tables, uint8_t* codes, float* scale) {
  const float block_scale = largest != largest || largest > 1e-12f ? largest : 1e-12f;
  *scale = block_scale;
  const F divisor = Vec::Set(block_scale);
  for (size_t j = 0; j < kStateBlockElems; j += kLanes) {
    Vec::StoreCodes(codes + j, EncodeLanes(Vec::Div(Vec::Load(values + j), divisor), tables));
  }
}

}  // namespace

// The reference's operations (scalar::Adam8bitUpdate), one vector at a
// time, none fused: every version gives its bits. A block's codes are first
// decoded whole (MapBlock), into the arrays that then take its new moments.
void Adam8bitUpdate(const Adam8bitConstants& c, float* master, const float* grad, uint8_t* const codes[2],
                    float* const scales[2], size_t n) {
  static_assert(kStateBlockElems % kLanes == 0);
  const StateTables &first_moment = TablesOf(true), &second_moment = TablesOf(false);
  const F lr_decay = Vec::Set(c.lr_decay), weight_decay = Vec::Set(c.weight_decay), lr = Vec::Set(c.lr);
  const F one_minus_beta1 = Vec::Set(c.one_minus_beta1), one_minus_beta2 = Vec::Set(c.one_minus_beta2);
  const F correction1 = Vec::Set(c.correction1), sqrt_correction2 = Vec::Set(c.sqrt_correction2);
  const F eps = Vec::Set(c.eps);
  alignas(64) float m[kStateBlockElems];
  alignas(64) float v[kStateBlockElems];
  for (size_t at = 0; at < n; at += kStateBlockElems) {
    const size_t block = at / kStateBlockElems;
    Vec::MapBlock(first_moment, codes[0] + at, m);
    Vec::MapBlock(second_moment, codes[1] + at, v);
    const F m_scale = Vec::Set(scales[0][block]), v_scale = Vec::Set(scales[1][block]);
    Vec::Largest m_largest, v_largest;
    for (size_t j = 0; j < kStateBlockElems; j += kLanes) {
      const size_t i = at + j;
      F weight = Vec::Load(master + i);
      F g = Vec::Load(grad + i);
      if (c.decoupled) {
        weight = Vec::Sub(weight, Vec::Mul(lr_decay, weight));
      } else {
        g = Vec::Add(g, Vec::Mul(weight_decay, weight));
      }
      const F m_old = Vec::Mul(Vec::Load(m + j), m_scale);
      const F v_old = Vec::Mul(Vec::Load(v + j), v_scale);
      const F m_new = Vec::Add(Vec::Mul(one_minus_beta1, Vec::Sub(g, m_old)), m_old);
      const F v_new = Vec::Add(Vec::Mul(one_minus_beta2, Vec::Sub(Vec::Mul(g, g), v_old)), v_old);
      const F denom = Vec::Add(Vec::Div(Vec::Sqrt(v_new), sqrt_correction2), eps);
      Vec::Store(master + i, Vec::Sub(weight, Vec::Div(Vec::Mul(lr, Vec::Div(m_new, correction1)), denom)));
      Vec::Store(m + j, m_new);
      Vec::Store(v + j, v_new);
      m_largest.Add(m_new);
      v_largest.Add(v_new);
    }
    EncodeBlock(m, m_largest.Total(), first_moment, codes[0] + at, &scales[0][block]);
    EncodeBlock(v, v_largest.Total(), second_moment, codes[1] + at, &scales[1][block]);
  }
}

void EncodeScaled(const float* scaled, size_t n, bool is_signed, uint8_t* codes) {
  static_assert(16 % kLanes == 0);
  const StateTables& tables = TablesOf(is_signed);
  for (size_t i = 0; i < n; i += kLanes) Vec::StoreCodes(codes + i, EncodeLanes(Vec::Load(scaled + i), tables));
}

void UpdateRange(const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end) {
  size_t stopped = begin;
  switch (chunk.grad_dtype) {
    case DType::kFloat32: stopped = UpdateVectorsForGrad<DType::kFloat32>(c, chunk, begin, end); break;
    case DType::kBFloat16: stopped = UpdateVectorsForGrad<DType::kBFloat16>(c, chunk, begin, end); break;
    case DType::kFloat16: stopped = UpdateVectorsForGrad<DType::kFloat16>(c, chunk, begin, end); break;
    case DType::kInt8Block: break;  // not a gradient's type (CheckChunk)
  }
  scalar::UpdateRange(c, chunk, stopped, end);  // the tail
}

double SumSquaresRange(const void* grad, DType dtype, size_t begin, size_t end) {
  size_t stopped = begin;
  double sum = 0;
  switch (dtype) {
    case DType::kFloat32: sum = SumSquaresVectors<DType::kFloat32>(grad, begin, end, &stopped); break;
    case DType::kBFloat16: sum = SumSquaresVectors<DType::kBFloat16>(grad, begin, end, &stopped); break;
    case DType::kFloat16: sum = SumSquaresVectors<DType::kFloat16>(grad, begin, end, &stopped); break;
    case DType::kInt8Block: break;
  }
  return sum + scalar::SumSquaresRange(grad, dtype, stopped, end);
}

void WidenGrad(const void* grad, DType dtype, float multiplier, float* out, size_t n) {
  size_t stopped = 0;
  switch (dtype) {
    case DType::kFloat32: stopped = WidenVectors<DType::kFloat32>(grad, multiplier, out, n); break;
    case DType::kBFloat16: stopped = WidenVectors<DType::kBFloat16>(grad, multiplier, out, n); break;
    case DType::kFloat16: stopped = WidenVectors<DType::kFloat16>(grad, multiplier, out, n); break;
    case DType::kInt8Block: return;  // not a gradient's type (CheckChunk)
  }
  scalar::WidenGrad(Ahead(grad, stopped, DTypeSizeBytes(dtype)), dtype, multiplier, out + stopped, n - stopped);
}

void ConvertToBf16(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Vec::StoreBf16(dst + i, Vec::Load(src + i));
  scalar::ConvertToBf16(src + i, dst + i, n - i);
}

void ConvertToFp16(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Vec::StoreFp16(dst + i, Vec::Load(src + i));
  scalar::ConvertToFp16(src + i, dst + i, n - i);
}
