// The soak's live assertions, as a pure object: the orchestrator feeds it what it
// does to the workers and every JSON line they print, each with a monotonic time in
// milliseconds, and asks it for violations. No clock, no IO, no processes: a test can
// drive it with invented lines and times (tests/soak/checker_test.cpp).
//
// What it asserts (docs/soak.md):
//  (a) parity: every worker that reports a revision reports the same state hash;
//      a worker's revisions advance by exactly one per successful sync;
//  (b) one outcome: every report of the same all-reduce attempt (tag, attempt number)
//      has the same status, and successes the same world size and checksum; a failed
//      all-reduce left its buffer exactly as it was; and every active peer of the
//      attempt learns the outcome within outcome_skew_ms of the others (the master
//      ends an attempt for all participants at once);
//  (c) no stall: no active worker (running, not stopped) goes without progress (a
//      successful sync or all-reduce) for longer than the heartbeat timeout plus a
//      margin while at least two workers are active;
//  (e) the run advances: the highest revision grows within every progress window;
//  plus: a worker resumed after being stopped past the heartbeat timeout exits within
//  the heartbeat timeout plus a margin, with the status of an evicted peer; no worker
//  reports a status that a correct program never sees; no worker crashes.
// Partitions (the WAN mode): the workers of a host cut off from every other host are
// treated like stopped ones while the cut lasts (not active, their late moments left
// out of the outcome skew); once healed, each one either makes progress again (it was
// not evicted) within the stall bound, or ends with the status of an evicted peer within
// the heartbeat timeout plus the exit margin, like a resumed worker. A
// stall that overlaps a partition may last partition_allowance_ms longer.
// (d), the master's memory, is measured by the orchestrator.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace lockstep::soak {

struct CheckerConfig {
  std::int64_t heartbeat_timeout_ms = 1000;
  // (c): a stall longer than heartbeat_timeout_ms + stall_margin_ms is a violation.
  std::int64_t stall_margin_ms = 10'000;
  // (e): the highest revision must grow within every window of this length.
  std::int64_t progress_window_ms = 20'000;
  // A resumed worker must exit within heartbeat_timeout_ms + exit_margin_ms.
  std::int64_t exit_margin_ms = 5'000;
  // (b) one outcome at once: the peers of one all-reduce attempt learn its outcome within
  // this long of each other (0: not checked).
  std::int64_t outcome_skew_ms = 2'000;
  // (c): extra time allowed to a stall that overlaps a partition (the cut's longest
  // duration, the p2p connect and stall timeouts: what a ring across the cut takes to
  // fail and be retried once healed).
  std::int64_t partition_allowance_ms = 0;
  // A failed all-reduce is explained by an event of the run this long (plus the
  // heartbeat timeout) before it began, or later (the stall timeout and a retry).
  std::int64_t explained_window_ms = 3'000;
  // Revisions and tags this far below the newest are forgotten (bounded memory).
  std::uint64_t history = 100'000;
};

struct Violation {
  std::int64_t t_ms = 0;
  // parity, revision, allreduce, outcome_skew, restore, stale_frame, stall, progress, resume, heal, status, state, crash,
  // output, or one of the orchestrator's: master, memory, shutdown, testbed
  std::string kind;
  std::string text;
};

// Statuses after which a communicator is finished (docs/errors.md).
bool finished_status(int code);
// Statuses an evicted (stopped, then resumed) peer may end with.
bool eviction_status(int code);

class Checker {
 public:
  explicit Checker(CheckerConfig config, std::int64_t start_ms);

