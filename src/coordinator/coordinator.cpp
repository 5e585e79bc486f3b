// Coordinator implementation: the events, admission, removal, the votes and the
// topology phases (the collectives are in collectives.cpp, the shared-state sync in
// shared_state.cpp, optimize topology in optimize.cpp, the key-value store in
// kv_store.cpp, the views from outside in introspection.cpp). Every handler follows one
// pattern: validate (refuse without touching state), apply, then advance() to run the
// completion checks, so that a decision is made at exactly one place whatever event
// made it possible.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <cassert>

namespace lockstep::coord {

using proto::MsgType;

const char* to_string(Phase phase) {
  return phase == Phase::kRegistered ? "REGISTERED" : "ACCEPTED";
}
const char* to_string(PeerState state) {
  switch (state) {
    case PeerState::kIdle: return "IDLE";
    case PeerState::kVoteAcceptNewPeers: return "VOTE_ACCEPT_NEW_PEERS";
    case PeerState::kEstablishingP2P: return "ESTABLISHING_P2P";
    case PeerState::kVoteSync: return "VOTE_SYNC_SHARED_STATE";
    case PeerState::kSyncing: return "SYNC_SHARED_STATE";
    case PeerState::kVoteOptimizeTopology: return "VOTE_OPTIMIZE_TOPOLOGY";
    case PeerState::kMeasuringBandwidth: return "MEASURING_BANDWIDTH";
  }
  return "?";
}
const char* to_string(TopologyPhase phase) {
  switch (phase) {
    case TopologyPhase::kIdle: return "IDLE";
    case TopologyPhase::kVoting: return "VOTING";
    case TopologyPhase::kMeasuring: return "MEASURING";
    case TopologyPhase::kEstablishing: return "ESTABLISHING";
  }
  return "?";
}
const char* to_string(Operation op) {
  switch (op) {
    case Operation::kNone: return "none";
    case Operation::kConnection: return "connection";
    case Operation::kUpdateTopology: return "update_topology";
    case Operation::kOptimizeTopology: return "optimize_topology";
    case Operation::kArePeersPending: return "are_peers_pending";
    case Operation::kAgree: return "agree";
    case Operation::kAllReduce: return "all_reduce";
    case Operation::kSharedStateSync: return "shared_state_sync";
  }
  return "?";
}
const char* to_string(EventKind kind) {
  switch (kind) {
    case EventKind::kInfo: return "info";
    case EventKind::kStarted: return "started";
    case EventKind::kSucceeded: return "succeeded";
    case EventKind::kFailed: return "failed";
    case EventKind::kRefused: return "refused";
    case EventKind::kRegistered: return "registered";
    case EventKind::kRejected: return "rejected";
    case EventKind::kRemoved: return "removed";
    case EventKind::kVoteMismatch: return "vote_mismatch";
  }
  return "?";
}
const char* to_string(MajorOp op) {
  switch (op) {
    case MajorOp::kNone: return "NONE";
    case MajorOp::kUpdateTopology: return "UPDATE_TOPOLOGY";
    case MajorOp::kCollective: return "COLLECTIVE";
    case MajorOp::kSharedStateSync: return "SHARED_STATE_SYNC";
  }
  return "?";
}

namespace {

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1";
}

// The operation a request belongs to, for the structured form of a refusal.
Operation operation_of(MsgType type) {
  switch (type) {
    case MsgType::kVoteUpdateTopology:
    case MsgType::kP2PReport: return Operation::kUpdateTopology;
    case MsgType::kVoteOptimizeTopology:
    case MsgType::kBandwidthReport: return Operation::kOptimizeTopology;
    case MsgType::kVotePeersPending: return Operation::kArePeersPending;
    case MsgType::kVoteAgree: return Operation::kAgree;
    case MsgType::kCollectiveInit:
    case MsgType::kCollectiveDone: return Operation::kAllReduce;
    case MsgType::kSyncVote:
    case MsgType::kSyncDone: return Operation::kSharedStateSync;
    default: return Operation::kNone;
  }
}

// A connection turned away before it became a peer.
Event rejected(std::string text, std::string reason, StatusCode status) {
  return Event{.text = std::move(text), .kind = EventKind::kRejected, .op = Operation::kConnection,
               .reason = std::move(reason), .status = status};
}

}  // namespace

std::string id_list(const std::vector<PeerId>& ids) {
  std::string out;
  for (const auto& id : ids) {
    if (!out.empty()) out += ' ';
    out += id.to_string();
  }
  return out;
}

Coordinator::Coordinator(Config config) : config_(config), relay_(config.relay), kv_(config.kv) {
  if (config.term > 0) {
    term_ = config.term;
    term_fixed_ = true;
  }
}

void Coordinator::Tally::count(const Peer& peer, int sign) {
  const auto add = [sign](std::size_t& n, bool counts) {
    if (counts) n = sign > 0 ? n + 1 : n - 1;
  };
  const bool accepted = peer.phase == Phase::kAccepted;
  const bool update = accepted && peer.state == PeerState::kVoteAcceptNewPeers;
  const bool optimize = accepted && peer.state == PeerState::kVoteOptimizeTopology;
  const bool sync = accepted && peer.state == PeerState::kVoteSync;
  const bool pending = accepted && peer.voted_pending;
  const bool agree = accepted && peer.agree_flag.has_value();
  add(registered, !accepted);
  add(control_voters, update || optimize || sync || pending || agree);
  add(pending_voters, pending);
  add(update_voters, update);
  add(optimize_voters, optimize);
  add(unreported, peer.state == PeerState::kEstablishingP2P && !peer.p2p_reported);
  const bool rewiring = peer.state == PeerState::kEstablishingP2P || peer.state == PeerState::kMeasuringBandwidth;
  if (!agree && !update && !optimize && !sync && !rewiring) return;
  Group& g = groups[peer.group];
  add(g.agree_voters, agree);
  add(g.major_voters, update || optimize || sync);
  add(g.rewiring, rewiring);
  if (g == Group{}) groups.erase(peer.group);
}

void Coordinator::send_kv_replies(const KvStore::Replies& replies, Outbox& out) {
  for (const auto& reply : replies) {
    if (const Peer* p = find_peer(reply.peer)) send(*p, reply.result, out);
  }
}

std::optional<std::uint64_t> Coordinator::revision(std::uint32_t group) const {
  auto it = revisions_.find(group);
  if (it == revisions_.end()) return std::nullopt;
  return it->second;
}

const Peer* Coordinator::find_peer(PeerId id) const {
  auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : &it->second;
}

std::optional<PeerId> Coordinator::peer_of(ConnId conn) const {
  auto it = by_conn_.find(conn);
  if (it == by_conn_.end()) return std::nullopt;
  return it->second;
}

std::vector<PeerId> Coordinator::ring(std::uint32_t group) const {
  auto it = rings_.find(group);
  return it == rings_.end() ? std::vector<PeerId>{} : it->second;
}

