// Status and Result<T>: how every fallible strata function reports failure.
//
// A Status is either OK or carries a code naming the cause and a message that
// says what was wrong and, where it helps, what would be right. Result<T> holds
// either a T or a non-OK Status. Both are values: cheap to move, no ownership
// beyond their own members. Not thread-safe for concurrent mutation; copies may
// be used from any thread.
//
// Library code never throws across the API and never exits; invariants that
// can only break through a bug in strata itself use STRATA_CHECK, which aborts
// with a message (always on), or STRATA_DCHECK (debug builds only).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace strata {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a caller's value is wrong: a bad option, shape, id
  kOutOfMemory,      // a tier is full: which tier, asked, used, capacity
  kIoError,          // storage failed: path, offset, errno
  kCorruption,       // stored bytes do not match their CRC: chunk, expected, found
  kDeviceError,      // the device backend failed (CUDA error, copy worker failure)
  kCommError,        // a collective failed
  kTimeout,          // a wait exceeded its deadline
  kNotSupported,     // the build or the machine lacks a capability
  kInternal,         // a broken invariant that could be reported rather than aborted on
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: chunk 3 ..." or "OK".
  std::string ToString() const;

  // Returns a copy whose message is prefixed by `context` (for call chains).
  Status WithContext(std::string_view context) const;

  // Marks a status as deliberately ignored (e.g. best-effort cleanup).
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Constructors named for the code, with fmt-style formatting of the message.
#define STRATA_DEFINE_STATUS_FACTORY(Name)                                        \
  template <typename... Args>                                                     \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {               \
    return Status(StatusCode::k##Name, fmt::format(format, std::forward<Args>(args)...)); \
  }
STRATA_DEFINE_STATUS_FACTORY(InvalidArgument)
STRATA_DEFINE_STATUS_FACTORY(OutOfMemory)
STRATA_DEFINE_STATUS_FACTORY(IoError)
STRATA_DEFINE_STATUS_FACTORY(Corruption)
STRATA_DEFINE_STATUS_FACTORY(DeviceError)
STRATA_DEFINE_STATUS_FACTORY(CommError)
STRATA_DEFINE_STATUS_FACTORY(Timeout)
STRATA_DEFINE_STATUS_FACTORY(NotSupported)
STRATA_DEFINE_STATUS_FACTORY(Internal)
#undef STRATA_DEFINE_STATUS_FACTORY

// Either a value or an error. Accessing value() of an error aborts.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & { CheckHasValue(); return *value_; }
  const T& value() const& { CheckHasValue(); return *value_; }
  T&& value() && { CheckHasValue(); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void CheckHasValue() const;

  Status status_;
  std::optional<T> value_;
};

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition, const std::string& message);

template <typename T>
void Result<T>::CheckHasValue() const {
  if (!value_.has_value()) CheckFailed(__FILE__, __LINE__, "ok()", "value() of an error Result: " + status_.ToString());
}

}  // namespace strata

// Always-on invariant check: aborts with file:line, the condition and a message.
#define STRATA_CHECK(condition, ...)                                                    \
  do {                                                                                  \
    if (!(condition)) [[unlikely]]                                                      \
      ::strata::CheckFailed(__FILE__, __LINE__, #condition, ::fmt::format("" __VA_ARGS__)); \
  } while (0)

#ifdef NDEBUG
#define STRATA_DCHECK(condition, ...) \
  do {                                \
  } while (0)
#else
#define STRATA_DCHECK(condition, ...) STRATA_CHECK(condition, __VA_ARGS__)
#endif

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// `lhs = value of expr`, or returns its error from the enclosing function.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_CONCAT(strata_result_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                                 \
  if (!result.ok()) return result.status();             \
  lhs = std::move(result).value()
