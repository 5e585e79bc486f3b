// The soak's orchestrator: a lockstep-master process on 127.0.0.1 (ephemeral port, short
// heartbeat timeout) and worker processes; one seeded chaos event every 0.5-1 s
// (SIGKILL a worker, SIGSTOP one and SIGCONT it after the heartbeat timeout, or spawn
// one); every worker line goes through the Checker; the master's memory is measured;
// a JSON summary ends the run (docs/soak.md).
#include "checker.h"
#include "soak.h"
#include "subprocess.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace lockstep::soak {
namespace {

using nlohmann::json;
using tools::Subprocess;

std::atomic<bool> g_interrupted{false};

// A field of /proc/PID/status in KiB: VmRSS (resident) or RssAnon (its anonymous part:
// the heap, which is what a leak grows; file-backed pages come and go under memory
// pressure).
long status_kib(pid_t pid, const std::string& field = "VmRSS") {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

void print(const json& j) {
  std::fputs((j.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
}

struct WorkerProc {
  std::string name;
  std::unique_ptr<Subprocess> proc;
  bool stopped = false;
  bool resumed = false;
  std::int64_t resume_at_ms = 0;
  std::int64_t resumed_ms = 0;
  bool gone = false;
  bool printed = false;  // its first line was read
};

class Soak {
 public:
  Soak(const RunOptions& o, std::string self) : o_(o), self_(std::move(self)), rng_(o.seed) {}

  int run() {
    start_ms_ = now_ms();
    if (!setup()) return 1;
    CheckerConfig cc;
    cc.heartbeat_timeout_ms = o_.heartbeat_timeout_ms;
    cc.stall_margin_ms = o_.stall_margin_ms;
    cc.exit_margin_ms = o_.exit_margin_ms;
    cc.outcome_skew_ms = o_.outcome_skew_ms;
    cc.progress_window_ms = std::max<std::int64_t>(o_.progress_window_ms, 3 * std::int64_t{o_.heartbeat_timeout_ms});
    checker_ = std::make_unique<Checker>(cc, start_ms_);
    rss_base_at_ms_ = start_ms_ + (o_.seconds >= 120 ? 60'000 : 30'000);
    for (std::uint32_t i = 0; i < o_.peers_initial; ++i) spawn(/*bootstrap=*/true);

    const auto end_ms = start_ms_ + static_cast<std::int64_t>(o_.seconds * 1000);
    std::int64_t next_event_ms = 0;
    std::int64_t next_progress_ms = start_ms_ + 10'000;
    std::int64_t next_rss_ms = start_ms_;
    std::optional<std::int64_t> first_violation_ms;
    for (;;) {
      const std::int64_t now = now_ms();
      if (now >= end_ms || g_interrupted) break;
      if (first_violation_ms && !o_.keep_going && now > *first_violation_ms + 2000) break;
      const bool any = pump(now, false);
      if (!master_alive(now)) break;
      resume_due(now);
      // Events start once the run holds a state (the first revision is reported).
      if (checker_->max_revision() > 0) {
        if (next_event_ms == 0) next_event_ms = now;
        if (checker_->active().size() < o_.peers_min) {
          spawn(false);
        } else if (now >= next_event_ms) {
          event(now);
          next_event_ms = now + uniform(o_.event_min_ms, o_.event_max_ms);
        }
      }
      if (now >= next_rss_ms) {
        next_rss_ms = now + 1000;
        const long rss = status_kib(master_->pid());
        rss_max_ = std::max(rss_max_, rss);
        if (!rss_base_ && now >= rss_base_at_ms_) {
          rss_base_ = rss;
          anon_base_ = status_kib(master_->pid(), "RssAnon");
          log("master RSS after " + std::to_string((now - start_ms_) / 1000) + " s: " + std::to_string(rss) +
              " KiB (anonymous " + std::to_string(anon_base_) + " KiB)");
        }
      }
      checker_->tick(now);
      if (report_violations(now) && !first_violation_ms) first_violation_ms = now;
      if (now >= next_progress_ms) {
        next_progress_ms += 10'000;
        progress(now);
      }
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return finish();
  }

 private:
  bool setup() {
    if (o_.log_dir.empty()) o_.log_dir = "/tmp/lockstep-soak-" + std::to_string(o_.seed) + "-" + std::to_string(::getpid());
    std::error_code ec;
    std::filesystem::create_directories(o_.log_dir, ec);
    log_.open(o_.log_dir + "/soak.log", std::ios::app);
    if (!log_) {
      std::fprintf(stderr, "lockstep-soak: cannot write to %s\n", o_.log_dir.c_str());
      return false;
    }
    if (o_.trace) trace_.open(o_.log_dir + "/trace.jsonl", std::ios::app);
    const std::string dir = self_.substr(0, self_.rfind('/') + 1);
    auto master = Subprocess::spawn({dir + "lockstep-master", "--listen", "127.0.0.1:0", "--heartbeat-timeout-ms",
                                     std::to_string(o_.heartbeat_timeout_ms)},
                                    o_.log_dir + "/master.log");
    if (!master) {
      std::fprintf(stderr, "lockstep-soak: cannot start %slockstep-master\n", dir.c_str());
      return false;
    }
    master_ = std::make_unique<Subprocess>(std::move(*master));
    auto first = master_->read_line(std::chrono::seconds(30));
    if (!first || first->rfind(':') == std::string::npos) {
      std::fprintf(stderr, "lockstep-soak: lockstep-master printed no address (see %s/master.log)\n", o_.log_dir.c_str());
      return false;
    }
    port_ = std::stoi(first->substr(first->rfind(':') + 1));
    json start;
    start["soak"] = "start";
    start["seed"] = o_.seed;
    start["seconds"] = o_.seconds;
    start["peers"] = std::to_string(o_.peers_initial) + ".." + std::to_string(o_.peers_max);
    start["heartbeat_timeout_ms"] = o_.heartbeat_timeout_ms;
    start["master"] = "127.0.0.1:" + std::to_string(port_);
    start["master_pid"] = master_->pid();
    start["log_dir"] = o_.log_dir;
    print(start);
    log("start: " + start.dump());
    return true;
  }

  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, std::max(lo, hi))(rng_);
  }

  double t_s(std::int64_t now) const { return static_cast<double>(now - start_ms_) / 1000.0; }

  void log(const std::string& text) {
    std::ostringstream s;
    s.setf(std::ios::fixed);
    s.precision(3);
    s << "[" << t_s(now_ms()) << "] " << text;
    log_ << s.str() << "\n";
    log_.flush();
    remember("soak " + s.str());
  }

  // The last lines seen, for the context of a violation.
  void remember(std::string text) {
    recent_.push_back(std::move(text));
    if (recent_.size() > 4000) recent_.pop_front();
  }

  void spawn(bool bootstrap) {
    const std::string name = "w" + std::to_string(++spawned_);
    std::vector<std::string> argv = {self_,
                                     "worker",
                                     "--master",
                                     "127.0.0.1:" + std::to_string(port_),
                                     "--name",
                                     name,
                                     "--seed",
                                     std::to_string(o_.seed),
                                     "--state-elements",
                                     std::to_string(o_.worker.state_elements),
                                     "--reduce-elements",
                                     std::to_string(o_.worker.reduce_elements),
                                     "--reduces",
                                     std::to_string(o_.worker.reduces),
                                     "--compute-ms",
                                     std::to_string(o_.worker.compute_ms)};
    if (bootstrap) argv.push_back("--bootstrap");
    if (o_.keep_going) argv.push_back("--keep-going");
    auto p = Subprocess::spawn(argv, o_.log_dir + "/" + name + ".log");
    if (!p) {
      checker_->fail("spawn", "cannot start a worker process", now_ms());
      return;
    }
    auto w = std::make_unique<WorkerProc>();
    w->name = name;
    w->proc = std::make_unique<Subprocess>(std::move(*p));
    log("spawn " + name + " (pid " + std::to_string(w->proc->pid()) + (bootstrap ? ", bootstrap)" : ")"));
    checker_->spawned(name, now_ms());
    workers_[name] = std::move(w);
    if (!bootstrap) ++spawns_;
  }

  // Reads every worker's lines and notices exits. Returns whether any line was read.
  bool pump(std::int64_t now, bool shutting_down) {
    bool any = false;
    for (auto& [name, w] : workers_) {
      if (w->gone) continue;
      any = drain(*w) || any;
      if (w->stopped) continue;  // a stopped process cannot exit (but may be killed)
      if (auto status = w->proc->wait(std::chrono::milliseconds(0))) {
        drain(*w);
        w->gone = true;
        log(name + " exited with status " + std::to_string(*status));
        checker_->exited(name, *status, now, shutting_down);
        drop_empty_log(name);
      }
    }
    return any;
  }

  // A worker that is gone leaves its log only if it wrote something (hours-long runs
  // start thousands of workers; most log nothing).
  void drop_empty_log(const std::string& name) {
    std::error_code ec;
    const std::string path = o_.log_dir + "/" + name + ".log";
    if (std::filesystem::file_size(path, ec) == 0 && !ec) std::filesystem::remove(path, ec);
  }

  bool drain(WorkerProc& w) {
    bool any = false;
    while (auto text = w.proc->read_line(std::chrono::milliseconds(0))) {
      any = true;
      w.printed = true;
      const std::int64_t now = now_ms();
      remember(w.name + " " + *text);
      if (trace_) trace_ << *text << "\n";
      checker_->line(w.name, *text, now);
    }
    return any;
  }

  bool master_alive(std::int64_t now) {
    if (master_dead_) return false;
    if (auto status = master_->wait(std::chrono::milliseconds(0))) {
      master_dead_ = true;
      checker_->fail("master", "lockstep-master ended during the run (status " + std::to_string(*status) + ")", now);
      report_violations(now);
      return false;
    }
    return true;
  }

  void resume_due(std::int64_t now) {
    for (auto& [name, w] : workers_) {
      if (w->gone || !w->stopped || now < w->resume_at_ms) continue;
      w->proc->signal(SIGCONT);
      w->stopped = false;
      w->resumed = true;
      w->resumed_ms = now;
      log("SIGCONT " + name + " (stopped " + std::to_string(now - stop_ms_[name]) +
          " ms; it was evicted and must fail fast)");
      checker_->resumed(name, now);
    }
  }

  void event(std::int64_t now) {
    const auto active = checker_->active();
    const auto holders = checker_->active_holders();
    std::vector<std::string> victims;
    // Never the last active holder of the state: a newcomer could not get it back.
    for (const auto& name : active) {
      if (holders.size() >= 2 || holders.count(name) == 0) victims.push_back(name);
    }
    if (holders.empty()) victims.clear();
    bool in_flight_stop = false;
    for (auto& [name, w] : workers_) in_flight_stop = in_flight_stop || (!w->gone && (w->stopped || w->resumed));
    const bool can_spawn = active.size() < o_.peers_max;
    const bool can_kill = active.size() > o_.peers_min && !victims.empty();
    const bool can_stop = can_kill && !in_flight_stop && (stops_ + 1) * 5 <= events_ + 1;
    const int w_kill = can_kill ? 2 : 0;
    const int w_spawn = can_spawn ? 2 : 0;
    const int w_stop = can_stop ? 1 : 0;
    if (w_kill + w_spawn + w_stop == 0) return;
    const auto pick = uniform(0, w_kill + w_spawn + w_stop - 1);
    ++events_;
    if (pick < w_spawn) {
      spawn(false);
      return;
    }
    const std::string victim = victims[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(victims.size()) - 1))];
    WorkerProc& w = *workers_.at(victim);
    if (pick < w_spawn + w_kill) {
      drain(w);
      w.proc->kill();
      drain(w);
      w.gone = true;
      ++kills_;
      log("SIGKILL " + victim);
      checker_->killed(victim, now);
      drop_empty_log(victim);
    } else {
      w.proc->signal(SIGSTOP);
      w.stopped = true;
      stop_ms_[victim] = now;
      // Past the heartbeat timeout, so that the master has evicted it when it resumes.
      w.resume_at_ms = now + o_.heartbeat_timeout_ms + uniform(500, 2000);
      ++stops_;
      log("SIGSTOP " + victim + " until +" + std::to_string(w.resume_at_ms - now) + " ms");
      checker_->stopped(victim, now);
    }
  }

  // Prints the violations found since the last call; returns whether there were any.
  bool report_violations(std::int64_t now) {
    const auto& all = checker_->violations();
    bool any = false;
    for (; reported_ < all.size(); ++reported_) {
      any = true;
      const Violation& v = all[reported_];
      json j;
      j["soak"] = "violation";
      j["t_s"] = t_s(v.t_ms);
      j["kind"] = v.kind;
      j["text"] = v.text;
      j["seed"] = o_.seed;
      print(j);
      log("VIOLATION " + j.dump());
      if (reported_ == 0) dump_context(v, now);
    }
    return any;
  }

  // The lines that led to the first violation, and for a hang the threads' stacks.
  void dump_context(const Violation& v, std::int64_t /*now*/) {
    std::ofstream out(o_.log_dir + "/violation-context.log");
    out << "first violation (" << v.kind << "): " << v.text << "\nthe last " << recent_.size()
        << " lines (worker name, then its line; soak: the orchestrator's log)\n";
    for (const auto& line : recent_) out << line << "\n";
    const bool hang = v.kind == "stall" || v.kind == "progress" || v.kind == "resume" || v.kind == "shutdown";
    if (!hang || ::access("/usr/bin/gdb", X_OK) != 0) return;
    std::vector<std::pair<std::string, pid_t>> targets = {{"master", master_->pid()}};
    for (auto& [name, w] : workers_) {
      if (!w->gone && !w->stopped) targets.emplace_back(name, w->proc->pid());
    }
    for (const auto& [name, pid] : targets) {
      const std::string file = o_.log_dir + "/stacks-" + name + ".txt";
      const std::string command = "timeout 60 /usr/bin/gdb -batch -p " + std::to_string(pid) +
                                  " -ex 'thread apply all bt' > '" + file + "' 2>&1";
      const int rc = std::system(command.c_str());
      log("stacks of " + name + " (pid " + std::to_string(pid) + ") in " + file + " (gdb status " + std::to_string(rc) + ")");
    }
  }

  void progress(std::int64_t now) {
    json j;
    j["soak"] = "progress";
    j["t_s"] = static_cast<std::int64_t>(t_s(now));
    j["active"] = checker_->active().size();
    j["revision"] = checker_->max_revision();
    j["allreduces"] = checker_->allreduces_completed();
    j["kills"] = kills_;
    j["stops"] = stops_;
    j["spawns"] = spawns_;
    j["longest_stall_ms"] = checker_->longest_stall_ms();
    j["master_rss_kib"] = status_kib(master_->pid());
    j["violations"] = checker_->violations().size();
    print(j);
    log("progress " + j.dump());
  }

  int finish() {
    std::int64_t now = now_ms();
    const double seconds = t_s(now);
    log("end of the chaos after " + std::to_string(seconds) + " s");
    // (d) the master's memory at the end of the run, against its value after the first minute.
    long rss_end = -1;
    long anon_end = -1;
    if (!master_dead_) {
      rss_end = status_kib(master_->pid());
      anon_end = status_kib(master_->pid(), "RssAnon");
      rss_max_ = std::max(rss_max_, rss_end);
      if (!rss_base_) {
        rss_base_ = rss_end;  // the run was shorter than the measuring point
        anon_base_ = anon_end;
        log("the run ended before the master's RSS was measured; no growth to compare");
      }
      const long limit = static_cast<long>(o_.rss_growth_limit_mib) * 1024;
      if (rss_end - *rss_base_ > limit || anon_end - anon_base_ > limit) {
        checker_->fail("memory", "the master's RSS grew from " + std::to_string(*rss_base_) + " KiB to " +
                                     std::to_string(rss_end) + " KiB (anonymous: " + std::to_string(anon_base_) +
                                     " KiB to " + std::to_string(anon_end) + " KiB)",
                       now);
      }
    }
    checker_->tick(now);
    const std::int64_t longest_gap = checker_->longest_revision_gap_ms(now);
    // A worker takes SIGTERM once it has printed its first line (before that its
    // handling is not set up yet).
    for (std::int64_t until = now + 10'000; now_ms() < until;) {
      pump(now_ms(), false);
      bool starting = false;
      for (auto& [name, w] : workers_) starting = starting || (!w->gone && !w->stopped && !w->printed);
      if (!starting) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    now = now_ms();
    // Stopped workers are resumed (they were evicted and exit); every other worker gets
    // SIGTERM and must end its loop, destroy its communicator and exit 0.
    for (auto& [name, w] : workers_) {
      if (w->gone) continue;
      if (w->stopped) {
        w->proc->signal(SIGCONT);
        w->stopped = false;
        w->resumed = true;
        checker_->resumed(name, now);
      }
      w->proc->signal(SIGTERM);
    }
    const std::int64_t terminated_ms = now;
    const std::int64_t deadline = now + 2 * std::int64_t{o_.heartbeat_timeout_ms} + o_.exit_margin_ms + 10'000;
    while (now_ms() < deadline) {
      pump(now_ms(), true);
      bool left = false;
      for (auto& [name, w] : workers_) left = left || !w->gone;
      if (!left) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    now = now_ms();
    std::vector<std::string> hung;
    for (auto& [name, w] : workers_) {
      if (!w->gone) hung.push_back(name);
    }
    if (!hung.empty()) {
      std::string names;
      for (const auto& n : hung) names += (names.empty() ? "" : ", ") + n;
      checker_->fail("shutdown", "worker(s) " + names + " did not exit within " +
                                     std::to_string(deadline - terminated_ms) + " ms of SIGTERM",
                     now);
      report_violations(now);
      for (const auto& n : hung) {
        workers_.at(n)->proc->kill();
        workers_.at(n)->gone = true;
        drop_empty_log(n);
      }
    }
    if (!master_dead_) {
      master_->signal(SIGTERM);
      const auto status = master_->wait(std::chrono::milliseconds(10'000 + o_.heartbeat_timeout_ms));
      if (!status || *status != 0) {
        checker_->fail("master", status ? "lockstep-master exited with status " + std::to_string(*status)
                                        : "lockstep-master did not exit after SIGTERM",
                       now_ms());
      }
    }
    report_violations(now_ms());

    const auto& violations = checker_->violations();
    json s;
    s["soak"] = "summary";
    s["seed"] = o_.seed;
    s["seconds"] = static_cast<double>(static_cast<std::int64_t>(seconds * 10)) / 10.0;
    s["peers"] = std::to_string(o_.peers_initial) + ".." + std::to_string(o_.peers_max);
    s["heartbeat_timeout_ms"] = o_.heartbeat_timeout_ms;
    s["events"] = {{"kills", kills_}, {"stops", stops_}, {"spawns", spawns_}};
    s["workers_started"] = spawned_;
    s["revisions"] = checker_->max_revision();
    s["syncs_reported"] = checker_->syncs_reported();
    s["newcomer_syncs"] = checker_->newcomer_syncs();
    s["allreduces_completed"] = checker_->allreduces_completed();
    s["allreduce_failures_reported"] = checker_->allreduce_failures_reported();
    s["longest_stall_ms"] = checker_->longest_stall_ms();
    s["longest_stall_worker"] = checker_->longest_stall_worker();
    s["longest_stall_from_s"] = static_cast<double>(checker_->longest_stall_from_ms()) / 1000.0;
    s["longest_revision_gap_ms"] = longest_gap;
    s["outcome_skews"] = checker_->outcome_skews();
    s["largest_outcome_skew_ms"] = checker_->largest_outcome_skew_ms();
    s["longest_resume_to_exit_ms"] = checker_->longest_resume_exit_ms();
    json rss;
    rss["after_s"] = (rss_base_at_ms_ - start_ms_) / 1000;
    rss["base_kib"] = rss_base_ ? *rss_base_ : -1;
    rss["end_kib"] = rss_end;
    rss["max_kib"] = rss_max_;
    rss["growth_kib"] = rss_base_ && rss_end >= 0 ? rss_end - *rss_base_ : 0;
    rss["anon_base_kib"] = anon_base_;
    rss["anon_end_kib"] = anon_end;
    rss["anon_growth_kib"] = anon_end >= 0 && anon_base_ >= 0 ? anon_end - anon_base_ : 0;
    s["master_rss"] = rss;
    s["unexpected_exits"] = checker_->unexpected_exits().size();
    if (!checker_->unexpected_exits().empty()) s["unexpected_exit_first"] = checker_->unexpected_exits().front();
    s["violations"] = violations.size();
    if (violations.empty()) {
      s["first_violation"] = nullptr;
    } else {
      s["first_violation"] = {{"t_s", t_s(violations[0].t_ms)}, {"kind", violations[0].kind}, {"text", violations[0].text}};
    }
    s["log_dir"] = o_.log_dir;
    s["ok"] = violations.empty();
    log("summary " + s.dump());
    print(s);
    return violations.empty() ? 0 : 1;
  }

  RunOptions o_;
  std::string self_;
  std::mt19937_64 rng_;
  std::unique_ptr<Subprocess> master_;
  bool master_dead_ = false;
  int port_ = 0;
  std::unique_ptr<Checker> checker_;
  std::map<std::string, std::unique_ptr<WorkerProc>> workers_;
  std::map<std::string, std::int64_t> stop_ms_;
  std::ofstream log_;
  std::ofstream trace_;
  std::deque<std::string> recent_;
  std::size_t reported_ = 0;
  std::int64_t start_ms_ = 0;
  std::int64_t rss_base_at_ms_ = 0;
  std::optional<long> rss_base_;
  long rss_max_ = -1;
  long anon_base_ = -1;
  std::uint64_t spawned_ = 0;
  std::uint64_t events_ = 0;
  std::uint64_t kills_ = 0;
  std::uint64_t stops_ = 0;
  std::uint64_t spawns_ = 0;
};

}  // namespace

int run_soak(const RunOptions& options, const std::string& self_path) {
  // SIGINT/SIGTERM end the chaos early; the summary is still printed. (A handler, not a
  // blocked mask: the children must not inherit a mask.)
  struct sigaction action = {};
  action.sa_handler = [](int) { g_interrupted = true; };
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  RunOptions o = options;
  if (o.seed == 0) o.seed = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  if (o.peers_min < 2) o.peers_min = 2;
  o.peers_max = std::max(o.peers_max, o.peers_min + 1);
  o.peers_initial = std::clamp(o.peers_initial, o.peers_min, o.peers_max);
  Soak soak(o, self_path);
  return soak.run();
}

}  // namespace lockstep::soak
