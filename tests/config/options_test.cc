#include "strata/options.h"

#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "optim/loss_scaler.h"
#include "strata/engine.h"
#include "optim/optimizer.h"
#include "test_util.h"

namespace strata {
namespace {

void ExpectInvalid(const Status& status, const std::string& must_mention) {
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find(must_mention), std::string::npos)
      << "message '" << status.message() << "' does not mention '" << must_mention << "'";
}

TEST(ParseSizeTest, AcceptsBinaryDecimalAndPlainBytes) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("64MiB"), 64u << 20);
  EXPECT_EQ(*ParseSize("1.5GiB"), (3ull << 30) / 2);
  EXPECT_EQ(*ParseSize("2GB"), 2'000'000'000u);
  EXPECT_EQ(*ParseSize(" 8 KiB "), 8192u);
  EXPECT_EQ(*ParseSize("1G"), 1ull << 30);
}

TEST(ParseSizeTest, RejectsNonSizes) {
  for (const char* bad : {"", "MiB", "-1", "12XB", "1.2.3GiB", "abc"}) {
    Result<size_t> parsed = ParseSize(bad);
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find("64MiB"), std::string::npos);
    }
  }
}

TEST(FormatSizeTest, RoundTripsThroughParseSize) {
  for (size_t bytes : {size_t{0}, size_t{512}, size_t{4096}, size_t{64} << 20, size_t{3} << 30}) {
    EXPECT_EQ(*ParseSize(FormatSize(bytes)), bytes) << FormatSize(bytes);
  }
}

TEST(OptionsTest, SetOptionUpdatesEachKind) {
  Options options;
  ASSERT_OK(SetOption(options, "device.budget", "2GiB"));
  ASSERT_OK(SetOption(options, "nvme.dirs", "/a, /b"));
  ASSERT_OK(SetOption(options, "nvme.queue_depth", "64"));
  ASSERT_OK(SetOption(options, "nvme.allow_buffered_io", "true"));
  ASSERT_OK(SetOption(options, "device.backend", "emulated"));
  ASSERT_OK(SetOption(options, "device.emulated_bandwidth_gbps", "12.5"));
  ASSERT_OK(SetOption(options, "precision", "bf16"));
  EXPECT_EQ(options.device.budget_bytes, size_t{2} << 30);
  EXPECT_EQ(options.nvme.dirs, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(options.nvme.queue_depth, 64u);
  EXPECT_TRUE(options.nvme.allow_buffered_io);
  EXPECT_EQ(options.device.backend, DeviceBackendKind::kEmulated);
  EXPECT_DOUBLE_EQ(options.device.emulated_bandwidth_gbps, 12.5);
  EXPECT_EQ(options.compute_dtype, DType::kBFloat16);
}

std::string Described(const Options& options, const std::string& key) {
  for (const auto& [k, v] : DescribeOptions(options)) {
    if (k == key) return v;
  }
  return "";
}

TEST(OptionsTest, TheDeviceBudgetIsAutoUnlessGivenASize) {
  Options options;
  EXPECT_TRUE(options.device.budget_auto);
  EXPECT_EQ(Described(options, "device.budget"), "auto");
  ASSERT_OK(SetOption(options, "device.budget", "2GiB"));
  EXPECT_FALSE(options.device.budget_auto);
  EXPECT_EQ(options.device.budget_bytes, size_t{2} << 30);
  EXPECT_EQ(Described(options, "device.budget"), "2GiB");
  ASSERT_OK(SetOption(options, "device.budget", "auto"));
  EXPECT_TRUE(options.device.budget_auto);
  Status bad = SetOption(options, "device.budget", "lots");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("or auto"), std::string::npos) << bad.ToString();
  // On the emulated device auto is the size the options hold; the engine's options say which it took.
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 8 << 20;
  options.host.budget_bytes = 32 << 20;
  options.log_level = LogLevel::kWarning;
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options));
  EXPECT_FALSE(engine->options().device.budget_auto);
  EXPECT_EQ(engine->options().device.budget_bytes, size_t{8} << 20);
  EXPECT_EQ(engine->stats().tiers[static_cast<int>(Tier::kDevice)].capacity_bytes, uint64_t{8} << 20);
}

