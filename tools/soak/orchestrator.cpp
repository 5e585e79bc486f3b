// The soak's orchestrator: a lockstep-master process on 127.0.0.1 (ephemeral port, short
// heartbeat timeout) and worker processes; one seeded chaos event every 0.5-1 s
// (SIGKILL a worker, SIGSTOP one and SIGCONT it after the heartbeat timeout, or spawn
// one); every worker line goes through the Checker; the master's memory is measured;
// a JSON summary ends the run (docs/soak.md).
// Each worker holds a slot (the lowest free one when it is spawned, released when it is
// gone); with --pccl-workers N, slots 0..N-1 run lockstep-soak-pccl-worker and the
// native workers run --all-reduces-only, so that both kinds run the same collectives.
// In WAN mode (--testbed N) the same runs on a lockstep-testbed bed: the master in host
// 0, the workers round-robin in hosts 1..N-1, and a fourth event, the partition: a worker
// host cut off from every other host, or the link between two worker hosts cut both
// ways, for 0.5-3 s, then healed. The bed is always taken down at the end.
// Which event happens when is the chaos schedule's decision (schedule.h); this file
// carries it out on the processes and the bed (bed.h) and prints the report (report.h).
#include "bed.h"
#include "checker.h"
#include "report.h"
#include "schedule.h"
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

// How long a peer waits for a p2p connection (the library's fixed p2p connect timeout):
// a ring across a healed cut may wait this long before its attempt fails and is retried.
constexpr std::int64_t kP2pConnectTimeoutMs = 5000;

struct WorkerProc {
  std::string name;
  std::unique_ptr<Subprocess> proc;
  bool stopped = false;
  bool resumed = false;
  std::int64_t resume_at_ms = 0;
  std::int64_t resumed_ms = 0;
  bool gone = false;
  bool printed = false;  // its first line was read
  std::uint32_t host = 0;  // its test bed host (WAN mode)
  std::uint32_t slot = 0;
  bool pccl = false;  // lockstep-soak-pccl-worker (its slot is below --pccl-workers)
};

// The partition in flight (WAN mode): a host cut off (b unused), or the link a<->b cut.
struct Partition {
  bool whole_host = false;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::int64_t heal_at_ms = 0;
};

class Soak {
 public:
  Soak(const RunOptions& o, std::string self) : o_(o), self_(std::move(self)), schedule_(schedule_config(o), o.seed) {}

