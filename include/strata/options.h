// Options: every setting of the engine, with its unit and default, in one
// struct. Load from JSON (nested objects or dotted keys), override single keys
// from the command line, and validate. A bad key or value is InvalidArgument
// naming the key, the value and what is allowed.
//
// OptionDocs() is the table of keys below.
// Value types; thread-safe to copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"
#include "strata/types.h"

namespace strata {

enum class DeviceBackendKind : uint8_t {
  kAuto,      // CUDA when built with it and a GPU is present, else emulated
  kEmulated,  // host memory standing in for HBM
  kCuda,
};
enum class OptimizerKind : uint8_t { kAdamW, kAdam, kSgd };
enum class LossScaleMode : uint8_t { kAuto, kDynamic, kOff };  // auto: dynamic for fp16, else off
enum class PlacementPolicy : uint8_t { kAdaptive, kStatic };
enum class CommBackendKind : uint8_t { kAuto, kHost, kNccl };
enum class ReduceDType : uint8_t { kGrad, kFloat32 };  // the grad chunk's dtype, or fp32

// One struct per section of keys; the key of each field is in its comment.
struct DeviceOptions {
  DeviceBackendKind backend = DeviceBackendKind::kAuto;  // device.backend
  int index = 0;                                         // device.index (CUDA ordinal)
  // device.budget: a size, or auto (budget_auto): on a GPU, half the memory
  // free as the engine starts (the rest for activations, workspaces and the
  // framework's allocator); on the emulated device, budget_bytes. Engine
  // options() hold the budget it took, with budget_auto false.
  size_t budget_bytes = size_t{1} << 30;
  bool budget_auto = true;
  double emulated_bandwidth_gbps = 0.0;                  // device.emulated_bandwidth_gbps; 0 = memory speed
  uint32_t copy_timeout_ms = 60'000;                     // device.copy_timeout_ms
};

struct HostOptions {
  // host.budget: a size, or 0 (auto): what the model's chunks need, at most
  // half the memory available as the engine is finalized (Note [Host budget
  // auto] in memory/engine.cc). Engine options() hold the budget it took
  // once finalized.
  size_t budget_bytes = 0;
  bool numa_local = true;  // host.numa_local
  bool huge_pages = true;  // host.huge_pages
};

struct NvmeOptions {
  std::vector<std::string> dirs;              // nvme.dirs: one per drive, striped; empty = no NVMe tier
  size_t capacity_bytes = 0;                  // nvme.capacity, all dirs together; 0 = what the model states need
  size_t block_size_bytes = size_t{1} << 20;  // nvme.block_size: one I/O request
  uint32_t queue_depth = 32;                  // nvme.queue_depth
  bool allow_buffered_io = false;             // nvme.allow_buffered_io
  uint32_t io_timeout_ms = 30'000;            // nvme.io_timeout_ms
  bool sqpoll = false;                        // nvme.sqpoll
};

struct ChunkOptions {
  size_t size_elems = 0;                       // chunk.size_elems; 0 = search
  size_t search_min_elems = 0;                 // chunk.search_min_elems; 0 = from the budgets and the model
  size_t search_max_elems = 0;                 // chunk.search_max_elems; 0 = from the budgets and the model
};

// Trainable parameters given no weight decay (a param group of their own):
// biases, and norm layers' parameters (both: the Hugging Face Trainer's rule).
struct NoDecayRules {
  bool bias = false;
  bool norm = false;
};

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;  // optimizer.kind
  double lr = 1e-3;                            // optimizer.lr
  double beta1 = 0.9;                          // optimizer.beta1 (Adam)
  double beta2 = 0.999;                        // optimizer.beta2 (Adam)
  double eps = 1e-8;                           // optimizer.eps (Adam)
  double weight_decay = 0.0;                   // optimizer.weight_decay
  double momentum = 0.0;                       // optimizer.momentum (SGD)
  double dampening = 0.0;                      // optimizer.dampening (SGD)
  bool nesterov = false;                       // optimizer.nesterov (SGD)
  double max_grad_norm = 0.0;                  // optimizer.max_grad_norm; 0 = no clipping
  // optimizer.states: the dtype of the moments (Adam's exp_avg and
  // exp_avg_sq, SGD's momentum buffer): fp32 or bf16.
  DType state_dtype = DType::kFloat32;
  NoDecayRules no_decay;                       // optimizer.no_decay: a list of bias, norm
  size_t stream_ring_bytes = size_t{512} << 20;  // optimizer.stream_ring: host ring NVMe states stream through
  // optimizer.overlap: host memory for the copies kept by updates begun
  // beside backward until the step confirms them; 0 = every update after backward.
  size_t overlap_bytes = 0;
};

