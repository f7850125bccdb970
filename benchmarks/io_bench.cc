#include "benchmarks/io_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "src/base/alignment.h"
#include "src/base/crc32c.h"
#include "src/base/logging.h"
#include "strata/buffer.h"
#include "strata/device.h"
#include "strata/options.h"
#include "strata/storage.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kAlignmentBytes = kIoAlignmentBytes;
// A benchmark pass moves a whole file in one call: allow it a long time.
constexpr uint32_t kPassTimeoutMs = 600'000;
constexpr const char* kFileName = "strata.nvme";
constexpr const char* kOneDirFileName = "strata-one-dir.nvme";

std::string_view OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }
std::string_view PatternName(IoPattern pattern) { return pattern == IoPattern::kRandom ? "random" : "sequential"; }

// One storage backend over the directories, with the buffers its passes use.
struct Target {
  std::unique_ptr<Storage> storage;
  std::vector<std::string> files;  // backing files, for fio
  uint64_t bytes = 0;              // what one pass moves: the whole space
};

Result<Target> OpenTarget(const std::vector<std::string>& dirs, const std::string& file_name, uint64_t file_size,
                          uint64_t block, uint32_t queue_depth, bool sqpoll) {
  UringStorageOptions options;
  options.dirs = dirs;
  options.file_name = file_name;
  // Whole blocks in every directory, so that fio and strata cover the same bytes.
  uint64_t stripe = block * dirs.size();
  options.capacity_bytes = std::max<uint64_t>(file_size / stripe, 1) * stripe;
  options.block_size_bytes = block;
  options.queue_depth = queue_depth;
  options.io_timeout_ms = kPassTimeoutMs;
  options.sqpoll = sqpoll;
  Target target;
  STRATA_ASSIGN_OR_RETURN(target.storage, CreateUringStorage(options));
  for (const std::string& dir : dirs) target.files.push_back((std::filesystem::path(dir) / file_name).string());
  target.bytes = options.capacity_bytes;
  return target;
}

// The segments of one pass over the whole space: every block once, in order
// or shuffled, cycling through queue_depth buffers as fio does (two requests
// in flight may share one when completions come out of order: the content
// does not matter to a bandwidth test).
std::vector<IoSegment> PassSegments(const Target& target, const Buffer& window, uint64_t block, IoPattern pattern,
                                    std::mt19937_64& rng) {
  uint64_t blocks = target.bytes / block;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (pattern == IoPattern::kRandom) std::shuffle(order.begin(), order.end(), rng);
  uint64_t buffers = window.size_bytes() / block;
  std::vector<IoSegment> segments;
  segments.reserve(blocks);
  for (uint64_t i = 0; i < blocks; ++i) segments.push_back({order[i] * block, window.bytes() + (i % buffers) * block, block});
  return segments;
}

// Runs one pass; returns its bandwidth in GB/s.
Result<double> StrataPass(Target& target, const std::vector<IoSegment>& segments, IoOp op) {
  Clock::time_point start = Clock::now();
  STRATA_RETURN_IF_ERROR(op == IoOp::kRead ? target.storage->ReadBatch(segments)
                                           : target.storage->WriteBatch(segments));
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(target.bytes) / seconds / 1e9;
}