MajorOp Coordinator::major_op(std::uint32_t group) const {
  if (auto t = tally_.groups.find(group); t != tally_.groups.end() && t->second.rewiring != 0) {
    return MajorOp::kUpdateTopology;
  }
  if (auto it = collectives_.find(group); it != collectives_.end() && !it->second.empty()) return MajorOp::kCollective;
  if (auto it = syncs_.find(group); it != syncs_.end() && it->second.phase == SharedStateSync::Phase::kTransferring) {
    return MajorOp::kSharedStateSync;
  }
  return MajorOp::kNone;
}

std::size_t Coordinator::accepted_count() const {
  std::size_t n = 0;
  for (const auto& [group, ids] : rings_) n += ids.size();
  return n;
}

proto::Attributes Coordinator::attributes(std::uint32_t group) const {
  proto::Attributes a;
  for (const auto& [g, ids] : rings_) {
    if (ids.empty()) continue;
    a.global_world_size += static_cast<std::uint32_t>(ids.size());
    a.num_groups += 1;
    a.largest_group_size = std::max(a.largest_group_size, static_cast<std::uint32_t>(ids.size()));
    if (g == group) a.group_world_size = static_cast<std::uint32_t>(ids.size());
  }
  return a;
}

std::vector<proto::MemberInfo> Coordinator::members(const std::vector<PeerId>& ids) const {
  std::vector<proto::MemberInfo> out;
  out.reserve(ids.size());
  for (const auto& id : ids) out.push_back(peers_.at(id).info);
  return out;
}

void Coordinator::send(const Peer& peer, proto::Message message, Outbox& out) {
  out.push_back(Send{peer.conn, std::move(message)});
}

void Coordinator::send_all(const std::vector<PeerId>& ids, proto::Message message, Outbox& out) {
  std::vector<ConnId> conns;
  conns.reserve(ids.size());
  for (const auto& id : ids) {
    if (const Peer* p = find_peer(id)) conns.push_back(p->conn);
  }
  if (conns.size() == 1) {
    out.push_back(Send{conns.front(), std::move(message)});
  } else if (!conns.empty()) {
    out.push_back(Broadcast{std::move(conns), std::move(message)});
  }
}

Outbox expanded(const Outbox& out) {
  Outbox result;
  result.reserve(out.size());
  for (const auto& command : out) {
    if (const auto* all = std::get_if<Broadcast>(&command)) {
      for (const auto conn : all->conns) result.push_back(Send{conn, all->message});
    } else {
      result.push_back(command);
    }
  }
  return result;
}

void Coordinator::refuse(const Peer& peer, MsgType request, StatusCode status, std::string reason, Outbox& out) {
  out.push_back(Event{.text = "refused " + std::string(proto::msg_type_name(request)) + " from " +
                              peer.id.to_string() + ": " + reason,
                      .kind = EventKind::kRefused,
                      .op = operation_of(request),
                      .reason = reason,
                      .status = status,
                      .group = peer.group,
                      .peers = {peer.id}});
  send(peer, proto::Refused{request, 0, status, std::move(reason)}, out);
}

bool Coordinator::in_control_vote(const Peer& peer) const {
  return peer.state == PeerState::kVoteAcceptNewPeers || peer.state == PeerState::kVoteOptimizeTopology ||
         peer.state == PeerState::kVoteSync || peer.voted_pending || peer.agree_flag.has_value();
}

// ---------------------------------------------------------------- events

void Coordinator::on_connect(ConnId conn, const std::string& observed_host, TimeMs now_ms, Outbox& out) {
  if (config_.pending_handshakes_max == 0) {
    out.push_back(rejected("connection from " + observed_host + " refused: no handshakes allowed",
                           "no unfinished handshakes allowed", LOCKSTEP_STATUS_REJECTED));
    out.push_back(Close{conn, "no unfinished handshakes allowed"});
    return;
  }
  // At the cap, the newest connection is not refused: the oldest unfinished handshake of
  // the host holding the most of them makes room. Connections that are held open idle
  // then cannot lock real newcomers out until the handshake timeout, and one flooding
  // address displaces its own connections before anybody else's.
  if (handshaking_.size() >= config_.pending_handshakes_max) {
    std::map<std::string, std::size_t> per_host;
    for (const auto& [c, hs] : handshaking_) ++per_host[hs.observed_host];
    std::size_t most = 0;
    for (const auto& [host, n] : per_host) most = std::max(most, n);
    auto victim = handshaking_.end();
    for (auto it = handshaking_.begin(); it != handshaking_.end(); ++it) {
      if (per_host[it->second.observed_host] != most) continue;
      if (victim == handshaking_.end() || it->second.connected_ms < victim->second.connected_ms) victim = it;
    }
    const std::string why = "displaced: " + std::to_string(handshaking_.size()) +
                            " unfinished handshakes (the cap), " + std::to_string(most) + " of them from " +
                            victim->second.observed_host;
    out.push_back(rejected("connection from " + victim->second.observed_host + " dropped: " + why, why,
                           LOCKSTEP_STATUS_REJECTED));
    out.push_back(Close{victim->first, "too many unfinished handshakes"});
    handshaking_.erase(victim);
  }
  handshaking_[conn] = Handshake{observed_host, now_ms};
}

void Coordinator::on_message(ConnId conn, const proto::Message& message, TimeMs now_ms, Outbox& out) {
  if (auto hs = handshaking_.find(conn); hs != handshaking_.end()) {
    if (const auto* hello = std::get_if<proto::Hello>(&message)) {
      handle_hello(conn, *hello, now_ms, out);
    } else {
      const std::string why = std::string("expected Hello, got ") + proto::msg_type_name(proto::type_of(message));
      out.push_back(rejected("connection from " + hs->second.observed_host + " dropped: " + why, why,
                             LOCKSTEP_STATUS_PROTOCOL_ERROR));
      out.push_back(Send{conn, proto::Goodbye{LOCKSTEP_STATUS_PROTOCOL_ERROR, why}});
      out.push_back(Close{conn, why});
      handshaking_.erase(hs);
    }
    advance(now_ms, out);
    return;
  }
  auto it = by_conn_.find(conn);
  if (it == by_conn_.end()) return;  // already closed by us; late bytes are ignored
  Peer& peer = peers_.at(it->second);
  peer.last_seen_ms = now_ms;
  handle_peer_message(peer, message, now_ms, out);
  advance(now_ms, out);
}

void Coordinator::on_disconnect(ConnId conn, const std::string& reason, TimeMs now_ms, Outbox& out) {
  if (handshaking_.erase(conn) > 0) return;
  auto it = by_conn_.find(conn);
  if (it == by_conn_.end()) return;
  remove_peer(it->second, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "connection closed: " + reason,
              /*connection_open=*/false, /*straggler=*/false, out);
  advance(now_ms, out);
}

bool Coordinator::on_evict(PeerId id, const std::string& reason, TimeMs now_ms, Outbox& out) {
  if (peers_.count(id) == 0) return false;
  remove_peer(id, LOCKSTEP_STATUS_KICKED, "evicted by the operator" + (reason.empty() ? "" : ": " + reason),
              /*connection_open=*/true, /*straggler=*/false, out);
  advance(now_ms, out);
  return true;
}