TEST(OptionsTest, TheHostBudgetIsAutoUnlessGivenASize) {
  Options options;
  EXPECT_EQ(options.host.budget_bytes, 0u);
  EXPECT_EQ(Described(options, "host.budget"), "auto");
  ASSERT_OK(SetOption(options, "host.budget", "3GiB"));
  EXPECT_EQ(options.host.budget_bytes, size_t{3} << 30);
  EXPECT_EQ(Described(options, "host.budget"), "3GiB");
  ASSERT_OK(SetOption(options, "host.budget", "auto"));
  EXPECT_EQ(options.host.budget_bytes, 0u);
  ASSERT_OK(ValidateOptions(options));
  Status bad = SetOption(options, "host.budget", "plenty");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("or auto"), std::string::npos) << bad.ToString();
  // A size set directly, as C++ callers do, is taken as it is, at Create; auto is sized at Finalize.
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 8 << 20;
  options.log_level = LogLevel::kWarning;
  options.host.budget_bytes = 32 << 20;
  ASSERT_OK_AND_ASSIGN(auto sized, Engine::Create(options));
  EXPECT_EQ(sized->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, uint64_t{32} << 20);
  options.host.budget_bytes = 0;
  ASSERT_OK_AND_ASSIGN(auto automatic, Engine::Create(options));
  EXPECT_EQ(automatic->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, 0u);
  ASSERT_OK(automatic->RegisterTensor({"w", {1024}, DType::kFloat32, true, "m"}).status());
  ASSERT_OK(automatic->Finalize());
  EXPECT_GT(automatic->options().host.budget_bytes, 0u);
  EXPECT_EQ(automatic->options().host.budget_bytes,
            automatic->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes);
}

TEST(OptionsTest, BadValuesNameKeyValueAndWhatIsAllowed) {
  Options options;
  ExpectInvalid(SetOption(options, "device.budget", "lots"), "device.budget");
  ExpectInvalid(SetOption(options, "device.budget", "lots"), "lots");
  ExpectInvalid(SetOption(options, "nvme.queue_depth", "0"), "allowed 1..4096");
  ExpectInvalid(SetOption(options, "nvme.queue_depth", "-3"), "nvme.queue_depth");
  ExpectInvalid(SetOption(options, "device.backend", "tpu"), "expected one of auto, emulated, cuda");
  ExpectInvalid(SetOption(options, "precision", "fp8"), "expected fp32, bf16 or fp16");
  ExpectInvalid(SetOption(options, "host.numa_local", "maybe"), "expected true or false");
  ExpectInvalid(SetOption(options, "device.emulated_bandwidth_gbps", "-1"), "allowed 0..");
  ExpectInvalid(SetOption(options, "log.level", "loud"), "log.level");
}

TEST(OptionsTest, UnknownKeyListsKnownKeys) {
  Options options;
  Status status = SetOption(options, "device.budgett", "1GiB");
  ExpectInvalid(status, "device.budgett");
  ExpectInvalid(status, "device.budget,");
}

TEST(OptionsTest, JsonNestedAndDottedKeysAreEquivalent) {
  Options nested, dotted;
  ASSERT_OK(ApplyOptionsJson(nested, R"({"device": {"budget": "512MiB", "backend": "emulated"},
                                         "nvme": {"dirs": ["/x", "/y"], "queue_depth": 8}, "precision": "fp16"})"));
  ASSERT_OK(ApplyOptionsJson(dotted, R"({"device.budget": 536870912, "device.backend": "emulated",
                                         "nvme.dirs": ["/x", "/y"], "nvme.queue_depth": "8", "precision": "fp16"})"));
  EXPECT_EQ(DescribeOptions(nested), DescribeOptions(dotted));
  EXPECT_EQ(nested.device.budget_bytes, size_t{512} << 20);
  EXPECT_EQ(nested.nvme.dirs.size(), 2u);
}