// The device leg of a pass: the same segments, a group of `group` blocks at
// a time, through two pinned bounce buffers and `device_buffer`. Reads copy
// each group to the device while the next group is read; writes copy the next
// group from the device while the current one is written.
Result<double> DevicePass(Target& target, Device& device, const std::vector<IoSegment>& segments, IoOp op,
                          uint64_t block, uint64_t group, Buffer (&bounce)[2], const Buffer& device_buffer) {
  constexpr uint32_t kCopyTimeoutMs = 60'000;
  auto span_of = [&](size_t first, int half) {
    std::vector<IoSegment> span;
    for (size_t k = first; k < std::min(segments.size(), first + group); ++k) {
      span.push_back({segments[k].offset, bounce[half].bytes() + (k - first) * block, block});
    }
    return span;
  };
  std::shared_ptr<Event> pending[2];
  auto settle = [&](int half) -> Status {
    if (!pending[half]) return Status::Ok();
    Status status = pending[half]->Wait(kCopyTimeoutMs);
    pending[half].reset();
    return status;
  };
  auto copy = [&](int half, size_t first) -> Status {
    uint64_t bytes = std::min<uint64_t>(group, segments.size() - first) * block;
    Result<std::shared_ptr<Event>> event =
        op == IoOp::kRead
            ? device.CopyAsync(CopyStream::kHostToDevice, device_buffer.data(), bounce[half].data(), bytes)
            : device.CopyAsync(CopyStream::kDeviceToHost, bounce[half].data(), device_buffer.data(), bytes);
    if (!event.ok()) return event.status();
    pending[half] = std::move(event).value();
    return Status::Ok();
  };

  Clock::time_point start = Clock::now();
  if (op == IoOp::kWrite && !segments.empty()) STRATA_RETURN_IF_ERROR(copy(0, 0));
  for (size_t first = 0, g = 0; first < segments.size(); first += group, ++g) {
    const int half = static_cast<int>(g % 2);
    STRATA_RETURN_IF_ERROR(settle(half));  // its copy to the device (read) or from it (write) is done
    std::vector<IoSegment> span = span_of(first, half);
    if (op == IoOp::kRead) {
      STRATA_RETURN_IF_ERROR(target.storage->ReadBatch(span));
      STRATA_RETURN_IF_ERROR(copy(half, first));
    } else {
      if (first + group < segments.size()) STRATA_RETURN_IF_ERROR(copy(1 - half, first + group));
      STRATA_RETURN_IF_ERROR(target.storage->WriteBatch(span));
    }
  }
  STRATA_RETURN_IF_ERROR(settle(0));
  STRATA_RETURN_IF_ERROR(settle(1));
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(target.bytes) / seconds / 1e9;
}

std::string ShellQuote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// fio on the same files, block size and queue depth, O_DIRECT through io_uring.
Result<double> FioPass(const IoBenchConfig& config, const Target& target, IoOp op, IoPattern pattern, uint64_t block,
                       uint32_t queue_depth) {
  std::string files;
  for (const std::string& file : target.files) files += (files.empty() ? "" : ":") + file;
  std::string rw = std::string(pattern == IoPattern::kRandom ? "rand" : "") + std::string(OpName(op));
  std::string output = (std::filesystem::temp_directory_path() / fmt::format("strata-fio-{}.json", ::getpid())).string();
  std::string command = fmt::format(
      "{} --name=strata-compare --ioengine=io_uring --direct=1 --rw={} --bs={} --iodepth={} --size={} "
      "--filename={} --numjobs=1 --randrepeat=0 --allow_file_create=0 --output-format=json --output={} 2>&1",
      ShellQuote(config.fio_path), rw, block, queue_depth, target.bytes, ShellQuote(files), ShellQuote(output));
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return IoError("bench io: cannot start fio ({}): {}", command, std::strerror(errno));
  std::string messages;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr) messages += line;
  int rc = ::pclose(pipe);
  std::ifstream in(output);
  std::stringstream json;
  json << in.rdbuf();
  std::filesystem::remove(output);
  if (rc != 0) {
    return IoError("bench io: fio failed (exit status {}): {}{}", rc, command,
                   messages.empty() ? "" : "\n" + messages);
  }
  return ParseFioBandwidthGbps(json.str(), op);
}

