#include "benchmarks/checkpoint_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "benchmarks/io_bench.h"
#include "strata/checkpoint.h"
#include "optim/optimizer.h"
#include "strata/engine.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A field of /proc/self/status in bytes (VmRSS, VmHWM), 0 if absent.
uint64_t StatusBytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}

// Resets the peak resident set (VmHWM) to the current one.
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

// One bench io pass of `op` (its file kept for the next), in GB/s.
Result<double> IoPass(IoBenchConfig io, IoOp op) {
  io.ops = {op};
  STRATA_ASSIGN_OR_RETURN(IoBenchReport measured, RunIoBench(io));
  return measured.rows.at(0).strata_median_gbps;
}

// The engine and optimizer whose state is saved and loaded.
struct SavedModel {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<optim::Optimizer> optimizer;
};

// Each run's ratios to its own bench io passes, whose medians are reported.
struct RunRatios {
  std::vector<double> save, async_save, load;
};

// The engine: `tensors` fp32 trainable tensors of a chunk each, every chunk
// given bytes where its home is (a free chunk has none to save).
Result<SavedModel> BuildModel(const CheckpointBenchConfig& config, CheckpointBenchReport& report) {
  const uint64_t tensors = config.params / config.chunk_elems;
  const uint64_t tensor_bytes = config.chunk_elems * sizeof(float);
  const uint64_t states_bytes = tensors * 2 * tensor_bytes;
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 4 * tensor_bytes;
  options.chunk.size_elems = config.chunk_elems;
  options.log_level = LogLevel::kWarning;
  options.nvme.dirs = {(fs::path(config.dir) / "nvme").string()};
  options.nvme.capacity_bytes = 3 * tensors * tensor_bytes + (uint64_t{64} << 20);
  // Host room for the parameters and either every state or a few.
  options.host.budget_bytes =
      tensors * tensor_bytes + (config.states_on_nvme ? 4 * tensor_bytes : states_bytes + 16 * tensor_bytes);
  std::error_code ec;
  fs::create_directories(options.nvme.dirs[0], ec);
  if (ec) return IoError("bench checkpoint: creating {}: {}", options.nvme.dirs[0], ec.message());
  SavedModel model;
  STRATA_ASSIGN_OR_RETURN(model.engine, Engine::Create(options));
  for (uint64_t t = 0; t < tensors; ++t) {
    STRATA_RETURN_IF_ERROR(model.engine
                               ->RegisterTensor({fmt::format("w{}", t),
                                                 {static_cast<int64_t>(config.chunk_elems)},
                                                 DType::kFloat32,
                                                 true,
                                                 fmt::format("m{}", t)})
                               .status());
  }
  STRATA_RETURN_IF_ERROR(model.engine->Finalize());
  for (const ChunkInfo& c : model.engine->chunks()) {
    if (c.kind == ChunkKind::kGrad) continue;
    {
      STRATA_ASSIGN_OR_RETURN(ChunkAccess access, model.engine->AccessChunk(c.id, Tier::kHost));
      std::memset(access.data(), 0x3c + static_cast<int>(c.kind), c.used_bytes);
    }
    STRATA_ASSIGN_OR_RETURN(Tier home, model.engine->ChunkHome(c.id));
    if (home != Tier::kHost) STRATA_RETURN_IF_ERROR(model.engine->MoveChunk(c.id, home));
    report.saved_from_nvme += home == Tier::kNvme ? 1 : 0;
  }
  STRATA_ASSIGN_OR_RETURN(optim::OptimizerConfig optimizer_config, optim::OptimizerConfigFromOptions(options));
  STRATA_ASSIGN_OR_RETURN(model.optimizer, optim::Optimizer::Create(optimizer_config));
  return model;
}

// The reference: bench io on the same directory, a file as large as the
// checkpoint (`checkpoint_bytes`), one pass at a time.
IoBenchConfig ReferenceIo(const CheckpointBenchConfig& config, uint64_t checkpoint_bytes) {
  IoBenchConfig io;
  io.dirs = {(fs::path(config.dir) / "io").string()};
  std::error_code ec;
  fs::create_directories(io.dirs[0], ec);
  io.file_size_bytes = std::max<uint64_t>(checkpoint_bytes, uint64_t{64} << 20) / (1 << 20) * (1 << 20);
  io.runs = 1;
  return io;
}

// The first save, into new files, timed; and the second, unmeasured, also
// into new files. Returns how many files a save writes.
Result<uint32_t> FirstSaves(SavedModel& model, const std::string& root, const offload::CheckpointOptions& options,
                            CheckpointBenchReport& report) {
  std::error_code ec;
  fs::remove_all(root, ec);
  const Clock::time_point start = Clock::now();
  STRATA_ASSIGN_OR_RETURN(offload::CheckpointSummary first,
                          offload::SaveCheckpoint(*model.engine, *model.optimizer, root, options));
  report.first_save_gbps = static_cast<double>(first.bytes) / SecondsSince(start) / 1e9;
  STRATA_RETURN_IF_ERROR(offload::SaveCheckpoint(*model.engine, *model.optimizer, root, options).status());
  return first.files;
}

