// strata plan [--layers N] [--hidden N] ... [--hbm 80GiB] [--dram 128GiB] [--nvme DIR]... [--json FILE]
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "offload/workloads/capacity_plan.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct PlanFlags {
  std::string model = "gpt";
  offload::ModelShape shape;
  offload::MachineSpec machine;
  std::string hbm = "80GiB";
  std::string dram = "128GiB";
  std::vector<std::string> nvme_dirs;
  std::string nvme_capacity = "0";
  std::string json_path;
  uint32_t micro_batches = 1;
  std::string accumulation = "standard";
  std::string states = "fp32";
};

// The machine's sizes from their flags; NVMe space: what the directories
// have free, unless --nvme-capacity says.
Status ParseMachineSizes(PlanFlags& flags) {
  for (auto [text, out, name] : {std::tuple{&flags.hbm, &flags.machine.hbm_bytes, "--hbm"},
                                 std::tuple{&flags.dram, &flags.machine.dram_bytes, "--dram"},
                                 std::tuple{&flags.nvme_capacity, &flags.machine.nvme_bytes, "--nvme-capacity"}}) {
    STRATA_ASSIGN_OR_RETURN(*out, ParseSizeFlag(name, *text));
  }
  if (flags.machine.nvme_bytes != 0) return Status::Ok();
  for (const std::string& dir : flags.nvme_dirs) {
    std::error_code error;
    const std::filesystem::space_info space = std::filesystem::space(dir, error);
    if (error) return IoError("--nvme {}: {}", dir, error.message());
    flags.machine.nvme_bytes += space.available;
  }
  return Status::Ok();
}

int RunPlan(PlanFlags flags) {
  if (flags.model != "gpt") return Fail(InvalidArgument("--model {}: only gpt is built", flags.model));
  Status sized = ParseMachineSizes(flags);
  if (!sized.ok()) return Fail(sized);
  const offload::Accumulation accumulation{.micro_batches = flags.micro_batches,
                                           .layered = flags.accumulation == "layered"};
  const DType moments = *ParseChunkDType(flags.states);  // one of the choices --states checks
  Result<offload::CapacityPlan> plan = offload::PlanCapacity(flags.shape, flags.machine, accumulation, moments);
  if (plan.ok() && accumulation.micro_batches > 1) {  // the other accumulation, to compare
    offload::Accumulation other = accumulation;
    other.layered = !other.layered;
    Result<offload::CapacityPlan> compared = offload::PlanCapacity(flags.shape, flags.machine, other, moments);
    if (compared.ok()) {
      plan->other_step_seconds = compared->step_seconds;
      plan->other_bytes_moved = compared->prediction.bytes_moved();
    } else {
      plan->other_error = compared.status().message();
    }
  }
  return PrintReport(std::move(plan), offload::FormatCapacityPlan, offload::CapacityPlanJson, flags.json_path);
}

}  // namespace

Command AddPlanCommand(CLI::App& parent) {
  auto flags = std::make_shared<PlanFlags>();
  offload::ModelShape& shape = flags->shape;
  offload::MachineSpec& machine = flags->machine;
  CLI::App* command = parent.add_subcommand(
      "plan", "what fits where for a GPT on a machine, the step time to expect and the bottleneck");
  command->add_option("--model", flags->model, "model family (gpt)")->capture_default_str();
  command->add_option("--layers", shape.layers, "transformer layers")->capture_default_str();
  command->add_option("--hidden", shape.hidden, "hidden size")->capture_default_str();
  command->add_option("--vocab", shape.vocab, "vocabulary")->capture_default_str();
  command->add_option("--seq", shape.sequence, "sequence length")->capture_default_str();
  command->add_option("--batch", shape.batch, "micro-batch")->capture_default_str();
  command->add_option("--heads", shape.heads, "attention heads; 0 = hidden / 64")->capture_default_str();
  command->add_option("--hbm", flags->hbm, "GPU memory")->capture_default_str();
  command->add_option("--hbm-reserve", machine.hbm_reserve_fraction,
                      "fraction of HBM kept for the CUDA context and workspace")->capture_default_str();
  command->add_option("--dram", flags->dram, "host memory strata may use for chunks")->capture_default_str();
  command->add_option("--nvme", flags->nvme_dirs, "NVMe directory (repeat); its free space counts");
  command->add_option("--nvme-capacity", flags->nvme_capacity, "NVMe space instead of the free space; 0 = measure")
      ->capture_default_str();
  command->add_option("--pcie-gbps", machine.pcie_gbps, "host<->device GB/s per direction")->capture_default_str();
  command->add_option("--nvme-read-gbps", machine.nvme_read_gbps, "NVMe read GB/s (all drives)")
      ->capture_default_str();
  command->add_option("--nvme-write-gbps", machine.nvme_write_gbps, "NVMe write GB/s (all drives)")
      ->capture_default_str();
  command->add_option("--gpu-tflops", machine.gpu_tflops, "sustained bf16 matmul TFLOPS")->capture_default_str();
  command->add_option("--cpu-adam-gparams", machine.cpu_adam_gparams,
                      "CPU AdamW rate, G params/s (see strata bench optim)")->capture_default_str();
  command->add_option("--gpu-adam-gparams", machine.gpu_adam_gparams, "GPU AdamW rate, G params/s")
      ->capture_default_str();
  command->add_option("--micro-batches", flags->micro_batches, "micro-batches a step (gradient accumulation)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  command->add_option("--accumulation", flags->accumulation,
                      "standard (the model once per micro-batch) or layered (each layer for every micro-batch in "
                      "turn); with several micro-batches the other is predicted too")
      ->check(CLI::IsMember({"standard", "layered"}))
      ->capture_default_str();
  command->add_option("--states", flags->states, "optimizer.states: the moments' dtype, fp32, bf16 or int8")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}))
      ->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the plan as JSON to this file");
  return {command, [flags] { return RunPlan(*flags); }};
}

}  // namespace strata::cli