// The NVMe tier's check of `bytes` bytes read into the window (CRC32C per
// piece, on oneTBB's threads): its time against the read's.
CrcCost MeasureCrc(const Buffer& window, uint64_t bytes, double read_gbps) {
  Clock::time_point start = Clock::now();
  uint32_t mix = 0;
  uint64_t done = 0;
  while (done < bytes) {
    uint64_t piece = std::min<uint64_t>(window.size_bytes(), bytes - done);
    for (uint32_t crc : Crc32cPieces(window.data(), piece)) mix ^= crc;
    done += piece;
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  STRATA_LOG_DEBUG("bench io: crc mix {:#010x}", mix);  // keeps the loop from being optimized away
  CrcCost cost;
  cost.crc_gbps = static_cast<double>(bytes) / seconds / 1e9;
  cost.read_gbps = read_gbps;
  cost.fraction_of_read = read_gbps > 0 ? read_gbps / cost.crc_gbps : 0;
  return cost;
}

// The median over runs of a[run] / b[run].
double MedianRatio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) ratios.push_back(a[i] / b[i]);
  return Median(ratios);
}

// The settings a run is refused for: no directory or run, a block size not
// a positive multiple of 4KiB or over the file, a queue depth out of 1..4096.
Status ValidateIoConfig(const IoBenchConfig& config) {
  if (config.dirs.empty()) return InvalidArgument("bench io: no --dir given: name at least one directory");
  if (config.runs == 0) return InvalidArgument("bench io: --runs 0: at least one run is needed");
  for (uint64_t block : config.block_sizes_bytes) {
    if (block == 0 || block % kAlignmentBytes != 0) {
      return InvalidArgument("bench io: block size {} is not allowed: expected a positive multiple of 4KiB", block);
    }
    if (block * config.dirs.size() > config.file_size_bytes) {
      return InvalidArgument("bench io: --file-size {} is smaller than one block per directory ({} x {})",
                             FormatSize(config.file_size_bytes), config.dirs.size(), FormatSize(block));
    }
  }
  for (uint32_t depth : config.queue_depths) {
    if (depth == 0 || depth > 4096) return InvalidArgument("bench io: queue depth {} is not allowed: expected 1..4096", depth);
  }
  if (config.compare_one_dir && config.dirs.size() < 2) {
    return InvalidArgument("bench io: --compare-one-dir needs at least two --dir");
  }
  return Status::Ok();
}

// With IoDestination::kDevice: the device, with room for the largest
// window; else none.
Result<std::unique_ptr<Device>> OpenDestination(const IoBenchConfig& config) {
  if (config.destination != IoDestination::kDevice) return std::unique_ptr<Device>();
  Options device_options;
  STRATA_RETURN_IF_ERROR(SetOption(device_options, "device.backend", config.device_backend));
  uint64_t largest = 0;
  for (uint64_t block : config.block_sizes_bytes) {
    for (uint32_t depth : config.queue_depths) largest = std::max(largest, block * depth);
  }
  device_options.device.budget_bytes = largest;
  device_options.device.budget_auto = false;
  return CreateDevice(device_options);
}

// One block size x queue depth: the striped target (and with
// compare_one_dir the first directory's alone), written once, and the
// buffers their passes use.
struct Sweep {
  uint64_t block = 0;
  uint32_t depth = 0;
  Target striped;
  std::optional<Target> single;
  Buffer window;             // queue_depth blocks of random bytes, registered with every target
  Buffer bounce[2];          // with a device: its pinned bounce buffers
  Buffer device_buffer;      // with a device: where the bytes start or end
};

