#include "strata/options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "strata/logging.h"

namespace strata {
namespace {

// Smallest unit of NVMe I/O: O_DIRECT needs offsets and sizes aligned to the
// logical block, and 4096 covers every drive in use today.
constexpr size_t kIoAlignmentBytes = 4096;

std::string Trim(std::string_view text) {
  size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return std::string(text.substr(begin, end - begin));
}

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

// A key of the table: its documentation, how to set it from text, how to read it back.
struct OptionEntry {
  OptionDoc doc;
  std::function<Status(Options&, std::string_view)> set;
  std::function<std::string(const Options&)> get;
};

OptionEntry SizeEntry(std::string key, std::string description, size_t Options::*field) {
  std::string default_text = FormatSize(Options().*field);
  return {{key, "size", default_text, std::move(description)},
          [key, field](Options& options, std::string_view text) -> Status {
            Result<size_t> bytes = ParseSize(text);
            if (!bytes.ok()) return InvalidArgument("option {}: {}", key, bytes.status().message());
            options.*field = *bytes;
            return Status::Ok();
          },
          [field](const Options& options) { return FormatSize(options.*field); }};
}

template <typename Int>
OptionEntry IntEntry(std::string key, std::string description, Int Options::*field, uint64_t min_value,
                     uint64_t max_value) {
  return {{key, "int", std::to_string(Options().*field), std::move(description)},
          [key, field, min_value, max_value](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(uint64_t value, ParseUnsigned(key, text));
            if (value < min_value || value > max_value) {
              return InvalidArgument("option {}: {} is out of range: allowed {}..{}", key, value, min_value,
                                     max_value);
            }
            options.*field = static_cast<Int>(value);
            return Status::Ok();
          },
          [field](const Options& options) { return std::to_string(options.*field); }};
}

OptionEntry BoolEntry(std::string key, std::string description, bool Options::*field) {
  return {{key, "bool", Options().*field ? "true" : "false", std::move(description)},
          [key, field](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(options.*field, ParseBool(key, text));
            return Status::Ok();
          },
          [field](const Options& options) { return std::string(options.*field ? "true" : "false"); }};
}

// A real number in [min_value, max_value]; `description` gives its meaning.
OptionEntry FloatEntry(std::string key, std::string description, double Options::*field, double min_value,
                       double max_value) {
  return {{key, "float", fmt::format("{}", Options().*field), std::move(description)},
          [key, field, min_value, max_value](Options& options, std::string_view text) -> Status {
            STRATA_ASSIGN_OR_RETURN(double value, ParseDouble(key, text));
            if (value < min_value || value > max_value) {
              return InvalidArgument("option {}: {} is out of range: allowed {}..{}", key, value, min_value,
                                     max_value);
            }
            options.*field = value;
            return Status::Ok();
          },
          [field](const Options& options) { return fmt::format("{}", options.*field); }};
}

// One of `allowed` (comma-separated in the text of the error).
OptionEntry ChoiceEntry(std::string key, std::string description, std::string Options::*field,
                        std::vector<std::string> allowed) {
  return {{key, "enum", Options().*field, std::move(description)},
          [key, field, allowed](Options& options, std::string_view text) -> Status {
            const std::string value = Trim(text);
            if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
              std::string list;
              for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
              return InvalidArgument("option {}: '{}' is not allowed: expected one of {}", key, text, list);
            }
            options.*field = value;
            return Status::Ok();
          },
          [field](const Options& options) { return options.*field; }};
}

std::string_view BackendName(DeviceBackendKind kind) {
  switch (kind) {
    case DeviceBackendKind::kAuto: return "auto";
    case DeviceBackendKind::kEmulated: return "emulated";
    case DeviceBackendKind::kCuda: return "cuda";
  }
  return "?";
}

std::string JoinDirs(const std::vector<std::string>& dirs) {
  std::string joined;
  for (const std::string& dir : dirs) joined += (joined.empty() ? "" : ",") + dir;
  return joined;
}

const std::vector<OptionEntry>& Table() {
  static const std::vector<OptionEntry> table = [] {
    std::vector<OptionEntry> t;
    t.push_back({{"device.backend", "enum", "auto",
                  "device tier backend: auto (cuda when a GPU is visible, else emulated), emulated, cuda"},
                 [](Options& o, std::string_view text) -> Status {
                   std::string v = Trim(text);
                   if (v == "auto") o.device_backend = DeviceBackendKind::kAuto;
                   else if (v == "emulated") o.device_backend = DeviceBackendKind::kEmulated;
                   else if (v == "cuda") o.device_backend = DeviceBackendKind::kCuda;
                   else return InvalidArgument("option device.backend: '{}' is not allowed: expected auto, emulated or cuda", text);
                   return Status::Ok();
                 },
                 [](const Options& o) { return std::string(BackendName(o.device_backend)); }});
    t.push_back(IntEntry("device.index", "CUDA device ordinal", &Options::cuda_device_index, 0, 1023));
    t.push_back(SizeEntry("device.budget", "bytes of device memory strata may use for chunks",
                          &Options::device_budget_bytes));
    t.push_back({{"device.emulated_bandwidth_gbps", "float", "0",
                  "emulated device only: copy bandwidth per direction in GB/s (10^9 bytes/s) imitating PCIe; 0 = unthrottled"},
                 [](Options& o, std::string_view text) -> Status {
                   STRATA_ASSIGN_OR_RETURN(double v, ParseDouble("device.emulated_bandwidth_gbps", text));
                   if (v < 0) return InvalidArgument("option device.emulated_bandwidth_gbps: {} is negative: expected >= 0", v);
                   o.device_emulated_bandwidth_gbps = v;
                   return Status::Ok();
                 },
                 [](const Options& o) { return fmt::format("{}", o.device_emulated_bandwidth_gbps); }});
    t.push_back(IntEntry("device.copy_timeout_ms", "milliseconds a host<->device copy may take before it is a Timeout",
                         &Options::device_copy_timeout_ms, 1, 86'400'000));
    t.push_back(SizeEntry("host.budget", "bytes of pinned host memory strata may use for chunks",
                          &Options::host_budget_bytes));
    t.push_back(BoolEntry("host.numa_local", "place host chunks on the NUMA node nearest the device (hwloc)",
                          &Options::host_numa_local));
    t.push_back(BoolEntry("host.huge_pages",
                          "back host buffers of 2MiB or more with transparent huge pages (fewer I/O segments)",
                          &Options::host_huge_pages));
    t.push_back({{"nvme.dirs", "list", "",
                  "directories for the NVMe tier, one per drive, comma-separated (JSON: a list); empty = no NVMe tier"},
                 [](Options& o, std::string_view text) -> Status {
                   o.nvme_dirs.clear();
                   std::stringstream stream{std::string(text)};
                   std::string item;
                   while (std::getline(stream, item, ',')) {
                     item = Trim(item);
                     if (!item.empty()) o.nvme_dirs.push_back(item);
                   }
                   return Status::Ok();
                 },
                 [](const Options& o) { return JoinDirs(o.nvme_dirs); }});
    t.push_back(SizeEntry("nvme.capacity", "bytes of NVMe space for chunks, all directories together",
                          &Options::nvme_capacity_bytes));
    t.push_back(SizeEntry("nvme.block_size", "bytes per NVMe I/O request and stripe unit; a multiple of 4KiB",
                          &Options::nvme_block_size_bytes));
    t.push_back(IntEntry("nvme.queue_depth", "NVMe requests in flight per drive (directory)", &Options::nvme_queue_depth,
                         1, 4096));
    t.push_back(BoolEntry("nvme.allow_buffered_io",
                          "use buffered I/O (with a warning) where a filesystem refuses O_DIRECT, instead of failing",
                          &Options::nvme_allow_buffered_io));
    t.push_back(BoolEntry("nvme.sqpoll",
                          "a kernel thread polls each io_uring submission queue (IORING_SETUP_SQPOLL); falls back "
                          "with a warning where refused",
                          &Options::nvme_sqpoll));
    t.push_back(IntEntry("nvme.io_timeout_ms", "milliseconds one NVMe read or write may take before it is a Timeout",
                         &Options::nvme_io_timeout_ms, 1, 86'400'000));
    t.push_back(IntEntry("chunk.size_elems", "elements per chunk; 0 = search for least padding waste",
                         &Options::chunk_size_elems, 0, uint64_t{1} << 34));
    t.push_back(IntEntry("chunk.search_min_elems", "smallest chunk size the search tries, in elements",
                         &Options::chunk_search_min_elems, 1, uint64_t{1} << 34));
    t.push_back(IntEntry("chunk.search_max_elems", "largest chunk size the search tries, in elements",
                         &Options::chunk_search_max_elems, 1, uint64_t{1} << 34));
    t.push_back({{"precision", "enum", "fp32", "compute dtype of param and grad chunks: fp32, bf16 or fp16"},
                 [](Options& o, std::string_view text) -> Status {
                   Result<DType> dtype = ParseDType(Trim(text));
                   if (!dtype.ok()) return InvalidArgument("option precision: {}", dtype.status().message());
                   o.compute_dtype = *dtype;
                   return Status::Ok();
                 },
                 [](const Options& o) { return std::string(DTypeName(o.compute_dtype)); }});
    t.push_back(ChoiceEntry("optimizer.kind",
                            "adamw (decoupled weight decay), adam (L2 weight decay in the gradient) or sgd "
                            "(momentum, dampening, nesterov)",
                            &Options::optimizer_kind, {"adamw", "adam", "sgd"}));
    t.push_back(FloatEntry("optimizer.lr", "learning rate", &Options::optimizer_lr, 0, 1e9));
    t.push_back(FloatEntry("optimizer.beta1", "Adam: decay of the first moment, in [0, 1)", &Options::optimizer_beta1,
                           0, 0.999999999));
    t.push_back(FloatEntry("optimizer.beta2", "Adam: decay of the second moment, in [0, 1)", &Options::optimizer_beta2,
                           0, 0.999999999));
    t.push_back(FloatEntry("optimizer.eps", "Adam: added to the denominator, > 0", &Options::optimizer_eps, 1e-30, 1));
    t.push_back(FloatEntry("optimizer.weight_decay",
                           "weight decay: decoupled for adamw (w -= lr * wd * w), added to the gradient for adam and sgd",
                           &Options::optimizer_weight_decay, 0, 1e9));
    t.push_back(FloatEntry("optimizer.momentum", "SGD: momentum; 0 keeps no state", &Options::optimizer_momentum, 0,
                           1e9));
    t.push_back(FloatEntry("optimizer.dampening", "SGD: dampening of the momentum, in [0, 1]",
                           &Options::optimizer_dampening, 0, 1));
    t.push_back(BoolEntry("optimizer.nesterov", "SGD: Nesterov momentum (needs momentum > 0, dampening 0)",
                          &Options::optimizer_nesterov));
    t.push_back(FloatEntry("optimizer.max_grad_norm",
                           "clip the global L2 norm of the unscaled gradients to this; 0 = no clipping",
                           &Options::optimizer_max_grad_norm, 0, 1e30));
    t.push_back(SizeEntry("optimizer.stream_ring",
                          "bytes of host memory that NVMe-resident optimizer states stream through (at least two "
                          "chunk groups' master and states)",
                          &Options::optimizer_stream_ring_bytes));
    t.push_back(ChoiceEntry("placement.policy",
                            "adaptive (homes by size; the planner moves chunks from a recorded warm-up iteration) or "
                            "static (the fixed shares below; no planning)",
                            &Options::placement_policy, {"adaptive", "static"}));
    t.push_back(FloatEntry("placement.device_params",
                           "static policy: share of the param and grad chunks (bytes, in model order) kept on the "
                           "device for the whole run, 0..1; the rest move on demand",
                           &Options::placement_device_params, 0, 1));
    t.push_back(FloatEntry("placement.host_states",
                           "static policy: share of the optimizer-state chunks (bytes, in model order) homed in host "
                           "memory, 0..1; the rest on NVMe",
                           &Options::placement_host_states, 0, 1));
    t.push_back(ChoiceEntry("loss_scale.mode",
                            "auto (dynamic when precision is fp16, else off), dynamic or off",
                            &Options::loss_scale_mode, {"auto", "dynamic", "off"}));
    t.push_back(FloatEntry("loss_scale.init", "first loss scale", &Options::loss_scale_init, 1e-30, 1e30));
    t.push_back(FloatEntry("loss_scale.growth_factor", "the scale grows by this after growth_interval good steps, > 1",
                           &Options::loss_scale_growth_factor, 1, 1e9));
    t.push_back(FloatEntry("loss_scale.backoff_factor", "the scale shrinks by this on an inf/NaN gradient, in (0, 1)",
                           &Options::loss_scale_backoff_factor, 0, 1));
    t.push_back(IntEntry("loss_scale.growth_interval", "good steps in a row before the scale grows",
                         &Options::loss_scale_growth_interval, 1, 1'000'000'000));
    t.push_back(FloatEntry("loss_scale.min", "the scale never backs off below this, > 0", &Options::loss_scale_min,
                           1e-30, 1e30));
    t.push_back(FloatEntry("loss_scale.max", "the scale never grows above this", &Options::loss_scale_max, 1e-30,
                           1e30));
    t.push_back(IntEntry("comm.timeout_ms",
                         "data parallel: milliseconds a collective may wait for its ranks before it is a Timeout on "
                         "every rank (a rank that died or hangs)",
                         &Options::comm_timeout_ms, 1, 86'400'000));
    t.push_back(BoolEntry("comm.shard_params",
                          "data parallel: each rank keeps 1/W of the parameters, frozen ones too (ZeRO-3); a param chunk is "
                          "all-gathered when compute needs it, in forward and again in backward, instead of once "
                          "after the update (fp32: 3 x parameter bytes x (W-1)/W a step instead of 2 x), and the "
                          "parameters take 1/W of each rank's host and NVMe memory",
                          &Options::comm_shard_params));
    t.push_back(ChoiceEntry("comm.backend",
                            "data parallel: what carries the collectives: auto (NCCL when the device is a GPU and "
                            "there are several ranks, else host), host (MPI under mpirun, torch.distributed's gloo "
                            "under torchrun; host buffers) or nccl (one GPU per rank, bootstrapped by the host "
                            "backend; also with a single rank)",
                            &Options::comm_backend, {"auto", "host", "nccl"}));
    t.push_back(ChoiceEntry("comm.reduce_dtype",
                            "data parallel: the dtype gradients are reduce-scattered in: grad (the grad chunk's, the "
                            "compute dtype; 16-bit sums are rounded, fp16 ones may overflow into a skipped step) or "
                            "fp32 (exact sums, twice the bytes under bf16 or fp16)",
                            &Options::comm_reduce_dtype, {"grad", "fp32"}));
    t.push_back(IntEntry("transfer.workers", "threads running asynchronous chunk moves", &Options::transfer_workers, 1, 64));
    t.push_back({{"log.level", "enum", "info", "debug, info, warning, error or off"},
                 [](Options& o, std::string_view text) -> Status {
                   Result<LogLevel> level = ParseLogLevel(Trim(text));
                   if (!level.ok()) return InvalidArgument("option log.level: {}", level.status().message());
                   o.log_level = *level;
                   return Status::Ok();
                 },
                 [](const Options& o) { return std::string(LogLevelName(o.log_level)); }});
    return t;
  }();
  return table;
}

std::string KnownKeys() {
  std::string keys;
  for (const OptionEntry& entry : Table()) keys += (keys.empty() ? "" : ", ") + entry.doc.key;
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

}  // namespace

const std::vector<OptionDoc>& OptionDocs() {
  static const std::vector<OptionDoc> docs = [] {
    std::vector<OptionDoc> d;
    for (const OptionEntry& entry : Table()) d.push_back(entry.doc);
    return d;
  }();
  return docs;
}

Status SetOption(Options& options, std::string_view key, std::string_view value) {
  for (const OptionEntry& entry : Table()) {
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
  if (options.nvme_block_size_bytes == 0 || options.nvme_block_size_bytes % kIoAlignmentBytes != 0) {
    return InvalidArgument("option nvme.block_size: {} bytes is not allowed: expected a positive multiple of 4KiB",
                           options.nvme_block_size_bytes);
  }
  if (options.device_budget_bytes == 0) {
    return InvalidArgument("option device.budget: 0 is not allowed: the device tier needs room for at least one chunk");
  }
  if (options.chunk_search_min_elems > options.chunk_search_max_elems) {
    return InvalidArgument("option chunk.search_min_elems: {} exceeds chunk.search_max_elems {}",
                           options.chunk_search_min_elems, options.chunk_search_max_elems);
  }
  if (!options.nvme_dirs.empty() && options.nvme_capacity_bytes == 0) {
    return InvalidArgument("option nvme.capacity: 0 is not allowed when nvme.dirs is set");
  }
  if (options.optimizer_stream_ring_bytes == 0) {
    return InvalidArgument("option optimizer.stream_ring: 0 is not allowed: the ring holds at least two chunk groups");
  }
  STRATA_ASSIGN_OR_RETURN(const optim::OptimizerConfig optimizer, optim::OptimizerConfigFromOptions(options));
  (void)optimizer;
  // The loss_scale.* keys are checked even where scaling is off, so a bad
  // one is found before a run that turns scaling on.
  const Status scaler = optim::ValidateLossScalerConfig(optim::LossScalerConfigOf(options));
  if (!scaler.ok()) return InvalidArgument("option loss_scale.*: {}", scaler.message());
  return Status::Ok();
}

std::vector<std::pair<std::string, std::string>> DescribeOptions(const Options& options) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const OptionEntry& entry : Table()) values.emplace_back(entry.doc.key, entry.get(options));
  return values;
}

Result<size_t> ParseSize(std::string_view text) {
  std::string trimmed = Trim(text);
  size_t split = 0;
  while (split < trimmed.size() && (std::isdigit(static_cast<unsigned char>(trimmed[split])) || trimmed[split] == '.')) {
    ++split;
  }
  std::string number = trimmed.substr(0, split);
  std::string suffix = Trim(trimmed.substr(split));
  static const std::pair<const char*, double> kSuffixes[] = {
      {"", 1},      {"B", 1},         {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40},
      {"KB", 1e3}, {"MB", 1e6},     {"GB", 1e9},     {"TB", 1e12},    {"K", 0x1p10},   {"M", 0x1p20},
      {"G", 0x1p30}, {"T", 0x1p40}};
  double scale = 0;
  for (const auto& [name, factor] : kSuffixes) {
    if (suffix == name) scale = factor;
  }
  char* end = nullptr;
  double value = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  if (scale == 0 || number.empty() || end != number.c_str() + number.size() || value < 0) {
    return InvalidArgument("'{}' is not a size: expected bytes like 4096, 64MiB, 1.5GiB or 2GB", text);
  }
  double bytes = std::round(value * scale);
  if (bytes > 0x1p62) return InvalidArgument("'{}' is too large a size", text);
  return static_cast<size_t>(bytes);
}

std::string FormatSize(size_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{}B", bytes);
  return fmt::format("{:.4g}{}", value, kUnits[unit]);
}

}  // namespace strata
