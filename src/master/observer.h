// The master's observability: what the run looks like and how it got there. The
// Observer takes the coordinator's structured events and the byte counts peers report
// with their CollectiveDone / SyncDone, each with the time the shell read, and keeps
// the figures the status page and /metrics show: operations started, succeeded and
// failed; failures by status; consensus round latency (from a round's first vote to its
// outcome); bytes moved; a throughput history; the recent events; and stalls (rounds
// that wait longer than a threshold, with the peers they wait for). It renders the
// picture of the run as JSON (/api/state) and as Prometheus text (/metrics) from those
// figures and the coordinator's read-only views.
//
// Like the coordinator it does no IO, starts no thread and reads no clock: the master's
// loop thread owns it and passes the time in, so tests can drive it directly.
#pragma once

#include "common/ids.h"
#include "coordinator/coordinator.h"

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace lockstep::master {

class Observer {
 public:
  // stall_after_ms: an open round older than this, still waiting for peers, is a stall
  // (logged once and marked on the page); 0 turns stall reports off.
  explicit Observer(TimeMs stall_after_ms = 10'000) : stall_after_ms_(stall_after_ms) {}

  // A decision of the coordinator, at the shell's time now_ms.
  void on_event(const coord::Event& event, TimeMs now_ms);
  // Bytes a peer reports having moved in an all-reduce attempt (all_reduce true) or a
  // shared-state sync.
  void on_bytes_reported(PeerId peer, bool all_reduce, std::uint64_t bytes_sent, std::uint64_t bytes_received,
                         TimeMs now_ms);
  // The same report of a ring all-reduce attempt, counted for the pool slot the
  // coordinator gave that attempt. Call it before the coordinator takes the report (the
  // attempt may end with it); a report of an attempt that already ended, or that
  // travels with the votes, has no slot and counts in the totals only.
  void on_slot_bytes_reported(const coord::Coordinator& coordinator, PeerId peer, std::uint64_t tag,
                              std::uint64_t attempt, std::uint64_t bytes_sent, std::uint64_t bytes_received);
  // Looks for new stalls; returns a log line for each (each stall is reported once).
  std::vector<std::string> check_stalls(const coord::Coordinator& coordinator, TimeMs now_ms);

  // The hot standby's state (master_server.h, Options::election), shown from the next
  // rendering on.
  struct Ha {
    std::string store;  // the election's store and key
    bool serving = false;
    std::string holder;  // the serving master, as the store names it
    std::uint64_t elections = 0;
    std::uint64_t step_downs = 0;
  };
  void set_ha(Ha ha) { ha_ = std::move(ha); }

  // The picture of the run (docs/observability.md lists the fields).
  std::string state_json(const coord::Coordinator& coordinator, TimeMs now_ms) const;
  // The Prometheus text exposition format, version 0.0.4.
  std::string metrics_text(const coord::Coordinator& coordinator, TimeMs now_ms) const;

  // Upper bounds (seconds) of the consensus-latency histogram's buckets.
  static constexpr std::array<double, 14> kLatencyBucketsS = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                              1,     2.5,  5,     10,   30,  60,  300};

 private:
  struct Stored {
    std::uint64_t seq = 0;
    TimeMs time_ms = 0;
    coord::Event event;
    std::size_t peers_omitted = 0;
  };
  struct Histogram {
    std::array<std::uint64_t, kLatencyBucketsS.size()> buckets{};  // non-cumulative
    std::uint64_t count = 0;
    double sum_s = 0;
  };
  struct Bucket {
    std::int64_t second = 0;
    std::uint64_t all_reduce_bytes = 0;
    std::uint64_t sync_bytes = 0;
  };
  struct PeerBytes {
    std::uint64_t sent = 0;
    std::uint64_t received = 0;
  };
  using RoundKey = std::tuple<int, std::uint32_t, std::uint64_t, std::uint64_t, TimeMs>;

  void remember(const coord::Event& event, TimeMs now_ms);
  void add_throughput(bool all_reduce, std::uint64_t bytes, TimeMs now_ms);
  bool stalled(const coord::OpenRound& round, TimeMs now_ms) const;

  TimeMs stall_after_ms_;
  std::uint64_t next_seq_ = 1;
  std::deque<Stored> events_;          // notable, the last kObservedEventsMax
  std::deque<Stored> routine_events_;  // everyday successes, the last kObservedRoutineEventsMax
  std::map<coord::Operation, std::uint64_t> started_;
  std::map<coord::Operation, std::uint64_t> succeeded_;
  std::map<coord::Operation, std::uint64_t> failed_;
  std::map<std::pair<coord::Operation, std::string>, std::uint64_t> failures_;  // by status name
  std::map<std::string, std::uint64_t> removals_;                                // by status name
  std::map<coord::Operation, std::uint64_t> refusals_;
  std::uint64_t registrations_ = 0;
  std::uint64_t rejections_ = 0;
  std::uint64_t vote_mismatches_ = 0;
  std::uint64_t stalls_ = 0;
  std::map<coord::Operation, Histogram> latency_;
  // bytes reported: [all_reduce?][sent?]
  std::uint64_t all_reduce_sent_ = 0, all_reduce_received_ = 0, sync_sent_ = 0, sync_received_ = 0;
  std::map<PeerId, PeerBytes> peer_bytes_;  // peers present in the run only
  // Ring bytes by (group, pool slot): slots below kP2PPoolSizeMax, groups that had a peer
  // when a group was last added (at most the groups present, plus one, times the pool bound).
  std::map<std::pair<std::uint32_t, std::uint32_t>, PeerBytes> slot_bytes_;
  // The (group, slot) of recent attempts, for the reports that come after a commit
  // ended the attempt (the oldest forgotten beyond kAttemptSlotsMax).
  std::map<std::uint64_t, std::pair<std::uint32_t, std::uint32_t>> attempt_slots_;
  static constexpr std::size_t kAttemptSlotsMax = 4096;
  std::deque<Bucket> throughput_;           // the last kThroughputHistorySeconds seconds
  std::set<RoundKey> reported_stalls_;      // open rounds already reported
  std::optional<Ha> ha_;
};

}  // namespace lockstep::master
