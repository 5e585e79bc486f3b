// The soak's live assertions (checker.h).
#include "checker.h"

#include <lockstep/lockstep.h>

#include <algorithm>

namespace lockstep::soak {

using nlohmann::json;

bool finished_status(int code) {
  switch (code) {
    case LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED:
    case LOCKSTEP_STATUS_MASTER_CONNECTION_LOST:
    case LOCKSTEP_STATUS_KICKED:
    case LOCKSTEP_STATUS_REJECTED:
    case LOCKSTEP_STATUS_PROTOCOL_ERROR:
    case LOCKSTEP_STATUS_REVISION_VIOLATION:
    case LOCKSTEP_STATUS_SHARED_STATE_MISMATCH:
    case LOCKSTEP_STATUS_INTERRUPTED:
      return true;
    default:
      return false;
  }
}

bool eviction_status(int code) {
  return code == LOCKSTEP_STATUS_KICKED || code == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST ||
         code == LOCKSTEP_STATUS_REJECTED;
}

namespace {

std::string status_text(int code) { return lockstep_status_string(static_cast<lockstep_status_t>(code)); }

}  // namespace

Checker::Checker(CheckerConfig config, std::int64_t start_ms)
    : config_(config), start_ms_(start_ms), max_revision_ms_(start_ms) {}

void Checker::add(const std::string& kind, const std::string& text, std::int64_t now_ms) {
  violations_.push_back(Violation{now_ms, kind, text});
}

void Checker::fail(const std::string& kind, const std::string& text, std::int64_t now_ms) { add(kind, text, now_ms); }

std::size_t Checker::active_count() const {
  std::size_t n = 0;
  for (const auto& [name, w] : workers_) n += w.life == Life::kActive ? 1 : 0;
  return n;
}

std::set<std::string> Checker::active() const {
  std::set<std::string> out;
  for (const auto& [name, w] : workers_) {
    if (w.life == Life::kActive) out.insert(name);
  }
  return out;
}

std::set<std::string> Checker::active_holders() const {
  std::set<std::string> out;
  for (const auto& [name, w] : workers_) {
    if (w.life == Life::kActive && w.revision) out.insert(name);
  }
  return out;
}

bool Checker::has_synced(const std::string& name) const {
  auto it = workers_.find(name);
  return it != workers_.end() && it->second.revision.has_value();
}

void Checker::update_condition(std::int64_t now_ms) {
  if (active_count() >= 2) {
    if (!two_active_since_) two_active_since_ = now_ms;
  } else {
    two_active_since_.reset();
  }
}

void Checker::spawned(const std::string& name, std::int64_t now_ms) {
  event(now_ms);
  Worker w;
  w.spawned_ms = now_ms;
  w.last_progress_ms = now_ms;
  workers_[name] = w;
  update_condition(now_ms);
}

void Checker::stopped(const std::string& name, std::int64_t now_ms) {
  event(now_ms);
  auto it = workers_.find(name);
  if (it == workers_.end() || it->second.life != Life::kActive) return;
  it->second.life = Life::kStopped;
  update_condition(now_ms);
}

void Checker::resumed(const std::string& name, std::int64_t now_ms) {
  event(now_ms);
  auto it = workers_.find(name);
  if (it == workers_.end() || it->second.life != Life::kStopped) return;
  it->second.life = it->second.may_be_taken_back ? Life::kHealed : Life::kResumed;
  it->second.resumed_ms = now_ms;
  update_condition(now_ms);
}

void Checker::partition_started(const std::vector<std::string>& cut_off, std::int64_t now_ms) {
  event(now_ms);
  for (const auto& name : cut_off) {
    auto it = workers_.find(name);
    if (it != workers_.end() && it->second.life == Life::kActive) it->second.life = Life::kPartitioned;
  }
  partitions_.emplace_back(now_ms, std::nullopt);
  if (partitions_.size() > 64) partitions_.erase(partitions_.begin());
  update_condition(now_ms);
}

void Checker::partition_healed(std::int64_t now_ms) {
  event(now_ms);
  for (auto& [name, w] : workers_) {
    if (w.life != Life::kPartitioned) continue;
    w.life = Life::kHealed;
    w.resumed_ms = now_ms;
  }
  if (!partitions_.empty() && !partitions_.back().second) partitions_.back().second = now_ms;
}

void Checker::master_replaced(std::int64_t now_ms) {
  event(now_ms);
  for (auto& [name, w] : workers_) {
    if (w.life == Life::kStopped) w.may_be_taken_back = true;
    if (w.life == Life::kResumed) {
      w.life = Life::kHealed;
      w.resumed_ms = now_ms;
    }
  }
}

void Checker::event(std::int64_t now_ms) {
  events_.push_back(now_ms);
  if (events_.size() > 4096) events_.erase(events_.begin(), events_.begin() + 2048);
}

void Checker::classify_failure(const json& j, std::uint64_t tag, std::uint64_t attempt) {
  if (!classified_.insert({tag, attempt}).second) return;
  while (!classified_.empty() && classified_.begin()->first + config_.history < tag) classified_.erase(classified_.begin());
  const std::string error = j.value("error", std::string());
  if (error.find("ring frame of attempt") != std::string::npos) {
    // A receiver gives up a connection whose first frame is of an older attempt, and an
    // attempt starts on a slot only once the previous one's outcome is known: a frame of
    // another attempt can no longer be the first reason an attempt fails.
    ++stale_frames_;
    add("stale_frame", "tag " + std::to_string(tag) + " attempt " + std::to_string(attempt) + " was lost to " + error,
        j.value("end_ms", std::int64_t{0}));
  }
  const std::int64_t end_ms = j.value("end_ms", std::int64_t{0});
  const std::int64_t began_ms = end_ms - j.value("ms", std::int64_t{0});
  if (end_ms <= 0) return;
  const std::int64_t from_ms = began_ms - config_.heartbeat_timeout_ms - config_.explained_window_ms;
  const bool explained = partition_overlaps(from_ms, end_ms) ||
                         std::any_of(events_.begin(), events_.end(), [&](std::int64_t t) {
                           // (the orchestrator notes an event just after it acted: a little slack)
                           return t >= from_ms && t <= end_ms + 100;
                         });
  if (explained) return;
  ++unexplained_;
  if (unexplained_samples_.size() < 8) {
    unexplained_samples_.push_back("tag " + std::to_string(tag) + " attempt " + std::to_string(attempt) + " (" +
                                   status_text(j.value("code", -1)) + "): " + error);
  }
}

bool Checker::partition_overlaps(std::int64_t from_ms, std::int64_t to_ms) const {
  for (const auto& [start, end] : partitions_) {
    if (start <= to_ms && (!end || *end >= from_ms)) return true;
  }
  return false;
}

// A successful sync or all-reduce that ended at done_ms (the worker's clock); a healed
// worker whose operation ended after the heal is active again (one that ended before
// the cut and was read late says nothing about the eviction).
void Checker::progressed(Worker& w, std::int64_t now_ms, std::int64_t done_ms) {
  w.last_progress_ms = now_ms;
  if (w.life != Life::kHealed || done_ms < w.resumed_ms) return;
  w.life = Life::kActive;
  ++partitioned_returned_;
  longest_heal_settle_ms_ = std::max(longest_heal_settle_ms_, now_ms - w.resumed_ms);
  update_condition(now_ms);
}

void Checker::killed(const std::string& name, std::int64_t now_ms) {
  event(now_ms);
  auto it = workers_.find(name);
  if (it == workers_.end() || it->second.life == Life::kGone) return;
  it->second.killed = true;
  it->second.life = Life::kGone;
  update_condition(now_ms);
}

void Checker::exited(const std::string& name, int exit_code, std::int64_t now_ms, bool shutting_down) {
  event(now_ms);
  auto it = workers_.find(name);
  if (it == workers_.end() || it->second.life == Life::kGone) return;
  Worker& w = it->second;
  const Life was = w.life;
  w.life = Life::kGone;
  update_condition(now_ms);
  if (was == Life::kResumed) {
    longest_resume_exit_ms_ = std::max(longest_resume_exit_ms_, now_ms - w.resumed_ms);
  }
  if (was == Life::kPartitioned && !shutting_down) ++partitioned_evicted_;  // it learned during the cut
  if (was == Life::kHealed && !shutting_down) {
    // Evicted during the cut: like a resumed worker, it must fail fast once healed.
    ++partitioned_evicted_;
    const std::int64_t waited = now_ms - w.resumed_ms;
    longest_heal_settle_ms_ = std::max(longest_heal_settle_ms_, waited);
    if (waited > config_.heartbeat_timeout_ms + config_.exit_margin_ms) {
      add("heal", name + " was evicted during a partition and exited " + std::to_string(waited) +
                      " ms after the heal", now_ms);
    }
  }
  // 0: a clean end after SIGTERM; 3: the worker printed why its communicator is finished.
  if (exit_code == 0 && shutting_down) return;
  if (exit_code == 3 && w.exit_status) {
    if (was == Life::kActive && !shutting_down) {
      unexpected_exits_.push_back(name + ": " + status_text(*w.exit_status) + ": " + w.exit_text);
    }
    return;
  }
  if (exit_code == 4) return;  // reported as a violation from its "unexpected" line
  std::string why = exit_code >= 128 ? "killed by signal " + std::to_string(exit_code - 128)
                                     : "exit status " + std::to_string(exit_code);
  add("crash", name + " ended unexpectedly (" + why + (shutting_down ? ", during shutdown" : "") + ")", now_ms);
}

void Checker::line(const std::string& name, const std::string& text, std::int64_t now_ms) {
  auto it = workers_.find(name);
  if (it == workers_.end()) return;
  Worker& w = it->second;
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    add("output", name + " printed a line that is not JSON: " + text.substr(0, 200), now_ms);
    return;
  }
  const std::string ev = j.value("ev", "");
  if (ev == "sync") {
    on_sync(w, name, j, now_ms);
  } else if (ev == "allreduce") {
    on_allreduce(w, name, j, now_ms);
  } else if (ev == "exit") {
    on_exit_line(w, name, j, now_ms);
  } else if (ev == "sync_retry" && j.value("code", -1) == LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE) {
    // The orchestrator never kills or stops the last active holder of the state.
    if (!w.no_state_reported) {
      w.no_state_reported = true;
      add("state", name + " got NO_SHARED_STATE_AVAILABLE at revision " +
                       std::to_string(j.value("revision", std::uint64_t{0})) + " (" + j.value("error", std::string()) + ")",
          now_ms);
    }
  } else if (ev == "unexpected") {
    add("status", name + " got a status a correct program never sees, in " + j.value("op", std::string("?")) + ": " +
                      j.value("status", std::string("?")) + " (" + j.value("error", std::string()) + ")",
        now_ms);
  }
}