  // What the orchestrator does to the workers.
  void spawned(const std::string& name, std::int64_t now_ms);
  void stopped(const std::string& name, std::int64_t now_ms);
  void resumed(const std::string& name, std::int64_t now_ms);
  // A partition began: the named workers (those of a host cut off from all others; none
  // for a cut between two worker hosts) are no longer active.
  void partition_started(const std::vector<std::string>& cut_off, std::int64_t now_ms);
  // Every cut was healed: the workers cut off are on probation until they progress or exit.
  void partition_healed(std::int64_t now_ms);
  // The master was killed and a new one started (--master-kill-ms): a worker stopped
  // meanwhile may not have been evicted, and the new master may take it back. From its
  // SIGCONT on it is held to what a healed worker is: progress again, or end as an
  // evicted peer, within the stall bound.
  void master_replaced(std::int64_t now_ms);
  // The worker was SIGKILLed by the orchestrator (its end needs no explanation).
  void killed(const std::string& name, std::int64_t now_ms);
  // The worker exited on its own: exit_code as from a shell (128+signal for a signal).
  // During the final shutdown (SIGTERM) pass shutting_down = true.
  void exited(const std::string& name, int exit_code, std::int64_t now_ms, bool shutting_down = false);

  // One line a worker printed on stdout.
  void line(const std::string& name, const std::string& text, std::int64_t now_ms);
  // Periodic checks (stall, progress, resumed workers' deadlines).
  void tick(std::int64_t now_ms);

  // An assertion the orchestrator makes itself (master crash, memory, shutdown).
  void fail(const std::string& kind, const std::string& text, std::int64_t now_ms);

  const std::vector<Violation>& violations() const { return violations_; }
  bool ok() const { return violations_.empty(); }

  // Figures for the summary.
  std::uint64_t max_revision() const { return max_revision_; }
  std::uint64_t syncs_reported() const { return syncs_; }
  std::uint64_t allreduce_attempts_ok() const { return allreduces_ok_reports_; }
  std::uint64_t allreduces_completed() const { return tags_completed_; }
  std::uint64_t allreduce_failures_reported() const { return allreduce_failures_; }
  std::uint64_t newcomer_syncs() const { return newcomer_syncs_; }
  // Attempts whose participants learned the outcome further apart than outcome_skew_ms,
  // and the largest such spread.
  std::uint64_t outcome_skews() const { return outcome_skews_; }
  std::int64_t largest_outcome_skew_ms() const { return largest_outcome_skew_ms_; }
  std::int64_t longest_stall_ms() const { return longest_stall_ms_; }
  const std::string& longest_stall_worker() const { return longest_stall_worker_; }
  // When the longest stall began, in ms after the start.
  std::int64_t longest_stall_from_ms() const { return longest_stall_from_ms_ - start_ms_; }
  std::int64_t longest_resume_exit_ms() const { return longest_resume_exit_ms_; }
  // Workers cut off by a partition: how many came back, how many ended (evicted; during
  // the cut or after the heal), and the longest time from a heal to either.
  std::uint64_t partitioned_returned() const { return partitioned_returned_; }
  std::uint64_t partitioned_evicted() const { return partitioned_evicted_; }
  std::int64_t longest_heal_settle_ms() const { return longest_heal_settle_ms_; }
  // Failed all-reduce attempts (counted once per tag and attempt) lost to a frame of
  // another attempt on a ring connection ("ring frame of attempt M during attempt N"),
  // and those that nothing done to the run explains: no worker was spawned, stopped,
  // resumed, killed or exited and no partition began, lasted or healed between the
  // heartbeat timeout plus explained_window_ms before the attempt began and its end (a
  // stale connection after a membership change, or any other fault of the library,
  // lands here). The first few of each, with the reason.
  std::uint64_t stale_frame_failures() const { return stale_frames_; }
  std::uint64_t unexplained_failures() const { return unexplained_; }
  const std::vector<std::string>& unexplained_samples() const { return unexplained_samples_; }
  // The longest time the highest revision did not grow, up to now_ms.
  std::int64_t longest_revision_gap_ms(std::int64_t now_ms) const {
    return std::max(longest_revision_gap_ms_, now_ms - max_revision_ms_);
  }
  // Workers that ended on their own although nothing was done to them, with why.
  const std::vector<std::string>& unexpected_exits() const { return unexpected_exits_; }
  // Workers that are active (running and not stopped), by name.
  std::set<std::string> active() const;
  // Workers that reported at least one successful sync and are active.
  std::set<std::string> active_holders() const;
  bool has_synced(const std::string& name) const;

