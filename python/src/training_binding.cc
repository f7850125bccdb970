// Training in Python: the optimizer, the prefetch pipeline's moments, one
// training step over them, and the data-parallel gradient reducer.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "strata/checkpoint.h"
#include "offload/schedule/pipeline.h"
#include "offload/training/grad_reducer.h"
#include "offload/training/train_step.h"
#include "optim/cpu/cpu_kernels.h"
#include "optim/optimizer.h"
#include "optim/state_codec.h"
#include "python/src/binding.h"
#include "strata/comm.h"
#include "strata/engine.h"

namespace strata::python {

namespace {

// A GradReducer as Python holds it. Closing (or collecting) it waits for its
// queued reductions with the GIL released: a Python communicator's jobs need
// the GIL to finish, and MPI's may wait out their timeout.
class PyGradReducer {
 public:
  explicit PyGradReducer(std::unique_ptr<offload::GradReducer> reducer) : reducer_(std::move(reducer)) {}
  ~PyGradReducer() { Close(); }
  offload::GradReducer& get() {
    if (!reducer_) throw std::runtime_error("GradReducer: closed");
    return *reducer_;
  }
  bool open() const { return reducer_ != nullptr; }
  void Close() {
    if (!reducer_) return;
    // On the reducer's own thread (Python's garbage collector run inside a
    // Python collective) it cannot be joined: python/strata/grad_sync.py
    // closes it at exit instead; a wrapper collected there anyway leaks it.
    if (reducer_->OnOwnThread()) {
      static_cast<void>(reducer_.release());  // leaked on purpose: no thread may join it
      return;
    }
    py::gil_scoped_release unlocked;
    reducer_.reset();
  }