void Coordinator::on_protocol_error(ConnId conn, const std::string& reason, TimeMs now_ms, Outbox& out) {
  if (auto hs = handshaking_.find(conn); hs != handshaking_.end()) {
    out.push_back(rejected("connection from " + hs->second.observed_host + " dropped: " + reason, reason,
                           LOCKSTEP_STATUS_PROTOCOL_ERROR));
    out.push_back(Send{conn, proto::Goodbye{LOCKSTEP_STATUS_PROTOCOL_ERROR, reason}});
    out.push_back(Close{conn, reason});
    handshaking_.erase(hs);
    return;
  }
  auto it = by_conn_.find(conn);
  if (it == by_conn_.end()) return;
  remove_peer(it->second, LOCKSTEP_STATUS_PROTOCOL_ERROR, "protocol error: " + reason,
              /*connection_open=*/true, /*straggler=*/false, out);
  advance(now_ms, out);
}

void Coordinator::on_tick(TimeMs now_ms, Outbox& out) {
  // Handshakes that take too long.
  for (auto it = handshaking_.begin(); it != handshaking_.end();) {
    if (now_ms - it->second.connected_ms >= config_.handshake_timeout_ms) {
      const std::string why = "handshake not finished within " + std::to_string(config_.handshake_timeout_ms) + " ms";
      out.push_back(rejected("connection from " + it->second.observed_host + " dropped: " + why, why,
                             LOCKSTEP_STATUS_PROTOCOL_ERROR));
      out.push_back(Close{it->first, "handshake timeout"});
      it = handshaking_.erase(it);
    } else {
      ++it;
    }
  }
  // Silent peers.
  std::vector<PeerId> silent;
  for (const auto& [id, peer] : peers_) {
    if (now_ms - peer.last_seen_ms >= config_.heartbeat_timeout_ms) silent.push_back(id);
  }
  for (const auto& id : silent) {
    if (peers_.count(id) == 0) continue;
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                "heartbeat timeout: silent for more than " + std::to_string(config_.heartbeat_timeout_ms) + " ms",
                /*connection_open=*/true, /*straggler=*/false, out);
  }
  kick_stragglers(now_ms, out);
  kick_silent_measurers(now_ms, out);
  step_background_search();
  {
    KvStore::Replies replies;
    kv_.on_tick(now_ms, replies);
    send_kv_replies(replies, out);
  }
  // Participants of a p2p establishment that never report: a newcomer after
  // newcomer_timeout_ms (it may hold the run no longer), an accepted peer after
  // establish_timeout_ms.
  if (topology_phase_ == TopologyPhase::kEstablishing) {
    const TimeMs elapsed = now_ms - topology_started_ms_;
    std::vector<std::pair<PeerId, std::uint32_t>> late;
    for (const auto& [id, peer] : peers_) {
      if (peer.state != PeerState::kEstablishingP2P || peer.p2p_reported) continue;
      const std::uint32_t limit = peer.phase == Phase::kRegistered
                                      ? std::min(config_.newcomer_timeout_ms, config_.establish_timeout_ms)
                                      : config_.establish_timeout_ms;
      if (elapsed >= limit) late.emplace_back(id, limit);
    }
    for (const auto& [id, limit] : late) {
      const Peer* peer = find_peer(id);
      if (peer == nullptr) continue;
      const bool newcomer = peer->phase == Phase::kRegistered;
      remove_peer(id, newcomer ? LOCKSTEP_STATUS_REJECTED : LOCKSTEP_STATUS_KICKED,
                  "did not report its p2p connections within " + std::to_string(limit) + " ms",
                  /*connection_open=*/true, /*straggler=*/false, out);
    }
  }
  advance(now_ms, out);
}

// Semantics rule 1: with a vote timeout, accepted peers that have not joined an open
// vote in time are removed so that the others can decide without them.
void Coordinator::kick_stragglers(TimeMs now_ms, Outbox& out) {
  if (config_.vote_timeout_ms == 0) return;
  const auto expired = [&](TimeMs started) { return now_ms - started >= config_.vote_timeout_ms; };
  std::vector<std::pair<PeerId, std::string>> stragglers;
  for (const auto& [id, peer] : peers_) {
    // Only a peer free to join the vote is a straggler. One blocked in another vote or
    // in an establishment cannot; if every peer is blocked that way,
    // detect_vote_mismatch() answers them all instead. A peer with collectives in
    // flight may not join an update-topology vote (but may join the others).
    if (peer.phase != Phase::kAccepted || peer.state != PeerState::kIdle || in_control_vote(peer)) continue;
    if (topology_phase_ == TopologyPhase::kVoting && expired(topology_started_ms_) && !has_collective_in_flight(peer)) {
      stragglers.emplace_back(id, "update-topology");
    } else if (pending_round_ && expired(pending_round_->started_ms) && !peer.voted_pending) {
      stragglers.emplace_back(id, "are-peers-pending");
    } else if (auto a = agree_rounds_.find(peer.group); a != agree_rounds_.end() &&
                                                        expired(a->second.started_ms) && !peer.agree_flag &&
                                                        agree_has_voter(peer.group)) {
      stragglers.emplace_back(id, "agree");
    } else if (auto sy = syncs_.find(peer.group); sy != syncs_.end() &&
                                                  sy->second.phase == SharedStateSync::Phase::kVoting &&
                                                  expired(sy->second.started_ms) && !has_collective_in_flight(peer)) {
      stragglers.emplace_back(id, "shared-state sync");
    } else if (auto g = collectives_.find(peer.group); g != collectives_.end()) {
      for (const auto& [tag, c] : g->second) {
        if (c.phase == Collective::Phase::kVoting && expired(c.started_ms) && c.votes.count(id) == 0) {
          stragglers.emplace_back(id, "collective tag " + std::to_string(tag));
          break;
        }
      }
    }
  }
  for (const auto& [id, vote] : stragglers) {
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                "did not join the " + vote + " vote within the vote timeout of " +
                    std::to_string(config_.vote_timeout_ms) + " ms",
                /*connection_open=*/true, /*straggler=*/true, out);
  }
}

// ---------------------------------------------------------------- handshake