Result<Sweep> PrepareSweep(const IoBenchConfig& config, uint64_t block, uint32_t depth, Device* device,
                           std::mt19937_64& rng) {
  Sweep sweep{.block = block, .depth = depth};
  STRATA_ASSIGN_OR_RETURN(sweep.striped,
                          OpenTarget(config.dirs, kFileName, config.file_size_bytes, block, depth, config.sqpoll));
  if (config.compare_one_dir && config.dirs.size() > 1) {
    STRATA_ASSIGN_OR_RETURN(sweep.single, OpenTarget({config.dirs[0]}, kOneDirFileName, sweep.striped.bytes, block,
                                                     depth, config.sqpoll));
  }
  sweep.window = AllocateAlignedHost(uint64_t{depth} * block, kAlignmentBytes);
  if (!sweep.window) return OutOfMemory("bench io: cannot allocate a {} window", FormatSize(uint64_t{depth} * block));
  std::vector<Target*> targets = {&sweep.striped};
  if (sweep.single) targets.push_back(&*sweep.single);
  // As the engine does with its host arena and bounce buffers.
  for (Target* target : targets) {
    STRATA_RETURN_IF_ERROR(target->storage->RegisterBuffer(sweep.window.data(), sweep.window.size_bytes()));
  }
  for (uint64_t i = 0; i < sweep.window.size_bytes(); i += 8) {
    uint64_t word = rng();
    std::memcpy(sweep.window.bytes() + i, &word, 8);
  }
  if (device) {
    for (Buffer& half : sweep.bounce) {
      STRATA_ASSIGN_OR_RETURN(half, device->AllocatePinnedHost(uint64_t{depth} * block, kNumaNodeNearDevice));
      STRATA_RETURN_IF_ERROR(sweep.striped.storage->RegisterBuffer(half.data(), half.size_bytes()));
    }
    STRATA_ASSIGN_OR_RETURN(sweep.device_buffer, device->Allocate(uint64_t{depth} * block));
  }
  // Reads must find written blocks: a preallocated, never-written extent
  // reads as zeros without touching the drive.
  for (Target* target : targets) {
    std::vector<IoSegment> fill = PassSegments(*target, sweep.window, block, IoPattern::kSequential, rng);
    STRATA_RETURN_IF_ERROR(target->storage->WriteBatch(fill).WithContext("bench io: writing the file once"));
  }
  return sweep;
}

// One row: `runs` rounds of strata's pass, fio's and the one-directory
// pass, in an order that alternates from run to run so that none always
// meets a drive warmed (or tired) by another; then their medians.
Result<IoBenchRow> MeasureRow(const IoBenchConfig& config, Sweep& sweep, Device* device, IoOp op, IoPattern pattern,
                              std::mt19937_64& rng) {
  const uint64_t block = sweep.block;
  IoBenchRow row{op, pattern, block, sweep.depth};
  for (uint32_t run = 0; run < config.runs; ++run) {
    std::vector<std::function<Status()>> passes;
    passes.push_back([&]() -> Status {
      std::vector<IoSegment> segments = PassSegments(sweep.striped, sweep.window, block, pattern, rng);
      STRATA_ASSIGN_OR_RETURN(double gbps, device ? DevicePass(sweep.striped, *device, segments, op, block, sweep.depth,
                                                               sweep.bounce, sweep.device_buffer)
                                                  : StrataPass(sweep.striped, segments, op));
      row.strata_gbps.push_back(gbps);
      return Status::Ok();
    });
    if (config.compare_fio) {
      passes.push_back([&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(double gbps, FioPass(config, sweep.striped, op, pattern, block, sweep.depth));
        row.fio_gbps.push_back(gbps);
        return Status::Ok();
      });
    }
    if (sweep.single) {
      passes.push_back([&]() -> Status {
        Target& single = *sweep.single;
        STRATA_ASSIGN_OR_RETURN(double gbps, StrataPass(single, PassSegments(single, sweep.window, block, pattern, rng), op));
        row.one_dir_gbps.push_back(gbps);
        return Status::Ok();
      });
    }
    if (run % 2 == 1) std::reverse(passes.begin(), passes.end());
    for (const auto& pass : passes) STRATA_RETURN_IF_ERROR(pass());
  }
  row.strata_median_gbps = Median(row.strata_gbps);
  if (!row.fio_gbps.empty()) {
    row.fio_median_gbps = Median(row.fio_gbps);
    row.ratio_median = MedianRatio(row.strata_gbps, row.fio_gbps);
  }
  if (!row.one_dir_gbps.empty()) row.one_dir_ratio_median = MedianRatio(row.strata_gbps, row.one_dir_gbps);
  return row;
}

}  // namespace