// A save (its peak resident memory watched), an asynchronous save, and a
// load, each beside a bench io pass of its own direction.
Status MeasureRun(SavedModel& model, const IoBenchConfig& io, const std::string& root,
                  const offload::CheckpointOptions& options, CheckpointBenchReport& report, RunRatios& ratios) {
  Engine& engine = *model.engine;
  optim::Optimizer& optimizer = *model.optimizer;
  STRATA_ASSIGN_OR_RETURN(report.io_write_run_gbps.emplace_back(), IoPass(io, IoOp::kWrite));
  const uint64_t before = StatusBytes("VmRSS");
  ResetPeakRss();
  Clock::time_point start = Clock::now();
  STRATA_ASSIGN_OR_RETURN(offload::CheckpointSummary saved, offload::SaveCheckpoint(engine, optimizer, root, options));
  const double save_seconds = SecondsSince(start);
  report.recycled_files = std::min(report.recycled_files, saved.recycled);
  report.save_rss_growth_bytes =
      std::max(report.save_rss_growth_bytes, StatusBytes("VmHWM") > before ? StatusBytes("VmHWM") - before : 0);
  report.checkpoint_bytes = saved.bytes;
  report.files = saved.files;
  report.save_gbps.push_back(static_cast<double>(saved.bytes) / save_seconds / 1e9);
  start = Clock::now();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::PendingCheckpoint> pending,
                          offload::StartCheckpoint(engine, optimizer, root, options));
  report.async_start_max_ms = std::max(report.async_start_max_ms, SecondsSince(start) * 1e3);
  STRATA_ASSIGN_OR_RETURN(offload::CheckpointSummary saved_async, pending->Wait());
  report.recycled_files = std::min(report.recycled_files, saved_async.recycled);
  report.async_save_gbps.push_back(static_cast<double>(saved.bytes) / SecondsSince(start) / 1e9);
  STRATA_ASSIGN_OR_RETURN(report.io_read_run_gbps.emplace_back(), IoPass(io, IoOp::kRead));
  start = Clock::now();
  STRATA_RETURN_IF_ERROR(offload::LoadCheckpoint(engine, optimizer, root).status());
  report.load_gbps.push_back(static_cast<double>(saved.bytes) / SecondsSince(start) / 1e9);
  STRATA_RETURN_IF_ERROR(engine.OffloadAll());  // the states back home, as they were when saved

  const double write = report.io_write_run_gbps.back(), read = report.io_read_run_gbps.back();
  ratios.save.push_back(write > 0 ? report.save_gbps.back() / write : 0);
  ratios.async_save.push_back(write > 0 ? report.async_save_gbps.back() / write : 0);
  ratios.load.push_back(read > 0 ? report.load_gbps.back() / read : 0);
  return Status::Ok();
}

// The medians of the runs, and the ratios reported.
void Summarize(const RunRatios& ratios, CheckpointBenchReport& report) {
  report.save_median_gbps = Median(report.save_gbps);
  report.async_save_median_gbps = Median(report.async_save_gbps);
  report.load_median_gbps = Median(report.load_gbps);
  report.io_write_gbps = Median(report.io_write_run_gbps);
  report.io_read_gbps = Median(report.io_read_run_gbps);
  report.save_ratio = Median(ratios.save);
  report.async_save_ratio = Median(ratios.async_save);
  report.load_ratio = Median(ratios.load);
  report.first_save_ratio = report.io_write_gbps > 0 ? report.first_save_gbps / report.io_write_gbps : 0;
}

}  // namespace

