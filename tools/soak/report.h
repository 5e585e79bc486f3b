// The soak's report (docs/soak.md): the JSON lines it prints on stdout, one object each:
// the start, a progress line every 10 s, each violation, and the summary at the end.
#pragma once

#include "checker.h"
#include "soak.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <sys/types.h>

namespace lockstep::soak {

// What the orchestrator did (events carried out, workers started).
struct EventCounts {
  std::uint64_t kills = 0;
  std::uint64_t stops = 0;
  std::uint64_t spawns = 0;  // not counting the workers started with the run
  std::uint64_t host_partitions = 0;
  std::uint64_t pair_partitions = 0;
  std::uint64_t relay_kills = 0;  // lockstep-relay processes killed (--relay-processes)
  std::uint64_t master_kills = 0;  // the master SIGKILLed and started again (--master-kill-ms)
  std::uint64_t workers_started = 0;
  // The PCCL workers (--pccl-workers): how many were started, and what their lines
  // reported (successful syncs, newcomers' among them, and successful all-reduce attempts).
  std::uint64_t pccl_workers_started = 0;
  std::uint64_t pccl_syncs = 0;
  std::uint64_t pccl_newcomer_syncs = 0;
  std::uint64_t pccl_allreduces_ok = 0;
};

// The master's memory (KiB of /proc/PID/status; -1: not measured).
struct MasterMemory {
  std::int64_t after_s = 0;      // when the base was taken, from the start
  std::optional<long> base_kib;  // VmRSS then
  long end_kib = -1;
  long max_kib = -1;
  long anon_base_kib = -1;  // RssAnon then
  long anon_end_kib = -1;
};

// One line on stdout, flushed.
void print(const nlohmann::json& j);

// The first line. bed_prefix: the test bed's (WAN mode only).
nlohmann::json start_report(const RunOptions& o, const std::string& master_address, pid_t master_pid,
                            const std::string& bed_prefix);

nlohmann::json progress_report(const RunOptions& o, const Checker& checker, const EventCounts& counts, double t_s,
                               long master_rss_kib);

nlohmann::json violation_report(const RunOptions& o, const Violation& v, double t_s);

// The last line. seconds: the length of the chaos; start_ms: the run's start (times of
// violations are printed from it).
nlohmann::json summary_report(const RunOptions& o, const Checker& checker, const EventCounts& counts, double seconds,
                              std::int64_t start_ms, std::int64_t longest_revision_gap_ms, const MasterMemory& memory);

}  // namespace lockstep::soak