struct LossScaleOptions {
  LossScaleMode mode = LossScaleMode::kAuto;  // loss_scale.mode
  double init = 65536.0;                      // loss_scale.init
  double growth_factor = 2.0;                 // loss_scale.growth_factor
  double backoff_factor = 0.5;                // loss_scale.backoff_factor
  uint32_t growth_interval = 2000;            // loss_scale.growth_interval (good steps)
  double min = 1.0;                           // loss_scale.min
  double max = 16777216.0;                    // loss_scale.max
};

struct PlacementOptions {
  PlacementPolicy policy = PlacementPolicy::kAdaptive;  // placement.policy
  double device_params = 0.5;  // placement.device_params (static): share of param+grad chunks kept on the device
  double host_states = 1.0;    // placement.host_states (static): share of optimizer states homed on the host
};

struct DataParallelOptions {
  uint32_t timeout_ms = 60'000;                  // comm.timeout_ms
  bool shard_params = false;                     // comm.shard_params (ZeRO-3)
  CommBackendKind backend = CommBackendKind::kAuto;  // comm.backend
  ReduceDType reduce_dtype = ReduceDType::kGrad;     // comm.reduce_dtype
};

// Every setting of the engine. The meaning, unit and allowed values of each
// key are in OptionDocs().
struct Options {
  DeviceOptions device;
  HostOptions host;
  NvmeOptions nvme;
  ChunkOptions chunk;
  DType compute_dtype = DType::kFloat32;  // precision
  OptimizerOptions optimizer;
  LossScaleOptions loss_scale;
  PlacementOptions placement;
  DataParallelOptions comm;
  uint32_t transfer_workers = 2;         // transfer.workers: threads running asynchronous moves
  LogLevel log_level = LogLevel::kInfo;  // log.level
};

// One documented key: for `strata options`, docs/options.md (generated from it) and error messages.
struct OptionDoc {
  std::string key;
  std::string type;           // "size", "int", "float", "bool", "string", "list", "enum"
  std::string default_value;  // as text
  std::string description;    // includes the unit and the allowed values
};
const std::vector<OptionDoc>& OptionDocs();

// Sets one key from its text form ("64MiB", "true", "a,b,c"). Unknown key or
// bad value: InvalidArgument naming both and what is allowed.
Status SetOption(Options& options, std::string_view key, std::string_view value);

// Applies every key of a JSON document (text). Nested objects and dotted keys
// both work: {"device": {"budget": "1GiB"}} == {"device.budget": "1GiB"}.
Status ApplyOptionsJson(Options& options, std::string_view json_text);
Status ApplyOptionsFile(Options& options, const std::string& path);

// Checks relations between keys (e.g. block size a multiple of 4096).
Status ValidateOptions(const Options& options);

// The longest one of the engine's waits for a move may take before it is a
// Timeout: the larger of device.copy_timeout_ms and nvme.io_timeout_ms.
uint32_t EngineWaitTimeoutMs(const Options& options);

// The current value of every key, as text, in OptionDocs() order.
std::vector<std::pair<std::string, std::string>> DescribeOptions(const Options& options);

}  // namespace strata
