// Status and Result: expected failures as values. A Status pairs one of the public
// lockstep_status_t codes with a message saying what happened; bugs are assertions.
#pragma once

#include <lockstep/lockstep.h>

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace lockstep {

using StatusCode = lockstep_status_t;
// The largest status code defined (the wire decoder rejects larger ones).
inline constexpr StatusCode kStatusCodeMax = LOCKSTEP_STATUS_NOT_SERVING;

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool is_ok() const { return code_ == LOCKSTEP_OK; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code name>: <message>"
  std::string to_string() const;

 private:
  StatusCode code_ = LOCKSTEP_OK;
  std::string message_;
};

// A value or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) { assert(!status_.is_ok()); }  // NOLINT

  bool is_ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(value_.has_value());
    return *value_;
  }
  const T& value() const& {
    assert(value_.has_value());
    return *value_;
  }
  T&& value() && {
    assert(value_.has_value());
    return std::move(*value_);
  }

 private:
  std::optional<T> value_;
  Status status_;
};

const char* status_name(StatusCode code);

}  // namespace lockstep