TEST(OptionsTest, JsonErrorsNameTheKey) {
  Options options;
  ExpectInvalid(ApplyOptionsJson(options, R"({"host": {"budgett": 1}})"), "host.budgett");
  ExpectInvalid(ApplyOptionsJson(options, R"({"nvme": {"dirs": [1, 2]}})"), "nvme.dirs");
  ExpectInvalid(ApplyOptionsJson(options, "{not json"), "not valid JSON");
  ExpectInvalid(ApplyOptionsJson(options, "[1, 2]"), "expected a JSON object");
}

TEST(OptionsTest, FileLoadingNamesThePath) {
  testing::ScratchDir dir("options");
  std::string path = dir.path() + "/strata.json";
  std::ofstream(path) << R"({"host": {"budget": "3GiB"}})";
  Options options;
  ASSERT_OK(ApplyOptionsFile(options, path));
  EXPECT_EQ(options.host.budget_bytes, size_t{3} << 30);

  std::ofstream(path) << R"({"host": {"budget": "three"}})";
  Status bad = ApplyOptionsFile(options, path);
  ExpectInvalid(bad, path);
  ExpectInvalid(bad, "host.budget");
  EXPECT_EQ(ApplyOptionsFile(options, dir.path() + "/missing.json").code(), StatusCode::kIoError);
}

TEST(OptionsTest, ValidateChecksRelationsBetweenKeys) {
  Options options;
  EXPECT_OK(ValidateOptions(options));
  options.nvme.block_size_bytes = 5000;
  ExpectInvalid(ValidateOptions(options), "nvme.block_size");
  options = Options();
  options.chunk.search_min_elems = 10;
  options.chunk.search_max_elems = 5;
  ExpectInvalid(ValidateOptions(options), "chunk.search_min_elems");
  options = Options();
  options.device.budget_bytes = 0;
  ExpectInvalid(ValidateOptions(options), "device.budget");
}

TEST(OptionsTest, ChunkBoundsAndNvmeCapacityLeftUnsetAreDerivedNotRefused) {
  Options options;
  EXPECT_EQ(options.chunk.search_min_elems, 0u);  // derived from the budgets and the model at Finalize
  EXPECT_EQ(options.chunk.search_max_elems, 0u);
  EXPECT_EQ(options.nvme.capacity_bytes, 0u);     // what the model states need on NVMe
  ASSERT_OK(SetOption(options, "nvme.dirs", "/mnt/nvme0"));
  EXPECT_OK(ValidateOptions(options));
  ASSERT_OK(SetOption(options, "chunk.search_min_elems", "4096"));  // one bound given, the other derived
  EXPECT_OK(ValidateOptions(options));
  ASSERT_OK(SetOption(options, "chunk.search_max_elems", "0"));
  EXPECT_OK(ValidateOptions(options));
}

TEST(OptionsTest, ValidateChecksFieldsSetDirectlyAgainstTheirKeysRanges) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    std::function<void(Options&)> set;
    std::string key;
  };
  const std::vector<Case> cases = {
      {[&](Options& o) { o.optimizer.lr = nan; }, "optimizer.lr"},
      {[&](Options& o) { o.optimizer.beta1 = 1.5; }, "optimizer.beta1"},
      {[&](Options& o) { o.optimizer.eps = 0; }, "optimizer.eps"},
      {[&](Options& o) { o.optimizer.dampening = 2; }, "optimizer.dampening"},
      {[&](Options& o) { o.loss_scale.growth_factor = inf; }, "loss_scale.growth_factor"},
      {[&](Options& o) { o.loss_scale.growth_interval = 0; }, "loss_scale.growth_interval"},
      {[&](Options& o) { o.loss_scale.min = 0; }, "loss_scale.min"},
      {[&](Options& o) { o.device.index = -1; }, "device.index"},
      {[&](Options& o) { o.device.emulated_bandwidth_gbps = -1; }, "device.emulated_bandwidth_gbps"},
      {[&](Options& o) { o.placement.device_params = 1.5; }, "placement.device_params"},
      // Within the key's range as a double, but 1 once rounded to the fp32 the loss scaler holds.
      {[&](Options& o) { o.loss_scale.growth_factor = 1.00000001; }, "loss_scale.growth_factor"},
      {[&](Options& o) { o.loss_scale.backoff_factor = 0.99999999; }, "loss_scale.backoff_factor"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    Options options;
    c.set(options);
    ExpectInvalid(ValidateOptions(options), c.key);
  }
}

