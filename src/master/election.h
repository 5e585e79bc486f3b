// The master's hot standby (docs/operations.md, "Hot standby"): which of several
// masters serves a run is decided outside them, by a lease on one key in a store they
// all reach. The MasterServer knows only this interface; master/etcd.h implements it
// on etcd.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace lockstep::master {

class Election {
 public:
  using Clock = std::chrono::steady_clock;
  // Called on the election's own thread.
  struct Handlers {
    // This master holds the lease now: it serves with this term (above every earlier
    // holder's) and must stop serving before lease_until unless renewed.
    std::function<void(std::uint64_t term, Clock::time_point lease_until)> elected;
    std::function<void(Clock::time_point lease_until)> renewed;
    // The lease is gone (expired, revoked, the key taken): stop serving at once.
    std::function<void(const std::string& why)> lost;
  };

  virtual ~Election() = default;
  // Competes for the lease as `self` (the address peers reach this master at), from a
  // thread of its own.
  virtual void start(const std::string& self, Handlers handlers) = 0;
  // Gives the lease up (a master that stepped down) and competes again. Thread-safe.
  virtual void resign() = 0;
  // Stops competing, and releases the lease if it is held, so that a standby takes over
  // at once. Blocks until the thread has ended.
  virtual void stop() = 0;
  // The serving master's address as the store last named it ("" while unknown).
  // Thread-safe.
  virtual std::string holder() const = 0;
  // The store and key, for the log and the status page.
  virtual std::string describe() const = 0;
  virtual std::chrono::milliseconds lease_ttl() const = 0;
};

}  // namespace lockstep::master