void Coordinator::handle_hello(ConnId conn, const proto::Hello& hello, TimeMs now_ms, Outbox& out) {
  const Handshake hs = handshaking_.at(conn);
  handshaking_.erase(conn);
  const std::string host = hello.advertised_host.empty() ? hs.observed_host : hello.advertised_host;
  auto reject = [&](const std::string& why) {
    out.push_back(rejected("peer from " + host + " rejected: " + why, why, LOCKSTEP_STATUS_REJECTED));
    out.push_back(Send{conn, proto::Goodbye{LOCKSTEP_STATUS_REJECTED, why}});
    out.push_back(Close{conn, why});
  };
  const bool no_ports = hello.p2p_port == 0 && hello.shared_state_port == 0 && hello.benchmark_port == 0;
  if (!no_ports && (hello.p2p_port == 0 || hello.shared_state_port == 0 || hello.benchmark_port == 0)) {
    return reject("the Hello names some of its ports but not all (a peer that accepts no inbound connection names none)");
  }
  if (peers_.size() >= config_.peers_max) {
    return reject("the run already has the maximum of " + std::to_string(config_.peers_max) + " peers");
  }
  // The loopback pitfall: a peer seen at 127.0.0.1 cannot be reached by peers on
  // other hosts, and a remote address cannot be used by... itself, so never mix (every
  // peer of the run is on the same side, so one of them stands for all).
  if (!peers_.empty()) {
    const Peer& other = peers_.begin()->second;
    if (is_loopback(other.info.host) != is_loopback(host)) {
      return reject("this run's peers are reached at " + other.info.host + " but this peer at " + host +
                    "; a run cannot mix loopback and non-loopback addresses (connect every peer to the "
                    "master through a non-loopback address, or set advertised_host)");
    }
  }
  if (!hello.resume_id.is_nil()) return handle_resume_hello(conn, hello, host, hs.observed_host, now_ms, out);
  register_peer(conn, hello, PeerId{config_.instance_nonce, next_peer_counter_++}, host, hs.observed_host,
                /*resuming=*/false, now_ms, out);
}

// A registered peer with this identity (a new one, or one a recovery takes back),
// welcomed under this master's term.
void Coordinator::register_peer(ConnId conn, const proto::Hello& hello, PeerId id, const std::string& host,
                                const std::string& observed_host, bool resuming, TimeMs now_ms, Outbox& out) {
  Peer peer;
  peer.conn = conn;
  peer.id = id;
  peer.group = hello.group;
  peer.last_seen_ms = now_ms;
  peer.info = proto::MemberInfo{id, host, hello.p2p_port, hello.shared_state_port, hello.benchmark_port};
  peer.pool_size = hello.pool_size;
  peer.resuming = resuming;
  by_conn_[conn] = id;
  tally_.count(peer, +1);
  out.push_back(Event{.text = "peer " + id.to_string() + (resuming ? " reconnected from " : " registered from ") + host +
                              " in group " + std::to_string(peer.group) + (resuming ? " to be taken back" : ""),
                      .kind = EventKind::kRegistered,
                      .op = Operation::kConnection,
                      .group = peer.group,
                      .peers = {id}});
  proto::Welcome welcome;  // the relay's address is the shell's to fill in
  welcome.id = id;
  welcome.observed_host = observed_host;
  welcome.heartbeat_timeout_ms = config_.heartbeat_timeout_ms;
  welcome.term = term_;
  send(peer, welcome, out);
  peers_.emplace(id, std::move(peer));
}

// ---------------------------------------------------------------- requests

void Coordinator::handle_peer_message(Peer& peer, const proto::Message& message, TimeMs now_ms, Outbox& out) {
  const MsgType type = proto::type_of(message);
  const bool accepted = peer.phase == Phase::kAccepted;
  switch (type) {
    case MsgType::kHeartbeat:
      send(peer, proto::HeartbeatAck{}, out);
      return;
    case MsgType::kKvRequest: {  // registered peers too: newcomers read the run's metadata
      KvStore::Replies replies;
      kv_.on_request(peer.id, std::get<proto::KvRequest>(message), now_ms, replies);
      return send_kv_replies(replies, out);
    }
    case MsgType::kVoteUpdateTopology:
    case MsgType::kVoteOptimizeTopology:
      if (!accepted) return refuse(peer, type, LOCKSTEP_STATUS_NOT_INITIALIZED, "peer is not accepted yet", out);
      if (peer.state != PeerState::kIdle || in_control_vote(peer)) {
        return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                      std::string("peer is already in ") + to_string(peer.state) + " or another vote", out);
      }
      if (has_collective_in_flight(peer)) {
        return refuse(peer, type, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS,
                      "collectives of this peer are still in flight; await them before updating the topology", out);
      }
      if (topology_phase_ == TopologyPhase::kIdle) {
        topology_phase_ = TopologyPhase::kVoting;
        // the vote timeout counts from the first vote
        topology_started_ms_ = peer.last_seen_ms;
        topology_round_started_ms_ = peer.last_seen_ms;
      }
      edit(peer, [type](Peer& p) {
        p.state = type == MsgType::kVoteUpdateTopology ? PeerState::kVoteAcceptNewPeers
                                                       : PeerState::kVoteOptimizeTopology;
      });
      return;
    case MsgType::kP2PReport: {
      const auto& report = std::get<proto::P2PReport>(message);
      // A report of an establishment that already ended (it failed while this peer was
      // still connecting) crossed the outcome on the wire: it changes nothing and gets
      // no answer, so no stale refusal waits for the peer's next call.
      if (peer.state != PeerState::kEstablishingP2P || report.epoch != epoch_) return;
      if (peer.p2p_reported) {
        return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE, "this peer already reported epoch " +
                                                                     std::to_string(epoch_), out);
      }
      edit(peer, [](Peer& p) { p.p2p_reported = true; });
      peer.unreachable = report.unreachable;
      return;
    }
    case MsgType::kVotePeersPending:
      if (!accepted) return refuse(peer, type, LOCKSTEP_STATUS_NOT_INITIALIZED, "peer is not accepted yet", out);
      if (peer.state != PeerState::kIdle || in_control_vote(peer)) {
        return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE, "peer is already in a vote", out);
      }
      if (!pending_round_) pending_round_ = Round{peer.last_seen_ms, false, {}};
      edit(peer, [](Peer& p) { p.voted_pending = true; });
      return;
    case MsgType::kVoteAgree:
      if (!accepted) return refuse(peer, type, LOCKSTEP_STATUS_NOT_INITIALIZED, "peer is not accepted yet", out);
      if (peer.state != PeerState::kIdle || in_control_vote(peer)) {
        return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE, "peer is already in a vote", out);
      }
      if (agree_rounds_.count(peer.group) == 0) agree_rounds_[peer.group] = Round{peer.last_seen_ms, false, {}};
      edit(peer, [&](Peer& p) { p.agree_flag = std::get<proto::VoteAgree>(message).flag; });
      peer.agree_mode = std::get<proto::VoteAgree>(message).mode;
      peer.agree_value = std::get<proto::VoteAgree>(message).value;
      return;
    case MsgType::kCollectiveInit:
      return handle_collective_init(peer, std::get<proto::CollectiveInit>(message), out);
    case MsgType::kCollectiveDone:
      return handle_collective_done(peer, std::get<proto::CollectiveDone>(message), out);
    case MsgType::kSyncVote:
      return handle_sync_vote(peer, std::get<proto::SyncVote>(message), out);
    case MsgType::kBandwidthReport:
      return handle_bandwidth_report(peer, std::get<proto::BandwidthReport>(message), out);
    case MsgType::kSyncDone:
      return handle_sync_done(peer, std::get<proto::SyncDone>(message), out);
    case MsgType::kResumeReport:
      return handle_resume_report(peer, std::get<proto::ResumeReport>(message), out);
    default:
      break;
  }
  // Anything else is a message a peer never sends the master after its handshake.
  remove_peer(peer.id, LOCKSTEP_STATUS_PROTOCOL_ERROR,
              std::string("protocol error: unexpected ") + proto::msg_type_name(type) + " from a peer",
              /*connection_open=*/true, /*straggler=*/false, out);
}

