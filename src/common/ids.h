// PeerId: the identity the master gives each connection. Unique per connection so
// that a restarted process is a new peer; 128 bits (master instance nonce, counter).
#pragma once

#include <compare>
#include <cstdint>
#include <cstdio>
#include <string>

namespace lockstep {

struct PeerId {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;

  auto operator<=>(const PeerId&) const = default;
  bool is_nil() const { return hi == 0 && lo == 0; }
  // Short human form: the counter, then the first hex digits of the nonce.
  std::string to_string() const {
    char buf[48];
    std::snprintf(buf, sizeof buf, "p%llu-%06llx", static_cast<unsigned long long>(lo),
                  static_cast<unsigned long long>(hi >> 40));
    return buf;
  }
};

// Milliseconds on a monotonic clock that the IO shell reads and the pure logic receives.
using TimeMs = std::int64_t;

}  // namespace lockstep