void Checker::on_sync(Worker& w, const std::string& name, const json& j, std::int64_t now_ms) {
  const auto revision = j.value("revision", std::uint64_t{0});
  const auto hash = j.value("hash", std::string());
  ++syncs_;
  if (!w.revision && j.value("strategy", std::string()) == "receive") ++newcomer_syncs_;
  // A worker advances its revision by exactly one before each sync; a newcomer adopts
  // the group's at its first.
  if (w.revision && revision != *w.revision + 1) {
    add("revision", name + " synced revision " + std::to_string(revision) + " after revision " +
                        std::to_string(*w.revision) + " (expected exactly one more)",
        now_ms);
  }
  w.revision = revision;
  progressed(w, now_ms, j.value("t_ms", now_ms));
  auto [rec, fresh] = revisions_.emplace(revision, SyncRecord{hash, name});
  if (!fresh && rec->second.hash != hash) {
    add("parity", "revision " + std::to_string(revision) + ": " + name + " holds state " + hash + " but " +
                      rec->second.reporter + " holds " + rec->second.hash,
        now_ms);
  }
  if (revision > max_revision_) {
    longest_revision_gap_ms_ = std::max(longest_revision_gap_ms_, now_ms - max_revision_ms_);
    max_revision_ = revision;
    max_revision_ms_ = now_ms;
    progress_reported_ = false;
  }
  while (!revisions_.empty() && revisions_.begin()->first + config_.history < max_revision_) {
    revisions_.erase(revisions_.begin());
  }
}