double Median(std::vector<double> values) {
  STRATA_CHECK(!values.empty(), "median of nothing");
  std::sort(values.begin(), values.end());
  size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

Result<double> ParseFioBandwidthGbps(const std::string& fio_json, IoOp op) {
  // fio may print notes before the JSON object.
  size_t start = fio_json.find('{');
  if (start == std::string::npos) return IoError("bench io: fio printed no JSON");
  nlohmann::json document = nlohmann::json::parse(fio_json.substr(start), nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded() || !document.contains("jobs") || document["jobs"].empty()) {
    return IoError("bench io: fio's JSON has no jobs");
  }
  const nlohmann::json& job = document["jobs"][0];
  const char* key = op == IoOp::kRead ? "read" : "write";
  if (!job.contains(key) || !job[key].contains("bw_bytes")) return IoError("bench io: fio's JSON has no {}.bw_bytes", key);
  double bytes_per_second = job[key]["bw_bytes"].get<double>();
  if (bytes_per_second <= 0) return IoError("bench io: fio reports no {} bandwidth", key);
  return bytes_per_second / 1e9;
}

// Note [The io bench]
// For each block size x queue depth the engine's storage backend (the one
// the NVMe tier uses) moves the whole file once per op and pattern, as one
// batch that keeps queue_depth requests in flight; fio does the same on the
// same file. Each pair is repeated `runs` times in alternating order and the
// median of the per-run ratios strata/fio is reported. Also measured: the
// cost of checking a CRC32C of everything read (the NVMe tier's integrity
// check) as a fraction of the read time, and with several directories, the
// striped engine against one directory alone.
Result<IoBenchReport> RunIoBench(const IoBenchConfig& config) {
  STRATA_RETURN_IF_ERROR(ValidateIoConfig(config));
  IoBenchReport report;
  report.config = config;
  SetHugePagesEnabled(config.huge_pages);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenDestination(config));
  if (device) report.device = device->Describe();
  std::mt19937_64 rng(config.seed);
  for (uint64_t block : config.block_sizes_bytes) {
    for (uint32_t depth : config.queue_depths) {
      STRATA_ASSIGN_OR_RETURN(Sweep sweep, PrepareSweep(config, block, depth, device.get(), rng));
      if (report.storage.empty()) report.storage = sweep.striped.storage->Describe();
      for (IoOp op : config.ops) {
        for (IoPattern pattern : config.patterns) {
          STRATA_ASSIGN_OR_RETURN(IoBenchRow row, MeasureRow(config, sweep, device.get(), op, pattern, rng));
          if (op == IoOp::kRead && pattern == IoPattern::kSequential && report.crc.crc_gbps == 0) {
            report.crc = MeasureCrc(sweep.window, sweep.striped.bytes, row.strata_median_gbps);
          }
          report.rows.push_back(std::move(row));
        }
      }
    }
  }
  return report;
}