  int run() {
    start_ms_ = now_ms();
    if (!setup()) return 1;
    CheckerConfig cc;
    cc.heartbeat_timeout_ms = o_.heartbeat_timeout_ms;
    cc.stall_margin_ms = o_.stall_margin_ms;
    cc.exit_margin_ms = o_.exit_margin_ms;
    cc.outcome_skew_ms = o_.outcome_skew_ms;
    if (wan()) {
      // A ring across a cut fails after the p2p stall timeout; its retries wait up to the
      // p2p connect timeout per try until the cut is healed.
      cc.partition_allowance_ms = o_.partition_max_ms + kP2pConnectTimeoutMs + o_.worker.p2p_stall_timeout_ms;
    }
    cc.progress_window_ms = std::max<std::int64_t>(o_.progress_window_ms, 3 * std::int64_t{o_.heartbeat_timeout_ms});
    checker_ = std::make_unique<Checker>(cc, start_ms_);
    rss_base_at_ms_ = start_ms_ + (o_.seconds >= 120 ? 60'000 : 30'000);
    for (std::uint32_t i = 0; i < o_.peers_initial; ++i) spawn(/*bootstrap=*/true);
    next_relay_churn_ms_ = start_ms_ + o_.relay_churn_ms;
    next_master_kill_ms_ = start_ms_ + o_.master_kill_ms;

    const auto end_ms = start_ms_ + static_cast<std::int64_t>(o_.seconds * 1000);
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
      heal_due(now);
      churn_relays(now);
      kill_master(now);
      carry_out(schedule_.next(now, schedule_state()), now);
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
    pccl_worker_ = dir + "lockstep-soak-pccl-worker";
    if (o_.pccl_workers > 0 && ::access(pccl_worker_.c_str(), X_OK) != 0) {
      std::fprintf(stderr, "lockstep-soak: --pccl-workers needs %s (build target lockstep-soak-pccl-worker)\n",
                   pccl_worker_.c_str());
      return false;
    }
    if (wan() && !setup_bed(dir)) return false;
    master_host_ = wan() ? addrs_[0] : "127.0.0.1";
    master_argv_ = {dir + "lockstep-master", "--listen", master_host_ + ":0", "--heartbeat-timeout-ms",
                    std::to_string(o_.heartbeat_timeout_ms)};
    std::vector<std::string>& master_argv = master_argv_;
    // With master kills the chaos goes on while a new master takes the run back, and may
    // kill half of the last view meanwhile: no majority would come back, and the run
    // would wait for ever. One master at a time is certain here (each is killed before
    // the next starts), so the operator's lower quorum is safe (docs/operations.md). The
    // chaos spawns newcomers at any time: a new master holds a new run's founding until
    // the run's peers are back (--resume-hold-ms), or one that came first would found a
    // run that refuses them.
    if (o_.master_kill_ms > 0) {
      master_argv.insert(master_argv.end(), {"--recovery-quorum", "1", "--resume-hold-ms", "2000"});
    }
    if (o_.relay || o_.relay_processes > 0) {
      // The master, every worker and relay read the secret from the environment they inherit.
      const std::string secret = o_.log_dir + "/run.secret";
      std::ofstream(secret) << "soak run secret " << o_.seed << " " << ::getpid() << "\n";
      std::filesystem::permissions(secret, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
                                   ec);
      ::setenv("LOCKSTEP_SECRET_FILE", secret.c_str(), 1);
      secret_file_ = secret;
      if (o_.relay) master_argv.insert(master_argv.end(), {"--relay-port", "0"});
    }
    if (!start_master()) return false;
    master_address_ = master_host_ + ":" + std::to_string(port_);
    for (std::uint32_t i = 0; i < o_.relay_processes; ++i) {
      if (!spawn_relay(dir)) return false;
    }
    const json start = start_report(o_, master_address_, master_->pid(), wan() ? bed_->prefix() : std::string());
    print(start);
    log("start: " + start.dump());
    return true;
  }

  bool wan() const { return o_.testbed_hosts > 0; }
  bool nat_host(std::uint32_t host) const { return host >= o_.testbed_hosts - o_.testbed_nat_hosts; }

  // A lockstep-relay process beside the master, registered with it before this returns
  // (its second line), so that the run always has the relays it counts on.
  bool spawn_relay(const std::string& dir) {
    const std::string host = wan() ? addrs_[0] : "127.0.0.1";
    std::vector<std::string> argv = {dir + "lockstep-relay", "--master", master_address_, "--secret-file",
                                     secret_file_, "--listen", host + ":0"};
    if (wan()) argv = bed_->in_host(0, argv);
    const std::string name = "relay" + std::to_string(++relays_started_);
    auto p = Subprocess::spawn(argv, o_.log_dir + "/" + name + ".log");
    if (!p) {
      std::fprintf(stderr, "lockstep-soak: cannot start %slockstep-relay\n", dir.c_str());
      return false;
    }
    relays_.push_back(std::make_unique<Subprocess>(std::move(*p)));
    for (const char* word : {"listening", "registered"}) {
      const auto line = relays_.back()->read_line(std::chrono::seconds(10));
      if (!line || line->find(word) == std::string::npos) {
        std::fprintf(stderr, "lockstep-soak: %s did not say it is %s (see %s/%s.log)\n", name.c_str(), word,
                     o_.log_dir.c_str(), name.c_str());
        return false;
      }
    }
    log("relay " + name + " (pid " + std::to_string(relays_.back()->pid()) + ") registered");
    return true;
  }

