#include "strata/options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "src/base/alignment.h"
#include "src/base/strings.h"

namespace strata {
namespace {

Result<uint64_t> ParseUnsigned(std::string_view key, std::string_view text) {
  std::string trimmed = Trim(text);
  uint64_t value = 0;
  auto [end, error] = std::from_chars(trimmed.data(), trimmed.data() + trimmed.size(), value);
  if (error != std::errc() || end != trimmed.data() + trimmed.size() || trimmed.empty()) {
    return InvalidArgument("option {}: '{}' is not a non-negative integer", key, text);
  }
  return value;
}

Result<double> ParseDouble(std::string_view key, std::string_view text) {
  std::string trimmed = Trim(text);
  char* end = nullptr;
  double value = std::strtod(trimmed.c_str(), &end);
  if (trimmed.empty() || end != trimmed.c_str() + trimmed.size() || !std::isfinite(value)) {
    return InvalidArgument("option {}: '{}' is not a number", key, text);
  }
  return value;
}

Result<bool> ParseBool(std::string_view key, std::string_view text) {
  std::string trimmed = Trim(text);
  if (trimmed == "true" || trimmed == "1" || trimmed == "yes" || trimmed == "on") return true;
  if (trimmed == "false" || trimmed == "0" || trimmed == "no" || trimmed == "off") return false;
  return InvalidArgument("option {}: '{}' is not a boolean: expected true or false", key, text);
}

// Where a key's value lives in Options: a field, or a field of a section.
template <typename T>
struct Field {
  std::function<T&(Options&)> ref;
  T& operator()(Options& options) const { return ref(options); }
  T operator()(const Options& options) const { return ref(const_cast<Options&>(options)); }
};
template <typename T>
Field<T> In(T Options::*member) {
  return {[member](Options& o) -> T& { return o.*member; }};
}
template <typename Section, typename T>
Field<T> In(Section Options::*section, T Section::*member) {
  return {[section, member](Options& o) -> T& { return (o.*section).*member; }};
}

// A key of the table: its documentation, how to set it from text, how to read it back.
struct OptionEntry {
  OptionDoc doc;
  std::function<Status(Options&, std::string_view)> set;
  std::function<std::string(const Options&)> get;
};

OptionEntry SizeEntry(std::string key, std::string description, Field<size_t> field) {
  return {{key, "size", FormatSize(field(Options())), std::move(description)},
          [key, field](Options& options, std::string_view text) -> Status {
            Result<size_t> bytes = ParseSize(text);
            if (!bytes.ok()) return InvalidArgument("option {}: {}", key, bytes.status().message());
            field(options) = *bytes;
            return Status::Ok();
          },
          [field](const Options& options) { return FormatSize(field(options)); }};
}

// device.budget: a size, or auto (DeviceOptions::budget_auto).
OptionEntry DeviceBudgetEntry() {
  return {{"device.budget", "size or auto", "auto",
           "bytes of device memory strata may use for chunks; auto: on a GPU half the memory free when the engine "
           "starts, on the emulated device " + FormatSize(DeviceOptions().budget_bytes)},
          [](Options& options, std::string_view text) -> Status {
            if (text == "auto") {
              options.device.budget_auto = true;
              options.device.budget_bytes = DeviceOptions().budget_bytes;  // what auto is on the emulated device
              return Status::Ok();
            }
            Result<size_t> bytes = ParseSize(text);
            if (!bytes.ok()) {
              return InvalidArgument("option device.budget: {} (or auto)", bytes.status().message());
            }
            options.device.budget_bytes = *bytes;
            options.device.budget_auto = false;
            return Status::Ok();
          },
          [](const Options& options) {
            return options.device.budget_auto ? std::string("auto") : FormatSize(options.device.budget_bytes);
          }};
}

// host.budget: a size, or auto (HostOptions::budget_bytes 0).
OptionEntry HostBudgetEntry() {
  return {{"host.budget", "size or auto", "auto",
           "bytes of pinned host memory strata may use for chunks; auto: what the model's chunks need there (every "
           "chunk homed on the host, an eighth more and two of the largest), at most half the memory available "
           "when the engine is finalized (MemAvailable, or less under a cgroup limit); states beyond that go to "
           "nvme.dirs, or are refused naming both figures"},
          [](Options& options, std::string_view text) -> Status {
            if (Trim(text) == "auto") {
              options.host.budget_bytes = 0;
              return Status::Ok();
            }
            Result<size_t> bytes = ParseSize(text);
            if (!bytes.ok()) return InvalidArgument("option host.budget: {} (or auto)", bytes.status().message());
            options.host.budget_bytes = *bytes;
            return Status::Ok();
          },
          [](const Options& options) {
            return options.host.budget_bytes == 0 ? std::string("auto") : FormatSize(options.host.budget_bytes);
          }};
}

template <typename Int>
OptionEntry IntEntry(std::string key, std::string description, Field<Int> field, uint64_t min_value,
                     uint64_t max_value) {
  return {{key, "int", std::to_string(field(Options())), std::move(description)},
          [key, field, min_value, max_value](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(uint64_t value, ParseUnsigned(key, text));
            if (value < min_value || value > max_value) {
              return InvalidArgument("option {}: {} is out of range: allowed {}..{}", key, value, min_value,
                                     max_value);
            }
            field(options) = static_cast<Int>(value);
            return Status::Ok();
          },
          [field](const Options& options) { return std::to_string(field(options)); }};
}

OptionEntry BoolEntry(std::string key, std::string description, Field<bool> field) {
  return {{key, "bool", field(Options()) ? "true" : "false", std::move(description)},
          [key, field](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(field(options), ParseBool(key, text));
            return Status::Ok();
          },
          [field](const Options& options) { return std::string(field(options) ? "true" : "false"); }};
}

// A real number in [min_value, max_value]; `description` gives its meaning.
OptionEntry FloatEntry(std::string key, std::string description, Field<double> field, double min_value,
                       double max_value) {
  return {{key, "float", fmt::format("{}", field(Options())), std::move(description)},
          [key, field, min_value, max_value](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(double value, ParseDouble(key, text));
            if (value < min_value || value > max_value) {
              return InvalidArgument("option {}: {} is out of range: allowed {}..{}", key, value, min_value,
                                     max_value);
            }
            field(options) = value;
            return Status::Ok();
          },
          [field](const Options& options) { return fmt::format("{}", field(options)); }};
}

// One of the named values of an enum.
template <typename Enum>
using EnumNames = std::vector<std::pair<std::string, Enum>>;

template <typename Enum>
std::string NameOf(const EnumNames<Enum>& names, Enum value) {
  for (const auto& [name, v] : names) {
    if (v == value) return name;
  }
  return "?";
}

template <typename Enum>
OptionEntry ChoiceEntry(std::string key, std::string description, Field<Enum> field, EnumNames<Enum> names) {
  return {{key, "enum", NameOf(names, field(Options())), std::move(description)},
          [key, field, names](Options& options, std::string_view text) -> Status {
            const std::string value = Trim(text);
            for (const auto& [name, v] : names) {
              if (name == value) {
                field(options) = v;
                return Status::Ok();
              }
            }
            std::string list;
            for (const auto& [name, v] : names) list += (list.empty() ? "" : ", ") + name;
            return InvalidArgument("option {}: '{}' is not allowed: expected one of {}", key, text, list);
          },
          [field, names](const Options& options) { return NameOf(names, field(options)); }};
}

std::string JoinDirs(const std::vector<std::string>& dirs) {
  std::string joined;
  for (const std::string& dir : dirs) joined += (joined.empty() ? "" : ",") + dir;
  return joined;
}

using Table = std::vector<OptionEntry>;

void AddDeviceAndHostKeys(Table& t) {
  t.push_back(ChoiceEntry<DeviceBackendKind>(
      "device.backend", "device tier backend: auto (cuda when a GPU is visible, else emulated), emulated, cuda",
      In(&Options::device, &DeviceOptions::backend),
      {{"auto", DeviceBackendKind::kAuto},
       {"emulated", DeviceBackendKind::kEmulated},
       {"cuda", DeviceBackendKind::kCuda}}));
  t.push_back(IntEntry("device.index", "CUDA device ordinal", In(&Options::device, &DeviceOptions::index), 0, 1023));
  t.push_back(DeviceBudgetEntry());
  t.push_back(FloatEntry("device.emulated_bandwidth_gbps",
                         "emulated device only: copy bandwidth per direction in GB/s (10^9 bytes/s) imitating PCIe; "
                         "0 = unthrottled",
                         In(&Options::device, &DeviceOptions::emulated_bandwidth_gbps), 0, 1e9));
  t.push_back(IntEntry("device.copy_timeout_ms", "milliseconds a host<->device copy may take before it is a Timeout",
                       In(&Options::device, &DeviceOptions::copy_timeout_ms), 1, 86'400'000));
  t.push_back(HostBudgetEntry());
  t.push_back(BoolEntry("host.numa_local", "place host chunks on the NUMA node nearest the device (hwloc)",
                        In(&Options::host, &HostOptions::numa_local)));
  t.push_back(BoolEntry("host.huge_pages",
                        "back host buffers of 2MiB or more with transparent huge pages (fewer I/O segments)",
                        In(&Options::host, &HostOptions::huge_pages)));
}

void AddNvmeAndChunkKeys(Table& t) {
  const Field<std::vector<std::string>> dirs = In(&Options::nvme, &NvmeOptions::dirs);
  t.push_back({{"nvme.dirs", "list", "",
                "directories for the NVMe tier, one per drive, comma-separated (JSON: a list); empty = no NVMe tier"},
               [dirs](Options& o, std::string_view text) -> Status {
                 dirs(o).clear();
                 std::stringstream stream{std::string(text)};
                 std::string item;
                 while (std::getline(stream, item, ',')) {
                   item = Trim(item);
                   if (!item.empty()) dirs(o).push_back(item);
                 }
                 return Status::Ok();
               },
               [dirs](const Options& o) { return JoinDirs(dirs(o)); }});
  t.push_back(SizeEntry("nvme.capacity",
                        "bytes of NVMe space for chunks, all directories together (preallocated; the free space is "
                        "checked); 0 = what the model states need there: those homed on NVMe, an eighth more and three "
                        "of the largest chunks",
                        In(&Options::nvme, &NvmeOptions::capacity_bytes)));
  t.push_back(SizeEntry("nvme.block_size", "bytes per NVMe I/O request and stripe unit; a multiple of 4KiB",
                        In(&Options::nvme, &NvmeOptions::block_size_bytes)));
  t.push_back(IntEntry("nvme.queue_depth", "NVMe requests in flight per drive (directory)",
                       In(&Options::nvme, &NvmeOptions::queue_depth), 1, 4096));
  t.push_back(BoolEntry("nvme.allow_buffered_io",
                        "use buffered I/O (with a warning) where a filesystem refuses O_DIRECT, instead of failing",
                        In(&Options::nvme, &NvmeOptions::allow_buffered_io)));
  t.push_back(BoolEntry("nvme.sqpoll",
                        "a kernel thread polls each io_uring submission queue (IORING_SETUP_SQPOLL); falls back "
                        "with a warning where refused",
                        In(&Options::nvme, &NvmeOptions::sqpoll)));
  t.push_back(IntEntry("nvme.io_timeout_ms", "milliseconds one NVMe read or write may take before it is a Timeout",
                       In(&Options::nvme, &NvmeOptions::io_timeout_ms), 1, 86'400'000));
  t.push_back(IntEntry("chunk.size_elems", "elements per chunk; 0 = search for least padding waste",
                       In(&Options::chunk, &ChunkOptions::size_elems), 0, uint64_t{1} << 34));
  t.push_back(IntEntry("chunk.search_min_elems",
                       "smallest chunk size the search tries, in elements; 0 = a 64th of the largest, at most 1Mi "
                       "and at most the model",
                       In(&Options::chunk, &ChunkOptions::search_min_elems), 0, uint64_t{1} << 34));
  t.push_back(IntEntry("chunk.search_max_elems",
                       "largest chunk size the search tries, in elements; 0 = what lets device.budget hold six param "
                       "and grad chunks (beside the largest tensor's) and host.budget four chunk groups, at most 64Mi",
                       In(&Options::chunk, &ChunkOptions::search_max_elems), 0, uint64_t{1} << 34));
  const Field<DType> precision = In(&Options::compute_dtype);
  t.push_back({{"precision", "enum", "fp32", "compute dtype of param and grad chunks: fp32, bf16 or fp16"},
               [precision](Options& o, std::string_view text) -> Status {
                 Result<DType> dtype = ParseDType(Trim(text));
                 if (!dtype.ok()) return InvalidArgument("option precision: {}", dtype.status().message());
                 precision(o) = *dtype;
                 return Status::Ok();
               },
               [precision](const Options& o) { return std::string(DTypeName(precision(o))); }});
}

OptionEntry NoDecayEntry(Field<NoDecayRules> rules) {
  const auto describe = [](const NoDecayRules& r) {
    return std::string(r.bias && r.norm ? "bias,norm" : r.bias ? "bias" : r.norm ? "norm" : "");
  };
  return {{"optimizer.no_decay", "list", "",
           "trainable parameters put in a param group without weight decay, comma-separated (JSON: a list): bias "
           "(names containing 'bias'), norm (parameters of LayerNorm modules, or named like layernorm, rmsnorm, "
           "norm, _norm); both is the Hugging Face Trainer's rule; empty = every parameter decays"},
          [rules](Options& o, std::string_view text) -> Status {
            NoDecayRules parsed;
            std::stringstream stream{std::string(text)};
            std::string item;
            while (std::getline(stream, item, ',')) {
              item = Trim(item);
              if (item == "bias") {
                parsed.bias = true;
              } else if (item == "norm") {
                parsed.norm = true;
              } else if (!item.empty()) {
                return InvalidArgument("option optimizer.no_decay: '{}' is not allowed: expected a list of bias, norm",
                                       item);
              }
            }
            rules(o) = parsed;
            return Status::Ok();
          },
          [rules, describe](const Options& o) { return describe(rules(o)); }};
}

void AddOptimizerKeys(Table& t) {
  const auto field = [](auto member) { return In(&Options::optimizer, member); };
  t.push_back(ChoiceEntry<OptimizerKind>(
      "optimizer.kind",
      "adamw (decoupled weight decay), adam (L2 weight decay in the gradient) or sgd (momentum, dampening, nesterov)",
      field(&OptimizerOptions::kind),
      {{"adamw", OptimizerKind::kAdamW}, {"adam", OptimizerKind::kAdam}, {"sgd", OptimizerKind::kSgd}}));
  t.push_back(FloatEntry("optimizer.lr", "learning rate", field(&OptimizerOptions::lr), 0, 1e9));
  t.push_back(FloatEntry("optimizer.beta1", "Adam: decay of the first moment, in [0, 1)",
                         field(&OptimizerOptions::beta1), 0, 0.999999999));
  t.push_back(FloatEntry("optimizer.beta2", "Adam: decay of the second moment, in [0, 1)",
                         field(&OptimizerOptions::beta2), 0, 0.999999999));
  t.push_back(FloatEntry("optimizer.eps", "Adam: added to the denominator, > 0", field(&OptimizerOptions::eps), 1e-30,
                         1));
  t.push_back(FloatEntry("optimizer.weight_decay",
                         "weight decay: decoupled for adamw (w -= lr * wd * w), added to the gradient for adam and sgd",
                         field(&OptimizerOptions::weight_decay), 0, 1e9));
  t.push_back(FloatEntry("optimizer.momentum", "SGD: momentum; 0 keeps no state", field(&OptimizerOptions::momentum),
                         0, 1e9));
  t.push_back(FloatEntry("optimizer.dampening", "SGD: dampening of the momentum, in [0, 1]",
                         field(&OptimizerOptions::dampening), 0, 1));
  t.push_back(BoolEntry("optimizer.nesterov", "SGD: Nesterov momentum (needs momentum > 0, dampening 0)",
                        field(&OptimizerOptions::nesterov)));
  t.push_back(FloatEntry("optimizer.max_grad_norm",
                         "clip the global L2 norm of the unscaled gradients to this; 0 = no clipping",
                         field(&OptimizerOptions::max_grad_norm), 0, 1e30));
  t.push_back(ChoiceEntry<DType>(
      "optimizer.states",
      "the moments' dtype (Adam's exp_avg and exp_avg_sq, SGD's momentum): fp32; bf16 (2 bytes each, updated in "
      "fp32 and rounded once as stored); or int8 (Adam and AdamW: torchao's AdamW8bit, 8-bit codes in blocks of 256 "
      "with an fp32 scale each, tensors under 4096 elements or not in whole blocks in fp32; one rank). bf16 and int8 "
      "update on the host",
      field(&OptimizerOptions::state_dtype),
      {{"fp32", DType::kFloat32}, {"bf16", DType::kBFloat16}, {"int8", DType::kInt8Block}}));
  t.push_back(NoDecayEntry(field(&OptimizerOptions::no_decay)));
  t.push_back(SizeEntry("optimizer.stream_ring",
                        "bytes of host memory that NVMe-resident optimizer states stream through (at least two "
                        "chunk groups' master and states)",
                        field(&OptimizerOptions::stream_ring_bytes)));
  t.push_back(SizeEntry("optimizer.overlap",
                        "bytes of host memory for overlapped updates: each keeps a copy of its chunk "
                        "group until the step confirms it (redone after a clip or an overflow); 0 = every update "
                        "after backward",
                        field(&OptimizerOptions::overlap_bytes)));
}

void AddPlacementAndLossScaleKeys(Table& t) {
  t.push_back(ChoiceEntry<PlacementPolicy>(
      "placement.policy",
      "adaptive (homes by size; the planner moves chunks from a recorded warm-up iteration) or static (the fixed "
      "shares below; no planning)",
      In(&Options::placement, &PlacementOptions::policy),
      {{"adaptive", PlacementPolicy::kAdaptive}, {"static", PlacementPolicy::kStatic}}));
  t.push_back(FloatEntry("placement.device_params",
                         "static policy: share of the param and grad chunks (bytes, in model order) kept on the "
                         "device for the whole run, 0..1; the rest move on demand",
                         In(&Options::placement, &PlacementOptions::device_params), 0, 1));
  t.push_back(FloatEntry("placement.host_states",
                         "static policy: share of the optimizer-state chunks (bytes, in model order) homed in host "
                         "memory, 0..1; the rest on NVMe",
                         In(&Options::placement, &PlacementOptions::host_states), 0, 1));
  const auto field = [](auto member) { return In(&Options::loss_scale, member); };
  t.push_back(ChoiceEntry<LossScaleMode>(
      "loss_scale.mode", "auto (dynamic when precision is fp16, else off), dynamic or off",
      field(&LossScaleOptions::mode),
      {{"auto", LossScaleMode::kAuto}, {"dynamic", LossScaleMode::kDynamic}, {"off", LossScaleMode::kOff}}));
  t.push_back(FloatEntry("loss_scale.init", "first loss scale", field(&LossScaleOptions::init), 1e-30, 1e30));
  t.push_back(FloatEntry("loss_scale.growth_factor", "the scale grows by this after growth_interval good steps, > 1",
                         field(&LossScaleOptions::growth_factor), 1, 1e9));
  t.push_back(FloatEntry("loss_scale.backoff_factor", "the scale shrinks by this on an inf/NaN gradient, in (0, 1)",
                         field(&LossScaleOptions::backoff_factor), 0, 1));
  t.push_back(IntEntry("loss_scale.growth_interval", "good steps in a row before the scale grows",
                       field(&LossScaleOptions::growth_interval), 1, 1'000'000'000));
  t.push_back(FloatEntry("loss_scale.min", "the scale never backs off below this, > 0", field(&LossScaleOptions::min),
                         1e-30, 1e30));
  t.push_back(FloatEntry("loss_scale.max", "the scale never grows above this", field(&LossScaleOptions::max), 1e-30,
                         1e30));
}

void AddCommAndRuntimeKeys(Table& t) {
  const auto field = [](auto member) { return In(&Options::comm, member); };
  t.push_back(IntEntry("comm.timeout_ms",
                       "data parallel: milliseconds a collective may wait for its ranks before it is a Timeout on "
                       "every rank (a rank that died or hangs)",
                       field(&DataParallelOptions::timeout_ms), 1, 86'400'000));
  t.push_back(BoolEntry("comm.shard_params",
                        "data parallel: each rank keeps 1/W of the parameters, frozen ones too (ZeRO-3); a param chunk "
                        "is all-gathered when compute needs it, in forward and again in backward, instead of once "
                        "after the update (fp32: 3 x parameter bytes x (W-1)/W a step instead of 2 x), and the "
                        "parameters take 1/W of each rank's host and NVMe memory",
                        field(&DataParallelOptions::shard_params)));
  t.push_back(ChoiceEntry<CommBackendKind>(
      "comm.backend",
      "data parallel: what carries the collectives: auto (NCCL when the device is a GPU and there are several ranks, "
      "else host), host (MPI under mpirun, torch.distributed's gloo under torchrun; host buffers) or nccl (one GPU "
      "per rank, bootstrapped by the host backend; also with a single rank)",
      field(&DataParallelOptions::backend),
      {{"auto", CommBackendKind::kAuto}, {"host", CommBackendKind::kHost}, {"nccl", CommBackendKind::kNccl}}));
  t.push_back(ChoiceEntry<ReduceDType>(
      "comm.reduce_dtype",
      "data parallel: the dtype gradients are reduce-scattered in: grad (the grad chunk's, the compute dtype; 16-bit "
      "sums are rounded, fp16 ones may overflow into a skipped step) or fp32 (exact sums, twice the bytes under bf16 "
      "or fp16)",
      field(&DataParallelOptions::reduce_dtype), {{"grad", ReduceDType::kGrad}, {"fp32", ReduceDType::kFloat32}}));
  t.push_back(IntEntry("transfer.workers", "threads running asynchronous chunk moves", In(&Options::transfer_workers),
                       1, 64));
  // "warn" as STRATA_LOG_LEVEL takes it; named "warning".
  t.push_back(ChoiceEntry<LogLevel>("log.level", "debug, info, warning, error or off", In(&Options::log_level),
                                    {{"debug", LogLevel::kDebug},
                                     {"info", LogLevel::kInfo},
                                     {"warning", LogLevel::kWarning},
                                     {"warn", LogLevel::kWarning},
                                     {"error", LogLevel::kError},
                                     {"off", LogLevel::kOff}}));
}

// Every key, in the order `strata options` and docs/options.md list them.
const Table& AllKeys() {
  static const Table table = [] {
    Table t;
    AddDeviceAndHostKeys(t);
    AddNvmeAndChunkKeys(t);
    AddOptimizerKeys(t);
    AddPlacementAndLossScaleKeys(t);
    AddCommAndRuntimeKeys(t);
    return t;
  }();
  return table;
}

std::string KnownKeys() {
  std::string keys;
  for (const OptionEntry& entry : AllKeys()) keys += (keys.empty() ? "" : ", ") + entry.doc.key;
  return keys;
}

Status ApplyJsonValue(Options& options, const std::string& key, const nlohmann::json& value) {
  if (value.is_object()) {
    for (const auto& [child, child_value] : value.items()) {
      STRATA_RETURN_IF_ERROR(ApplyJsonValue(options, key.empty() ? child : key + "." + child, child_value));
    }
    return Status::Ok();
  }
  if (value.is_array()) {
    std::string joined;
    for (const nlohmann::json& item : value) {
      if (!item.is_string()) return InvalidArgument("option {}: list items must be strings, got {}", key, item.dump());
      joined += (joined.empty() ? "" : ",") + item.get<std::string>();
    }
    return SetOption(options, key, joined);
  }
  if (value.is_string()) return SetOption(options, key, value.get<std::string>());
  if (value.is_boolean() || value.is_number()) return SetOption(options, key, value.dump());
  return InvalidArgument("option {}: value {} has an unsupported JSON type", key, value.dump());
}

// Note [Validating set fields]
// SetOption bounds each key as it parses it, but C++ callers set the fields
// directly. Every key's value is therefore read back through the table and
// set again on a scratch copy: a value out of the key's range, or one that is
// not finite, is refused with the same message SetOption gives. The text
// forms round-trip exactly (fmt prints the shortest form that reads back).
Status CheckEachKey(const Options& options) {
  Options scratch;
  for (const OptionEntry& entry : AllKeys()) STRATA_RETURN_IF_ERROR(entry.set(scratch, entry.get(options)));
  return Status::Ok();
}

Status CheckTierRelations(const Options& options) {
  if (options.nvme.block_size_bytes == 0 || options.nvme.block_size_bytes % kIoAlignmentBytes != 0) {
    return InvalidArgument("option nvme.block_size: {} bytes is not allowed: expected a positive multiple of 4KiB",
                           options.nvme.block_size_bytes);
  }
  if (options.device.budget_bytes == 0) {
    return InvalidArgument("option device.budget: 0 is not allowed: the device tier needs room for at least one chunk");
  }
  if (options.chunk.search_max_elems > 0 && options.chunk.search_min_elems > options.chunk.search_max_elems) {
    return InvalidArgument("option chunk.search_min_elems: {} exceeds chunk.search_max_elems {}",
                           options.chunk.search_min_elems, options.chunk.search_max_elems);
  }
  if (options.optimizer.stream_ring_bytes == 0) {
    return InvalidArgument("option optimizer.stream_ring: 0 is not allowed: the ring holds at least two chunk groups");
  }
  return Status::Ok();
}

Status CheckOptimizerRelations(const OptimizerOptions& optimizer) {
  if (optimizer.kind == OptimizerKind::kSgd && optimizer.nesterov &&
      (optimizer.momentum <= 0 || optimizer.dampening != 0)) {
    return InvalidArgument("option optimizer.nesterov: needs momentum > 0 (got {}) and dampening 0 (got {})",
                           optimizer.momentum, optimizer.dampening);
  }
  if (optimizer.kind == OptimizerKind::kSgd && optimizer.state_dtype == DType::kInt8Block) {
    return InvalidArgument("option optimizer.states: int8 is for adam and adamw (8-bit moments); sgd keeps fp32 or "
                           "bf16 momentum");
  }
  return Status::Ok();
}

// Checked even where scaling is off, so that a bad key is found before a run
// that turns scaling on; in fp32, as the loss scaler holds them, so that a
// factor a hair from 1 is not accepted here and refused by the scaler.
Status CheckLossScaleRelations(const LossScaleOptions& scale) {
  const float growth = static_cast<float>(scale.growth_factor);
  const float backoff = static_cast<float>(scale.backoff_factor);
  if (!(growth > 1.0f && backoff > 0.0f && backoff < 1.0f)) {
    return InvalidArgument(
        "options loss_scale.growth_factor, loss_scale.backoff_factor: need growth_factor > 1 (got {}) and "
        "backoff_factor in (0, 1) (got {}), in fp32",
        scale.growth_factor, scale.backoff_factor);
  }
  const float min = static_cast<float>(scale.min), init = static_cast<float>(scale.init);
  if (!(min > 0.0f && min <= init && init <= static_cast<float>(scale.max))) {
    return InvalidArgument(
        "options loss_scale.min, loss_scale.init, loss_scale.max: need 0 < min ({}) <= init ({}) <= max ({})",
        scale.min, scale.init, scale.max);
  }
  return Status::Ok();
}

}  // namespace

const std::vector<OptionDoc>& OptionDocs() {
  static const std::vector<OptionDoc> docs = [] {
    std::vector<OptionDoc> d;
    for (const OptionEntry& entry : AllKeys()) d.push_back(entry.doc);
    return d;
  }();
  return docs;
}

Status SetOption(Options& options, std::string_view key, std::string_view value) {
  for (const OptionEntry& entry : AllKeys()) {
    if (entry.doc.key == key) return entry.set(options, value);
  }
  return InvalidArgument("unknown option '{}': known options are {}", key, KnownKeys());
}

Status ApplyOptionsJson(Options& options, std::string_view json_text) {
  nlohmann::json document = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded()) return InvalidArgument("options: the text is not valid JSON");
  if (!document.is_object()) return InvalidArgument("options: expected a JSON object, got {}", document.type_name());
  return ApplyJsonValue(options, "", document);
}

Status ApplyOptionsFile(Options& options, const std::string& path) {
  std::ifstream file(path);
  if (!file) return IoError("options file {}: cannot open it: {}", path, std::strerror(errno));
  std::stringstream text;
  text << file.rdbuf();
  return ApplyOptionsJson(options, text.str()).WithContext(fmt::format("options file {}", path));
}

Status ValidateOptions(const Options& options) {
  STRATA_RETURN_IF_ERROR(CheckEachKey(options));
  STRATA_RETURN_IF_ERROR(CheckTierRelations(options));
  STRATA_RETURN_IF_ERROR(CheckOptimizerRelations(options.optimizer));
  return CheckLossScaleRelations(options.loss_scale);
}

uint32_t EngineWaitTimeoutMs(const Options& options) {
  return std::max(options.device.copy_timeout_ms, options.nvme.io_timeout_ms);
}

std::vector<std::pair<std::string, std::string>> DescribeOptions(const Options& options) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const OptionEntry& entry : AllKeys()) values.emplace_back(entry.doc.key, entry.get(options));
  return values;
}

}  // namespace strata