void Checker::on_allreduce(Worker& w, const std::string& name, const json& j, std::int64_t now_ms) {
  const auto tag = j.value("tag", std::uint64_t{0});
  const auto attempt = j.value("attempt", std::uint64_t{0});
  const int code = j.value("code", -1);
  const auto world = j.value("world", std::uint64_t{0});
  const auto checksum = j.value("checksum", std::string());
  if (code == LOCKSTEP_OK) {
    ++allreduces_ok_reports_;
    if (completed_tags_.insert(tag).second) ++tags_completed_;
    while (!completed_tags_.empty() && *completed_tags_.begin() + config_.history < tag) {
      completed_tags_.erase(completed_tags_.begin());
    }
  } else {
    ++allreduce_failures_;
    classify_failure(j, tag, attempt);
    if (j.contains("restored") && !j.value("restored", true)) {
      add("restore", name + ": tag " + std::to_string(tag) + " attempt " + std::to_string(attempt) + " failed (" +
                         status_text(code) + ") and its buffer does not hold what it held before the call",
          now_ms);
    }
  }
  if (finished_status(code)) return;  // this peer is out; the others' outcome stands
  const auto key = std::make_pair(tag, attempt);
  const std::int64_t end_ms = j.value("end_ms", std::int64_t{0});
  auto [rec, fresh] = attempts_.emplace(key, ReduceRecord{code, world, checksum, name, 0, 0, {}, {}, false});
  // When the outcome reached this peer, if it is active (a stopped one learns it late).
  if (end_ms > 0 && w.life == Life::kActive) {
    ReduceRecord& r = rec->second;
    const bool had = r.first_end_ms > 0;
    if (!had || end_ms < r.first_end_ms) {
      r.first_end_ms = end_ms;
      r.first_ender = name;
    }
    if (!had || end_ms > r.last_end_ms) {
      r.last_end_ms = end_ms;
      r.last_ender = name;
    }
    const std::int64_t skew = r.last_end_ms - r.first_end_ms;
    if (config_.outcome_skew_ms > 0 && skew > config_.outcome_skew_ms && had && !r.skew_reported) {
      r.skew_reported = true;
      ++outcome_skews_;
      largest_outcome_skew_ms_ = std::max(largest_outcome_skew_ms_, skew);
      add("outcome_skew", "tag " + std::to_string(tag) + " attempt " + std::to_string(attempt) + " (" +
                              status_text(code) + "): " + r.first_ender + " learned the outcome " +
                              std::to_string(skew) + " ms before " + r.last_ender,
          now_ms);
    }
  }
  if (!fresh) {
    const ReduceRecord& first = rec->second;
    const std::string where = "tag " + std::to_string(tag) + " attempt " + std::to_string(attempt) + ": ";
    if (first.code != code) {
      add("allreduce", where + name + " got " + status_text(code) + " but " + first.reporter + " got " +
                           status_text(first.code),
          now_ms);
    } else if (code == LOCKSTEP_OK && (first.world != world || first.checksum != checksum)) {
      add("allreduce", where + name + " got world " + std::to_string(world) + " checksum " + checksum + " but " +
                           first.reporter + " got world " + std::to_string(first.world) + " checksum " +
                           first.checksum,
          now_ms);
    }
  }
  while (!attempts_.empty() && attempts_.begin()->first.first + config_.history < tag) attempts_.erase(attempts_.begin());
  if (code == LOCKSTEP_OK) progressed(w, now_ms, end_ms > 0 ? end_ms : now_ms);
}

