#include "report.h"

#include <cstdio>

namespace lockstep::soak {

using nlohmann::json;

void print(const json& j) {
  std::fputs((j.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
}

json start_report(const RunOptions& o, const std::string& master_address, pid_t master_pid,
                  const std::string& bed_prefix) {
  json start;
  start["soak"] = "start";
  start["seed"] = o.seed;
  start["seconds"] = o.seconds;
  start["peers"] = std::to_string(o.peers_initial) + ".." + std::to_string(o.peers_max);
  start["heartbeat_timeout_ms"] = o.heartbeat_timeout_ms;
  start["master"] = master_address;
  if (o.testbed_hosts > 0) {
    start["testbed"] = {{"hosts", o.testbed_hosts},
                        {"prefix", bed_prefix},
                        {"rate", o.testbed_rate},
                        {"delay_ms", o.testbed_delay_ms},
                        {"p2p_stall_timeout_ms", o.worker.p2p_stall_timeout_ms}};
  }
  if (o.pccl_workers > 0) start["pccl_workers"] = o.pccl_workers;
  start["master_pid"] = master_pid;
  start["log_dir"] = o.log_dir;
  return start;
}

json progress_report(const RunOptions& o, const Checker& checker, const EventCounts& counts, double t_s,
                     long master_rss_kib) {
  json j;
  j["soak"] = "progress";
  j["t_s"] = static_cast<std::int64_t>(t_s);
  j["active"] = checker.active().size();
  j["revision"] = checker.max_revision();
  j["allreduces"] = checker.allreduces_completed();
  j["kills"] = counts.kills;
  j["stops"] = counts.stops;
  j["spawns"] = counts.spawns;
  if (o.testbed_hosts > 0) j["partitions"] = counts.host_partitions + counts.pair_partitions;
  j["longest_stall_ms"] = checker.longest_stall_ms();
  j["master_rss_kib"] = master_rss_kib;
  j["violations"] = checker.violations().size();
  return j;
}

json violation_report(const RunOptions& o, const Violation& v, double t_s) {
  json j;
  j["soak"] = "violation";
  j["t_s"] = t_s;
  j["kind"] = v.kind;
  j["text"] = v.text;
  j["seed"] = o.seed;
  return j;
}

json summary_report(const RunOptions& o, const Checker& checker, const EventCounts& counts, double seconds,
                    std::int64_t start_ms, std::int64_t longest_revision_gap_ms, const MasterMemory& memory) {
  const auto& violations = checker.violations();
  json s;
  s["soak"] = "summary";
  s["seed"] = o.seed;
  s["seconds"] = static_cast<double>(static_cast<std::int64_t>(seconds * 10)) / 10.0;
  s["peers"] = std::to_string(o.peers_initial) + ".." + std::to_string(o.peers_max);
  s["heartbeat_timeout_ms"] = o.heartbeat_timeout_ms;
  s["events"] = {{"kills", counts.kills}, {"stops", counts.stops}, {"spawns", counts.spawns}};
  if (o.relay_processes > 0) s["events"]["relay_kills"] = counts.relay_kills;
  if (o.master_kill_ms > 0) s["events"]["master_kills"] = counts.master_kills;
  if (o.testbed_nat_hosts > 0) s["testbed_nat_hosts"] = o.testbed_nat_hosts;
  if (o.testbed_hosts > 0) {
    s["events"]["partitions"] = counts.host_partitions + counts.pair_partitions;
    s["events"]["host_partitions"] = counts.host_partitions;
    s["events"]["pair_partitions"] = counts.pair_partitions;
    s["testbed_hosts"] = o.testbed_hosts;
    s["partitioned_workers_returned"] = checker.partitioned_returned();
    s["partitioned_workers_evicted"] = checker.partitioned_evicted();
    s["longest_heal_settle_ms"] = checker.longest_heal_settle_ms();
  }
  s["workers_started"] = counts.workers_started;
  if (o.pccl_workers > 0) {
    s["pccl"] = {{"slots", o.pccl_workers},
                 {"workers_started", counts.pccl_workers_started},
                 {"syncs", counts.pccl_syncs},
                 {"newcomer_syncs", counts.pccl_newcomer_syncs},
                 {"allreduces_ok", counts.pccl_allreduces_ok}};
  }
  s["revisions"] = checker.max_revision();
  s["syncs_reported"] = checker.syncs_reported();
  s["newcomer_syncs"] = checker.newcomer_syncs();
  s["allreduces_completed"] = checker.allreduces_completed();
  s["allreduce_failures_reported"] = checker.allreduce_failures_reported();
  s["stale_frame_failures"] = checker.stale_frame_failures();
  s["unexplained_failures"] = checker.unexplained_failures();
  if (!checker.unexplained_samples().empty()) s["unexplained_failure_samples"] = checker.unexplained_samples();
  s["longest_stall_ms"] = checker.longest_stall_ms();
  s["longest_stall_worker"] = checker.longest_stall_worker();
  s["longest_stall_from_s"] = static_cast<double>(checker.longest_stall_from_ms()) / 1000.0;
  s["longest_revision_gap_ms"] = longest_revision_gap_ms;
  s["outcome_skews"] = checker.outcome_skews();
  s["largest_outcome_skew_ms"] = checker.largest_outcome_skew_ms();
  s["longest_resume_to_exit_ms"] = checker.longest_resume_exit_ms();
  json rss;
  rss["after_s"] = memory.after_s;
  rss["base_kib"] = memory.base_kib ? *memory.base_kib : -1;
  rss["end_kib"] = memory.end_kib;
  rss["max_kib"] = memory.max_kib;
  rss["growth_kib"] = memory.base_kib && memory.end_kib >= 0 ? memory.end_kib - *memory.base_kib : 0;
  rss["anon_base_kib"] = memory.anon_base_kib;
  rss["anon_end_kib"] = memory.anon_end_kib;
  rss["anon_growth_kib"] =
      memory.anon_end_kib >= 0 && memory.anon_base_kib >= 0 ? memory.anon_end_kib - memory.anon_base_kib : 0;
  s["master_rss"] = rss;
  s["unexpected_exits"] = checker.unexpected_exits().size();
  if (!checker.unexpected_exits().empty()) s["unexpected_exit_first"] = checker.unexpected_exits().front();
  s["violations"] = violations.size();
  if (violations.empty()) {
    s["first_violation"] = nullptr;
  } else {
    s["first_violation"] = {{"t_s", static_cast<double>(violations[0].t_ms - start_ms) / 1000.0},
                            {"kind", violations[0].kind},
                            {"text", violations[0].text}};
  }
  s["log_dir"] = o.log_dir;
  s["ok"] = violations.empty();
  return s;
}

}  // namespace lockstep::soak