// ---------------------------------------------------------------- removal

void Coordinator::remove_peer(PeerId id, StatusCode status, const std::string& reason, bool connection_open,
                              bool straggler, Outbox& out) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  const Peer peer = it->second;
  out.push_back(Event{.text = "peer " + id.to_string() + " (" + to_string(peer.phase) + ", group " +
                              std::to_string(peer.group) + ") removed: " + reason,
                      .kind = EventKind::kRemoved,
                      .op = Operation::kConnection,
                      .reason = reason,
                      .status = status,
                      .group = peer.group,
                      .peers = {id}});
  if (connection_open) {
    out.push_back(Send{peer.conn, proto::Goodbye{status, reason}});
    out.push_back(Close{peer.conn, reason});
  }
  by_conn_.erase(peer.conn);
  tally_.count(peer, -1);
  peers_.erase(it);
  kv_.on_peer_removed(id);
  if (peer.phase == Phase::kAccepted) {
    auto& ids = rings_[peer.group];
    ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
    if (ids.empty()) rings_.erase(peer.group);
    topology_dirty_ = true;
    // One outcome per agree: the loss of a participant fails the round for everyone,
    // unless the vote timeout removed it precisely so that the others could decide.
    if (auto a = agree_rounds_.find(peer.group); a != agree_rounds_.end() && !straggler && !a->second.failed) {
      a->second.failed = true;
      a->second.failure = "peer " + id.to_string() + " was lost during the agree vote (" + reason + ")";
    }
    // Collectives of its group: a vote simply loses a voter; a running attempt can no
    // longer commit: the other participants are told to stop and report, and their
    // reports decide it (settle_collective, handle_collective_done).
    std::vector<std::uint64_t> lost_in;
    if (auto g = collectives_.find(peer.group); g != collectives_.end()) {
      for (auto c = g->second.begin(); c != g->second.end();) {
        c->second.votes.erase(id);
        c->second.contributions.erase(id);
        auto& who = c->second.participants;
        if (c->second.phase == Collective::Phase::kPerforming && std::find(who.begin(), who.end(), id) != who.end()) {
          c->second.lost.insert(id);
          c->second.done.erase(id);
          abort_attempt(c->first, c->second, "peer " + id.to_string() + " was lost during the collective (" + reason + ")",
                        out);
          lost_in.push_back(c->first);
        }
        const bool abandoned = c->second.phase == Collective::Phase::kVoting && c->second.votes.empty();
        c = abandoned ? g->second.erase(c) : std::next(c);
      }
      if (g->second.empty()) collectives_.erase(g);
    }
    for (const std::uint64_t tag : lost_in) settle_collective(peer.group, tag, out);
    // Its shared-state sync: a vote loses a voter; a transfer fails for everyone (rule 7).
    if (auto sy = syncs_.find(peer.group); sy != syncs_.end()) {
      if (sy->second.phase == SharedStateSync::Phase::kVoting) {
        sy->second.votes.erase(id);
        if (sy->second.votes.empty()) syncs_.erase(sy);
      } else if (std::find(sy->second.participants.begin(), sy->second.participants.end(), id) !=
                 sy->second.participants.end()) {
        finish_sync(peer.group, LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                    "peer " + id.to_string() + " was lost during the shared-state sync (" + reason + ")", out);
      }
    }
  }
  for (auto edge = bandwidth_.begin(); edge != bandwidth_.end();) {
    edge = edge->first.first == id || edge->first.second == id ? bandwidth_.erase(edge) : std::next(edge);
  }
  if (topology_phase_ == TopologyPhase::kEstablishing && peer.state == PeerState::kEstablishingP2P) {
    fail_establish("peer " + id.to_string() + " was lost during p2p establishment (" + reason + ")", out);
  }
  if (topology_phase_ == TopologyPhase::kMeasuring && peer.state == PeerState::kMeasuringBandwidth) {
    fail_optimize("peer " + id.to_string() + " was lost during the bandwidth measurements (" + reason + ")", out);
  }
  if (peer.phase == Phase::kAccepted && !relay_) {
    remove_unreachable_neighbours(peer.group, "since peer " + id.to_string() + " left", out);
  }
}

void Coordinator::on_relay_change(bool available, TimeMs now_ms, Outbox& out) {
  if (relay_ && available) {
    // Another relay took over: an establishment whose relayed edges were being made
    // through the old one fails without blaming anyone (the next vote retries it).
    if (topology_phase_ != TopologyPhase::kEstablishing) return;
    for (const auto& [group, ids] : proposed_rings_) {
      if (neighbours_accepting_none(ids)) {
        fail_establish("the relay in use changed while the ring of group " + std::to_string(group) +
                           " was being connected through it",
                       out);
        break;
      }
    }
    advance(now_ms, out);
    return;
  }
  if (relay_ == available) return;
  relay_ = available;
  out.push_back(Event{.text = available ? "the run has a relay: peers that accept no inbound connection may be "
                                          "ring neighbours"
                                        : "the run lost its last relay: no two ring neighbours may both accept no "
                                          "inbound connection any more"});
  if (available) return;
  if (topology_phase_ == TopologyPhase::kEstablishing) {
    for (const auto& [group, ids] : proposed_rings_) {
      if (const auto edge = unreachable_neighbours(ids)) {
        fail_establish("the run lost its relay, and in the proposed ring of group " + std::to_string(group) + " " +
                           *edge,
                       out);
        break;
      }
    }
  }
  std::vector<std::uint32_t> groups;
  for (const auto& [group, ids] : rings_) groups.push_back(group);
  for (const std::uint32_t group : groups) remove_unreachable_neighbours(group, "since the run lost its relay", out);
  advance(now_ms, out);
}

// After a removal two peers that both accept no inbound connection may be ring
// neighbours: their edge cannot be made, and every collective of the group would fail
// on it until an update topology re-formed the ring. The one that joined later leaves
// (KICKED); it may join again, and is then placed where its edges can be made
// (docs/deployment.md, "NAT"). Each removal checks again, so no such pair is left.
void Coordinator::remove_unreachable_neighbours(std::uint32_t group, const std::string& why, Outbox& out) {
  const auto it = rings_.find(group);
  if (it == rings_.end()) return;
  const std::vector<PeerId>& ring = it->second;
  const auto refuses = [&](PeerId id) { return !proto::accepts_inbound(peers_.at(id).info); };
  for (std::size_t k = 0; k < ring.size() && ring.size() >= 2; ++k) {
    const PeerId a = ring[k];
    const PeerId b = ring[(k + 1) % ring.size()];
    if (!refuses(a) || !refuses(b)) continue;
    const PeerId later = std::max(a, b);  // PeerIds grow in join order
    const PeerId other = later == a ? b : a;
    return remove_peer(later, LOCKSTEP_STATUS_KICKED,
                       why + ", this peer's ring neighbour " + other.to_string() +
                           " is one that accepts no inbound connection, as this peer is, so their ring edge cannot "
                           "be made (docs/deployment.md, \"NAT\"); join again to be placed where it can",
                       /*connection_open=*/true, /*straggler=*/false, out);
  }
}