void Checker::on_exit_line(Worker& w, const std::string& name, const json& j, std::int64_t now_ms) {
  const int code = j.value("code", -1);
  w.exit_status = code;
  w.exit_text = j.value("op", std::string()) + ": " + j.value("error", std::string());
  if (code == LOCKSTEP_STATUS_REVISION_VIOLATION || code == LOCKSTEP_STATUS_SHARED_STATE_MISMATCH ||
      code == LOCKSTEP_STATUS_PROTOCOL_ERROR || code == LOCKSTEP_STATUS_INTERRUPTED) {
    add("status", name + " was removed with " + status_text(code) + " in " + w.exit_text, now_ms);
    return;
  }
  if ((w.life == Life::kResumed || w.life == Life::kStopped) && !eviction_status(code)) {
    add("resume", name + " was evicted while stopped but ended with " + status_text(code) + " in " + w.exit_text,
        now_ms);
  }
  if ((w.life == Life::kPartitioned || w.life == Life::kHealed) && !eviction_status(code)) {
    add("heal", name + " was cut off by a partition and ended with " + status_text(code) + " in " + w.exit_text,
        now_ms);
  }
}

void Checker::tick(std::int64_t now_ms) {
  // (c) stalls, while at least two workers are active.
  if (two_active_since_) {
    for (const auto& [name, w] : workers_) {
      if (w.life != Life::kActive) continue;
      const std::int64_t since = std::max({w.last_progress_ms, w.spawned_ms, *two_active_since_});
      const std::int64_t stall = now_ms - since;
      const std::int64_t bound = config_.heartbeat_timeout_ms + config_.stall_margin_ms +
                                 (partition_overlaps(since, now_ms) ? config_.partition_allowance_ms : 0);
      if (stall > longest_stall_ms_) {
        longest_stall_ms_ = stall;
        longest_stall_worker_ = name;
        longest_stall_from_ms_ = since;
      }
      if (stall > bound && !stall_reported_) {
        stall_reported_ = true;
        add("stall", name + " made no progress for " + std::to_string(stall) + " ms (since " +
                         std::to_string(since - start_ms_) + " ms after the start) while " +
                         std::to_string(active_count()) + " workers were active",
            now_ms);
      }
    }
  }
  // (e) the highest revision grows within every window.
  if (now_ms - max_revision_ms_ > config_.progress_window_ms && !progress_reported_) {
    progress_reported_ = true;
    add("progress", "the highest revision (" + std::to_string(max_revision_) + ") did not grow for " +
                        std::to_string(now_ms - max_revision_ms_) + " ms",
        now_ms);
  }
  // Healed workers progress again or, evicted, end (the "exit" line is checked), within the stall bound.
  for (auto& [name, w] : workers_) {
    if (w.life != Life::kHealed || w.resume_reported) continue;
    const std::int64_t waited = now_ms - w.resumed_ms;
    if (waited > config_.heartbeat_timeout_ms + config_.stall_margin_ms + config_.partition_allowance_ms) {
      w.resume_reported = true;
      add("heal", name + " was cut off by a partition; " + std::to_string(waited) +
                      " ms after the heal it has neither progressed nor exited",
          now_ms);
    }
  }
  // Resumed workers were evicted and must fail fast.
  for (auto& [name, w] : workers_) {
    if (w.life != Life::kResumed) continue;
    const std::int64_t waited = now_ms - w.resumed_ms;
    longest_resume_exit_ms_ = std::max(longest_resume_exit_ms_, waited);
    if (waited > config_.heartbeat_timeout_ms + config_.exit_margin_ms && !w.resume_reported) {
      w.resume_reported = true;
      add("resume", name + " was resumed after its eviction but has not exited after " + std::to_string(waited) + " ms",
          now_ms);
    }
  }
}

}  // namespace lockstep::soak
