#include "coordinator/kv_store.h"

#include <algorithm>

#include <sstream>

namespace lockstep::coord {
namespace {

proto::KvResult answer(const proto::KvRequest& request, StatusCode status, std::string reason = {},
                       std::vector<std::uint8_t> value = {}) {
  return proto::KvResult{request.request, status, std::move(reason), std::move(value)};
}

}  // namespace

std::string KvStore::bound_error(const proto::KvRequest& request, StatusCode* status) const {
  *status = LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (request.key.empty()) return "an empty key";
  if (request.op != proto::KvOp::kSet && !request.value.empty()) return "a value with a request that takes none";
  if (request.op != proto::KvOp::kWait && request.timeout_ms != 0) return "a timeout with a request that takes none";
  *status = LOCKSTEP_STATUS_LIMIT_EXCEEDED;
  if (request.key.size() > config_.key_bytes_max) {
    return "a key of " + std::to_string(request.key.size()) + " bytes; this master's bound is " +
           std::to_string(config_.key_bytes_max) + " (--kv-key-bytes-max)";
  }
  if (request.value.size() > config_.value_bytes_max) {
    return "a value of " + std::to_string(request.value.size()) + " bytes; this master's bound is " +
           std::to_string(config_.value_bytes_max) + " (--kv-value-bytes-max)";
  }
  return {};
}

void KvStore::on_request(PeerId peer, const proto::KvRequest& request, TimeMs now_ms, Replies& out) {
  StatusCode status = LOCKSTEP_OK;
  if (std::string why = bound_error(request, &status); !why.empty()) {
    out.push_back({peer, answer(request, status, std::move(why))});
    return;
  }
  switch (request.op) {
    case proto::KvOp::kSet: {
      auto it = entries_.find(request.key);
      if (it == entries_.end() && entries_.size() >= config_.keys_max) {
        out.push_back({peer, answer(request, LOCKSTEP_STATUS_LIMIT_EXCEEDED,
                                    "the store holds " + std::to_string(entries_.size()) +
                                        " keys, this master's bound (--kv-keys-max); delete some first")});
        return;
      }
      if (it == entries_.end()) {
        it = entries_.emplace(request.key, std::vector<std::uint8_t>{}).first;
        bytes_ += request.key.size();
      }
      bytes_ -= it->second.size();
      it->second = request.value;
      bytes_ += it->second.size();
      out.push_back({peer, answer(request, LOCKSTEP_OK)});
      // Every wait for this key ends now, with the value (in (peer, request) order).
      if (auto k = waits_by_key_.find(request.key); k != waits_by_key_.end()) {
        const std::set<WaitId> ids = k->second;
        for (const WaitId& id : ids) {
          out.push_back({id.first, proto::KvResult{id.second, LOCKSTEP_OK, {}, it->second}});
          erase_wait(waits_.find(id));
        }
      }
      return;
    }
    case proto::KvOp::kGet:
    case proto::KvOp::kWait: {
      if (auto it = entries_.find(request.key); it != entries_.end()) {
        out.push_back({peer, answer(request, LOCKSTEP_OK, {}, it->second)});
        return;
      }
      if (request.op == proto::KvOp::kGet) {
        out.push_back({peer, answer(request, LOCKSTEP_STATUS_KEY_NOT_FOUND, "no key '" + request.key + "'")});
        return;
      }
      if (waits_.count({peer, request.request}) != 0) {
        out.push_back({peer, answer(request, LOCKSTEP_STATUS_INVALID_USAGE,
                                    "request " + std::to_string(request.request) + " is already waiting")});
        return;
      }
      if (waits_of(peer) >= config_.waits_per_peer_max) {
        out.push_back({peer, answer(request, LOCKSTEP_STATUS_LIMIT_EXCEEDED,
                                    "this peer has " + std::to_string(config_.waits_per_peer_max) +
                                        " waits open, the master's bound")});
        return;
      }
      add_wait({peer, request.request}, Wait{request.key, request.timeout_ms == 0 ? 0 : now_ms + request.timeout_ms});
      return;
    }
    case proto::KvOp::kDelete: {
      if (auto it = entries_.find(request.key); it != entries_.end()) {
        bytes_ -= it->first.size() + it->second.size();
        entries_.erase(it);
      }
      out.push_back({peer, answer(request, LOCKSTEP_OK)});
      return;
    }
  }
}

void KvStore::on_tick(TimeMs now_ms, Replies& out) {
  // The waits whose deadline has passed, answered in (peer, request) order.
  std::vector<WaitId> expired;
  for (auto d = deadlines_.begin(); d != deadlines_.end() && d->first <= now_ms; ++d) expired.push_back(d->second);
  std::sort(expired.begin(), expired.end());
  for (const WaitId& id : expired) {
    auto w = waits_.find(id);
    out.push_back({id.first, proto::KvResult{id.second, LOCKSTEP_STATUS_TIMEOUT,
                                             "key '" + w->second.key + "' was not set in time", {}}});
    erase_wait(w);
  }
}

void KvStore::on_peer_removed(PeerId peer) {
  auto w = waits_.lower_bound({peer, 0});
  while (w != waits_.end() && w->first.first == peer) w = erase_wait(w);
}

void KvStore::add_wait(const WaitId& id, Wait wait) {
  waits_by_key_[wait.key].insert(id);
  if (wait.deadline_ms != 0) deadlines_.insert({wait.deadline_ms, id});
  waits_.emplace(id, std::move(wait));
}

KvStore::Waits::iterator KvStore::erase_wait(Waits::iterator it) {
  auto k = waits_by_key_.find(it->second.key);
  k->second.erase(it->first);
  if (k->second.empty()) waits_by_key_.erase(k);
  if (it->second.deadline_ms != 0) deadlines_.erase({it->second.deadline_ms, it->first});
  return waits_.erase(it);
}

std::size_t KvStore::waits_of(PeerId peer) const {
  std::size_t n = 0;
  for (auto w = waits_.lower_bound({peer, 0}); w != waits_.end() && w->first.first == peer; ++w) ++n;
  return n;
}

std::string KvStore::digest() const {
  std::ostringstream s;
  s << "kv " << entries_.size() << " keys " << bytes_ << " bytes;";
  for (const auto& [key, value] : entries_) {
    std::uint64_t h = 14695981039346656037ull;  // FNV-1a of the value
    for (std::uint8_t b : value) h = (h ^ b) * 1099511628211ull;
    s << " " << key << "=" << value.size() << "/" << std::hex << h << std::dec;
  }
  for (const auto& [who, wait] : waits_) {
    s << " wait " << who.first.to_string() << "/" << who.second << " " << wait.key << " @" << wait.deadline_ms;
  }
  return s.str();
}

std::optional<std::string> KvStore::check_invariants(const std::function<bool(PeerId)>& known) const {
  if (entries_.size() > config_.keys_max) return "the key-value store holds more keys than its bound";
  std::size_t bytes = 0;
  for (const auto& [key, value] : entries_) {
    if (key.empty() || key.size() > config_.key_bytes_max) return "a key outside the bounds: '" + key + "'";
    if (value.size() > config_.value_bytes_max) return "a value larger than the bound under '" + key + "'";
    bytes += key.size() + value.size();
  }
  if (bytes != bytes_) return "the key-value store's byte count is off";
  std::size_t by_key = 0, with_deadline = 0;
  for (const auto& [key, ids] : waits_by_key_) by_key += ids.size();
  for (const auto& [who, wait] : waits_) {
    if (entries_.count(wait.key) != 0) return "a wait for a key that is set: '" + wait.key + "'";
    if (!known(who.first)) return "a wait of peer " + who.first.to_string() + ", which left";
    auto k = waits_by_key_.find(wait.key);
    if (k == waits_by_key_.end() || k->second.count(who) == 0) return "a wait missing from the index by key";
    if (wait.deadline_ms != 0) {
      ++with_deadline;
      if (deadlines_.count({wait.deadline_ms, who}) == 0) return "a wait missing from the index by deadline";
    }
  }
  if (by_key != waits_.size() || with_deadline != deadlines_.size()) return "a wait index holds waits that are gone";
  return std::nullopt;
}

}  // namespace lockstep::coord
