// C++ support for tests on the lockstep WAN test bed (docs/testbed.md).
//
//   lockstep::testbed::Testbed bed(4);          // up: hosts 0..3, a unique prefix
//   bed.Cap(0, 1, "200mbit");
//   bed.Delay(0, 1, 25, /*both=*/true);
//   auto peer = bed.Spawn(1, {"./my-peer", "--listen", bed.Addr(1) + ":7000"});
//   peer.Stop();                                 // a silent peer (SIGSTOP)
//   ...                                          // ~Testbed: down, always
//
// or derive a GoogleTest fixture from lockstep::testbed::TestbedTest (override Hosts()).
// The bed is taken down by the destructor, so also when an assertion fails; a bed whose
// test process died is taken down by the next bed's construction (`lockstep-testbed gc`)
// or by the testbed.gc CTest cleanup. Without root the fixture fails the test (never
// skips). The command is $LOCKSTEP_TESTBED, else LOCKSTEP_TESTBED_COMMAND (defined by
// the CMake target lockstep_testbed_fixture), else lockstep-testbed on PATH.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::testbed {

struct CommandResult {
  int exit_code = -1;  // the exit status, or 128 + signal
  std::string output;  // stdout and stderr together
  bool ok() const { return exit_code == 0; }
};

inline std::string CommandPath() {
  if (const char* env = std::getenv("LOCKSTEP_TESTBED"); env != nullptr && *env != '\0') return env;
#ifdef LOCKSTEP_TESTBED_COMMAND
  return LOCKSTEP_TESTBED_COMMAND;
#else
  return "lockstep-testbed";
#endif
}

namespace detail {

inline std::vector<char*> Argv(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  return argv;
}

inline int DecodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

[[noreturn]] inline void ExecOrDie(const std::vector<std::string>& args) {
  auto argv = Argv(args);
  execvp(argv[0], argv.data());
  std::fprintf(stderr, "testbed: cannot run %s: %s\n", args[0].c_str(), std::strerror(errno));
  _exit(127);
}

}  // namespace detail

// Runs a command and waits for it, collecting its stdout and stderr.
inline CommandResult Run(const std::vector<std::string>& args) {
  CommandResult result;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    result.output = std::string("pipe: ") + std::strerror(errno);
    return result;
  }
  pid_t pid = fork();
  if (pid < 0) {
    result.output = std::string("fork: ") + std::strerror(errno);
    close(fds[0]);
    close(fds[1]);
    return result;
  }
  if (pid == 0) {
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    detail::ExecOrDie(args);
  }
  close(fds[1]);
  char buf[4096];
  for (;;) {
    ssize_t n = read(fds[0], buf, sizeof buf);
    if (n > 0) {
      result.output.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exit_code = detail::DecodeStatus(status);
  return result;
}

// A process started inside a host; pid() is the process itself (not a wrapper), so
// signals reach it directly. The destructor kills (SIGKILL) and reaps it if it runs.
class Process {
 public:
  Process() = default;
  explicit Process(pid_t pid) : pid_(pid) {}
  Process(Process&& o) noexcept : pid_(std::exchange(o.pid_, -1)), status_(o.status_) {}
  Process& operator=(Process&& o) noexcept {
    if (this != &o) {
      Reap();
      pid_ = std::exchange(o.pid_, -1);
      status_ = o.status_;
    }
    return *this;
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() { Reap(); }

  pid_t pid() const { return pid_; }
  bool Signal(int sig) const { return pid_ > 0 && kill(pid_, sig) == 0; }
  bool Stop() const { return Signal(SIGSTOP); }
  bool Continue() const { return Signal(SIGCONT); }
  bool Kill() const { return Signal(SIGKILL); }
  // Waits for the end; returns the exit status, or 128 + signal.
  int Wait() {
    if (pid_ > 0) {
      int status = 0;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      status_ = detail::DecodeStatus(status);
      pid_ = -1;
    }
    return status_;
  }
  // True while it runs; reaps it if it ended.
  bool Running() {
    if (pid_ <= 0) return false;
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == 0) return true;
    if (r == pid_) status_ = detail::DecodeStatus(status);
    pid_ = -1;
    return false;
  }

 private:
  void Reap() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }
  pid_t pid_ = -1;
  int status_ = -1;
};

struct Options {
  std::string prefix;     // empty: a unique one
  std::string cc;         // "reno" or "bbr"; empty: the command's default
  std::string subnet;     // e.g. "10.1.2.0/24"; empty: derived from the prefix
  long long tcp_mem_max = 0;  // bytes; 0: the command's default
};

inline std::string UniquePrefix() {
  std::random_device rd;
  unsigned int v = rd();
  char buf[16];
  std::snprintf(buf, sizeof buf, "c%08x", v);
  return buf;
}