  // The master process (master_argv_, on port_ once it has one), its log appended to
  // master.log; false (said) if it does not start.
  bool start_master() {
    std::vector<std::string> argv = master_argv_;
    if (port_ != 0) argv[2] = master_host_ + ":" + std::to_string(port_);  // --listen HOST:PORT
    if (wan()) argv = bed_->in_host(0, argv);
    auto master = Subprocess::spawn(argv, o_.log_dir + "/master.log");
    if (!master) {
      std::fprintf(stderr, "lockstep-soak: cannot start %s\n", master_argv_[0].c_str());
      return false;
    }
    master_ = std::make_unique<Subprocess>(std::move(*master));
    auto first = master_->read_line(std::chrono::seconds(30));
    if (!first || first->rfind(':') == std::string::npos) {
      std::fprintf(stderr, "lockstep-soak: lockstep-master printed no address (see %s/master.log)\n", o_.log_dir.c_str());
      return false;
    }
    port_ = std::stoi(first->substr(first->rfind(':') + 1));
    return true;
  }

  // Failover under chaos (--master-kill-ms): the master is SIGKILLed and a new one started
  // on its address at once; the workers (failover on) must carry on with every invariant.
  void kill_master(std::int64_t now) {
    if (o_.master_kill_ms == 0 || now < next_master_kill_ms_) return;
    next_master_kill_ms_ = now + o_.master_kill_ms;
    log("SIGKILL the master (pid " + std::to_string(master_->pid()) + "); a new one on " + master_address_);
    master_->kill();
    ++counts_.master_kills;
    checker_->master_replaced(now);
    if (!start_master()) {
      master_dead_ = true;
      checker_->fail("master", "the new master did not start (see master.log)", now);
    }
  }

  // The relay process in use (the oldest) is killed and a new one started: its relayed
  // edges move to the next one (the attempt in flight on them fails for everyone alike).
  void churn_relays(std::int64_t now) {
    if (o_.relay_processes == 0 || now < next_relay_churn_ms_) return;
    next_relay_churn_ms_ = now + o_.relay_churn_ms;
    log("SIGKILL the relay process in use (pid " + std::to_string(relays_.front()->pid()) + ")");
    relays_.front()->kill();
    relays_.erase(relays_.begin());
    ++counts_.relay_kills;
    const std::string dir = self_.substr(0, self_.rfind('/') + 1);
    if (!spawn_relay(dir)) checker_->fail("spawn", "cannot start a relay process", now);
  }

