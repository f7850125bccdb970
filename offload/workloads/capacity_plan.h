// `strata plan`: what fits where for a GPT-style model on a given machine,
// and the step time to expect, before anything is allocated. The model's
// tensors are those of offload/workloads/gpt_model.h (bf16 with fp32 master
// weights and Adam moments) in the engine's chunk layout and homes; the step
// is estimated as Note [The GPT step estimate] in capacity_plan.cc says and
// predicted by the planner (offload/schedule/planner.h).
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "memory/chunk_layout.h"
#include "offload/schedule/planner.h"
#include "offload/workloads/gpt_model.h"
#include "strata/status.h"

namespace strata::offload {

struct MachineSpec {
  uint64_t hbm_bytes = uint64_t{80} << 30;
  double hbm_reserve_fraction = 0.1;  // for the CUDA context, workspace and fragmentation
  uint64_t dram_bytes = uint64_t{128} << 30;  // host memory strata may use for chunks
  uint64_t nvme_bytes = 0;                    // 0: no NVMe tier
  double pcie_gbps = 25;                      // each direction, GB/s (10^9 B/s)
  double nvme_read_gbps = 3;
  double nvme_write_gbps = 2;
  double gpu_tflops = 200;        // sustained bf16 matmul rate
  double cpu_adam_gparams = 1.5;  // CPU AdamW, G parameters/s (`strata bench optim`)
  double gpu_adam_gparams = 100;  // GPU AdamW, G parameters/s (HBM-bound: ~30 bytes per parameter)
};

// Gradient accumulation over micro_batches micro-batches a step (each of
// ModelShape::batch): standard runs the whole model once per micro-batch;
// layered runs each layer for every micro-batch before the next layer, its
// blocks checkpointed (Note [Layered accumulation] in capacity_plan.cc).
struct Accumulation {
  uint32_t micro_batches = 1;
  bool layered = false;
  // "layered" or "standard", as the command line and the reports spell it.
  const char* order_name() const { return layered ? "layered" : "standard"; }
};

struct CapacityPlan {
  ModelShape model;
  Accumulation accumulation;
  MachineSpec machine;
  DType moment_dtype = DType::kFloat32;  // the moments' (optimizer.states)
  uint64_t params = 0;
  uint64_t param_bytes = 0, grad_bytes = 0, state_bytes = 0;  // as chunks: bf16, bf16, fp32 master and the moments
  uint64_t activation_peak_bytes = 0;
  uint64_t device_bytes = 0;      // HBM for chunks and activations (after the reserve)
  uint64_t host_chunk_bytes = 0;  // chunks homed in DRAM
  uint64_t nvme_chunk_bytes = 0;  // chunks homed on NVMe
  uint64_t nvme_state_bytes = 0;  // of which optimizer states (streamed by the optimizer step)
  double compute_seconds = 0;           // forward and backward, compute alone
  double forward_backward_seconds = 0;  // with the stalls
  double optimizer_seconds = 0;         // the updates, with their stalls
  double update_compute_seconds = 0;    // the updates, compute alone (where the plan runs each)
  uint32_t updates = 0;                 // chunk groups updated
  uint32_t updates_on_device = 0;       // of which on the GPU
  double step_seconds = 0;
  double model_flops = 0;  // per step, forward and backward
  double tflops() const { return step_seconds > 0 ? model_flops / step_seconds / 1e12 : 0; }
  double per_param(uint64_t bytes) const { return params > 0 ? static_cast<double>(bytes) / params : 0; }
  std::string bottleneck;  // "compute", "pcie", "nvme" or "cpu optimizer"
  Prediction prediction;   // the planner's, for the whole step
  uint64_t boundary_bytes = 0;  // layered: the micro-batches' layer inputs held at once, at most
  // Set by `strata plan` with several micro-batches: the other accumulation's
  // step and bytes moved, or why it does not fit.
  double other_step_seconds = 0;
  uint64_t other_bytes_moved = 0;
  std::string other_error;
};

// One training step of the GPT as the planner sees it: forward, backward
// (once per micro-batch, or layer by layer over all of them), then one
// update per trainable chunk group that may run on the device.
struct GptStep {
  Trace trace;
  double model_flops = 0;  // forward and backward, every micro-batch
  uint64_t activation_peak_bytes = 0;
  // Layered: the layer-boundary activations of every micro-batch held at
  // once at their most (in activation_peak_bytes too).
  uint64_t boundary_bytes = 0;
  // By moment: how many micro-batch passes of its module it computes (a
  // forward or a backward pass each; a layered backward recomputes the
  // forward, a pass more; 0 for an update), for compute that takes the same
  // time a pass whichever its direction (the replay's --compute-ms).
  std::vector<double> passes;
};
// The tensors (indices into `specs`, GptTensorSpecs') each forward module
// reads: the embedding (0), each layer, the head (the embedding's, tied).
std::vector<std::vector<uint32_t>> GptForwardGroups(const std::vector<TensorSpec>& specs, uint32_t layers);
// How long an update of `params` parameters with moments of `moment` takes
// on `machine`'s CPU (Tier::kHost) or GPU (fp32 moments only).
double UpdateSeconds(uint64_t params, DType moment, Tier where, const MachineSpec& machine);
GptStep GptStepTrace(const std::vector<TensorSpec>& specs, const memory::ChunkLayout& layout, const ModelShape& model,
                     const MachineSpec& machine, const Accumulation& accumulation = {});

// OutOfMemory naming the shortfall when a moment's chunks and activations do
// not fit in HBM, or the model states do not fit in DRAM and NVMe together;
// InvalidArgument for a zero size or rate.
// `moment_dtype`: Adam's moments' (optimizer.states: fp32, bf16 or int8
// (kInt8Block); bf16 and int8 moments are updated on the host, bf16 at the
// CPU rate scaled by the bytes the update moves, int8 at its kernel's).
Result<CapacityPlan> PlanCapacity(const ModelShape& model, const MachineSpec& machine,
                                  const Accumulation& accumulation = {}, DType moment_dtype = DType::kFloat32);
std::string FormatCapacityPlan(const CapacityPlan& plan);
std::string CapacityPlanJson(const CapacityPlan& plan);

}  // namespace strata::offload