// Note [The checkpoint bench]
// The model: fp32 trainable tensors of one chunk each, `params` in all, so a
// checkpoint holds 12 bytes a parameter (the parameters and AdamW's two
// moments). Its optimizer states stay in host memory, or with
// states_on_nvme live in the NVMe tier (a directory under `dir`), as they do
// when they outgrow the host.
//
// The reference is a bench io pass just before each run's saves (write) and
// its load (read): a drive that drifts moves both alike.
//
// Every save replaces the one before (the same step), as a run saving every
// N steps with keep_last replaces its oldest: with recycling, the files of
// the one before that are written over (strata/checkpoint.h). The
// first save writes new files, and so does the second, unmeasured; then each
// run saves, saves asynchronously (started, then waited for, nothing
// training between), and loads.
Result<CheckpointBenchReport> RunCheckpointBench(const CheckpointBenchConfig& config) {
  if (config.dir.empty()) return InvalidArgument("bench checkpoint: --dir is required: where to save");
  if (config.runs == 0) return InvalidArgument("bench checkpoint: --runs 0: at least one run is needed");
  if (config.chunk_elems == 0 || config.params < config.chunk_elems) {
    return InvalidArgument("bench checkpoint: --params {} must hold at least one chunk of --chunk-elems {} (> 0)",
                           config.params, config.chunk_elems);
  }
  CheckpointBenchReport report;
  report.config = config;
  const uint64_t tensor_bytes = config.chunk_elems * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(SavedModel model, BuildModel(config, report));
  const IoBenchConfig io = ReferenceIo(config, 3 * (config.params / config.chunk_elems) * tensor_bytes);
  const std::string root = (fs::path(config.dir) / "checkpoint").string();
  const offload::CheckpointOptions save_options{.keep_last = 1, .recycle = config.recycle};
  STRATA_ASSIGN_OR_RETURN(report.recycled_files, FirstSaves(model, root, save_options, report));
  RunRatios ratios;
  for (uint32_t run = 0; run < config.runs; ++run) {
    STRATA_RETURN_IF_ERROR(MeasureRun(model, io, root, save_options, report, ratios));
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  fs::remove_all(io.dirs[0], ec);
  report.buffer_bytes = 3 * tensor_bytes;  // a buffer for each of the three files written at a time
  Summarize(ratios, report);
  return report;
}

std::string FormatCheckpointBench(const CheckpointBenchReport& r) {
  std::string out = fmt::format(
      "strata bench checkpoint: {} fp32 parameters in {} chunks, {} of {} chunks saved from NVMe; a checkpoint of "
      "{:.1f} MiB in {} files under {}\n",
      r.config.params, r.config.params / r.config.chunk_elems, r.saved_from_nvme, r.files,
      r.checkpoint_bytes / 1048576.0, r.files, r.config.dir);
  out += fmt::format("           median GB/s   bench io GB/s   ratio   runs (ratio: the median of the runs' own)\n");
  out += fmt::format("save       {:>11.3f}   {:>13.3f}   {:>5.2f}   {}\n", r.save_median_gbps, r.io_write_gbps,
                     r.save_ratio, fmt::join(r.save_gbps, " "));
  out += fmt::format("load       {:>11.3f}   {:>13.3f}   {:>5.2f}   {}\n", r.load_median_gbps, r.io_read_gbps,
                     r.load_ratio, fmt::join(r.load_gbps, " "));
  out += fmt::format("save async {:>11.3f}   {:>13.3f}   {:>5.2f}   {}\n", r.async_save_median_gbps, r.io_write_gbps,
                     r.async_save_ratio, fmt::join(r.async_save_gbps, " "));
  out += fmt::format("first save {:>11.3f}   {:>13.3f}   {:>5.2f}   (into new files)\n", r.first_save_gbps,
                     r.io_write_gbps, r.first_save_ratio);
  out += fmt::format("files written over a removed checkpoint's by every measured save: {} of {}{}\n",
                     r.recycled_files,
                     r.files, r.config.recycle ? "" : " (--no-recycle)");
  out += fmt::format("an asynchronous save returned to its caller within {:.1f} ms\n", r.async_start_max_ms);
  out += fmt::format("a save's peak resident memory above its start: {:.1f} MiB (its buffers: {:.1f} MiB)\n",
                     r.save_rss_growth_bytes / 1048576.0, r.buffer_bytes / 1048576.0);
  return out;
}

std::string CheckpointBenchJson(const CheckpointBenchReport& r) {
  nlohmann::json j = {{"params", r.config.params},
                      {"chunk_elems", r.config.chunk_elems},
                      {"states_on_nvme", r.config.states_on_nvme},
                      {"checkpoint_bytes", r.checkpoint_bytes},
                      {"files", r.files},
                      {"saved_from_nvme", r.saved_from_nvme},
                      {"save_gbps", r.save_gbps},
                      {"load_gbps", r.load_gbps},
                      {"save_median_gbps", r.save_median_gbps},
                      {"load_median_gbps", r.load_median_gbps},
                      {"io_write_gbps", r.io_write_gbps},
                      {"io_read_gbps", r.io_read_gbps},
                      {"io_write_run_gbps", r.io_write_run_gbps},
                      {"io_read_run_gbps", r.io_read_run_gbps},
                      {"save_ratio", r.save_ratio},
                      {"load_ratio", r.load_ratio},
                      {"buffer_bytes", r.buffer_bytes},
                      {"save_rss_growth_bytes", r.save_rss_growth_bytes},
                      {"async_save_gbps", r.async_save_gbps},
                      {"async_save_median_gbps", r.async_save_median_gbps},
                      {"async_save_ratio", r.async_save_ratio},
                      {"async_start_max_ms", r.async_start_max_ms},
                      {"recycle", r.config.recycle},
                      {"recycled_files", r.recycled_files},
                      {"first_save_gbps", r.first_save_gbps},
                      {"first_save_ratio", r.first_save_ratio}};
  return j.dump(2);
}

}  // namespace strata::bench