TEST(OptionsTest, LogLevelTakesWarnAsWarning) {
  Options options;
  ASSERT_OK(SetOption(options, "log.level", "warn"));
  EXPECT_EQ(options.log_level, LogLevel::kWarning);
  EXPECT_EQ(DescribeOptions(options).back(), (std::pair<std::string, std::string>{"log.level", "warning"}));
}

TEST(OptionsTest, OptimizerKeysBecomeTheOptimizerConfig) {
  Options options;
  ASSERT_OK(ApplyOptionsJson(options, R"({"optimizer": {"kind": "sgd", "lr": 0.05, "momentum": 0.9,
                                                         "nesterov": true, "max_grad_norm": 1.0},
                                           "optimizer.stream_ring": "256MiB"})"));
  ASSERT_OK(ValidateOptions(options));
  ASSERT_OK_AND_ASSIGN(optim::OptimizerConfig config, optim::OptimizerConfigFromOptions(options));
  EXPECT_EQ(config.kind, optim::OptimizerKind::kSgd);
  EXPECT_FLOAT_EQ(config.lr, 0.05f);
  EXPECT_FLOAT_EQ(config.momentum, 0.9f);
  EXPECT_TRUE(config.nesterov);
  EXPECT_FLOAT_EQ(config.max_grad_norm, 1.0f);
  EXPECT_EQ(options.optimizer.stream_ring_bytes, size_t{256} << 20);

  ExpectInvalid(SetOption(options, "optimizer.kind", "lamb"), "optimizer.kind");
  ExpectInvalid(SetOption(options, "optimizer.beta2", "1.5"), "optimizer.beta2");
  ExpectInvalid(SetOption(options, "loss_scale.mode", "static"), "loss_scale.mode");
  options.optimizer.momentum = 0;  // nesterov without momentum
  ExpectInvalid(ValidateOptions(options), "nesterov");
}

TEST(OptionsTest, LossScalingIsDynamicForFp16UnlessSaidOtherwise) {
  Options options;
  EXPECT_FALSE(optim::LossScalerConfigFromOptions(options).has_value());  // fp32
  ASSERT_OK(SetOption(options, "precision", "fp16"));
  ASSERT_OK(SetOption(options, "loss_scale.init", "1024"));
  std::optional<optim::LossScalerConfig> scaler = optim::LossScalerConfigFromOptions(options);
  ASSERT_TRUE(scaler.has_value());
  EXPECT_EQ(scaler->init_scale, 1024.0f);
  ASSERT_OK(SetOption(options, "loss_scale.mode", "off"));
  EXPECT_FALSE(optim::LossScalerConfigFromOptions(options).has_value());
  ASSERT_OK(SetOption(options, "precision", "bf16"));
  ASSERT_OK(SetOption(options, "loss_scale.mode", "dynamic"));
  ASSERT_OK(SetOption(options, "loss_scale.min", "4096"));  // above init
  ExpectInvalid(ValidateOptions(options), "loss_scale.min");
  ASSERT_OK(SetOption(options, "loss_scale.mode", "off"));  // checked even when off
  ExpectInvalid(ValidateOptions(options), "loss_scale.min");
}

TEST(OptionsTest, EveryDocumentedKeyHasADefaultThatParses) {
  Options options;
  auto values = DescribeOptions(options);
  ASSERT_EQ(values.size(), OptionDocs().size());
  for (const auto& [key, value] : values) {
    Options copy;
    EXPECT_OK(SetOption(copy, key, value));
    EXPECT_EQ(DescribeOptions(copy), values) << key;
  }
}

TEST(OptionsTest, TheEngineWaitsAsLongAsTheSlowerOfItsMovesMayTake) {
  Options options;
  ASSERT_OK(SetOption(options, "nvme.io_timeout_ms", "90000"));  // a slow drive's, past the copies' 60 s
  EXPECT_EQ(EngineWaitTimeoutMs(options), 90'000u);
  ASSERT_OK(SetOption(options, "device.copy_timeout_ms", "120000"));
  EXPECT_EQ(EngineWaitTimeoutMs(options), 120'000u);
}

}  // namespace
}  // namespace strata
