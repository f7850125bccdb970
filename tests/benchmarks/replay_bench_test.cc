#include "benchmarks/replay_bench.h"

#include <nlohmann/json.hpp>

#include "tools/selftest.h"
#include "test_util.h"

namespace strata::bench {
namespace {

// A GPT of 3 layers x 256 over links of 8 GB/s, measured for `iterations`.
ReplayBenchConfig SmallReplay(uint32_t iterations) {
  ReplayBenchConfig config;
  config.model = {.layers = 3, .hidden = 256, .vocab = 1024, .sequence = 64, .batch = 1, .heads = 0};
  config.iterations = iterations;
  config.pcie_gbps = 8;
  return config;
}

TEST(ReplayBenchTest, ReplaysWithAPlanAndWithoutAndWritesTheJsonKeys) {
  ReplayBenchConfig config = SmallReplay(2);
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  EXPECT_GT(report.updates, 0u);
  EXPECT_EQ(report.moments, 2u * (config.model.layers + 2) + report.updates);
  EXPECT_GT(report.planned.step_seconds, 0);
  EXPECT_GT(report.lru.step_seconds, 0);
  EXPECT_GE(report.planned.step_seconds, report.compute_seconds * 0.99);
  EXPECT_EQ(report.divergences, 0u);
  EXPECT_GT(report.predicted_step_seconds, 0);
  EXPECT_LE(report.device_budget_bytes, report.model_states_bytes);
  nlohmann::json json = nlohmann::json::parse(ReplayBenchJson(report));
  for (const char* key : {"stall_fraction", "lru_stall_fraction", "planning_seconds", "step_seconds"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  for (const char* key : {"bytes_moved", "lru_bytes_moved"}) {
    ASSERT_TRUE(json.contains(key)) << key;
    EXPECT_TRUE(json[key].contains("host->device")) << key;
  }
  EXPECT_EQ(json["pipeline"]["planned_iterations"].get<uint64_t>(), 3u);  // the second warm-up iteration and two more
  EXPECT_GT(report.predicted_bytes[static_cast<int>(offload::Link::kHostToDevice)], 0u);
  EXPECT_EQ(json["pipeline"]["plan"]["predicted_bytes_moved"]["host->device"].get<uint64_t>(),
            report.predicted_bytes[static_cast<int>(offload::Link::kHostToDevice)]);
  EXPECT_NE(FormatReplayBench(report).find("LRU, on demand"), std::string::npos);
}

// Int8 states: the replay lays the moments out in their real bytes (the
// model states a third smaller than with fp32 moments: bf16 params and grads,
// fp32 masters) and counts every update as one, though none may run on the
// device.
TEST(ReplayBenchTest, Int8StatesReplayTheirBytesAndEveryUpdateOnTheHost) {
  ReplayBenchConfig config = SmallReplay(1);
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport fp32, RunReplayBench(config));
  config.states = "int8";
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport int8, RunReplayBench(config));
  EXPECT_GT(int8.updates, fp32.updates);  // the small tensors' groups of fp32 moments besides
  EXPECT_EQ(int8.updates_on_device, 0u);
  EXPECT_LT(static_cast<double>(int8.model_states_bytes), 0.7 * static_cast<double>(fp32.model_states_bytes));
  EXPECT_EQ(nlohmann::json::parse(ReplayBenchJson(int8))["config"]["states"], "int8");
  config.ranks = 2;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.ranks = 1;
  config.states = "int4";
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
}

// The replay's headline, planned stall below LRU's, in figures noise cannot
// move. Every state fits in host memory, so the plan is made on the two
// throttled links alone and its modelled stall is the same on every run. On
// demand, LRU waits for every byte it fetches: its host->device bytes over
// the link are a floor of its stall, which load only raises. A plan that
// fetched nothing ahead would stall about that long; this one models under
// half of it, and is followed: every access finds its chunk on the device or
// on its way.
TEST(ReplayBenchTest, ThePlannedStallIsBelowLrus) {
  ReplayBenchConfig config;
  config.model = {.layers = 6, .hidden = 256, .vocab = 1024, .sequence = 64, .batch = 1, .heads = 0};
  config.pcie_gbps = 2;
  config.compute_ms = 10;
  config.host_budget_bytes = 200 << 20;
  config.iterations = 1;
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  ASSERT_TRUE(report.plan_error.empty()) << report.plan_error;
  EXPECT_EQ(report.divergences, 0u);
  const nlohmann::json pipeline = nlohmann::json::parse(report.pipeline_json);
  EXPECT_EQ(pipeline["demand_fetches"].get<uint64_t>(), 0u);
  for (const ReplayRun* run : {&report.planned, &report.lru}) {
    EXPECT_EQ(run->bytes[static_cast<int>(offload::Link::kNvmeRead)], 0u);
  }
  const double lru_floor_seconds =
      static_cast<double>(report.lru.bytes[static_cast<int>(offload::Link::kHostToDevice)]) / (config.pcie_gbps * 1e9);
  EXPECT_GE(report.lru.stall_seconds, 0.9 * lru_floor_seconds);
  const double planned_seconds = pipeline["plan"]["predicted_stall_seconds"].get<double>();
  EXPECT_LT(planned_seconds, 0.6 * lru_floor_seconds) << FormatReplayBench(report);
}

// Two ranks replaying a small GPT of `layers` x `hidden` (no LRU run), and
// its trainable parameters.
ReplayBenchConfig TwoRanks(uint32_t layers, uint32_t hidden, uint64_t& params) {
  ReplayBenchConfig config;
  config.model.layers = layers;
  config.model.hidden = hidden;
  config.model.vocab = 512;
  config.model.sequence = 32;
  config.pcie_gbps = 8;
  config.ranks = 2;
  config.baseline = false;
  params = 0;
  for (const TensorSpec& spec : offload::GptTensorSpecs({.layers = layers, .hidden = hidden, .vocab = 512, .sequence = 32},
                                               DType::kBFloat16)) {
    if (spec.trainable) params += static_cast<uint64_t>(spec.num_elements());
  }
  return config;
}

// Two ranks over a throttled network: each sends (W-1)/W of the bf16
// gradients (reduce-scatter, in the grad dtype) and of the bf16 params
// (all-gather) a step, plus shard padding and tags, and the stall is reported.
TEST(ReplayBenchTest, RanksSendTheirShareOfGradientsAndParamsAndReportTheStall) {
  uint64_t params = 0;
  ReplayBenchConfig config = TwoRanks(2, 128, params);
  config.iterations = 1;
  config.net_gbps = 2;
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  const double expected = 0.5 * static_cast<double>(params) * (2 + 2);
  EXPECT_GE(static_cast<double>(report.planned.comm_bytes), expected);
  EXPECT_LE(static_cast<double>(report.planned.comm_bytes), 1.02 * expected);
  EXPECT_GE(report.planned.comm_stall_fraction, 0.0);
  EXPECT_LE(report.planned.comm_stall_fraction, 1.0);
  EXPECT_NE(FormatReplayBench(report).find("data parallel, 2 ranks over a 2 GB/s network"), std::string::npos);
  nlohmann::json json = nlohmann::json::parse(ReplayBenchJson(report));
  EXPECT_EQ(json["comm_bytes_per_rank"].get<uint64_t>(), report.planned.comm_bytes);
  config.ranks = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
}

// Parameters sharded (ZeRO-3): the params are gathered in forward and
// again in backward instead of once after the update, and the gradients
// reduce-scattered in bf16: ZeRO-3's 2 + 2 + 2 bytes a parameter, (W-1)/W of them, less the backward's first chunks (the last
// two gathered in forward are kept), plus the tied embedding's second
// gather in forward, tags and padding. (4 chunk groups: with one or two,
// the kept chunks would spare backward every gather.)
TEST(ReplayBenchTest, RanksWithShardedParamsGatherThemInForwardAndBackward) {
  uint64_t params = 0;
  ReplayBenchConfig config = TwoRanks(6, 256, params);
  config.iterations = 3;
  config.shard_params = true;
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  const double zero3 = 0.5 * static_cast<double>(params) * (2 + 2 + 2);
  EXPECT_GE(static_cast<double>(report.planned.comm_bytes), 0.85 * zero3);
  EXPECT_LE(static_cast<double>(report.planned.comm_bytes), 1.08 * zero3);
  EXPECT_NE(FormatReplayBench(report).find("data parallel, 2 ranks (parameters sharded)"), std::string::npos);
  EXPECT_TRUE(nlohmann::json::parse(ReplayBenchJson(report))["config"]["shard_params"].get<bool>());
}

TEST(ReplayBenchTest, OverlapBeginsEachUpdateDuringBackward) {
  ReplayBenchConfig config = SmallReplay(1);
  config.compute_ms = 20;  // a backward of 100 ms: the first updates begin well before it ends
  config.baseline = false;
  config.overlap = true;
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  EXPECT_EQ(report.divergences, 0u);
  // Every update but the embeddings' group's (two groups here), which backward's last pass makes final:
  // the step runs that one (Note [Overlapped updates]).
  ASSERT_EQ(report.updates, 2u);
  ASSERT_EQ(report.planned.overlap_spans.size(), report.updates - 1);
  EXPECT_LT(report.planned.overlap_spans.front().first, report.planned.backward_end_seconds);
  nlohmann::json json = nlohmann::json::parse(ReplayBenchJson(report));
  EXPECT_TRUE(json["config"]["overlap"].get<bool>());
  EXPECT_EQ(json["overlap_spans_seconds"].size(), report.updates - 1);
  EXPECT_NE(FormatReplayBench(report).find("1 of 1 began while backward went on (the step ran the other 1 updates"),
            std::string::npos);
  // Data parallel, likewise, each on its reduced shard (the engine's OverlapUpdates with the reducer), once
  // that shard's reduction is done: how soon is the machine's.
  config.ranks = 2;
  ASSERT_OK_AND_ASSIGN(report, RunReplayBench(config));
  EXPECT_EQ(report.divergences, 0u);
  EXPECT_EQ(report.planned.overlap_spans.size(), report.updates - 1);
  EXPECT_GT(report.planned.comm_bytes, 0u);
}

TEST(ReplayBenchTest, LayeredAccumulationMovesTheChunksOnceWhateverTheMicroBatches) {
  // A device below the parameters: every layer's chunks stream (Note [Layered accumulation]).
  const auto run = [](uint32_t micro_batches, bool layered) {
    ReplayBenchConfig config;
    config.model = {.layers = 4, .hidden = 256, .vocab = 1024, .sequence = 128, .batch = 1, .heads = 0};
    config.device_budget_bytes = 16 << 20;
    config.pcie_gbps = 8;
    config.compute_ms = 0.2;
    config.iterations = 1;
    config.baseline = false;
    config.accumulation = {.micro_batches = micro_batches, .layered = layered};
    Result<ReplayBenchReport> report = RunReplayBench(config);
    EXPECT_OK(report.status());
    if (!report.ok()) return ReplayBenchReport{};
    EXPECT_EQ(report->divergences, 0u);
    EXPECT_TRUE(report->plan_error.empty()) << report->plan_error;
    return *std::move(report);
  };
  const ReplayBenchReport layered_one = run(1, true), layered_four = run(4, true);
  const ReplayBenchReport standard_one = run(1, false), standard_four = run(4, false);
  const auto to_device = [](const ReplayBenchReport& r) {
    return static_cast<double>(r.planned.bytes[static_cast<int>(offload::Link::kHostToDevice)]);
  };
  const auto planned_to_device = [](const ReplayBenchReport& r) {
    return static_cast<double>(r.predicted_bytes[static_cast<int>(offload::Link::kHostToDevice)]);
  };
  // The plan moves each chunk up once a step whatever the micro-batches; standard moves them again every
  // micro-batch (2.8x at M = 4: some stay on the device between them).
  EXPECT_GT(planned_to_device(layered_one), 0);
  EXPECT_LE(planned_to_device(layered_four), 1.05 * planned_to_device(layered_one));
  EXPECT_GE(planned_to_device(standard_four), 2.5 * planned_to_device(standard_one));
  // The run adds what its timing costs (a chunk fetched on demand after a late eviction: one or two of
  // the eight here, more under load), never a move a micro-batch.
  EXPECT_GT(to_device(layered_one), 0);
  EXPECT_LE(to_device(layered_four), 1.5 * to_device(layered_one));
  // The headline, as run: at four micro-batches, layered moves under half of standard's traffic (a
  // quarter here).
  EXPECT_LT(to_device(layered_four), 0.5 * to_device(standard_four));
  for (const ReplayBenchReport* r : {&layered_one, &layered_four, &standard_one, &standard_four}) {
    // A moment a module pass, either order (Note [Accumulated steps]), and one an update.
    EXPECT_EQ(r->moments, r->config.accumulation.micro_batches * 2 * (4 + 2) + r->updates);
  }
  EXPECT_EQ(layered_four.boundary_bytes, 4 * layered_one.boundary_bytes);
  nlohmann::json json = nlohmann::json::parse(ReplayBenchJson(layered_four));
  EXPECT_EQ(json["config"]["accumulation"].get<std::string>(), "layered");
  EXPECT_EQ(json["config"]["micro_batches"].get<uint32_t>(), 4u);
  EXPECT_NE(FormatReplayBench(layered_four).find("4 micro-batches (layered)"), std::string::npos);
}

TEST(ReplayBenchTest, BadShapesAreInvalidArgument) {
  ReplayBenchConfig config;
  config.model.layers = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.model.layers = 2;
  config.pcie_gbps = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.pcie_gbps = 2;
  config.iterations = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.iterations = 1;
  config.accumulation.micro_batches = 0;
  Status no_micro_batches = RunReplayBench(config).status();
  EXPECT_EQ(no_micro_batches.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_micro_batches.message().find("--micro-batches"), std::string::npos) << no_micro_batches.ToString();
}

}  // namespace
}  // namespace strata::bench