 private:
  std::unique_ptr<offload::GradReducer> reducer_;
};

// A train step's report as a dict.
py::dict TrainStepDict(const offload::TrainStepReport& report) {
  py::dict d;
  d["skipped"] = report.plan.skip;
  d["step"] = report.plan.step;
  d["grad_norm"] = report.plan.grad_norm;
  d["loss_scale"] = report.plan.loss_scale;
  const offload::StepSeconds& s = report.seconds;
  d["phases"] = py::dict(py::arg("overlap_wait") = s.overlap_wait, py::arg("merge") = s.merge,
                         py::arg("stats") = s.stats, py::arg("plan") = s.plan, py::arg("access") = s.access,
                         py::arg("kernel") = s.kernel, py::arg("put_back") = s.put_back,
                         py::arg("gather") = s.gather, py::arg("release") = s.release, py::arg("finish") = s.finish);
  d["train_step_seconds"] = s.total;
  d["kernel_elems"] = report.kernel_elems;
  d["stats_read_groups"] = report.stats_read_groups;
  d["stats_copied_bytes"] = report.stats_copied_bytes;
  d["groups"] = report.groups;
  d["comm_bytes"] = report.comm_bytes;
  d["comm_wait_seconds"] = report.comm_wait_seconds;
  d["overlap_groups"] = report.overlap_groups;
  d["redone_groups"] = report.redone_groups;
  return d;
}

}  // namespace

namespace {

// `buffer` as one contiguous dimension of T (writable if asked), of `size` elements where given.
template <typename T>
py::buffer_info Contiguous(const py::buffer& buffer, const char* name, bool writable, ssize_t size = -1) {
  py::buffer_info info = buffer.request(writable);
  if (info.format != py::format_descriptor<T>::format() || info.ndim != 1 || info.strides[0] != sizeof(T) ||
      (size >= 0 && info.size != size)) {
    throw py::value_error(fmt::format("{} must be one contiguous dimension of {}{}; got format '{}', {} dimension(s), "
                                      "{} elements",
                                      name, std::is_same_v<T, float> ? "float32" : "uint8",
                                      size >= 0 ? fmt::format(" of {} elements", size) : "", info.format, info.ndim,
                                      info.size));
  }
  return info;
}

// The 8-bit states' codec (optim/state_codec.h) and update (the scalar
// reference), for checks against other implementations.
void BindStateCodec(py::module_& m) {
  m.def(
      "state_code_map",
      [](bool is_signed) {
        const optim::StateCodeMap& map = optim::CodeMap(is_signed);
        return std::vector<float>(map.begin(), map.end());
      },
      py::arg("signed"), "the 256 values the codes of 8-bit states stand for, ascending (signed: the first moment's)");
  m.def(
      "quantize_states",
      [](const py::buffer& values, bool is_signed) {
        const py::buffer_info info = Contiguous<float>(values, "quantize_states: values", false);
        if (info.size % static_cast<ssize_t>(optim::kStateBlockElems) != 0) {
          throw py::value_error(fmt::format("quantize_states: {} values; they must come in whole blocks of {}",
                                            info.size, optim::kStateBlockElems));
        }
        const auto n = static_cast<size_t>(info.size);
        std::string codes(n, '\0'), scales(n / optim::kStateBlockElems * sizeof(float), '\0');
        optim::QuantizeBlocks(static_cast<const float*>(info.ptr), n, is_signed, reinterpret_cast<uint8_t*>(codes.data()),
                              reinterpret_cast<float*>(scales.data()));
        return py::make_tuple(py::bytes(codes), py::bytes(scales));
      },
      py::arg("values"), py::arg("signed"),
      "(codes, scales) of float32 `values` as 8-bit states: a byte a value, a float32 scale a block of 256");
  m.def(
      "adam8bit_step",
      [](const py::buffer& weights, const py::buffer& grads, std::array<py::buffer, 2> codes,
         std::array<py::buffer, 2> scales, int64_t step, double lr, std::pair<double, double> betas, double eps,
         double weight_decay, bool adamw) {
        const py::buffer_info w = Contiguous<float>(weights, "weights", true);
        const auto n = static_cast<size_t>(w.size);
        const py::buffer_info g = Contiguous<float>(grads, "grads", false, n);
        const py::buffer_info c0 = Contiguous<uint8_t>(codes[0], "codes", true, n);
        const py::buffer_info c1 = Contiguous<uint8_t>(codes[1], "codes", true, n);
        const py::buffer_info s0 = Contiguous<float>(scales[0], "scales", true, n / optim::kStateBlockElems);
        const py::buffer_info s1 = Contiguous<float>(scales[1], "scales", true, n / optim::kStateBlockElems);
        if (n % optim::kStateBlockElems != 0 || step < 1) {
          throw py::value_error(fmt::format("adam8bit_step: {} weights (whole blocks of {} needed), step {} (>= 1)", n,
                                            optim::kStateBlockElems, step));
        }
        const optim::OptimizerConfig config{.kind = adamw ? optim::OptimizerKind::kAdamW : optim::OptimizerKind::kAdam,
                                            .lr = lr,
                                            .beta1 = betas.first,
                                            .beta2 = betas.second,
                                            .eps = eps,
                                            .weight_decay = weight_decay};
        uint8_t* const code_ptrs[2] = {static_cast<uint8_t*>(c0.ptr), static_cast<uint8_t*>(c1.ptr)};
        float* const scale_ptrs[2] = {static_cast<float*>(s0.ptr), static_cast<float*>(s1.ptr)};
        optim::scalar::Adam8bitUpdate(optim::MakeAdam8bitConstants(config, step), static_cast<float*>(w.ptr),
                                      static_cast<const float*>(g.ptr), code_ptrs, scale_ptrs, n);
      },
      py::arg("weights"), py::arg("grads"), py::arg("codes"), py::arg("scales"), py::kw_only(), py::arg("step"),
      py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true,
      "one step of the scalar 8-bit Adam(W) reference in place: float32 weights, their float32 grads, the two "
      "moments' codes (uint8, a value each) and scales (float32, a block each)");
}

}  // namespace

void BindOptimizer(py::module_& m) {
  py::class_<optim::Optimizer, std::unique_ptr<optim::Optimizer>>(
      m, "Optimizer", "strata's optimizer over chunk groups, from the optimizer.* and loss_scale.* keys")
      .def(py::init([](const Options& options, uint32_t num_groups) {
             const optim::OptimizerConfig config = ValueOrThrow(optim::OptimizerConfigFromOptions(options));
             return ValueOrThrow(
                 optim::Optimizer::Create(config, optim::LossScalerConfigFromOptions(options), num_groups));
           }),
           py::arg("options"), py::arg("num_groups") = 1)
      .def_property_readonly("num_groups", &optim::Optimizer::num_groups)
      .def(
          "group",
          [](const optim::Optimizer& o, uint32_t group) {
            if (group >= o.num_groups()) throw py::index_error(fmt::format("no param group {}", group));
            const optim::GroupHyperparams g = o.group(group);
            return py::dict(py::arg("lr") = g.lr, py::arg("betas") = py::make_tuple(g.beta1, g.beta2),
                            py::arg("eps") = g.eps, py::arg("weight_decay") = g.weight_decay,
                            py::arg("momentum") = g.momentum, py::arg("dampening") = g.dampening,
                            py::arg("nesterov") = g.nesterov);
          },
          py::arg("group"), "param group `group`'s hyperparameters: lr, betas, eps, weight_decay, momentum, ...")
      .def(
          "set_group",
          [](optim::Optimizer& o, uint32_t group, double lr, std::pair<double, double> betas, double eps,
             double weight_decay, double momentum, double dampening, bool nesterov) {
            ThrowIfError(o.SetGroup(group, {.lr = lr,
                                            .beta1 = betas.first,
                                            .beta2 = betas.second,
                                            .eps = eps,
                                            .weight_decay = weight_decay,
                                            .momentum = momentum,
                                            .dampening = dampening,
                                            .nesterov = nesterov}));
          },
          py::arg("group"), py::kw_only(), py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"),
          "sets param group `group`'s hyperparameters for the next updates; ValueError naming the group and the "
          "field when one is out of range")
      .def_property_readonly("loss_scale", &optim::Optimizer::loss_scale)
      .def_property_readonly("steps_taken", &optim::Optimizer::steps_taken);
  BindStateCodec(m);
}

void BindPipeline(py::module_& m) {
  using offload::Pipeline;
  py::class_<Pipeline, std::unique_ptr<Pipeline>>(
      m, "Pipeline", "the prefetch pipeline: moments of an iteration, traced, planned and replayed")
      .def(py::init([](Engine& engine, uint64_t device_bytes) {
             offload::PipelineOptions options = offload::PipelineOptionsOf(engine.options());
             options.device_bytes = device_bytes;
             return ValueOrThrow(Pipeline::Create(engine, options));
           }),
           py::arg("engine"), py::arg("device_bytes") = 0, py::keep_alive<1, 2>(),
           "device_bytes: device memory for chunks and the framework's memory together (0: device.budget; "
           "chunks take at most device.budget of it)")
      .def("begin_iteration", [](Pipeline& p) { ThrowIfError(p.BeginIteration()); })
      .def(
          "begin_moment",
          [](Pipeline& p, uint64_t non_model_bytes) {
            ThrowIfError(Unlocked([&] { return p.BeginMoment(non_model_bytes); }));
          },
          py::arg("non_model_bytes") = 0)
      .def(
          "access",
          [](Pipeline& p, Engine& engine, uint32_t chunk) {
            return Held(engine, ValueOrThrow(Unlocked([&] { return p.Access(ChunkId(chunk)); })));
          },
          py::arg("engine"), py::arg("chunk"), py::keep_alive<0, 1>(),
          "pins a chunk where the moment computes (the pipeline's engine); waits for its planned transfer")
      .def("end_moment", [](Pipeline& p) { ThrowIfError(p.EndMoment()); })
      .def("end_iteration", [](Pipeline& p) { ThrowIfError(Unlocked([&] { return p.EndIteration(); })); })
      .def("drain", [](Pipeline& p) { ThrowIfError(Unlocked([&] { return p.Drain(); })); },
           "waits for every move and update queued to end: before the engine closes")
      .def("stats_json", &Pipeline::StatsJson)
      .def(
          "timeline",
          [](const Pipeline& p, const Engine& engine) {
            const MemoryStats stats = engine.stats();
            py::list timeline;
            for (const Pipeline::TierBytes& used : p.last_timeline()) {
              py::dict moment;
              for (int t = 0; t < kNumTiers; ++t) {
                if (stats.tier_present[t]) moment[py::str(std::string(TierName(static_cast<Tier>(t))))] = used[t];
              }
              timeline.append(moment);
            }
            return timeline;
          },
          py::arg("engine"),
          "each tier's bytes in use as each device moment of the last ended iteration began, and as it ended");
}

void BindTrainStep(py::module_& m) {
  m.def(
      "check_step_room",
      [](const Engine& engine, const optim::Optimizer& optimizer) {
        ThrowIfError(offload::CheckStepRoom(engine, optimizer));
      },
      py::arg("engine"), py::arg("optimizer"),
      "MemoryError, naming host.budget, when the host tier cannot hold one chunk group's chunks at once, as the "
      "step's update needs them");
  m.def(
      "train_step",
      [](Engine& engine, offload::Pipeline& pipeline, optim::Optimizer& optimizer,
         const std::vector<uint32_t>& skip_tensors, Communicator* comm, PyGradReducer* reducer,
         offload::PendingCheckpoint* fence, uintptr_t stream, offload::OverlapUpdates* overlap) {
        std::vector<bool> skip(engine.tensors().size(), false);
        for (uint32_t t : skip_tensors) skip.at(t) = true;
        return TrainStepDict(ValueOrThrow(Unlocked([&] {
          return offload::RunTrainStep(engine, pipeline, optimizer,
                                       {.skip = std::move(skip),
                                        .comm = comm,
                                        .reducer = reducer != nullptr ? &reducer->get() : nullptr,
                                        .fence = fence,
                                        .compute_stream = stream,
                                        .overlap = overlap});
        })));
      },
      py::arg("engine"), py::arg("pipeline"), py::arg("optimizer"), py::arg("skip_tensors") = std::vector<uint32_t>{},
      py::arg("comm") = nullptr, py::arg("reducer") = nullptr, py::arg("fence") = nullptr, py::arg("stream") = 0,
      py::arg("overlap") = nullptr,
      "the optimizer step over every trainable chunk group, in host moments of the open iteration; "
      "skip_tensors (ids) are left as they are; with fence (a PendingCheckpoint) each group's update waits "
      "until the save has read the group; on a GPU, updates the plan runs there are queued on stream (the "
      "framework's, where it wrote the gradients: torch.cuda.Stream.cuda_stream); overlap (OverlapUpdates): the "
      "updates it began in backward, confirmed or redone");
  py::class_<offload::OverlapUpdates, std::unique_ptr<offload::OverlapUpdates>>(
      m, "OverlapUpdates",
      "optimizer updates begun in backward, each once its chunk group's gradients are final, beside the rest of "
      "it; the step confirms or redoes them (offload/training/overlap_updates.h)")
      .def(py::init([](Engine& engine, offload::Pipeline& pipeline, optim::Optimizer& optimizer,
                       std::optional<uint64_t> kept_bytes, PyGradReducer* reducer) {
             // Default: the engine's optimizer.overlap, exactly (a size read back from describe() is rounded).
             const uint64_t kept = kept_bytes.value_or(engine.options().optimizer.overlap_bytes);
             return ValueOrThrow(offload::OverlapUpdates::Create(
                 engine, pipeline, optimizer,
                 {.kept_bytes = kept, .reducer = reducer != nullptr ? &reducer->get() : nullptr}));
           }),
           py::arg("engine"), py::arg("pipeline"), py::arg("optimizer"), py::arg("kept_bytes") = std::nullopt,
           py::arg("reducer") = nullptr, py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<1, 4>(),
           py::keep_alive<1, 6>())
      .def_property_readonly("kept_bytes", &offload::OverlapUpdates::kept_bytes,
                             "host memory the updates' copies may take (optimizer.overlap)")
      .def(
          "begin",
          [](offload::OverlapUpdates& b, uint32_t grad) {
            return ValueOrThrow(Unlocked([&] { return b.Begin(ChunkId(grad)); }));
          },
          py::arg("grad_chunk"),
          "its group's gradients are final: its update begins beside what follows when its copy fits; whether it "
          "did. Between moments of the open iteration")
      .def("late", [](offload::OverlapUpdates& b, uint32_t grad) { return b.Late(ChunkId(grad)); },
           py::arg("grad_chunk"),
           "gradients came into the chunk after its group's update began: the step redoes it from the whole")
      .def("wait", [](offload::OverlapUpdates& b) { ThrowIfError(Unlocked([&] { return b.Wait(); })); },
           "waits for the updates in flight; raises the first error")
      .def("discard", [](offload::OverlapUpdates& b) { Unlocked([&] { b.Discard(); }); },
           "forgets this step's updates once done (after a failure)")
      .def("undo", [](offload::OverlapUpdates& b) { ThrowIfError(Unlocked([&] { return b.Undo(); })); },
           "puts every group this step's updates changed back as it was, and forgets them (a forward before the "
           "step); between moments");
}

void BindGradReducer(py::module_& m) {
  py::class_<PyGradReducer, std::unique_ptr<PyGradReducer>>(
      m, "GradReducer",
      "data parallel: the gradient reduce-scatter of each chunk group on a thread of its own, submitted as the "
      "group's gradients complete in backward (offload/training/grad_reducer.h)")
      .def(py::init([](Engine& engine, Communicator& comm) {
             return std::make_unique<PyGradReducer>(std::make_unique<offload::GradReducer>(engine, comm));
           }),
           py::arg("engine"), py::arg("comm"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def(
          "submit",
          [](PyGradReducer& r, uint32_t chunk) {
            ThrowIfError(Unlocked([&] { return r.get().Submit(ChunkId(chunk)); }));
          },
          py::arg("chunk"), "copies a grad chunk and queues its reduce-scatter")
      .def(
          "submitted", [](PyGradReducer& r, uint32_t chunk) { return r.get().submitted(ChunkId(chunk)); },
          py::arg("chunk"))
      .def("drain", [](PyGradReducer& r) { ThrowIfError(Unlocked([&] { return r.get().Drain(); })); },
           "waits for every queued reduction")
      .def(
          "gather",
          [](PyGradReducer& r, const PyAccess& into) {
            ThrowIfError(Unlocked([&] { return r.get().Gather(into.access.id(), into.access); }));
          },
          py::arg("into"),
          "parameters sharded: fills a pinned transient param chunk from every rank's master shard (nothing is "
          "sent for one of the last two chunks gathered)")
      .def("release_gathered",
           [](PyGradReducer& r) {
             ThrowIfError(Unlocked([&] {
               r.get().ReleaseGathered();  // waits for the gathers queued ahead, which a Python communicator runs
               return Status::Ok();
             }));
           },
           "lets the kept gathered chunks go and drops those gathered ahead")
      .def_property_readonly("gathers", [](PyGradReducer& r) { return r.get().gathers(); },
                             "parameter all-gathers that communicated")
      .def_property_readonly("gathered_ahead", [](PyGradReducer& r) { return r.get().gathered_ahead(); },
                             "of them, those queued ahead of their need (the last step's sequence)")
      .def_property_readonly("filled_ahead", [](PyGradReducer& r) { return r.get().filled_ahead(); },
                             "of those, the ones whose device chunk was filled ahead too (the access copied nothing)")
      .def("close", &PyGradReducer::Close,
           "waits for what is queued and stops the reducer's thread (also when it is collected); later calls raise")
      .def("on_own_thread", [](PyGradReducer& r) { return r.open() && r.get().OnOwnThread(); },
           "whether the caller runs on the reducer's thread (a Python communicator's collective, or the garbage "
           "collector inside one), where the reducer cannot be closed")
      .def_property_readonly("wait_seconds", [](PyGradReducer& r) { return r.get().wait_seconds(); });
}

}  // namespace strata::python