 private:
  // kPartitioned: its host is cut off; kHealed: the cut was healed and it has neither
  // progressed nor exited since.
  enum class Life { kActive, kStopped, kResumed, kPartitioned, kHealed, kGone };
  struct Worker {
    Life life = Life::kActive;
    std::int64_t spawned_ms = 0;
    std::int64_t last_progress_ms = 0;
    std::int64_t resumed_ms = 0;  // also: when its partition was healed
    std::optional<std::uint64_t> revision;  // of its last successful sync
    std::optional<int> exit_status;          // from its "exit" line
    std::string exit_text;
    bool killed = false;
    bool resume_reported = false;
    bool no_state_reported = false;
    bool may_be_taken_back = false;  // stopped when the master was replaced
  };
  struct SyncRecord {
    std::string hash;
    std::string reporter;
  };
  struct ReduceRecord {
    int code = 0;
    std::uint64_t world = 0;
    std::string checksum;
    std::string reporter;
    // The first and last moments an active peer saw the attempt end, and who.
    std::int64_t first_end_ms = 0;
    std::int64_t last_end_ms = 0;
    std::string first_ender;
    std::string last_ender;
    bool skew_reported = false;
  };

  void on_sync(Worker& w, const std::string& name, const nlohmann::json& j, std::int64_t now_ms);
  void on_allreduce(Worker& w, const std::string& name, const nlohmann::json& j, std::int64_t now_ms);
  void on_exit_line(Worker& w, const std::string& name, const nlohmann::json& j, std::int64_t now_ms);
  void add(const std::string& kind, const std::string& text, std::int64_t now_ms);
  void update_condition(std::int64_t now_ms);
  void progressed(Worker& w, std::int64_t now_ms, std::int64_t done_ms);
  // Whether a partition overlapped [from_ms, to_ms].
  bool partition_overlaps(std::int64_t from_ms, std::int64_t to_ms) const;
  // Something was done to the run (spawn, stop, resume, kill, exit, partition, heal).
  void event(std::int64_t now_ms);
  void classify_failure(const nlohmann::json& j, std::uint64_t tag, std::uint64_t attempt);
  std::size_t active_count() const;

  CheckerConfig config_;
  std::int64_t start_ms_ = 0;
  std::map<std::string, Worker> workers_;
  std::map<std::uint64_t, SyncRecord> revisions_;
  std::map<std::pair<std::uint64_t, std::uint64_t>, ReduceRecord> attempts_;
  std::set<std::uint64_t> completed_tags_;
  std::vector<Violation> violations_;
  std::vector<std::string> unexpected_exits_;
  // (c): since when at least two workers have been active (unset: fewer now).
  std::optional<std::int64_t> two_active_since_;
  std::uint64_t max_revision_ = 0;
  std::int64_t max_revision_ms_ = 0;
  bool progress_reported_ = false;
  bool stall_reported_ = false;
  std::uint64_t syncs_ = 0;
  std::uint64_t newcomer_syncs_ = 0;
  std::uint64_t outcome_skews_ = 0;
  std::int64_t largest_outcome_skew_ms_ = 0;
  std::uint64_t allreduces_ok_reports_ = 0;
  std::uint64_t allreduce_failures_ = 0;
  std::uint64_t tags_completed_ = 0;
  std::int64_t longest_stall_ms_ = 0;
  std::string longest_stall_worker_;
  std::int64_t longest_stall_from_ms_ = 0;
  std::int64_t longest_resume_exit_ms_ = 0;
  std::int64_t longest_revision_gap_ms_ = 0;
  // The latest partitions (start, end; end unset while it lasts), oldest first.
  std::vector<std::pair<std::int64_t, std::optional<std::int64_t>>> partitions_;
  // When things were done to the run, the latest last (bounded).
  std::vector<std::int64_t> events_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> classified_;
  std::uint64_t stale_frames_ = 0;
  std::uint64_t unexplained_ = 0;
  std::vector<std::string> unexplained_samples_;
  std::uint64_t partitioned_returned_ = 0;
  std::uint64_t partitioned_evicted_ = 0;
  std::int64_t longest_heal_settle_ms_ = 0;
};

}  // namespace lockstep::soak
