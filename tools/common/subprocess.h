// A child process with pipes to its stdin and stdout, for orchestrating real peers
// in tests and in the demo: line-based reads with deadlines, signals, and a
// destructor that always kills and reaps the child (no process outlives its owner).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::tools {

class Subprocess {
 public:
  // Starts argv[0] (a path) with the given arguments; stderr is inherited unless
  // stderr_path names a file to append to.
  static std::optional<Subprocess> spawn(const std::vector<std::string>& argv, const std::string& stderr_path = "");

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  bool write_line(const std::string& line);
  // The next line of stdout, or nullopt on EOF or when the deadline passes.
  std::optional<std::string> read_line(std::chrono::milliseconds timeout);
  bool signal(int signo);
  // Kills (SIGKILL) and reaps. Safe to call twice.
  void kill();
  // Waits for exit up to the timeout; returns the exit status or nullopt.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  bool running();

 private:
  Subprocess() = default;
  void close_fds();
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  bool reaped_ = false;
};

}  // namespace lockstep::tools