  // Brings the bed up: hosts, every link capped and delayed both ways, the addresses.
  bool setup_bed(const std::string& dir) {
    if (o_.testbed_prefix.empty()) o_.testbed_prefix = "sk" + std::to_string(::getpid());
    const char* env = std::getenv("LOCKSTEP_TESTBED");
    const std::string command = env != nullptr && *env != '\0' ? std::string(env) : dir + "lockstep-testbed";
    bed_ = std::make_unique<Bed>(command, o_.testbed_prefix, o_.log_dir + "/testbed.log");
    const auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "lockstep-soak: test bed: %s failed (needs root; see %s/testbed.log)\n", what.c_str(),
                   o_.log_dir.c_str());
      return false;
    };
    if (!bed_->up(o_.testbed_hosts)) return fail("up " + std::to_string(o_.testbed_hosts));
    for (std::uint32_t h = o_.testbed_hosts - o_.testbed_nat_hosts; h < o_.testbed_hosts; ++h) {
      if (!bed_->run({"nat", std::to_string(h)})) return fail("nat " + std::to_string(h));
    }
    for (std::uint32_t i = 0; i < o_.testbed_hosts; ++i) {
      std::string addr;
      if (!bed_->run({"addr", std::to_string(i)}, &addr) || addr.empty()) return fail("addr " + std::to_string(i));
      addrs_.push_back(addr);
      for (std::uint32_t j = 0; j < i; ++j) {
        const std::string a = std::to_string(j);
        const std::string b = std::to_string(i);
        if (!o_.testbed_rate.empty() && !bed_->run({"cap", a, b, o_.testbed_rate, "--both"})) return fail("cap");
        if (o_.testbed_delay_ms > 0 && !bed_->run({"delay", a, b, std::to_string(o_.testbed_delay_ms), "--both"})) {
          return fail("delay");
        }
      }
    }
    log("test bed " + o_.testbed_prefix + " up: " + std::to_string(o_.testbed_hosts) + " hosts, links " +
        (o_.testbed_rate.empty() ? "uncapped" : o_.testbed_rate) + " and " + std::to_string(o_.testbed_delay_ms) +
        " ms one way");
    return true;
  }

  static ScheduleConfig schedule_config(const RunOptions& o) {
    ScheduleConfig c;
    c.peers_min = o.peers_min;
    c.peers_max = o.peers_max;
    c.event_min_ms = o.event_min_ms;
    c.event_max_ms = o.event_max_ms;
    c.heartbeat_timeout_ms = o.heartbeat_timeout_ms;
    c.partitions = o.testbed_hosts > 0;
    c.partition_min_ms = o.partition_min_ms;
    c.partition_max_ms = o.partition_max_ms;
    return c;
  }

  // The run as the schedule sees it.
  ScheduleState schedule_state() const {
    ScheduleState s;
    s.started = checker_->max_revision() > 0;
    if (!s.started) return s;
    s.active = checker_->active();
    s.holders = checker_->active_holders();
    if (wan()) {
      for (const auto& name : s.active) s.hosts[name] = workers_.at(name)->host;
    }
    for (auto& [name, w] : workers_) s.stop_in_flight = s.stop_in_flight || (!w->gone && (w->stopped || w->resumed));
    s.partition_in_flight = partition_.has_value();
    return s;
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

  // The lowest free slot, taken.
  std::uint32_t take_slot() {
    for (std::uint32_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i]) {
        slots_[i] = true;
        return i;
      }
    }
    slots_.push_back(true);
    return static_cast<std::uint32_t>(slots_.size() - 1);
  }

  // The worker has ended or was killed: its slot is free for the next spawn.
  void gone(WorkerProc& w) {
    w.gone = true;
    if (w.slot < slots_.size()) slots_[w.slot] = false;
  }

  void spawn(bool bootstrap) {
    const std::string name = "w" + std::to_string(++spawned_);
    const std::uint32_t slot = take_slot();
    const bool pccl = slot < o_.pccl_workers;
    std::vector<std::string> argv = pccl ? std::vector<std::string>{pccl_worker_}
                                         : std::vector<std::string>{self_, "worker"};
    argv.insert(argv.end(), {"--master", master_address_, "--name", name, "--seed", std::to_string(o_.seed),
                             "--state-elements", std::to_string(o_.worker.state_elements), "--reduce-elements",
                             std::to_string(o_.worker.reduce_elements), "--reduces",
                             std::to_string(o_.worker.reduces), "--compute-ms", std::to_string(o_.worker.compute_ms)});
    if (bootstrap) argv.push_back("--bootstrap");
    // PCCL has no reduce-scatter, all-gather or broadcast: with PCCL workers in the
    // group, the native ones leave theirs out.
    if (!pccl && o_.pccl_workers > 0) argv.push_back("--all-reduces-only");
    if (o_.keep_going) argv.push_back("--keep-going");
    if (!pccl && o_.no_inbound_every != 0 && spawned_ % o_.no_inbound_every == 0) argv.push_back("--no-inbound");
    if (o_.worker.p2p_stall_timeout_ms != 0) {
      argv.insert(argv.end(), {"--p2p-stall-timeout-ms", std::to_string(o_.worker.p2p_stall_timeout_ms)});
    }
    if (!pccl && o_.master_kill_ms > 0) argv.insert(argv.end(), {"--failover-timeout-ms", "30000"});
    std::uint32_t host = 0;
    if (wan()) {
      // Round-robin over hosts 1..N-1, past a host that is cut off (it could not connect).
      const std::uint32_t workers_hosts = o_.testbed_hosts - 1;
      for (std::uint32_t k = 0; k < workers_hosts; ++k) {
        host = 1 + static_cast<std::uint32_t>(next_host_++ % workers_hosts);
        if (!partition_ || !partition_->whole_host || partition_->a != host) break;
      }
      // Behind a NAT the worker names no address: the master finds it cannot reach it.
      if (!nat_host(host)) argv.insert(argv.end(), {"--advertised-host", addrs_[host], "--bind-host", addrs_[host]});
      argv = bed_->in_host(host, argv);
    }
    auto p = Subprocess::spawn(argv, o_.log_dir + "/" + name + ".log");
    if (!p) {
      slots_[slot] = false;
      checker_->fail("spawn", std::string("cannot start a ") + (pccl ? "PCCL " : "") + "worker process", now_ms());
      return;
    }
    auto w = std::make_unique<WorkerProc>();
    w->name = name;
    w->proc = std::make_unique<Subprocess>(std::move(*p));
    w->host = host;
    w->slot = slot;
    w->pccl = pccl;
    log("spawn " + name + " (pid " + std::to_string(w->proc->pid()) + ", slot " + std::to_string(slot) +
        (pccl ? ", pccl" : "") + (wan() ? ", host " + std::to_string(host) : "") + (bootstrap ? ", bootstrap)" : ")"));
    checker_->spawned(name, now_ms());
    workers_[name] = std::move(w);
    if (!bootstrap) ++counts_.spawns;
    if (pccl) ++counts_.pccl_workers_started;
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
        gone(*w);
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
      if (w.pccl) count_pccl(*text);
      checker_->line(w.name, *text, now);
    }
    return any;
  }

  // What the PCCL workers' lines report, for the summary.
  void count_pccl(const std::string& text) {
    const json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return;  // the checker reports it
    const std::string ev = j.value("ev", "");
    if (ev == "sync") {
      ++counts_.pccl_syncs;
      if (j.value("strategy", "") == "receive") ++counts_.pccl_newcomer_syncs;
    } else if (ev == "allreduce" && j.value("code", -1) == 0) {
      ++counts_.pccl_allreduces_ok;
    }
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

  // Heals the partition in flight when its time has come (or at the end: force).
  void heal_due(std::int64_t now, bool force = false) {
    if (!partition_ || (!force && now < partition_->heal_at_ms)) return;
    if (!bed_->run({"heal"})) checker_->fail("testbed", "lockstep-testbed heal failed (see testbed.log)", now_ms());
    const std::int64_t healed = now_ms();
    log("heal " + describe(*partition_) + " after " + std::to_string(healed - partition_start_ms_) + " ms");
    checker_->partition_healed(healed);
    partition_.reset();
  }

  static std::string describe(const Partition& p) {
    return p.whole_host ? "host " + std::to_string(p.a) + " cut off"
                        : "hosts " + std::to_string(p.a) + " <-> " + std::to_string(p.b) + " cut";
  }

  // Carries out what the schedule decided.
  void carry_out(const Fault& f, std::int64_t now) {
    switch (f.kind) {
      case Fault::Kind::kNone:
        return;
      case Fault::Kind::kTopUp:
      case Fault::Kind::kSpawn:
        spawn(false);
        return;
      case Fault::Kind::kPartition:
        partition(f, now);
        return;
      case Fault::Kind::kKill:
      case Fault::Kind::kStop:
        break;
    }
    const std::string& victim = f.victim;
    WorkerProc& w = *workers_.at(victim);
    if (f.kind == Fault::Kind::kKill) {
      drain(w);
      w.proc->kill();
      drain(w);
      gone(w);
      ++counts_.kills;
      log("SIGKILL " + victim);
      checker_->killed(victim, now);
      drop_empty_log(victim);
    } else {
      w.proc->signal(SIGSTOP);
      w.stopped = true;
      stop_ms_[victim] = now;
      w.resume_at_ms = now + f.resume_after_ms;
      ++counts_.stops;
      log("SIGSTOP " + victim + " until +" + std::to_string(w.resume_at_ms - now) + " ms");
      checker_->stopped(victim, now);
    }
  }

  void partition(const Fault& f, std::int64_t now) {
    Partition p;
    p.whole_host = f.whole_host;
    p.a = f.a;
    p.b = f.b;
    const std::vector<std::string>& cut_off = f.cut_off;
    const std::int64_t duration = f.duration_ms;
    partition_start_ms_ = now;
    checker_->partition_started(cut_off, now);
    bool ok = true;
    if (p.whole_host) {
      for (std::uint32_t j = 0; j < o_.testbed_hosts; ++j) {
        if (j != p.a) ok = bed_->run({"cut", std::to_string(p.a), std::to_string(j), "--both"}) && ok;
      }
      ++counts_.host_partitions;
    } else {
      ok = bed_->run({"cut", std::to_string(p.a), std::to_string(p.b), "--both"});
      ++counts_.pair_partitions;
    }
    if (!ok) checker_->fail("testbed", "lockstep-testbed cut failed (see testbed.log)", now_ms());
    p.heal_at_ms = now_ms() + duration;
    std::string names;
    for (const auto& n : cut_off) names += (names.empty() ? "" : " ") + n;
    log("partition: " + describe(p) + " for " + std::to_string(duration) + " ms" +
        (names.empty() ? "" : " (workers " + names + ")"));
    partition_ = p;
  }

  // Prints the violations found since the last call; returns whether there were any.
  bool report_violations(std::int64_t now) {
    const auto& all = checker_->violations();
    bool any = false;
    for (; reported_ < all.size(); ++reported_) {
      any = true;
      const Violation& v = all[reported_];
      const json j = violation_report(o_, v, t_s(v.t_ms));
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
    const json j = progress_report(o_, *checker_, counts_, t_s(now), status_kib(master_->pid()));
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
    heal_due(now, /*force=*/true);
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
        gone(*workers_.at(n));
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

    MasterMemory memory;
    memory.after_s = (rss_base_at_ms_ - start_ms_) / 1000;
    memory.base_kib = rss_base_;
    memory.end_kib = rss_end;
    memory.max_kib = rss_max_;
    memory.anon_base_kib = anon_base_;
    memory.anon_end_kib = anon_end;
    counts_.workers_started = spawned_;
    const json s = summary_report(o_, *checker_, counts_, seconds, start_ms_, longest_gap, memory);
    log("summary " + s.dump());
    print(s);
    return checker_->violations().empty() ? 0 : 1;
  }

  RunOptions o_;
  std::string self_;
  std::string pccl_worker_;  // lockstep-soak-pccl-worker, next to self_
  std::vector<bool> slots_;  // taken or free
  ChaosSchedule schedule_;
  // Declared before every process: destroyed after them, it takes the bed down last.
  std::unique_ptr<Bed> bed_;
  std::vector<std::string> addrs_;  // of the bed's hosts
  std::optional<Partition> partition_;
  std::int64_t partition_start_ms_ = 0;
  std::uint64_t next_host_ = 0;
  std::string master_address_;
  std::unique_ptr<Subprocess> master_;
  std::string secret_file_;  // with --relay or --relay-processes
  std::vector<std::unique_ptr<Subprocess>> relays_;  // the relay processes, oldest (in use) first
  std::uint32_t relays_started_ = 0;
  std::int64_t next_relay_churn_ms_ = 0;
  std::int64_t next_master_kill_ms_ = 0;
  std::string master_host_;
  std::vector<std::string> master_argv_;  // the first start's: --listen HOST:0
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
  EventCounts counts_;
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
  sigaction(SIGHUP, &action, nullptr);
  RunOptions o = options;
  // WAN mode: a ring across a cut must fail well before the stall bound.
  if (o.testbed_hosts > 0 && o.worker.p2p_stall_timeout_ms == 0) o.worker.p2p_stall_timeout_ms = 2000;
  if (o.seed == 0) o.seed = std::random_device{}() | (static_cast<std::uint64_t>(std::random_device{}()) << 32);
  if (o.peers_min < 2) o.peers_min = 2;
  o.peers_max = std::max(o.peers_max, o.peers_min + 1);
  o.peers_initial = std::clamp(o.peers_initial, o.peers_min, o.peers_max);
  Soak soak(o, self_path);
  return soak.run();
}

}  // namespace lockstep::soak