// ---------------------------------------------------------------- decisions

bool Coordinator::agree_has_voter(std::uint32_t group) const {
  const auto t = tally_.groups.find(group);
  return t != tally_.groups.end() && t->second.agree_voters != 0;
}

// A vote whose every voter has left is closed: nobody waits in it any more, so its
// deadline must not make the vote timeout remove anyone.
void Coordinator::close_abandoned_votes() {
  const bool topology_voter = tally_.update_voters + tally_.optimize_voters != 0;
  if (topology_phase_ == TopologyPhase::kVoting && !topology_voter) topology_phase_ = TopologyPhase::kIdle;
  if (pending_round_ && tally_.pending_voters == 0) pending_round_.reset();
  // A failed agree round stays until the next update topology, so that the peers of
  // that step who vote later still get its failure (one outcome per round).
  for (auto it = agree_rounds_.begin(); it != agree_rounds_.end();) {
    it = !agree_has_voter(it->first) && !it->second.failed ? agree_rounds_.erase(it) : std::next(it);
  }
}

void Coordinator::advance(TimeMs now_ms, Outbox& out) {
  close_abandoned_votes();
  for (int guard = 0; guard < 64; ++guard) {
    bool changed = false;
    changed |= try_finish_recovery(now_ms, out);
    changed |= try_complete_establish(out);
    changed |= try_complete_topology_vote(now_ms, out);
    changed |= try_complete_optimize_vote(now_ms, out);
    changed |= try_complete_round(now_ms, out);
    changed |= try_complete_pending(out);
    changed |= try_complete_agree(out);
    changed |= fail_collectives_blocked_by_major_vote(out);
    changed |= try_start_collectives(out);
    changed |= try_complete_syncs(out);
    if (!changed) break;
  }
  detect_vote_mismatch(out);
}

bool Coordinator::try_complete_topology_vote(TimeMs now_ms, Outbox& out) {
  if (topology_phase_ == TopologyPhase::kEstablishing || topology_phase_ == TopologyPhase::kMeasuring) return false;
  if (topology_phase_ == TopologyPhase::kIdle) {
    // An empty run admits newcomers without a vote: there is nobody to ask (unless a
    // recovery is taking a lost master's run back: they wait for its first update; or
    // the master holds the founding for the peers of a lost run to come back first).
    const auto registered = [](const auto& p) { return p.second.phase == Phase::kRegistered && !p.second.resuming; };
    const bool held = now_ms - config_.started_ms < config_.resume_hold_ms;
    if (!recovery_ && !held && accepted_count() == 0 && std::any_of(peers_.begin(), peers_.end(), registered)) {
      out.push_back(Event{.text = "no accepted peers: admitting registered peers without a vote",
                          .op = Operation::kUpdateTopology,
                          .reason = "the run has no accepted peer to vote"});
      topology_round_started_ms_ = now_ms;
      start_establish(now_ms, out);
      return true;
    }
    return false;
  }
  // abandoned votes are closed elsewhere
  if (accepted_count() == 0 || tally_.update_voters != accepted_count()) return false;
  out.push_back(Event{.text = "update-topology vote complete (" + std::to_string(accepted_count()) + " voters)",
                      .op = Operation::kUpdateTopology,
                      .round_started_ms = topology_round_started_ms_});
  start_establish(now_ms, out);
  return true;
}

void Coordinator::start_establish(TimeMs now_ms, Outbox& out,
                                  const std::optional<std::map<std::uint32_t, std::vector<PeerId>>>& optimized) {
  ++epoch_;
  topology_phase_ = TopologyPhase::kEstablishing;
  topology_started_ms_ = now_ms;
  optimizing_ = optimized.has_value();
  newcomers_.clear();
  proposed_rings_ = optimized ? *optimized : rings_;
  const std::map<PeerId, std::string> no_room =
      optimizing_ || relay_ ? std::map<PeerId, std::string>{} : without_room();
  for (auto& [id, peer] : peers_) {
    if (peer.phase == Phase::kRegistered) {
      if (optimizing_) continue;  // an optimization admits nobody: they wait for the next update
      if (no_room.count(id) != 0) continue;
      newcomers_.insert(id);
      place_newcomer(proposed_rings_[peer.group], id);
    }
    edit(peer, [](Peer& p) {
      p.state = PeerState::kEstablishingP2P;
      p.p2p_reported = false;
    });
    peer.unreachable.clear();
  }
  for (const auto& [id, why] : no_room) {
    remove_peer(id, LOCKSTEP_STATUS_REJECTED, why, /*connection_open=*/true, /*straggler=*/false, out);
  }
  std::map<std::uint32_t, std::vector<PeerId>> participants;
  for (const auto& [id, peer] : peers_) {
    if (peer.state == PeerState::kEstablishingP2P) participants[peer.group].push_back(id);
  }
  for (const auto& [group, ids] : participants) {
    send_all(ids, proto::EstablishP2P{epoch_, members(proposed_rings_.at(group))}, out);
  }
  std::vector<PeerId> newcomers(newcomers_.begin(), newcomers_.end());
  out.push_back(Event{.text = "epoch " + std::to_string(epoch_) + ": establishing p2p connections with " +
                              std::to_string(newcomers_.size()) + " newcomer(s)" +
                              (newcomers.empty() ? "" : " (" + id_list(newcomers) + ")"),
                      // an optimization started at its vote; this is its rewiring
                      .kind = optimizing_ ? EventKind::kInfo : EventKind::kStarted,
                      .op = optimizing_ ? Operation::kOptimizeTopology : Operation::kUpdateTopology,
                      .peers = std::move(newcomers),
                      .round_started_ms = topology_round_started_ms_});
}

// A ring edge needs one end that accepts inbound connections, so peers that accept none
// must each sit between two that do: a group (of two or more) holds at most as many of
// them as of the others. The registered peers that accept no inbound connection beyond
// that (the last to register), with why: they are rejected now rather than placed where
// their ring edges cannot be made (docs/deployment.md, "NAT").
std::map<PeerId, std::string> Coordinator::without_room() const {
  std::map<std::uint32_t, std::pair<std::size_t, std::size_t>> counts;  // group: (accept, refuse)
  const auto add = [&](const Peer& p) {
    auto& [open, closed] = counts[p.group];
    ++(proto::accepts_inbound(p.info) ? open : closed);
  };
  for (const auto& [group, ring] : proposed_rings_) {
    for (const PeerId& id : ring) add(peers_.at(id));
  }
  for (const auto& [id, peer] : peers_) {
    if (peer.phase == Phase::kRegistered && proto::accepts_inbound(peer.info)) add(peer);
  }
  std::map<PeerId, std::string> out;
  for (const auto& [id, peer] : peers_) {
    if (peer.phase != Phase::kRegistered || proto::accepts_inbound(peer.info)) continue;
    auto& [open, closed] = counts[peer.group];
    if (open + closed == 0 || closed < open) {
      ++closed;
      continue;
    }
    out.emplace(id, "no place in the ring of group " + std::to_string(peer.group) +
                        " for another peer that accepts no inbound connection: each must sit between two peers "
                        "that accept connections, and " + std::to_string(open) + " of its " +
                        std::to_string(open + closed) +
                        " peers do (docs/deployment.md, \"NAT\"); join again once more such peers have joined, or "
                        "make this peer reachable");
  }
  return out;
}

