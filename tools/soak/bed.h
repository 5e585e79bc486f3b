// The soak's bed control (docs/soak.md): the lockstep-testbed bed of WAN mode, and the
// master's memory read from /proc. The processes themselves (master and workers: spawn,
// signals, exits) are driven by the orchestrator (orchestrator.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace lockstep::soak {

// A lockstep-testbed bed (docs/testbed.md) that the soak brings up and always takes
// down, also when the run fails or is interrupted (its destructor). Commands run
// synchronously; their stderr goes to LOG_DIR/testbed.log.
class Bed {
 public:
  Bed(std::string command, std::string prefix, std::string log_path)
      : command_(std::move(command)), prefix_(std::move(prefix)), log_path_(std::move(log_path)) {}
  Bed(const Bed&) = delete;
  Bed& operator=(const Bed&) = delete;
  ~Bed();

  bool up(std::uint32_t hosts);

  // Runs `lockstep-testbed --prefix P ARGS...`; its stdout (lines joined) goes to *out.
  bool run(const std::vector<std::string>& args, std::string* out = nullptr);

  // The argv that runs argv inside a host: `ip netns exec` execs the program, so the
  // pid is the program's own, and SIGKILL/SIGSTOP reach it.
  std::vector<std::string> in_host(std::uint32_t host, const std::vector<std::string>& argv) const;

  const std::string& prefix() const { return prefix_; }

 private:
  std::string command_;
  std::string prefix_;
  std::string log_path_;
  bool up_ = false;
};

// A field of /proc/PID/status in KiB: VmRSS (resident) or RssAnon (its anonymous part:
// the heap, which is what a leak grows; file-backed pages come and go under memory
// pressure).
long status_kib(pid_t pid, const std::string& field = "VmRSS");

}  // namespace lockstep::soak