// A bed that is up for the object's lifetime.
class Testbed {
 public:
  explicit Testbed(int hosts, Options options = {})
      : hosts_(hosts), prefix_(options.prefix.empty() ? UniquePrefix() : options.prefix) {
    if (geteuid() != 0)
      throw std::runtime_error(
          "the lockstep test bed needs root (network namespaces, tc, iptables): run the tests as root");
    Run({CommandPath(), "gc"});  // beds of dead test processes go first
    std::vector<std::string> args = {"up", std::to_string(hosts), "--owner",
                                     std::to_string(getpid())};
    if (!options.cc.empty()) args.insert(args.end(), {"--cc", options.cc});
    if (!options.subnet.empty()) args.insert(args.end(), {"--subnet", options.subnet});
    if (options.tcp_mem_max > 0)
      args.insert(args.end(), {"--tcp-mem-max", std::to_string(options.tcp_mem_max)});
    Must(args);
    up_ = true;
    try {
      for (int i = 0; i < hosts; i++) {
        std::string a = Must({"addr", std::to_string(i)}).output;
        while (!a.empty() && (a.back() == '\n' || a.back() == ' ')) a.pop_back();
        addrs_.push_back(a);
      }
    } catch (...) {
      Down();  // no destructor runs for a throwing constructor
      throw;
    }
  }
  ~Testbed() {
    if (!up_) return;
    CommandResult r = Down();
    if (!r.ok()) ADD_FAILURE() << "taking test bed " << prefix_ << " down failed: " << r.output;
  }
  Testbed(const Testbed&) = delete;
  Testbed& operator=(const Testbed&) = delete;

  const std::string& prefix() const { return prefix_; }
  int hosts() const { return hosts_; }
  const std::string& Addr(int host) const { return addrs_.at(static_cast<size_t>(host)); }
  std::string Namespace(int host) const { return prefix_ + "h" + std::to_string(host); }

  // lockstep-testbed --prefix P args...
  CommandResult Command(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {CommandPath(), "--prefix", prefix_};
    argv.insert(argv.end(), args.begin(), args.end());
    return Run(argv);
  }
  // The same; throws std::runtime_error if it fails.
  CommandResult Must(const std::vector<std::string>& args) const {
    CommandResult r = Command(args);
    if (!r.ok()) {
      std::string line = "lockstep-testbed";
      for (const auto& a : args) line += " " + a;
      throw std::runtime_error(line + " failed (" + std::to_string(r.exit_code) + "): " + r.output);
    }
    return r;
  }

  // Runs a command inside a host and waits for it.
  CommandResult Exec(int host, const std::vector<std::string>& cmd) const {
    std::vector<std::string> args = {"exec", std::to_string(host)};
    args.insert(args.end(), cmd.begin(), cmd.end());
    return Command(args);
  }
  // Starts a command inside a host (stdin /dev/null, stdout/stderr inherited).
  Process Spawn(int host, const std::vector<std::string>& cmd) const {
    std::vector<std::string> argv = {CommandPath(), "--prefix", prefix_, "exec",
                                     std::to_string(host)};
    argv.insert(argv.end(), cmd.begin(), cmd.end());
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
      detail::ExecOrDie(argv);  // the script execs the command: same pid
    }
    return Process(pid);
  }

  void Cap(int src, int dst, const std::string& rate, bool both = false) const {
    Must(Pair("cap", src, dst, {rate}, both));
  }
  void Uncap(int src, int dst, bool both = false) const { Must(Pair("uncap", src, dst, {}, both)); }
  void UncapAll() const { Must({"uncap"}); }
  void Delay(int src, int dst, double ms, bool both = false) const {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", ms);
    Must(Pair("delay", src, dst, {buf}, both));
  }
  void Undelay(int src, int dst, bool both = false) const { Must(Pair("undelay", src, dst, {}, both)); }
  void UndelayAll() const { Must({"undelay"}); }
  void Cut(int src, int dst, bool both = false) const { Must(Pair("cut", src, dst, {}, both)); }
  void Heal(int src, int dst, bool both = false) const { Must(Pair("heal", src, dst, {}, both)); }
  void HealAll() const { Must({"heal"}); }
  // The self-check's JSON lines (one per pair); see docs/testbed.md.
  CommandResult Check(const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> args = {"check", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Command(args);
  }

  // Takes the bed down now (idempotent; the destructor then does nothing).
  CommandResult Down() {
    CommandResult r = Command({"down"});
    if (r.ok()) up_ = false;
    return r;
  }

 private:
  static std::vector<std::string> Pair(const std::string& cmd, int src, int dst,
                                       std::vector<std::string> rest, bool both) {
    std::vector<std::string> args = {cmd, std::to_string(src), std::to_string(dst)};
    args.insert(args.end(), rest.begin(), rest.end());
    if (both) args.emplace_back("--both");
    return args;
  }

  int hosts_;
  std::string prefix_;
  bool up_ = false;
  std::vector<std::string> addrs_;
};

// A GoogleTest fixture: bed() is up during each test and down after it, whatever the
// test's outcome. Override Hosts() / BedOptions() to shape it.
class TestbedTest : public ::testing::Test {
 protected:
  virtual int Hosts() const { return 2; }
  virtual Options BedOptions() const { return {}; }

  void SetUp() override {
    if (geteuid() != 0)
      GTEST_FAIL() << "the lockstep test bed needs root (network namespaces, tc, iptables): "
                      "run the tests as root";
    try {
      bed_.emplace(Hosts(), BedOptions());
    } catch (const std::exception& e) {
      GTEST_FAIL() << "cannot bring the test bed up: " << e.what();
    }
  }
  void TearDown() override { bed_.reset(); }

  Testbed& bed() { return *bed_; }

 private:
  std::optional<Testbed> bed_;
};

}  // namespace lockstep::testbed