// A newcomer joins the ring at its end (join order: PeerId counters increase), except
// where reachability says otherwise (docs/deployment.md, "NAT"): a ring edge needs one
// end that accepts inbound connections, so a newcomer that accepts none goes between
// the first two neighbours that both do, and one that does goes between the first two
// that both do not; with no such place, at the end.
void Coordinator::place_newcomer(std::vector<PeerId>& ring, PeerId id) const {
  const bool inbound = proto::accepts_inbound(peers_.at(id).info);
  for (std::size_t k = 0; k < ring.size() && ring.size() >= 2; ++k) {
    const bool here = proto::accepts_inbound(peers_.at(ring[k]).info);
    const bool next = proto::accepts_inbound(peers_.at(ring[(k + 1) % ring.size()]).info);
    if (here == !inbound && next == !inbound) {
      ring.insert(ring.begin() + static_cast<std::ptrdiff_t>(k + 1), id);
      return;
    }
  }
  ring.push_back(id);
}

void Coordinator::fail_establish(const std::string& reason, Outbox& out) {
  topology_phase_ = TopologyPhase::kIdle;
  const StatusCode status =
      optimizing_ ? LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED : LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
  const Operation op = optimizing_ ? Operation::kOptimizeTopology : Operation::kUpdateTopology;
  optimizing_ = false;
  std::vector<PeerId> participants;
  for (auto& [id, peer] : peers_) {
    if (peer.state != PeerState::kEstablishingP2P) continue;
    edit(peer, [](Peer& p) {
      p.state = PeerState::kIdle;
      p.p2p_reported = false;
    });
    peer.unreachable.clear();
    participants.push_back(id);
  }
  send_all(participants, proto::TopologyResult{epoch_, status, reason, {}, {}}, out);
  newcomers_.clear();
  proposed_rings_.clear();
  out.push_back(Event{.text = "epoch " + std::to_string(epoch_) + ": " +
                              (op == Operation::kOptimizeTopology ? "optimize" : "update") +
                              " topology failed: " + reason,
                      .kind = EventKind::kFailed,
                      .op = op,
                      .reason = reason,
                      .status = status,
                      .round_started_ms = topology_round_started_ms_});
}

bool Coordinator::try_complete_establish(Outbox& out) {
  if (topology_phase_ != TopologyPhase::kEstablishing || tally_.unreported != 0) return false;
  // Semantics rule 2: no newcomer blocks a run. A failed connection that involves a
  // newcomer is the newcomer's fault; between accepted peers, the one that could not
  // reach its neighbour is removed.
  std::map<PeerId, std::string> blamed;
  for (const auto& [id, peer] : peers_) {
    for (const auto& target : peer.unreachable) {
      if (newcomers_.count(target) != 0) {
        blamed.emplace(target, "peer " + id.to_string() + " could not connect to it");
      } else if (newcomers_.count(id) != 0) {
        blamed.emplace(id, "it could not connect to peer " + target.to_string());
      } else {
        blamed.emplace(id, "it could not connect to its ring neighbour " + target.to_string());
      }
    }
  }
  if (!blamed.empty()) {
    std::string reason = "p2p connections failed:";
    for (const auto& [id, why] : blamed) reason += " " + id.to_string() + " (" + why + ");";
    fail_establish(reason, out);
    for (const auto& [id, why] : blamed) {
      const Peer* peer = find_peer(id);
      if (peer == nullptr) continue;
      const bool newcomer = peer->phase == Phase::kRegistered;
      remove_peer(id, newcomer ? LOCKSTEP_STATUS_REJECTED : LOCKSTEP_STATUS_KICKED,
                  "p2p connections could not be established: " + why, /*connection_open=*/true,
                  /*straggler=*/false, out);
    }
    return true;
  }
  topology_phase_ = TopologyPhase::kIdle;
  const Operation op = optimizing_ ? Operation::kOptimizeTopology : Operation::kUpdateTopology;
  // After an optimization registered peers may still wait: the views stay current only
  // for the accepted ones, so a departure since then still counts.
  if (!optimizing_) topology_dirty_ = false;
  optimizing_ = false;
  agree_rounds_.clear();  // every peer was in the update: no agree round has a voter
  rings_ = proposed_rings_;
  views_ = rings_;
  view_epoch_ = epoch_;
  for (const auto& id : newcomers_) {
    edit(peers_.at(id), [this](Peer& p) {
      p.phase = Phase::kAccepted;
      p.accepted_epoch = epoch_;
    });
  }
  // Peers that registered during the establishment are not participants: they wait.
  std::map<std::uint32_t, std::vector<PeerId>> participants;
  for (auto& [id, peer] : peers_) {
    if (peer.state != PeerState::kEstablishingP2P) continue;
    edit(peer, [](Peer& p) {
      p.state = PeerState::kIdle;
      p.p2p_reported = false;
    });
    participants[peer.group].push_back(id);
  }
  for (const auto& [group, ids] : participants) {
    send_all(ids, proto::TopologyResult{epoch_, LOCKSTEP_OK, {}, members(rings_.at(group)), attributes(group)}, out);
  }
  std::string summary = "epoch " + std::to_string(epoch_) + ": topology updated;";
  std::vector<PeerId> everyone;
  for (const auto& [group, ids] : rings_) {
    summary += " group " + std::to_string(group) + " ring [";
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i != 0) summary += ' ';
      summary += ids[i].to_string();
    }
    summary += "]";
    everyone.insert(everyone.end(), ids.begin(), ids.end());
  }
  out.push_back(Event{.text = summary,
                      .kind = EventKind::kSucceeded,
                      .op = op,
                      .peers = std::move(everyone),
                      .round_started_ms = topology_round_started_ms_});
  newcomers_.clear();
  proposed_rings_.clear();
  return true;
}

bool Coordinator::try_complete_pending(Outbox& out) {
  if (!pending_round_ || tally_.pending_voters != accepted_count()) return false;
  const bool any_registered = tally_.registered != 0;
  const TimeMs round_started_ms = pending_round_->started_ms;
  pending_round_.reset();
  const bool pending = any_registered || topology_dirty_;
  std::vector<PeerId> voters;
  for (auto& [id, peer] : peers_) {
    if (!peer.voted_pending) continue;
    edit(peer, [](Peer& p) { p.voted_pending = false; });
    voters.push_back(id);
  }
  send_all(voters, proto::PeersPendingResult{LOCKSTEP_OK, pending, {}}, out);
  std::string why;
  if (any_registered) why = "registered peers wait to join";
  if (topology_dirty_) why += std::string(why.empty() ? "" : "; ") + "peers left since the last update";
  out.push_back(Event{.text = std::string("are-peers-pending vote complete: ") + (pending ? "yes" : "no") +
                              (topology_dirty_ ? " (peers left since the last update)" : ""),
                      .routine = !pending,
                      .kind = EventKind::kSucceeded,
                      .op = Operation::kArePeersPending,
                      .reason = why,
                      .round_started_ms = round_started_ms});
  return true;
}

