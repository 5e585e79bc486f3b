// The master's key-value store of run metadata (docs/collectives.md, "Key-value store"):
// set, get, wait-for-key and delete, run-wide, as a pure state machine inside the
// coordinator. Requests and time come in; the answers to send come out. Every bound is
// a master flag (KvConfig); a request beyond one is answered LIMIT_EXCEEDED and changes
// nothing. A wait is answered when the key is set, or TIMEOUT at its deadline, or
// forgotten when its peer leaves.
#pragma once

#include "common/ids.h"
#include "common/limits.h"
#include "protocol/messages.h"

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::coord {

struct KvConfig {
  std::uint32_t keys_max = limits::kKvKeysMaxDefault;
  std::uint32_t key_bytes_max = limits::kKvKeyBytesMaxDefault;
  std::uint32_t value_bytes_max = limits::kKvValueBytesMaxDefault;
  std::uint32_t waits_per_peer_max = limits::kKvWaitsPerPeerMax;
};

class KvStore {
 public:
  struct Reply {
    PeerId peer;
    proto::KvResult result;
  };
  using Replies = std::vector<Reply>;

  explicit KvStore(KvConfig config) : config_(config) {}

  void on_request(PeerId peer, const proto::KvRequest& request, TimeMs now_ms, Replies& out);
  // Answers the waits whose deadline has passed with TIMEOUT.
  void on_tick(TimeMs now_ms, Replies& out);
  // The peer left: its open waits are forgotten.
  void on_peer_removed(PeerId peer);

  std::size_t keys() const { return entries_.size(); }
  std::size_t bytes() const { return bytes_; }  // keys' and values' bytes held
  std::size_t waits() const { return waits_.size(); }
  std::size_t waits_of(PeerId peer) const;
  const std::map<std::string, std::vector<std::uint8_t>>& entries() const { return entries_; }
  // A canonical text form of the store and its waits (the coordinator's digest).
  std::string digest() const;
  // Checks the structural invariants (`known`: whether a peer is still in the run); a
  // description of the first violation.
  std::optional<std::string> check_invariants(const std::function<bool(PeerId)>& known) const;

 private:
  struct Wait {
    std::string key;
    TimeMs deadline_ms = 0;  // 0: none
  };
  using WaitId = std::pair<PeerId, std::uint64_t>;  // (peer, request id)
  using Waits = std::map<WaitId, Wait>;
  // A reason for a request that breaks a bound, or empty.
  std::string bound_error(const proto::KvRequest& request, StatusCode* status) const;
  void add_wait(const WaitId& id, Wait wait);
  Waits::iterator erase_wait(Waits::iterator it);

  KvConfig config_;
  std::map<std::string, std::vector<std::uint8_t>> entries_;
  std::size_t bytes_ = 0;
  // Open waits, and two indexes of them, so that a set, a tick and a leaver cost what
  // they touch, not every wait of the run (up to 64 per peer).
  Waits waits_;
  std::map<std::string, std::set<WaitId>> waits_by_key_;
  std::set<std::pair<TimeMs, WaitId>> deadlines_;  // the waits that have one
};

}  // namespace lockstep::coord
