// Options: every setting of the engine, with its unit and default, in one
// struct. Load from JSON (nested objects or dotted keys), override single keys
// from the command line, and validate. A bad key or value is InvalidArgument
// naming the key, the value and what is allowed.
//
// `strata options` prints the table of keys below (OptionDocs()).
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

enum class LogLevel : uint8_t { kDebug, kInfo, kWarning, kError, kOff };

struct Options {
  // --- device tier -------------------------------------------------------
  DeviceBackendKind device_backend = DeviceBackendKind::kAuto;  // key device.backend
  int cuda_device_index = 0;                                     // key device.index
  size_t device_budget_bytes = size_t{1} << 30;                  // key device.budget
  // Imitates a PCIe link on the emulated device; 0 = copy at memory speed.
  double device_emulated_bandwidth_gbps = 0.0;  // key device.emulated_bandwidth_gbps
  uint32_t device_copy_timeout_ms = 60'000;     // key device.copy_timeout_ms

  // --- host tier ---------------------------------------------------------
  size_t host_budget_bytes = size_t{4} << 30;  // key host.budget
  bool host_numa_local = true;                 // key host.numa_local
  bool host_huge_pages = true;                 // key host.huge_pages

  // --- nvme tier ---------------------------------------------------------
  // Directories (one per drive); slots are striped across them. Empty: no NVMe tier.
  std::vector<std::string> nvme_dirs;              // key nvme.dirs
  size_t nvme_capacity_bytes = size_t{8} << 30;    // key nvme.capacity (all dirs together)
  size_t nvme_block_size_bytes = size_t{1} << 20;  // key nvme.block_size (one I/O request)
  uint32_t nvme_queue_depth = 32;                  // key nvme.queue_depth
  bool nvme_allow_buffered_io = false;             // key nvme.allow_buffered_io
  uint32_t nvme_io_timeout_ms = 30'000;            // key nvme.io_timeout_ms
  bool nvme_sqpoll = false;                        // key nvme.sqpoll

  // --- chunks ------------------------------------------------------------
  size_t chunk_size_elems = 0;                    // key chunk.size_elems; 0 = search
  size_t chunk_search_min_elems = size_t{1} << 20;  // key chunk.search_min_elems
  size_t chunk_search_max_elems = size_t{1} << 26;  // key chunk.search_max_elems
  DType compute_dtype = DType::kFloat32;          // key precision

  // --- optimizer (optim/optimizer.h; OptimizerConfigFromOptions) ----------
  std::string optimizer_kind = "adamw";   // key optimizer.kind: adamw, adam (L2 decay) or sgd
  double optimizer_lr = 1e-3;             // key optimizer.lr
  double optimizer_beta1 = 0.9;           // key optimizer.beta1 (Adam)
  double optimizer_beta2 = 0.999;         // key optimizer.beta2 (Adam)
  double optimizer_eps = 1e-8;            // key optimizer.eps (Adam)
  double optimizer_weight_decay = 0.0;    // key optimizer.weight_decay
  double optimizer_momentum = 0.0;        // key optimizer.momentum (SGD)
  double optimizer_dampening = 0.0;       // key optimizer.dampening (SGD)
  bool optimizer_nesterov = false;        // key optimizer.nesterov (SGD)
  double optimizer_max_grad_norm = 0.0;   // key optimizer.max_grad_norm; 0 = no clipping
  // Host memory of the ring NVMe-resident states stream through.
  size_t optimizer_stream_ring_bytes = size_t{512} << 20;  // key optimizer.stream_ring
  // --- loss scaling (optim/loss_scaler.h) -------------------------------
  std::string loss_scale_mode = "auto";         // key loss_scale.mode: auto (dynamic for fp16), dynamic, off
  double loss_scale_init = 65536.0;             // key loss_scale.init
  double loss_scale_growth_factor = 2.0;        // key loss_scale.growth_factor
  double loss_scale_backoff_factor = 0.5;       // key loss_scale.backoff_factor
  uint32_t loss_scale_growth_interval = 2000;   // key loss_scale.growth_interval (good steps)
  double loss_scale_min = 1.0;                  // key loss_scale.min
  double loss_scale_max = 16777216.0;           // key loss_scale.max
  // --- placement (offload/pipeline.h, Engine::Finalize) -------------------
  // adaptive: homes by size (params and grads first), the planner moves
  // chunks from the warm-up trace. static: fixed fractions, no planning.
  std::string placement_policy = "adaptive";  // key placement.policy: adaptive or static
  double placement_device_params = 0.5;       // key placement.device_params (static): share of param+grad chunks kept on the device
  double placement_host_states = 1.0;         // key placement.host_states (static): share of optimizer states homed on the host
  // --- data parallelism (strata/comm.h) ----------------------------------
  // A collective waiting longer than this for its ranks (one died) is a Timeout on every rank that waited.
  uint32_t comm_timeout_ms = 60'000;  // key comm.timeout_ms
  // ZeRO-3: each rank keeps 1/W of the parameters too (as its fp32 master
  // shard; a frozen one's in its own dtype); a param chunk is all-gathered when compute needs it and
  // dropped when evicted. Off: every rank keeps every parameter, gathered
  // once after the update (2/3 of ZeRO-3's volume in fp32).
  bool comm_shard_params = false;  // key comm.shard_params
  // What carries the collectives (chosen by the launcher's adapter,
  // python/strata/distributed.py): auto, host or nccl.
  std::string comm_backend = "auto";  // key comm.backend: auto, host or nccl
  // The dtype gradients are reduce-scattered in: grad (the grad chunk's, the
  // compute dtype: ZeRO's volume) or fp32 (twice the bytes under bf16/fp16,
  // the sums unrounded). 16-bit sums round; fp16 sums can overflow where
  // their mean would not (the loss scaler then skips the step).
  std::string comm_reduce_dtype = "grad";  // key comm.reduce_dtype: grad or fp32
  // --- runtime -----------------------------------------------------------
  uint32_t transfer_workers = 2;  // key transfer.workers: threads running asynchronous moves
  LogLevel log_level = LogLevel::kInfo;  // key log.level
};

// One documented key: for `strata options`, the README and error messages.
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

// The current value of every key, as text, in OptionDocs() order.
std::vector<std::pair<std::string, std::string>> DescribeOptions(const Options& options);

// "64MiB", "1.5GiB", "4096", "2GB" -> bytes. Binary (KiB, MiB, GiB, TiB) and
// decimal (KB, MB, GB, TB) suffixes; plain numbers are bytes.
Result<size_t> ParseSize(std::string_view text);
// 1536 -> "1.5KiB".
std::string FormatSize(size_t bytes);

}  // namespace strata