bool Coordinator::try_complete_agree(Outbox& out) {
  bool changed = false;
  for (auto it = agree_rounds_.begin(); it != agree_rounds_.end();) {
    const std::uint32_t group = it->first;
    const auto t = tally_.groups.find(group);
    const auto r = rings_.find(group);
    if ((t == tally_.groups.end() ? 0 : t->second.agree_voters) != (r == rings_.end() ? 0 : r->second.size())) {
      ++it;
      continue;
    }
    bool value = true;
    const Peer* first = nullptr;  // the voter accepted first (then the lowest id)
    if (r != rings_.end()) {
      for (const auto& id : r->second) {
        const Peer& peer = peers_.at(id);
        value = value && *peer.agree_flag;
        if (first == nullptr || peer.accepted_epoch < first->accepted_epoch ||
            (peer.accepted_epoch == first->accepted_epoch && peer.id < first->id)) {
          first = &peer;
        }
      }
    }
    Round round = it->second;
    it = agree_rounds_.erase(it);
    changed = true;
    // Agree on a value: every voter used the same mode, and (all-equal) proposed the
    // same bytes; then every voter gets the value (all-equal: theirs; first-accepted:
    // the first-accepted voter's).
    StatusCode status = round.failed ? LOCKSTEP_STATUS_PEER_CONNECTION_LOST : LOCKSTEP_OK;
    std::vector<std::uint8_t> agreed;
    if (!round.failed && first != nullptr) {
      for (const auto& [id, peer] : peers_) {
        if (peer.group != group || !peer.agree_flag || status != LOCKSTEP_OK) continue;
        if (peer.agree_mode != first->agree_mode) {
          status = LOCKSTEP_STATUS_OPERATION_MISMATCH;
          round.failure = "peers called agree with different modes (a flag, all-equal, first-accepted)";
        } else if (peer.agree_mode == proto::AgreeMode::kAllEqual && peer.agree_value != first->agree_value) {
          status = LOCKSTEP_STATUS_OPERATION_MISMATCH;
          round.failure = "peers proposed different values (peer " + id.to_string() + " and peer " +
                          first->id.to_string() + ")";
        }
      }
      if (status == LOCKSTEP_OK && first->agree_mode != proto::AgreeMode::kFlag) agreed = first->agree_value;
    }
    std::vector<PeerId> voters;
    for (auto& [id, peer] : peers_) {
      if (peer.group != group || !peer.agree_flag) continue;
      edit(peer, [](Peer& p) { p.agree_flag.reset(); });
      peer.agree_value.clear();
      voters.push_back(id);
    }
    send_all(voters,
             status != LOCKSTEP_OK ? proto::AgreeResult{status, false, round.failure}
                                   : proto::AgreeResult{LOCKSTEP_OK, value, {}, agreed},
             out);
    const bool failed = status != LOCKSTEP_OK;
    out.push_back(Event{.text = "group " + std::to_string(group) + " agree vote complete: " +
                                (failed ? "failed (" + round.failure + ")"
                                        : !agreed.empty() ? "a value of " + std::to_string(agreed.size()) + " bytes"
                                                          : (value ? "true" : "false")),
                        .routine = !failed,
                        .kind = failed ? EventKind::kFailed : EventKind::kSucceeded,
                        .op = Operation::kAgree,
                        .reason = round.failure,
                        .status = status,
                        .group = group,
                        .round_started_ms = round.started_ms});
  }
  return changed;
}

// Every accepted peer is blocked in a vote and no vote can complete: they asked for
// different operations. Votes are barriers, so without this the run would wait
// forever; instead every vote fails with OPERATION_MISMATCH and all may retry.
void Coordinator::detect_vote_mismatch(Outbox& out) {
  const std::size_t accepted = accepted_count();
  if (accepted == 0 || tally_.control_voters != accepted) return;
  const std::string reason = "accepted peers are waiting in different votes (update topology, optimize topology, "
                             "are-peers-pending, agree, shared-state sync); the application must call the same operation "
                             "on every peer";
  // Which vote each peer waits in: the rule the application broke, peer by peer.
  std::string votes;
  std::vector<PeerId> voters;
  for (const auto& [id, peer] : peers_) {
    if (peer.phase != Phase::kAccepted) continue;
    const char* vote = peer.state == PeerState::kVoteAcceptNewPeers     ? "update topology"
                       : peer.state == PeerState::kVoteOptimizeTopology ? "optimize topology"
                       : peer.state == PeerState::kVoteSync             ? "shared-state sync"
                       : peer.voted_pending                             ? "are-peers-pending"
                                                                        : "agree";
    votes += (votes.empty() ? "" : ", ") + id.to_string() + " in " + vote;
    voters.push_back(id);
  }
  out.push_back(Event{.text = "vote mismatch: " + reason + " (" + votes + ")",
                      .kind = EventKind::kVoteMismatch,
                      .reason = reason + " (" + votes + ")",
                      .status = LOCKSTEP_STATUS_OPERATION_MISMATCH,
                      .peers = std::move(voters)});
  if (topology_phase_ == TopologyPhase::kVoting) topology_phase_ = TopologyPhase::kIdle;
  pending_round_.reset();
  agree_rounds_.clear();
  for (auto it = syncs_.begin(); it != syncs_.end();) {
    it = it->second.phase == SharedStateSync::Phase::kVoting ? syncs_.erase(it) : std::next(it);
  }
  for (auto& [id, peer] : peers_) {
    if (peer.state == PeerState::kVoteSync) {
      edit(peer, [](Peer& p) { p.state = PeerState::kIdle; });
      send(peer, proto::SyncResult{0, LOCKSTEP_STATUS_OPERATION_MISMATCH, 0, reason}, out);
    }
    if (peer.state == PeerState::kVoteAcceptNewPeers || peer.state == PeerState::kVoteOptimizeTopology) {
      edit(peer, [](Peer& p) { p.state = PeerState::kIdle; });
      send(peer, proto::TopologyResult{epoch_, LOCKSTEP_STATUS_OPERATION_MISMATCH, reason, {}, {}}, out);
    }
    if (peer.voted_pending) {
      edit(peer, [](Peer& p) { p.voted_pending = false; });
      send(peer, proto::PeersPendingResult{LOCKSTEP_STATUS_OPERATION_MISMATCH, false, reason}, out);
    }
    if (peer.agree_flag) {
      edit(peer, [](Peer& p) { p.agree_flag.reset(); });
      send(peer, proto::AgreeResult{LOCKSTEP_STATUS_OPERATION_MISMATCH, false, reason}, out);
    }
  }
}

}  // namespace lockstep::coord
