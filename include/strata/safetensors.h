// Interchange with the rest of the ecosystem: the parameters exported to a
// safetensors file, and set from one, a chunk group at a time, through a
// FileSystem (the POSIX one unless given). The format and how it is
// written: Note [The safetensors format] in safetensors.cc.
//
//   STRATA_ASSIGN_OR_RETURN(auto out, offload::ExportSafetensors(*engine, "model.safetensors", {.fp32 = true}));
//   ... another engine of the same tensors, before training ...
//   STRATA_ASSIGN_OR_RETURN(auto in, offload::ImportSafetensors(*other, "model.safetensors"));
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::offload {

struct ExportOptions {
  // fp32: the fp32 masters where the engine keeps them (bf16/fp16
  // training), other parameters (frozen ones) widened to fp32. Else the
  // parameters in the dtype their chunks hold (the compute dtype).
  bool fp32 = false;
};

struct ImportOptions {
  // Every registered tensor must be in the file and every tensor of the
  // file registered (InvalidArgument naming those that are not). false:
  // registered tensors the file lacks keep their values, and the file's
  // other tensors are left unread (both listed in the summary).
  bool strict = true;
};

struct InterchangeSummary {
  std::string path;
  uint32_t tensors = 0;              // written, or set
  uint64_t bytes = 0;                // tensor data written, or read
  std::vector<std::string> missing;  // import, not strict: registered tensors the file lacks
  std::vector<std::string> unused;   // import, not strict: the file's tensors that no registered one takes
};

// Writes every registered tensor's parameters to a safetensors file at
// `path`, published whole by a rename. Data parallel, every rank calls it
// with its communicator (rank 0 writes) and every rank returns the same
// outcome. With comm.shard_params the parameters come from the masters.
Result<InterchangeSummary> ExportSafetensors(Engine& engine, const std::string& path,
                                             const ExportOptions& options = {}, Communicator* comm = nullptr,
                                             FileSystem& files = PosixFileSystem());

// Sets every registered tensor's parameters from the safetensors file at
// `path`, by name: the param chunk in its dtype and this rank's shard of
// the fp32 master; gradients and optimizer states are left as they are (it
// is how a model is initialized, before training). Any of F64, F32, BF16
// and F16 converts. A shape that differs, a file that is not safetensors or
// whose ranges fall outside it is InvalidArgument naming it; a read error
// is IoError. With `comm`, every rank returns an error when any failed.
Result<InterchangeSummary> ImportSafetensors(Engine& engine, const std::string& path,
                                             const ImportOptions& options = {}, Communicator* comm = nullptr,
                                             FileSystem& files = PosixFileSystem());

// One tensor of a safetensors file: its dtype ("F32", ...), shape, and where
// its bytes are, from the start of the file.
struct SafetensorsEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// The file's tensors by name, the header checked as the format says: each
// dtype one of safetensors', each range of its shape's size (no overflow),
// the ranges tiling the data, no name twice, __metadata__ an object of
// strings; InvalidArgument naming the file otherwise.
Result<std::map<std::string, SafetensorsEntry>> ReadSafetensorsIndex(const std::string& path,
                                                                     FileSystem& files = PosixFileSystem());

}  // namespace strata::offload