std::string FormatIoBench(const IoBenchReport& r) {
  std::string out = fmt::format("strata bench io: {}; I/O buffers on {} pages\n", r.storage,
                                r.config.huge_pages ? "huge (host.huge_pages)" : "4KiB");
  if (!r.device.empty()) out += fmt::format("destination: {} memory, through two pinned bounce buffers\n", r.device);
  out += fmt::format("file {} per pass, {} run{} per row{}\n\n", FormatSize(r.rows.empty() ? 0 : r.config.file_size_bytes),
                     r.config.runs, r.config.runs == 1 ? "" : "s",
                     r.config.compare_fio ? ", alternating with fio (io_uring, direct=1) on the same file" : "");
  bool fio = r.config.compare_fio;
  bool one = !r.rows.empty() && !r.rows[0].one_dir_gbps.empty();
  out += fmt::format("{:<6} {:<10} {:>8} {:>4} {:>12}", "op", "pattern", "block", "qd", "strata GB/s");
  if (fio) out += fmt::format(" {:>10} {:>12}", "fio GB/s", "strata/fio");
  if (one) out += fmt::format(" {:>12} {:>14}", "1-dir GB/s", "striped/1-dir");
  out += "\n";
  for (const IoBenchRow& row : r.rows) {
    out += fmt::format("{:<6} {:<10} {:>8} {:>4} {:>12.3f}", OpName(row.op), PatternName(row.pattern),
                       FormatSize(row.block_size_bytes), row.queue_depth, row.strata_median_gbps);
    if (fio) out += fmt::format(" {:>10.3f} {:>12.3f}", row.fio_median_gbps, row.ratio_median);
    if (one) out += fmt::format(" {:>12.3f} {:>14.3f}", Median(row.one_dir_gbps), row.one_dir_ratio_median);
    out += "\n";
  }
  out += "(medians over runs; ratios are medians of the per-run ratios)\n";
  if (r.crc.crc_gbps > 0) {
    out += fmt::format("\nCRC32C check of everything read (per 1MiB piece, oneTBB): {:.2f} GB/s = {:.1f}% of the "
                       "sequential read time at {:.3f} GB/s\n",
                       r.crc.crc_gbps, 100 * r.crc.fraction_of_read, r.crc.read_gbps);
  }
  return out;
}

std::string IoBenchJson(const IoBenchReport& r) {
  nlohmann::json j;
  const IoBenchConfig& c = r.config;
  j["config"] = {{"dirs", c.dirs},
                 {"file_size_bytes", c.file_size_bytes},
                 {"block_sizes_bytes", c.block_sizes_bytes},
                 {"queue_depths", c.queue_depths},
                 {"runs", c.runs},
                 {"compare_fio", c.compare_fio},
                 {"compare_one_dir", c.compare_one_dir},
                 {"sqpoll", c.sqpoll},
                 {"huge_pages", c.huge_pages},
                 {"direct_io", true},
                 {"destination", c.destination == IoDestination::kDevice ? "device" : "host"},
                 {"device", r.device},
                 {"storage", r.storage}};
  nlohmann::json rows = nlohmann::json::array();
  for (const IoBenchRow& row : r.rows) {
    nlohmann::json item = {{"op", OpName(row.op)},
                           {"pattern", PatternName(row.pattern)},
                           {"block_size_bytes", row.block_size_bytes},
                           {"queue_depth", row.queue_depth},
                           {"strata_gbps", row.strata_gbps},
                           {"strata_median_gbps", row.strata_median_gbps}};
    if (!row.fio_gbps.empty()) {
      item["fio_gbps"] = row.fio_gbps;
      item["fio_median_gbps"] = row.fio_median_gbps;
      item["ratio_strata_over_fio_median"] = row.ratio_median;
    }
    if (!row.one_dir_gbps.empty()) {
      item["one_dir_gbps"] = row.one_dir_gbps;
      item["ratio_striped_over_one_dir_median"] = row.one_dir_ratio_median;
    }
    // The first row of each op stands for a single-configuration run.
    std::string key = fmt::format("{}_gbps", OpName(row.op));
    if (!j.contains(key)) {
      j[key] = row.strata_median_gbps;
      if (!row.fio_gbps.empty()) j[fmt::format("{}_ratio_vs_fio", OpName(row.op))] = row.ratio_median;
    }
    rows.push_back(std::move(item));
  }
  j["results"] = rows;
  if (r.crc.crc_gbps > 0) {
    j["crc"] = {{"crc_gbps", r.crc.crc_gbps}, {"read_gbps", r.crc.read_gbps}, {"fraction_of_read", r.crc.fraction_of_read}};
  }
  return j.dump(2);
}

}  // namespace strata::bench
