#include "coordinator/kv_store.h"

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
      // Every wait for this key ends now, with the value.
      for (auto w = waits_.begin(); w != waits_.end();) {
        if (w->second.key == request.key) {
          out.push_back({w->first.first, proto::KvResult{w->first.second, LOCKSTEP_OK, {}, it->second}});
          w = waits_.erase(w);
        } else {
          ++w;
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
      waits_[{peer, request.request}] = Wait{request.key, request.timeout_ms == 0 ? 0 : now_ms + request.timeout_ms};
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
  for (auto w = waits_.begin(); w != waits_.end();) {
    if (w->second.deadline_ms != 0 && now_ms >= w->second.deadline_ms) {
      out.push_back({w->first.first, proto::KvResult{w->first.second, LOCKSTEP_STATUS_TIMEOUT,
                                                     "key '" + w->second.key + "' was not set in time", {}}});
      w = waits_.erase(w);
    } else {
      ++w;
    }
  }
}

void KvStore::on_peer_removed(PeerId peer) {
  for (auto w = waits_.begin(); w != waits_.end();) {
    w = w->first.first == peer ? waits_.erase(w) : std::next(w);
  }
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
  for (const auto& [who, wait] : waits_) {
    if (entries_.count(wait.key) != 0) return "a wait for a key that is set: '" + wait.key + "'";
    if (!known(who.first)) return "a wait of peer " + who.first.to_string() + ", which left";
  }
  return std::nullopt;
}

}  // namespace lockstep::coord
