// Communicator implementation: membership, votes and collectives on top of the Link
// (peer/link.h). The first fatal error sticks: every later call fails fast.
#include "peer/communicator.h"

#include "collectives/doubling.h"
#include "collectives/quantize.h"
#include "common/limits.h"
#include "common/log.h"
#include "kernels/reduce.h"
#include "kernels/vote_carried.h"
#include "peer/handshake.h"
#include "peer/link.h"
#include "transport/framed.h"

#include <poll.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <set>

namespace lockstep::peer {
namespace {

// All-reduce tags whose last attempt failed, remembered to count retries.
constexpr std::size_t kFailedTagsRemembered = 4096;

}  // namespace

// ------------------------------------------------------------------ counters

Counters Communicator::counters() const {
  const auto get = [this](Counter c) { return counters_[static_cast<std::size_t>(c)].load(std::memory_order_relaxed); };
  Counters out;
  out.all_reduce_bytes_sent = get(Counter::kAllReduceBytesSent);
  out.all_reduce_bytes_received = get(Counter::kAllReduceBytesReceived);
  out.sync_bytes_sent = get(Counter::kSyncBytesSent);
  out.sync_bytes_received = get(Counter::kSyncBytesReceived);
  out.operations_started = get(Counter::kOperationsStarted);
  out.operations_succeeded = get(Counter::kOperationsSucceeded);
  out.operations_failed = get(Counter::kOperationsFailed);
  out.all_reduces_started = get(Counter::kAllReducesStarted);
  out.all_reduces_succeeded = get(Counter::kAllReducesSucceeded);
  out.all_reduces_failed = get(Counter::kAllReducesFailed);
  out.syncs_started = get(Counter::kSyncsStarted);
  out.syncs_succeeded = get(Counter::kSyncsSucceeded);
  out.syncs_failed = get(Counter::kSyncsFailed);
  out.retries = get(Counter::kRetries);
  out.connect_us = get(Counter::kConnectUs);
  out.update_topology_us = get(Counter::kUpdateTopologyUs);
  out.optimize_topology_us = get(Counter::kOptimizeTopologyUs);
  out.sync_us = get(Counter::kSyncUs);
  out.all_reduce_us = get(Counter::kAllReduceUs);
  for (std::uint32_t k = 0; k < options_.p2p_pool_size; ++k) {
    out.slot_bytes_sent.push_back(slot_bytes_[k].sent.load(std::memory_order_relaxed));
    out.slot_bytes_received.push_back(slot_bytes_[k].received.load(std::memory_order_relaxed));
  }
  return out;
}

// ------------------------------------------------------------------ Communicator

Communicator::Communicator(const Options& options) : options_(options), owner_(std::this_thread::get_id()) {}

Communicator::~Communicator() {
  // Collectives still in flight end with an error; their threads are joined before
  // anything they use goes away.
  if (link_) link_->stop();
  workers_.stop();
}

Result<std::unique_ptr<Communicator>> Communicator::create(const Options& options) {
  if (options.master_host.empty()) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "master host is empty");
  if (options.p2p_pool_size == 0 || options.p2p_pool_size > limits::kP2PPoolSizeMax) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "p2p pool size must be 1.." + std::to_string(limits::kP2PPoolSizeMax));
  }
  if (options.base_port < -1 || options.base_port > 65535) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "base port must be -1, 0 or a port number");
  }
  if (options.advertised_host.size() > 255) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "advertised host too long");
  if (options.encrypt_data && !options.secret) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "encrypt_data needs a run secret (secret_file, secret or LOCKSTEP_SECRET_FILE): the data-plane keys "
                  "are derived from it");
  }
  if (options.p2p_streams > limits::kP2PStreamsMax) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "p2p streams must be 0 (adaptive) or 1.." + std::to_string(limits::kP2PStreamsMax) + ", not " +
                      std::to_string(options.p2p_streams));
  }
  Options chosen = options;
  if (const char* env = std::getenv("LOCKSTEP_ALLREDUCE_ALGORITHM");
      env != nullptr && *env != '\0' && chosen.allreduce_algorithm == proto::Algorithm::kAuto) {
    const std::string name(env);
    if (name == "ring") {
      chosen.allreduce_algorithm = proto::Algorithm::kRing;
    } else if (name == "doubling") {
      chosen.allreduce_algorithm = proto::Algorithm::kDoubling;
    } else if (name != "auto") {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "LOCKSTEP_ALLREDUCE_ALGORITHM is \"" + name.substr(0, 32) +
                                                          "\"; it must be auto, ring or doubling");
    }
  }
  if (!chosen.tcp_congestion.empty()) {
    if (!transport::congestion_control_name_valid(chosen.tcp_congestion)) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "tcp congestion control \"" + chosen.tcp_congestion.substr(0, 32) +
                                                          "\" is not a name (1 to 15 of a-z, 0-9, _ and -)");
    }
    // Asked of the kernel once, on a socket of our own: where it refuses, one warning
    // and the system's default on every connection.
    transport::Fd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    Status set = probe.get() < 0 ? Status(LOCKSTEP_STATUS_INTERNAL_ERROR, std::strerror(errno))
                                 : transport::set_congestion_control(probe.get(), chosen.tcp_congestion);
    if (!set.is_ok()) {
      LOG_WARN(kLog, "tcp congestion control \"" << chosen.tcp_congestion << "\" refused by the kernel ("
                                                  << set.message() << "); the system's default is used");
      chosen.tcp_congestion.clear();
    }
  }
  std::unique_ptr<Communicator> comm(new Communicator(chosen));
  comm->link_ = std::make_unique<Link>(chosen);
  Status s = comm->link_->start(/*listen=*/chosen.accept_inbound);
  if (!s.is_ok()) return s;
  comm->view_p2p_port_.store(comm->link_->port(proto::Channel::kRing));
  return comm;
}

Status Communicator::remember(Status status) {
  if (!status.is_ok()) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    last_error_ = status.to_string();
  }
  return status;
}

Status Communicator::with_p2p_refusal(Status status) const {
  if (status.is_ok() || p2p_refusal_.empty()) return status;
  return Status(status.code(), status.message() + " (" + p2p_refusal_ + ")");
}

std::string Communicator::last_error() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return last_error_;
}

PeerId Communicator::id() const { return id_; }
std::uint16_t Communicator::p2p_port() const { return link_->port(proto::Channel::kRing); }

Status Communicator::check_call(bool need_accepted) const {
  if (std::this_thread::get_id() != owner_) {
    return Status(LOCKSTEP_STATUS_WRONG_THREAD, "a communicator may only be used by the thread that created it");
  }
  if (need_accepted && !accepted_) {
    return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "connect the communicator (and be accepted) first");
  }
  if (connected_) {
    Status fatal = link_->fatal();
    if (!fatal.is_ok()) return fatal;
  }
  return Status::ok();
}

Status Communicator::connect() {
  if (Status s = check_call(false); !s.is_ok()) return remember(s);
  if (connected_) return remember(Status(LOCKSTEP_STATUS_INVALID_USAGE, "already connected"));
  OperationScope scope(*this, Counter::kConnectUs, nullptr);
  proto::Hello hello;
  hello.group = options_.peer_group;
  hello.pool_size = static_cast<std::uint16_t>(options_.p2p_pool_size);  // at most kP2PPoolSizeMax
  hello.p2p_port = link_->port(proto::Channel::kRing);
  hello.shared_state_port = link_->port(proto::Channel::kSharedState);
  hello.benchmark_port = link_->port(proto::Channel::kBenchmark);
  hello.advertised_host = options_.advertised_host;
  // The master's address, then each fallback: one that cannot be reached, or a hot
  // standby that does not serve the run (NOT_SERVING), sends the peer on to the next.
  Status last;
  std::optional<MasterChannel> channel;
  transport::Fd fd;
  std::string master_host;
  for (const auto& [host, port] : options_.master_addresses()) {
    const std::string name = transport::join_host_port(host, port);
    auto connected = transport::connect_tcp(host, port, options_.connect_timeout_ms);
    if (!connected.is_ok()) {
      last = Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED,
                    "master at " + name + " unreachable: " + connected.status().message());
      continue;
    }
    auto answer = master_handshake(connected.value().get(), hello, options_.secret, name, options_.connect_timeout_ms);
    if (!answer.is_ok()) return remember(answer.status());
    if (const auto* bye = std::get_if<proto::Goodbye>(&answer.value().reply)) {
      last = Status(bye->status, "master at " + name + ": " + bye->reason);
      if (bye->status == LOCKSTEP_STATUS_NOT_SERVING) continue;
      return remember(last);
    }
    channel = std::move(answer.value());
    fd = std::move(connected.value());
    master_host = host;
    break;
  }
  if (!channel) return remember(last);
  std::shared_ptr<security::FrameCrypto> crypto = std::move(channel->crypto);
  const auto* welcome = std::get_if<proto::Welcome>(&channel->reply);
  if (welcome == nullptr) return remember(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "master answered Hello with something else"));
  id_ = welcome->id;
  link_->set_relay(RelayAddress{welcome->relay_host.empty() ? master_host : welcome->relay_host, welcome->relay_port});
  link_->set_identity(id_, welcome->term);
  link_->attach_master(std::move(fd), welcome->heartbeat_timeout_ms, std::move(crypto), hello);
  connected_ = true;
  LOG_DEBUG(kLog, "registered as " << id_.to_string() << ", waiting to be accepted");
  // A newcomer waits for the accepted peers' vote; failed attempts are retried by
  // the master with the next vote, unless it rejects us (a fatal Goodbye).
  for (;;) {
    auto result = run_establishment(/*newcomer=*/true);
    if (!result.is_ok()) return remember(with_p2p_refusal(result.status()));
    if (result.value().status == LOCKSTEP_OK) break;
    LOG_INFO(kLog, "admission attempt failed, waiting for the next one: " << result.value().reason);
  }
  accepted_ = true;
  scope.succeeded();
  return Status::ok();
}

Status Communicator::update_topology() {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    if (!tags_in_flight_.empty()) {
      return remember(Status(LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS,
                             "await every collective in flight before updating the topology"));
    }
  }
  OperationScope scope(*this, Counter::kUpdateTopologyUs, &update_failed_);
  link_->send(proto::VoteUpdateTopology{});
  auto result = run_establishment(/*newcomer=*/false);
  if (!result.is_ok()) return remember(result.status());
  if (result.value().status != LOCKSTEP_OK) return remember(Status(result.value().status, result.value().reason));
  scope.succeeded();
  return Status::ok();
}

Result<proto::TopologyResult> Communicator::run_establishment(bool newcomer) {
  auto plan = link_->wait([&](const proto::Message& m) {
    if (std::holds_alternative<proto::EstablishP2P>(m)) return true;
    if (newcomer) return false;
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kVoteUpdateTopology;
    // a vote that ended before establishment (OPERATION_MISMATCH)
    return std::holds_alternative<proto::TopologyResult>(m);
  });
  if (!plan.is_ok()) return plan.status();
  if (const auto* r = std::get_if<proto::Refused>(&plan.value())) return Status(r->status, "master: " + r->reason);
  if (const auto* t = std::get_if<proto::TopologyResult>(&plan.value())) return *t;
  return finish_establishment(std::get<proto::EstablishP2P>(plan.value()));
}

Result<proto::TopologyResult> Communicator::finish_establishment(const proto::EstablishP2P& establish) {
  const std::uint64_t epoch = establish.epoch;
  auto cancel = std::make_shared<OpChannel>();
  link_->set_establishment(epoch, cancel);
  const std::vector<PeerId> unreachable = this->establish(establish, *cancel);
  link_->set_establishment(0, nullptr);
  link_->send(proto::P2PReport{epoch, unreachable});
  auto outcome = link_->wait([&](const proto::Message& m) {
    if (const auto* t = std::get_if<proto::TopologyResult>(&m)) return t->epoch == epoch;
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kP2PReport;
    return false;
  });
  if (!outcome.is_ok()) return outcome.status();
  if (const auto* r = std::get_if<proto::Refused>(&outcome.value())) return Status(r->status, "master: " + r->reason);
  auto result = std::get<proto::TopologyResult>(std::move(outcome.value()));
  if (result.status != LOCKSTEP_OK && !p2p_refusal_.empty()) result.reason += " (" + p2p_refusal_ + ")";
  if (result.status == LOCKSTEP_OK) {
    epoch_ = epoch;
    view_ = result.ring;
    view_size_.store(static_cast<std::uint32_t>(view_.size()));
    attributes_ = result.attributes;
    for (std::uint32_t i = 0; i < view_.size(); ++i) {
      if (view_[i].id == id_) rank_ = i;
    }
    view_rank_.store(rank_);
    members_.clear();
    for (const auto& m : view_) members_[m.id] = m;
  }
  return result;
}

// Makes sure every pool slot has a connection to the next peer of the new ring and
// one from the previous peer. Returns the peers that could not be reached.
std::vector<PeerId> Communicator::establish(const proto::EstablishP2P& plan, const OpChannel& cancel) {
  p2p_refusal_.clear();
  prune_connections(plan.ring);
  const auto& ring = plan.ring;
  const auto self = std::find_if(ring.begin(), ring.end(), [&](const auto& m) { return m.id == id_; });
  if (self == ring.end() || ring.size() < 2) return {};
  // The view says whether this peer accepts inbound connections: the master names no
  // port for one that could not be reached from it (docs/deployment.md, "NAT").
  if (self->p2p_port == 0 && view_p2p_port_.exchange(0) != 0) {
    LOG_WARN(kLog, "the master could not reach this peer's p2p port " << link_->port(proto::Channel::kRing)
                                                                        << " at " << self->host
                                                                        << ": this peer dials its ring neighbours "
                                                                           "(it runs as one that accepts no inbound "
                                                                           "connection)");
  }
  const std::size_t n = ring.size();
  const std::size_t i = static_cast<std::size_t>(self - ring.begin());
  const proto::MemberInfo& next = ring[(i + 1) % n];
  const proto::MemberInfo& prev = ring[(i + n - 1) % n];
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
  const auto connect_next = [&] {
    for (std::uint32_t k = 0; k < options_.p2p_pool_size; ++k) {
      auto tx = tx_connection(next, k, cancel);
      if (!tx.is_ok()) {
        LOG_WARN(kLog, "cannot connect to ring neighbour " << next.id.to_string() << " at " << next.host << ":"
                                                            << next.p2p_port << ": " << tx.status().message());
        if (tx.status().code() == LOCKSTEP_STATUS_INVALID_ARGUMENT) p2p_refusal_ = tx.status().message();
        return false;
      }
    }
    return true;
  };
  const auto connect_prev = [&] {
    for (std::uint32_t k = 0; k < options_.p2p_pool_size; ++k) {
      auto rx = rx_connection(prev, k, deadline, cancel);
      if (!rx.is_ok()) {
        LOG_WARN(kLog, "ring neighbour " << prev.id.to_string() << " did not connect within "
                                         << options_.p2p_connect_timeout_ms << " ms: " << rx.status().message());
        return false;
      }
    }
    return true;
  };
  // The connections to a relayed next peer are made while those from the previous one
  // are (see ring_connections).
  bool next_ok = true;
  bool prev_ok = true;
  if (relayed_edge(self_info(), next)) {
    auto sends = std::async(std::launch::async, connect_next);
    prev_ok = connect_prev();
    next_ok = sends.get();
  } else {
    next_ok = connect_next();
    prev_ok = connect_prev();
  }
  std::vector<PeerId> unreachable;
  if (!next_ok) unreachable.push_back(next.id);
  if (!prev_ok && (prev.id != next.id || unreachable.empty())) unreachable.push_back(prev.id);
  return unreachable;
}

// ------------------------------------------------------------------ connections

namespace {
// Whether the other end closed a cached ring connection. A peer drops its ends of a
// slot's connections when an attempt it ran fails; its neighbour may not have had
// its turn in that attempt and still holds the other ends. Reusing them would fail
// the next attempt too (a write into a closed connection, or leftover bytes of the
// failed attempt), so they are replaced. The FIN shows without reading (POLLRDHUP),
// even behind unread bytes.
bool closed_by_other_end(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// An edge between two peers that both accept no inbound connection cannot be made
// without a relay: reported at once, not after the connect timeout
// (docs/deployment.md, "NAT").
Status edge_possible(const proto::MemberInfo& from, const proto::MemberInfo& to, bool relay) {
  if (proto::accepts_inbound(from) || proto::accepts_inbound(to) || relay) return Status::ok();
  return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED,
                "peers " + from.id.to_string() + " and " + to.id.to_string() +
                    " both accept no inbound connection and the run has no relay: their ring edge cannot be made");
}
}  // namespace

proto::MemberInfo Communicator::self_info() const {
  proto::MemberInfo self;
  self.id = id_;
  self.p2p_port = view_p2p_port_.load();
  return self;
}

bool Communicator::relayed_edge(const proto::MemberInfo& from, const proto::MemberInfo& to) const {
  return !proto::accepts_inbound(from) && !proto::accepts_inbound(to) && link_->relay().port != 0;
}

Result<transport::Fd> Communicator::dial_relay(const proto::MemberInfo& other, std::uint32_t slot, bool receiver,
                                               const OpChannel& channel) {
  if (!options_.secret) {
    return Status(LOCKSTEP_STATUS_INVALID_USAGE, "a relayed ring edge needs the run secret, and this peer has none");
  }
  return peer::dial_relay(link_->relay(), id_, other, proto::Channel::kRing,
                          slot, receiver, options_.p2p_connect_timeout_ms, channel.event_fd());
}

Result<std::pair<transport::Fd, security::SessionKeys>> Communicator::dial_ring(const proto::MemberInfo& to,
                                                                                std::uint32_t slot, bool reversed,
                                                                                bool relayed,
                                                                                const OpChannel& channel) {
  auto fd = relayed ? dial_relay(to, slot, /*receiver=*/reversed, channel)
                    : transport::connect_tcp(to.host, to.p2p_port, options_.p2p_connect_timeout_ms, channel.event_fd());
  if (!fd.is_ok()) return fd.status();
  if (!options_.tcp_congestion.empty()) (void)transport::set_congestion_control(fd.value().get(), options_.tcp_congestion);
  proto::P2PHello hello;
  hello.channel = proto::Channel::kRing;
  hello.from = id_;
  hello.to = to.id;
  hello.epoch = next_generation_.fetch_add(1);  // the acceptor keeps the newest
  hello.pool_index = slot;
  if (sealed_edge(relayed)) hello.flags |= proto::kP2PFlagEncryptData;
  if (reversed) hello.flags |= proto::kP2PFlagReversed;
  security::SessionKeys keys;
  Status s = p2p_handshake(fd.value().get(), hello, options_.secret.has_value(), to.key, options_.p2p_connect_timeout_ms,
                           &keys, channel.event_fd());
  if (!s.is_ok()) return s;
  transport::set_nonblocking(fd.value().get());
  return std::make_pair(std::move(fd.value()), keys);
}

Result<int> Communicator::tx_connection(const proto::MemberInfo& to, std::uint32_t slot, const OpChannel& channel,
                                        security::Aead** seal) {
  if (Status s = edge_possible(self_info(), to, link_->relay().port != 0); !s.is_ok()) return s;
  const bool relayed = relayed_edge(self_info(), to);
  const bool reversed = proto::reversed_edge(self_info(), to) || relayed;
  const bool sealed = sealed_edge(relayed);
  std::uint64_t have = 0;  // a cached reversed connection's generation (0: none)
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(connections_mutex_);
    if (auto it = tx_.find(SlotKey{to.id, slot}); it != tx_.end()) {
      if (!closed_by_other_end(it->second.fd.get())) {
        cached = true;
        have = it->second.generation;
        if (!reversed) {
          if (seal != nullptr) *seal = it->second.seal.get();
          return it->second.fd.get();
        }
      } else {
        LOG_DEBUG(kLog, "ring connection to " << to.id.to_string() << " (slot " << slot
                                              << ") was closed at the other end; " << (reversed ? "waiting for" : "making")
                                              << " a new one");
        tx_.erase(it);
      }
    }
  }
  if (!reversed) {
    auto dialled = dial_ring(to, slot, /*reversed=*/false, /*relayed=*/false, channel);
    if (!dialled.is_ok()) return dialled.status();
    std::lock_guard<std::mutex> lock(connections_mutex_);
    auto& entry = tx_[SlotKey{to.id, slot}];
    entry.fd = std::move(dialled.value().first);
    entry.seal = sealed ? std::make_unique<security::Aead>(dialled.value().second.to_server) : nullptr;
    if (seal != nullptr) *seal = entry.seal.get();
    return entry.fd.get();
  }
  // Reversed: `to` accepts no inbound connection and dials this peer to receive. A newer
  // connection of its replaces the cached one (it dropped the old one and dialled anew).
  // Relayed: this peer joins it at the relay first; the cached one is kept while it is open.
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
  if (relayed && !cached) {
    auto joined = dial_relay(to, slot, /*receiver=*/false, channel);
    if (!joined.is_ok()) return joined.status();
    link_->adopt_relayed(std::move(joined.value()), proto::Channel::kRing);
  }
  auto fresh = link_->take_inbound(to.id, slot, have, cached ? Clock::now() : deadline, channel.abort_flag(),
                                   /*reversed=*/true);
  while (fresh && closed_by_other_end(fresh->fd.get())) {
    fresh = link_->take_inbound(to.id, slot, fresh->epoch, cached ? Clock::now() : deadline, channel.abort_flag(), true);
  }
  std::lock_guard<std::mutex> lock(connections_mutex_);
  if (fresh) {
    if (sealed && !fresh->keys) {
      return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "a ring connection from " + to.id.to_string() + " has no session keys");
    }
    transport::set_nonblocking(fresh->fd.get());
    auto& entry = tx_[SlotKey{to.id, slot}];
    entry.fd = std::move(fresh->fd);
    entry.generation = fresh->epoch;
    entry.seal = sealed ? std::make_unique<security::Aead>(fresh->keys->to_client) : nullptr;
    if (seal != nullptr) *seal = entry.seal.get();
    return entry.fd.get();
  }
  if (auto it = tx_.find(SlotKey{to.id, slot}); it != tx_.end()) {
    if (seal != nullptr) *seal = it->second.seal.get();
    return it->second.fd.get();
  }
  return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED,
                "peer " + to.id.to_string() + " (it accepts no inbound connection) did not connect to this one" +
                    (relayed ? " through the relay" : "") + " in time");
}

Result<int> Communicator::rx_connection(const proto::MemberInfo& from_info, std::uint32_t slot,
                                        Clock::time_point deadline, const OpChannel& channel, security::Aead** open,
                                        bool give_up_cached) {
  const PeerId from = from_info.id;
  if (Status s = edge_possible(from_info, self_info(), link_->relay().port != 0); !s.is_ok()) return s;
  const bool relayed = relayed_edge(from_info, self_info());
  const bool reversed = proto::reversed_edge(from_info, self_info()) || relayed;
  const bool sealed = sealed_edge(relayed);
  std::uint64_t have = 0;  // the generation of the cached connection (0: none)
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(connections_mutex_);
    if (auto it = rx_.find(SlotKey{from, slot}); it != rx_.end()) {
      have = it->second.generation;
      cached = true;
      if (give_up_cached || closed_by_other_end(it->second.fd.get())) {
        // Wait below for the sender's new connection (newer than the closed one), or
        // dial one where this peer accepts none.
        LOG_DEBUG(kLog, "ring connection from " << from.to_string() << " (slot " << slot << ") "
                                                << (give_up_cached ? "carries frames of an ended attempt"
                                                                   : "was closed at the other end")
                                                << (reversed ? "; dialling a new one" : "; waiting for a new one"));
        rx_.erase(it);
        cached = false;
      } else if (reversed) {
        if (open != nullptr) *open = it->second.open.get();
        return it->second.fd.get();
      }
    }
  }
  if (reversed) {
    auto dialled = dial_ring(from_info, slot, /*reversed=*/true, relayed, channel);
    if (!dialled.is_ok()) return dialled.status();
    std::lock_guard<std::mutex> lock(connections_mutex_);
    auto& entry = rx_[SlotKey{from, slot}];
    entry.fd = std::move(dialled.value().first);
    entry.open = sealed ? std::make_unique<security::Aead>(dialled.value().second.to_client) : nullptr;
    if (open != nullptr) *open = entry.open.get();
    return entry.fd.get();
  }
  // A newer connection from the same sender replaces the cached one (it reconnected).
  auto fresh = link_->take_inbound(from, slot, have, cached ? Clock::now() : deadline, channel.abort_flag());
  // One its sender has closed already belongs to an attempt that failed (a peer drops
  // its connections then), and its unread frames must not meet this attempt: a newer
  // one follows.
  while (fresh && closed_by_other_end(fresh->fd.get())) {
    LOG_DEBUG(kLog, "ring connection from " << from.to_string() << " (slot " << slot
                                            << ") was closed before it was used; waiting for a newer one");
    fresh = link_->take_inbound(from, slot, fresh->epoch, cached ? Clock::now() : deadline, channel.abort_flag());
  }
  std::lock_guard<std::mutex> lock(connections_mutex_);
  if (fresh) {
    if (sealed && !fresh->keys) {
      return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "a ring connection from " + from.to_string() + " has no session keys");
    }
    transport::set_nonblocking(fresh->fd.get());
    auto& slot_entry = rx_[SlotKey{from, slot}];
    slot_entry.fd = std::move(fresh->fd);
    slot_entry.generation = fresh->epoch;
    slot_entry.open = sealed ? std::make_unique<security::Aead>(fresh->keys->to_server) : nullptr;
    if (open != nullptr) *open = slot_entry.open.get();
    return slot_entry.fd.get();
  }
  if (auto it = rx_.find(SlotKey{from, slot}); it != rx_.end()) {
    if (open != nullptr) *open = it->second.open.get();
    return it->second.fd.get();
  }
  return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "peer " + from.to_string() + " did not connect in time");
}

std::pair<Result<int>, Result<int>> Communicator::ring_connections(const proto::MemberInfo& to,
                                                                   const proto::MemberInfo& from, std::uint32_t slot,
                                                                   Clock::time_point deadline, const OpChannel& channel,
                                                                   security::Aead** seal, security::Aead** open) {
  if (!relayed_edge(self_info(), to)) {
    auto tx = tx_connection(to, slot, channel, seal);
    auto rx = tx.is_ok() ? rx_connection(from, slot, deadline, channel, open) : Result<int>(tx.status());
    return {std::move(tx), std::move(rx)};
  }
  auto tx = std::async(std::launch::async, [&] { return tx_connection(to, slot, channel, seal); });
  auto rx = rx_connection(from, slot, deadline, channel, open);
  return {tx.get(), std::move(rx)};
}

std::function<Result<coll::RingStream>(std::size_t)> Communicator::rx_replacer(const proto::MemberInfo& from,
                                                                               std::uint32_t slot,
                                                                               const OpChannel& channel) {
  return [this, from, slot, &channel](std::size_t stream) -> Result<coll::RingStream> {
    coll::RingStream out;
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
    const std::uint32_t key = stream == 0 ? slot : stream_key(slot, static_cast<std::uint32_t>(stream));
    auto fd = rx_connection(from, key, deadline, channel, &out.aead, /*give_up_cached=*/true);
    if (!fd.is_ok()) return fd.status();
    out.fd = fd.value();
    return out;
  };
}

void Communicator::drop_connections(PeerId next, PeerId prev, std::uint32_t slot) {
  std::lock_guard<std::mutex> lock(connections_mutex_);
  for (std::uint32_t s = 0; s < limits::kP2PStreamsMax; ++s) {
    tx_.erase(SlotKey{next, stream_key(slot, s)});
    rx_.erase(SlotKey{prev, stream_key(slot, s)});
  }
}

// Opens (or reuses) this hop's stripes for an attempt: as many streams as the tuner of
// the next peer says, but no more than the largest chunk has sub-chunks (a stream
// without any would carry nothing). Adaptive, a next peer on this host gets one: a
// loopback path has no loss or window to win back, and a probe would only cost. A
// stream that cannot be connected leaves the attempt with those before it.
void Communicator::open_streams(const proto::MemberInfo& to, std::uint32_t slot, const coll::RingPlan& plan,
                                const OpChannel& channel, coll::RingIo& io) {
  std::uint32_t wanted = 1;
  {
    std::lock_guard<std::mutex> lock(tuners_mutex_);
    auto it = tuners_.find(to.id);
    if (it == tuners_.end()) {
      const std::uint32_t max = options_.p2p_streams != 0 ? options_.p2p_streams : limits::kP2PStreamsAdaptiveMax;
      it = tuners_.emplace(to.id, StreamTuner(options_.p2p_streams, max)).first;
    }
    wanted = it->second.streams();
  }
  if (options_.p2p_streams == 0 && peers_on_this_host({to.id}) == 1) wanted = 1;
  // A reversed edge has one: its receiver dials the stripes, and it learns their
  // count only from the first frame, which would wait for them.
  if (proto::reversed_edge(self_info(), to) || relayed_edge(self_info(), to)) wanted = 1;
  const std::size_t chunk_elems =
      plan.kind == coll::RingKind::kBroadcast ? plan.count : (plan.count + plan.world - 1) / plan.world;
  const std::size_t chunk_bytes = chunk_elems * coll::dtype_size(plan.dtype);
  const std::size_t subchunks = (chunk_bytes + plan.subchunk_bytes - 1) / plan.subchunk_bytes;
  wanted = static_cast<std::uint32_t>(std::clamp<std::size_t>(subchunks, 1, wanted));
  for (std::uint32_t s = 1; s < wanted; ++s) {
    coll::RingStream stream;
    auto fd = tx_connection(to, stream_key(slot, s), channel, &stream.aead);
    if (!fd.is_ok()) {
      LOG_WARN(kLog, "stream " << s << " of slot " << slot << " to " << to.id.to_string()
                               << " cannot be connected (" << fd.status().message() << "); the attempt uses " << s);
      return;
    }
    stream.fd = fd.value();
    io.tx_more.push_back(stream);
  }
}

void Communicator::prune_connections(const std::vector<proto::MemberInfo>& members) {
  std::set<PeerId> ids;
  for (const auto& m : members) ids.insert(m.id);
  link_->prune_inbound(ids);
  std::lock_guard<std::mutex> lock(connections_mutex_);
  for (auto it = tx_.begin(); it != tx_.end();) it = ids.count(it->first.peer) == 0 ? tx_.erase(it) : std::next(it);
  for (auto it = rx_.begin(); it != rx_.end();) it = ids.count(it->first.peer) == 0 ? rx_.erase(it) : std::next(it);
  std::lock_guard<std::mutex> tuners_lock(tuners_mutex_);
  for (auto it = tuners_.begin(); it != tuners_.end();) it = ids.count(it->first) == 0 ? tuners_.erase(it) : std::next(it);
}

Status Communicator::optimize_topology() {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    if (!tags_in_flight_.empty()) {
      return remember(Status(LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS,
                             "await every collective in flight before optimizing the topology"));
    }
  }
  OperationScope scope(*this, Counter::kOptimizeTopologyUs, &optimize_failed_);
  link_->send(proto::VoteOptimizeTopology{});
  // Bandwidth tests as the master asks for them, then the rewiring.
  for (;;) {
    auto next = link_->wait([](const proto::Message& m) {
      if (const auto* r = std::get_if<proto::Refused>(&m)) {
        return r->request == proto::MsgType::kVoteOptimizeTopology || r->request == proto::MsgType::kBandwidthReport;
      }
      return std::holds_alternative<proto::BandwidthTest>(m) || std::holds_alternative<proto::EstablishP2P>(m) ||
             std::holds_alternative<proto::TopologyResult>(m);
    });
    if (!next.is_ok()) return remember(next.status());
    if (const auto* r = std::get_if<proto::Refused>(&next.value())) return remember(Status(r->status, "master: " + r->reason));
    if (const auto* t = std::get_if<proto::TopologyResult>(&next.value())) return remember(Status(t->status, t->reason));
    if (const auto* test = std::get_if<proto::BandwidthTest>(&next.value())) {
      const std::uint64_t rate = measure_bandwidth(*test);
      link_->send(proto::BandwidthReport{test->test, test->partner.id, rate});
      continue;
    }
    auto result = finish_establishment(std::get<proto::EstablishP2P>(next.value()));
    if (!result.is_ok()) return remember(result.status());
    if (result.value().status != LOCKSTEP_OK) return remember(Status(result.value().status, result.value().reason));
    scope.succeeded();
    return Status::ok();
  }
}

Result<bool> Communicator::are_peers_pending() {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  link_->send(proto::VotePeersPending{});
  auto reply = link_->wait([](const proto::Message& m) {
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kVotePeersPending;
    return std::holds_alternative<proto::PeersPendingResult>(m);
  });
  if (!reply.is_ok()) return remember(reply.status());
  if (const auto* r = std::get_if<proto::Refused>(&reply.value())) return remember(Status(r->status, "master: " + r->reason));
  const auto& result = std::get<proto::PeersPendingResult>(reply.value());
  if (result.status != LOCKSTEP_OK) return remember(Status(result.status, result.reason));
  return result.pending;
}

Result<std::vector<std::uint8_t>> Communicator::agree_value(proto::AgreeMode mode, std::vector<std::uint8_t> value) {
  if (mode == proto::AgreeMode::kFlag || static_cast<std::uint8_t>(mode) > proto::kAgreeModeMax) {
    return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "unknown agree mode"));
  }
  if (value.size() > limits::kAgreeValueBytesMax) {
    return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "a value of " + std::to_string(value.size()) +
                                                                 " bytes; at most " +
                                                                 std::to_string(limits::kAgreeValueBytesMax)));
  }
  auto result = vote_agree(proto::VoteAgree{true, mode, std::move(value)});
  if (!result.is_ok()) return result.status();
  return std::move(result.value().agreed);
}

Result<bool> Communicator::agree(bool flag) {
  auto result = vote_agree(proto::VoteAgree{flag});
  if (!result.is_ok()) return result.status();
  return result.value().value;
}

Result<proto::AgreeResult> Communicator::vote_agree(proto::VoteAgree vote) {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  link_->send(std::move(vote));
  auto reply = link_->wait([](const proto::Message& m) {
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kVoteAgree;
    return std::holds_alternative<proto::AgreeResult>(m);
  });
  if (!reply.is_ok()) return remember(reply.status());
  if (const auto* r = std::get_if<proto::Refused>(&reply.value())) return remember(Status(r->status, "master: " + r->reason));
  auto& result = std::get<proto::AgreeResult>(reply.value());
  if (result.status != LOCKSTEP_OK) return remember(Status(result.status, result.reason));
  return std::move(result);
}

// ------------------------------------------------------------------ key-value store

Result<std::vector<std::uint8_t>> Communicator::kv_request(proto::KvRequest request) {
  if (Status s = check_call(false); !s.is_ok()) return remember(s);
  if (!connected_) return remember(Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "connect the communicator first"));
  if (request.key.empty()) return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "an empty key"));
  if (request.key.size() > limits::kKvKeyBytesMaxLimit || request.value.size() > limits::kKvValueBytesMaxLimit) {
    return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                           "keys of at most " + std::to_string(limits::kKvKeyBytesMaxLimit) + " bytes and values of at most " +
                               std::to_string(limits::kKvValueBytesMaxLimit) + " (and the master's bounds, which may be lower)"));
  }
  const std::uint64_t id = ++kv_requests_;
  request.request = id;
  link_->send(std::move(request));
  auto reply = link_->wait([id](const proto::Message& m) {
    const auto* r = std::get_if<proto::KvResult>(&m);
    return r != nullptr && r->request == id;
  });
  if (!reply.is_ok()) return remember(reply.status());
  auto& result = std::get<proto::KvResult>(reply.value());
  if (result.status != LOCKSTEP_OK) return remember(Status(result.status, "master: " + result.reason));
  return std::move(result.value);
}

Status Communicator::kv_set(const std::string& key, std::vector<std::uint8_t> value) {
  return kv_request(proto::KvRequest{0, proto::KvOp::kSet, key, std::move(value)}).status();
}

Result<std::vector<std::uint8_t>> Communicator::kv_get(const std::string& key) {
  return kv_request(proto::KvRequest{0, proto::KvOp::kGet, key});
}

Result<std::vector<std::uint8_t>> Communicator::kv_wait(const std::string& key, std::uint32_t timeout_ms) {
  return kv_request(proto::KvRequest{0, proto::KvOp::kWait, key, {}, timeout_ms});
}

Status Communicator::kv_delete(const std::string& key) {
  return kv_request(proto::KvRequest{0, proto::KvOp::kDelete, key}).status();
}

// ------------------------------------------------------------------ collectives

Status Communicator::check_collective_call(const ReduceDescriptor& d) {
  using Kind = proto::CollectiveKind;
  if (static_cast<std::uint8_t>(d.kind) > proto::kCollectiveKindMax) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "unknown collective");
  }
  if (d.kind != Kind::kBarrier) {
    if (!coll::dtype_valid(static_cast<int>(d.dtype))) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "unknown dtype");
    const std::uint64_t limit = (std::uint64_t{1} << 48) / coll::dtype_size(d.dtype);
    std::uint64_t total = d.count;
    if (d.kind == Kind::kAllGather && !d.counts.empty()) {
      if (d.count != 0) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "all-gather with counts per rank takes no count");
      if (d.counts.size() > limits::kMembersPerMessageMax) {
        return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                      "more than " + std::to_string(limits::kMembersPerMessageMax) + " counts per rank");
      }
      total = 0;
      for (const std::uint64_t c : d.counts) {
        if (c > limit) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "buffer larger than 256 TiB");
        total += c;
      }
    }
    if (total == 0) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "count is zero");
    if (total > limit) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "buffer larger than 256 TiB");
    if (d.dst == nullptr) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "null buffer");
    // All-gather with counts: a rank whose count is 0 may pass no input (its rank is known
    // only once accepted, so here: any zero).
    const bool src_needed = d.kind == Kind::kAllReduce || d.kind == Kind::kReduceScatter ||
                            (d.kind == Kind::kAllGather &&
                             (d.counts.empty() || std::find(d.counts.begin(), d.counts.end(), 0) == d.counts.end()));
    if (src_needed && d.src == nullptr) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "null buffer");
  }
  if (d.kind == Kind::kAllReduce || d.kind == Kind::kReduceScatter) {
    if (!coll::op_valid(static_cast<int>(d.op))) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "unknown reduce op");
    if (d.quantization != LOCKSTEP_QUANT_NONE && !coll::quantization_supported(d.dtype, d.quantization)) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "quantization needs a floating-point dtype (f16, bf16, f32, f64; a cast to f16 or bf16: f32 or f64)");
    }
  }
  if (d.residual != nullptr) {
    if (d.kind != Kind::kAllReduce || d.quantization == LOCKSTEP_QUANT_NONE ||
        (d.op != LOCKSTEP_SUM && d.op != LOCKSTEP_AVG)) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "a residual (error feedback) needs a quantized all-reduce with op sum or avg");
    }
    // The residual is read during every attempt and written after the last: it may not
    // share a byte with the input or the output.
    const std::size_t bytes = static_cast<std::size_t>(d.count) * coll::dtype_size(d.dtype);
    const auto overlaps = [&](const void* p) {
      const auto a = reinterpret_cast<std::uintptr_t>(d.residual);
      const auto b = reinterpret_cast<std::uintptr_t>(p);
      return p != nullptr && a < b + bytes && b < a + bytes;
    };
    if (overlaps(d.src) || overlaps(d.dst)) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "the residual overlaps the all-reduce's src or dst");
    }
  }
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "connect the communicator (and be accepted) first");
  if (Status fatal = link_->fatal(); !fatal.is_ok()) return fatal;
  return Status::ok();
}

proto::CollectiveDescriptor Communicator::wire_descriptor(const ReduceDescriptor& d, std::string* refusal) const {
  using Kind = proto::CollectiveKind;
  proto::CollectiveDescriptor w;
  w.kind = d.kind;
  if (d.kind == Kind::kBarrier) return w;
  w.count = d.count;
  w.dtype = static_cast<std::uint8_t>(d.dtype);
  if (d.kind == Kind::kAllReduce || d.kind == Kind::kReduceScatter) {
    w.op = static_cast<std::uint8_t>(d.op);
    w.quantization = static_cast<std::uint8_t>(d.quantization);
  }
  if (d.kind == Kind::kAllReduce) w.algorithm = options_.allreduce_algorithm;
  if (!proto::shape_bound(d.kind)) return w;
  const std::uint32_t world = view_size_.load();
  w.world = world;
  if (d.kind == Kind::kBroadcast) {
    w.root = d.root;
    if (d.root >= world) {
      *refusal = "broadcast root " + std::to_string(d.root) + " is not a rank of this view of " + std::to_string(world);
    }
  }
  if (d.kind == Kind::kAllGather) {
    w.counts = d.counts;
    std::uint64_t total = d.count * world;
    if (!d.counts.empty()) {
      total = 0;
      for (const std::uint64_t c : d.counts) total += c;
      if (d.counts.size() != world) {
        *refusal = "all-gather with " + std::to_string(d.counts.size()) + " counts in a view of " + std::to_string(world);
      } else if (d.counts[view_rank_.load()] > 0 && d.src == nullptr) {
        *refusal = "null input for this rank's " + std::to_string(d.counts[view_rank_.load()]) + " elements";
      }
    }
    if (refusal->empty() && d.dst_capacity < total) {
      *refusal = "all-gather destination has room for " + std::to_string(d.dst_capacity) + " elements where " +
                 std::to_string(total) + " are gathered";
    }
  }
  return w;
}

Result<std::shared_ptr<AsyncReduce>> Communicator::all_reduce_async(const ReduceDescriptor& d) {
  return start_collective(d, /*on_own_thread=*/true);
}

// The blocking form runs the collective on the calling thread (no thread to start
// and wake); the async form on a pooled worker thread. The bookkeeping is the same.
Result<std::shared_ptr<AsyncReduce>> Communicator::start_collective(const ReduceDescriptor& d, bool on_own_thread) {
  if (Status s = check_collective_call(d); !s.is_ok()) return remember(s);
  const auto self = std::this_thread::get_id();
  auto op = std::make_shared<AsyncReduce>();
  {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    if (self != owner_) {
      // One thread besides the owner may run collectives (PRODUCT.md, threading).
      if (collective_thread_ && *collective_thread_ != self && !tags_in_flight_.empty()) {
        return remember(Status(LOCKSTEP_STATUS_WRONG_THREAD, "collectives are already launched from another thread"));
      }
      collective_thread_ = self;
    }
    if (!tags_in_flight_.insert(d.tag).second) {
      return remember(Status(LOCKSTEP_STATUS_INVALID_USAGE, "tag " + std::to_string(d.tag) + " is already in flight"));
    }
    count(Counter::kOperationsStarted);
    if (d.kind == proto::CollectiveKind::kAllReduce) count(Counter::kAllReducesStarted);
    if (failed_tags_.count(d.tag) != 0) count(Counter::kRetries);
  }
  op->launcher_ = self;
  op->tag_ = d.tag;
  auto channel = std::make_shared<OpChannel>();
  if (!channel->valid()) {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    tags_in_flight_.erase(d.tag);
    return remember(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "eventfd failed"));
  }
  link_->register_op(d.tag, channel);
  const bool all_reduce = d.kind == proto::CollectiveKind::kAllReduce;
  auto body = [this, d, channel, op, all_reduce] {
    ReduceInfo info;
    const auto started = Clock::now();
    Status status = run_collective(d, *channel, &info);
    count(status.is_ok() ? Counter::kOperationsSucceeded : Counter::kOperationsFailed);
    if (all_reduce) {
      count(Counter::kAllReduceUs, static_cast<std::uint64_t>(
                                       std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - started).count()));
      count(Counter::kAllReduceBytesSent, info.bytes_sent);
      count(Counter::kAllReduceBytesReceived, info.bytes_received);
      count(status.is_ok() ? Counter::kAllReducesSucceeded : Counter::kAllReducesFailed);
    }
    link_->unregister_op(d.tag);
    {
      std::lock_guard<std::mutex> lock(ops_mutex_);
      tags_in_flight_.erase(d.tag);
      // Bounded by the tags an application uses; a pathological one only loses retry counts.
      if (status.is_ok() || failed_tags_.size() >= kFailedTagsRemembered) failed_tags_.erase(d.tag);
      else failed_tags_.insert(d.tag);
    }
    op->status_ = std::move(status);
    op->info_ = info;
    op->finish();
  };
  if (on_own_thread) {
    workers_.submit(std::move(body));
  } else {
    body();
  }
  return op;
}

Result<ReduceInfo> Communicator::await(const std::shared_ptr<AsyncReduce>& op) {
  if (!op) return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "null handle"));
  if (std::this_thread::get_id() != op->launcher_) {
    return remember(Status(LOCKSTEP_STATUS_WRONG_THREAD, "a handle is awaited on the thread that launched it"));
  }
  if (op->awaited_) return remember(Status(LOCKSTEP_STATUS_INVALID_USAGE, "handle already awaited"));
  op->wait_finished();
  op->awaited_ = true;
  if (!op->status_.is_ok()) return remember(op->status_);
  return op->info_;
}

Result<ReduceInfo> Communicator::all_reduce(const ReduceDescriptor& d) {
  auto op = start_collective(d, /*on_own_thread=*/false);
  if (!op.is_ok()) return op.status();
  return await(op.value());
}

Status Communicator::all_reduce_multiple_with_retry(const std::vector<ReduceDescriptor>& descriptors,
                                                    std::size_t max_in_flight, std::vector<ReduceInfo>* infos) {
  if (max_in_flight == 0) return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "max_in_flight is zero"));
  std::set<std::uint64_t> tags;
  for (const auto& d : descriptors) {
    if (!tags.insert(d.tag).second) return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "duplicate tag"));
    if (d.kind != proto::CollectiveKind::kAllReduce && d.kind != proto::CollectiveKind::kBarrier) {
      // The others are bound to their view: a retry with the survivors would only fail.
      return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "multiple-with-retry takes all-reduces and barriers"));
    }
  }
  if (infos != nullptr) infos->assign(descriptors.size(), ReduceInfo{});
  std::vector<std::size_t> todo(descriptors.size());
  for (std::size_t i = 0; i < todo.size(); ++i) todo[i] = i;
  while (!todo.empty()) {
    std::vector<std::size_t> failed;
    Status hard;
    std::deque<std::pair<std::size_t, std::shared_ptr<AsyncReduce>>> running;
    std::size_t next = 0;
    // Keep at most max_in_flight running; await in launch order (every peer launches
    // in the same order, and a tag waits for the others like a vote).
    while (next < todo.size() || !running.empty()) {
      while (hard.is_ok() && next < todo.size() && running.size() < max_in_flight) {
        auto op = all_reduce_async(descriptors[todo[next]]);
        if (!op.is_ok()) {
          hard = op.status();
          break;
        }
        running.emplace_back(todo[next++], op.value());
      }
      if (running.empty()) break;
      auto [index, op] = running.front();
      running.pop_front();
      auto r = await(op);
      if (r.is_ok()) {
        if (infos != nullptr) (*infos)[index] = r.value();
      } else if (r.status().code() == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
        failed.push_back(index);  // retried with the survivors below
      } else if (hard.is_ok()) {
        hard = r.status();
      }
    }
    if (!hard.is_ok()) return remember(hard);
    todo = failed;
  }
  return Status::ok();
}

void Communicator::check_contribution(const ReduceDescriptor& d, proto::CollectiveInit* init) const {
  using Kind = proto::CollectiveKind;
  if (d.kind == Kind::kBarrier || !coll::is_float(d.dtype)) return;
  const std::uint32_t rank = view_rank_.load();
  const void* data = d.src;
  std::uint64_t count = d.count;
  switch (d.kind) {
    case Kind::kReduceScatter: count = d.count * view_size_.load(); break;
    case Kind::kAllGather:
      if (!d.counts.empty()) count = rank < d.counts.size() ? d.counts[rank] : 0;
      break;
    case Kind::kBroadcast:
      if (d.root != rank) return;  // only the root contributes
      data = d.dst;
      break;
    default: break;
  }
  if (data == nullptr || count == 0) return;
  const std::size_t at = coll::first_non_finite(data, count, d.dtype);
  if (at == count) return;
  const auto* bytes = static_cast<const std::uint8_t*>(data) + at * coll::dtype_size(d.dtype);
  double value = 0;
  switch (d.dtype) {
    case LOCKSTEP_F16: value = static_cast<double>(coll::f16_to_f32(*reinterpret_cast<const std::uint16_t*>(bytes))); break;
    case LOCKSTEP_BF16: value = static_cast<double>(coll::bf16_to_f32(*reinterpret_cast<const std::uint16_t*>(bytes))); break;
    case LOCKSTEP_F32: value = static_cast<double>(*reinterpret_cast<const float*>(bytes)); break;
    default: value = *reinterpret_cast<const double*>(bytes); break;
  }
  init->refusal = "element " + std::to_string(at) + " is " + (std::isnan(value) ? "NaN" : value > 0 ? "+inf" : "-inf");
  init->refusal_status = LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION;
}

// How many peers of this ring run on this host, by the host the master recorded for
// each member (0 if this peer is not in the view): with the core count it decides
// whether the ring sends from a second thread (coll::ring_sender_thread). A local
// choice: the bytes on the wire are the same either way.
std::size_t Communicator::peers_on_this_host(const std::vector<PeerId>& ring) {
  std::lock_guard<std::mutex> lock(connections_mutex_);
  const auto self = members_.find(id_);
  if (self == members_.end()) return 0;
  std::size_t here = 0;
  for (const PeerId& id : ring) {
    const auto it = members_.find(id);
    if (it != members_.end() && it->second.host == self->second.host) ++here;
  }
  return here;
}

// Vote to initiate, wait for the attempt, run the ring, vote to complete, and take
// the master's outcome; failed attempts leave the destination as it was.
Status Communicator::run_collective(const ReduceDescriptor& d, OpChannel& channel, ReduceInfo* info) {
  using Kind = proto::CollectiveKind;
  proto::CollectiveInit init;
  init.tag = d.tag;
  init.descriptor = wire_descriptor(d, &init.refusal);
  if (options_.check_finite && init.refusal.empty()) check_contribution(d, &init);
  // A small all-reduce (and a barrier) travels with the votes: the contribution goes with
  // this vote and the master's outcome brings the result (nothing is written before it).
  const bool carried = coll::travels_with_votes(init.descriptor);
  const std::size_t bytes = d.kind == Kind::kBarrier ? 0 : static_cast<std::size_t>(d.count) * coll::dtype_size(d.dtype);
  if (carried) {
    const auto* src = static_cast<const std::uint8_t*>(d.src);
    init.data.assign(src, src + bytes);
  }
  LOG_TRACE(kLog, id_.to_string() << " tag " << d.tag << ": vote to initiate");
  link_->send(init);
  auto go_message = channel.wait([](const proto::Message& m) {
    return std::holds_alternative<proto::CollectiveGo>(m) || std::holds_alternative<proto::CollectiveResult>(m) ||
           std::holds_alternative<proto::Refused>(m);
  });
  if (!go_message.is_ok()) return go_message.status();
  if (const auto* r = std::get_if<proto::Refused>(&go_message.value())) return Status(r->status, "master: " + r->reason);
  if (const auto* r = std::get_if<proto::CollectiveResult>(&go_message.value())) {
    if (r->status != LOCKSTEP_OK) return Status(r->status, r->reason);
    if (!carried || r->data.size() != bytes) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master's result of tag " + std::to_string(d.tag) + " carries " +
                                                        std::to_string(r->data.size()) + " bytes where " +
                                                        std::to_string(carried ? bytes : 0) + " were due");
    }
    if (bytes > 0) std::memcpy(d.dst, r->data.data(), bytes);
    info->world_size = r->world_size;
    info->bytes_sent = bytes;
    info->bytes_received = bytes;
    return Status::ok();
  }
  const auto go = std::get<proto::CollectiveGo>(go_message.value());
  if (carried) {
    // Not this protocol's master: end the attempt for everyone rather than leave it open.
    const std::string why = "the master started a ring for a small all-reduce";
    link_->send(proto::CollectiveDone{d.tag, go.attempt, false, why, 0, 0});
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, why);
  }
  // The attempt's ring: this peer's view less the peers the master names as removed
  // since (the master starts collectives only between updates, so the view is that of
  // go.epoch; anything else is not this protocol's master).
  std::vector<PeerId> ring;
  ring.reserve(view_.size());
  for (const auto& m : view_) {
    if (std::find(go.absent.begin(), go.absent.end(), m.id) == go.absent.end()) ring.push_back(m.id);
  }
  if (go.epoch != epoch_ || ring.size() + go.absent.size() != view_.size()) {
    const std::string why = "the master started tag " + std::to_string(d.tag) + " in the view of epoch " +
                            std::to_string(go.epoch) + " less " + std::to_string(go.absent.size()) +
                            " peer(s), where this peer's view is that of epoch " + std::to_string(epoch_);
    link_->release_slot(go.slot, go.attempt);
    link_->send(proto::CollectiveDone{d.tag, go.attempt, false, why, 0, 0});
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, why);
  }
  LOG_TRACE(kLog, id_.to_string() << " tag " << d.tag << ": attempt " << go.attempt << " over " << ring.size()
                                  << " peer(s), slot " << go.slot);
  if (go.slot >= options_.p2p_pool_size) {
    const std::string why = "the master gave slot " + std::to_string(go.slot) + " of a pool of " +
                            std::to_string(options_.p2p_pool_size);
    link_->release_slot(go.slot, go.attempt);
    link_->send(proto::CollectiveDone{d.tag, go.attempt, false, why, 0, 0});
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, why);
  }

  const auto self = std::find(ring.begin(), ring.end(), id_);
  if (self == ring.end()) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master's ring does not include this peer");
  const std::size_t n = ring.size();
  const std::size_t rank = static_cast<std::size_t>(self - ring.begin());
  if (proto::shape_bound(d.kind) && n != init.descriptor.world) {
    // The master checks this before any attempt: not this protocol's master.
    const std::string why = "the master started tag " + std::to_string(d.tag) + " over " + std::to_string(n) +
                            " peers where its view has " + std::to_string(init.descriptor.world);
    link_->release_slot(go.slot, go.attempt);
    link_->send(proto::CollectiveDone{d.tag, go.attempt, false, why, 0, 0});
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, why);
  }
  const PeerId next = ring[(rank + 1) % n];
  const PeerId prev = ring[(rank + n - 1) % n];

  std::unique_ptr<coll::RingScratch> scratch;
  {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    if (!free_scratch_.empty()) {
      scratch = std::move(free_scratch_.back());
      free_scratch_.pop_back();
    }
  }
  if (!scratch) scratch = std::make_unique<coll::RingScratch>();
  coll::RingPlan plan;
  plan.world = n;
  plan.rank = rank;
  plan.src = d.src;
  plan.dst = d.dst;
  plan.count = static_cast<std::size_t>(d.count);
  switch (d.kind) {
    case Kind::kBroadcast:
      plan.kind = coll::RingKind::kBroadcast;
      plan.src = d.dst;
      plan.root = d.root;
      break;
    case Kind::kAllGather:
      plan.kind = coll::RingKind::kAllGather;
      if (d.counts.empty()) {
        plan.count = static_cast<std::size_t>(d.count) * n;
      } else {
        plan.counts.assign(d.counts.begin(), d.counts.end());
        plan.count = 0;
        for (const std::size_t c : plan.counts) plan.count += c;
      }
      break;
    case Kind::kReduceScatter:
      plan.kind = coll::RingKind::kReduceScatter;
      plan.count = static_cast<std::size_t>(d.count) * n;
      break;
    default: break;
  }
  plan.dtype = d.dtype;
  plan.op = d.op;
  plan.quantization = d.quantization;
  plan.residual = d.residual;
  plan.distribution = d.distribution;
  plan.attempt = go.attempt;
  plan.subchunk_bytes = coll::ring_subchunk_bytes(n);
  const std::size_t peers_here = peers_on_this_host(ring);
  const unsigned cores = std::thread::hardware_concurrency();
  if (coll::ring_sender_thread(peers_here, cores)) plan.sender_thread_bytes_min = coll::kSenderThreadBytesMin;
  plan.spin_us = coll::ring_spin_us(peers_here, cores);
  coll::tune_same_host(plan, n > 1 && peers_on_this_host({prev}) == 1, n > 1 && peers_on_this_host({next}) == 1);
  coll::RingStats stats;
  const bool doubling = coll::runs_by_doubling(init.descriptor, n);
  std::vector<std::uint8_t> original;  // doubling: the destination before the attempt

  Status local = Status::ok();
  bool ran = false;
  bool reported = false;     // CollectiveDone sent
  bool committed = false;    // the ring's commit exchange completed here
  bool out_of_step = false;  // it was cut short: tokens may be left on the connections
  // Only the attempt whose turn it is on the slot may touch the slot's connections: one
  // that ended before its turn must not drop those another attempt is using.
  const bool had_turn = link_->wait_slot_turn(go.slot, go.attempt, channel);
  if (!had_turn) {
    local = Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the attempt ended before it started here");
  } else if (doubling) {
    ran = true;
    const auto* dst = static_cast<const std::uint8_t*>(plan.dst);
    original.assign(dst, dst + plan.count * coll::dtype_size(plan.dtype));
    local = run_doubling(ring, rank, plan, go.slot, channel, *scratch, &stats);
  } else {
    coll::RingIo io;
    io.abort_fd = channel.event_fd();
    io.abort_flag = channel.abort_flag();
    io.stall_timeout_ms = options_.p2p_stall_timeout_ms;
    if (n > 1) {
      proto::MemberInfo to;
      proto::MemberInfo from;
      {
        std::lock_guard<std::mutex> lock(connections_mutex_);
        if (auto it = members_.find(next); it != members_.end()) to = it->second;
        if (auto it = members_.find(prev); it != members_.end()) from = it->second;
      }
      if (to.id.is_nil() || from.id.is_nil()) {
        local = Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring peer " + (to.id.is_nil() ? next : prev).to_string() +
                                                           " is not in the membership view");
      } else {
        // A connection that cannot be made fails the attempt at once; making ours and
        // waiting for the previous peer's stop as soon as the master ends the attempt
        // (a neighbour died or was stopped, and the handshake would wait for it).
        const auto rx_deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
        auto [tx, rx] = ring_connections(to, from, go.slot, rx_deadline, channel, &io.seal, &io.open);
        if (!tx.is_ok()) local = tx.status();
        else if (!rx.is_ok()) local = rx.status();
        else {
          io.tx_fd = tx.value();
          io.rx_fd = rx.value();
          io.rx_replace = rx_replacer(from, go.slot, channel);
          open_streams(to, go.slot, plan, channel, io);
          // The previous peer's stripes, once its first frame says how many.
          io.rx_more = [&, rx_deadline](std::size_t count, std::vector<coll::RingStream>* out) {
            for (std::uint32_t s = 1; s < count; ++s) {
              coll::RingStream stream;
              auto fd = rx_connection(from, stream_key(go.slot, s), rx_deadline, channel, &stream.aead);
              if (!fd.is_ok()) return fd.status();
              stream.fd = fd.value();
              out->push_back(stream);
            }
            return Status::ok();
          };
        }
      }
    }
    if (local.is_ok()) {
      ran = true;
      const auto started = Clock::now();
      local = coll::run_ring(plan, io, *scratch, &stats);
      if (local.is_ok() && n > 1) {
        const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - started).count();
        std::lock_guard<std::mutex> lock(tuners_mutex_);
        if (auto it = tuners_.find(next); it != tuners_.end()) {
          it->second.on_attempt(stats.streams, stats.bytes_sent, static_cast<std::uint64_t>(us));
        }
      }
      if (local.is_ok()) {
        // This peer holds the result: it says so to the master, and runs the commit
        // exchange meanwhile (docs/protocol.md, "Completion"); whichever ends first, the
        // master's outcome or the exchange, ends the call. (The exchange's few bytes are
        // left out of the counters, which must match what the reports carry.)
        link_->send(proto::CollectiveDone{d.tag, go.attempt, true, {}, stats.bytes_sent, stats.bytes_received});
        reported = true;
        io.settled_flag = channel.settled_flag();
        auto end = coll::run_ring_commit(plan, io, nullptr);
        if (!end.is_ok()) {
          LOG_DEBUG(kLog, id_.to_string() << " tag " << d.tag << ": no commit: " << end.status().to_string());
          out_of_step = true;
        } else if (end.value() == coll::CommitEnd::kCommitted) {
          committed = true;
        }
      }
    }
  }
  LOG_TRACE(kLog, id_.to_string() << " tag " << d.tag << ": attempt " << go.attempt << " done here: " << local.to_string()
                                  << (committed ? " (committed)" : ""));
  // Every participant holds the result: the attempt can only succeed. The master learns
  // it from this report (and ends the attempt for the others, if it has not); its
  // outcome, when it comes, is dropped. (Should it have come in between, it reached
  // the collective's channel instead, and the session's note of this attempt is
  // forgotten among its oldest.) While the master is away (failover) the attempt waits
  // for the outcome instead, which the master that takes the run back decides.
  if (committed && !channel.settled_flag()->load() &&
      link_->settled_early(d.tag, go.attempt, static_cast<std::uint32_t>(n))) {
    link_->send(proto::CollectiveDone{d.tag, go.attempt, true, {}, 0, 0, true});
    coll::commit_residual(plan, *scratch);
    info->world_size = static_cast<std::uint32_t>(n);
    finish_attempt(go.slot, go.attempt, stats, info, std::move(scratch));
    return Status::ok();
  }
  // Vote to complete (also after the master's abort or outcome: a late report is ignored).
  if (!reported) {
    link_->send(proto::CollectiveDone{d.tag, go.attempt, local.is_ok(), local.message(), stats.bytes_sent,
                                      stats.bytes_received});
  }
  auto outcome = channel.wait([&](const proto::Message& m) {
    const auto* r = std::get_if<proto::CollectiveResult>(&m);
    return r != nullptr && r->attempt == go.attempt;
  });
  LOG_TRACE(kLog, id_.to_string() << " tag " << d.tag << ": outcome received");
  Status final_status = Status::ok();
  if (!outcome.is_ok()) {
    final_status = outcome.status();
  } else {
    const auto& result = std::get<proto::CollectiveResult>(outcome.value());
    if (result.status != LOCKSTEP_OK) final_status = Status(result.status, result.reason);
    info->world_size = result.world_size;
    // A success needs every participant to hold the result (a commit proves it): one
    // declared where this peer never got it is not this protocol's master (or a peer
    // lied about its commit). The destination is as it was; say so rather than return it
    // as the result.
    if (final_status.is_ok() && !local.is_ok()) {
      final_status = Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                            "the master declared attempt " + std::to_string(go.attempt) + " of tag " +
                                std::to_string(d.tag) + " a success where this peer did not finish it (" +
                                local.message() + ")");
    }
  }
  if (doubling) {
    // Every stage wrote the destination in place: a failed attempt gets it back whole.
    if (!final_status.is_ok() && ran) std::memcpy(plan.dst, original.data(), original.size());
    // Every partner of the plan, not only those reached: a later partner may already
    // have sent this attempt's frames, which must not meet the next attempt.
    if (!final_status.is_ok() && had_turn) {
      for (const auto& stage : coll::doubling_stages(n, rank)) {
        drop_connections(ring[stage.partner], ring[stage.partner], go.slot);
      }
    }
  } else {
    if (!final_status.is_ok() && ran && local.is_ok()) coll::restore(plan, *scratch);  // we had finished: undo
    if (final_status.is_ok() && ran) coll::commit_residual(plan, *scratch);
    // A commit exchange cut short leaves tokens on the connections.
    if ((!final_status.is_ok() || out_of_step) && had_turn) drop_connections(next, prev, go.slot);
  }
  finish_attempt(go.slot, go.attempt, stats, info, std::move(scratch));
  return final_status;
}

void Communicator::finish_attempt(std::uint32_t slot, std::uint64_t attempt, const coll::RingStats& stats,
                                  ReduceInfo* info, std::unique_ptr<coll::RingScratch> scratch) {
  link_->release_slot(slot, attempt);
  slot_bytes_[slot].sent.fetch_add(stats.bytes_sent, std::memory_order_relaxed);
  slot_bytes_[slot].received.fetch_add(stats.bytes_received, std::memory_order_relaxed);
  info->bytes_sent = stats.bytes_sent;
  info->bytes_received = stats.bytes_received;
  info->streams = stats.streams;
  std::lock_guard<std::mutex> lock(ops_mutex_);
  free_scratch_.push_back(std::move(scratch));
}

Status Communicator::run_doubling(const std::vector<PeerId>& ring, std::size_t rank, const coll::RingPlan& plan,
                                  std::uint32_t slot, const OpChannel& channel, coll::RingScratch& scratch,
                                  coll::RingStats* stats) {
  using Kind = coll::DoublingStage::Kind;
  bool first = true;  // the first stage reads the caller's source; the others the destination
  for (const auto& stage : coll::doubling_stages(ring.size(), rank)) {
    const PeerId partner = ring[stage.partner];
    proto::MemberInfo to;
    {
      std::lock_guard<std::mutex> lock(connections_mutex_);
      if (auto it = members_.find(partner); it != members_.end()) to = it->second;
    }
    if (to.id.is_nil()) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "peer " + partner.to_string() + " is not in the membership view");
    }
    coll::RingIo io;
    io.abort_fd = channel.event_fd();
    io.abort_flag = channel.abort_flag();
    io.stall_timeout_ms = options_.p2p_stall_timeout_ms;
    const auto rx_deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
    auto [tx, rx] = ring_connections(to, to, slot, rx_deadline, channel, &io.seal, &io.open);
    if (!tx.is_ok()) return tx.status();
    if (!rx.is_ok()) return rx.status();
    io.tx_fd = tx.value();
    io.rx_fd = rx.value();
    io.rx_replace = rx_replacer(to, slot, channel);
    // A ring of the two, the partner both next and previous.
    coll::RingPlan pair = plan;
    pair.world = 2;
    pair.rank = stage.role;
    pair.residual = nullptr;
    pair.subchunk_bytes = coll::ring_subchunk_bytes(2);
    if (stage.kind == Kind::kBroadcast) {
      pair.kind = coll::RingKind::kBroadcast;
      pair.root = 0;
      pair.src = plan.dst;
    } else {
      pair.src = first ? plan.src : plan.dst;
      if (plan.op == LOCKSTEP_AVG) pair.op = LOCKSTEP_SUM;  // divided once, at the end
    }
    pair.tx_buffer_bytes = 0;
    pair.rx_buffer_bytes = 0;
    pair.rx_lowat_bytes = coll::RingPlan{}.rx_lowat_bytes;
    const bool here = peers_on_this_host({partner}) == 1;
    coll::tune_same_host(pair, here, here);
    coll::RingStats step;
    const Status s = coll::run_ring(pair, io, scratch, &step);
    stats->bytes_sent += step.bytes_sent;
    stats->bytes_received += step.bytes_received;
    if (!s.is_ok()) return s;
    first = false;
    if (stage.finalize_after) {
      coll::finalize(plan.dst, plan.count, plan.dtype, plan.op, static_cast<std::uint32_t>(ring.size()));
    }
  }
  return Status::ok();
}

Result<proto::Attributes> Communicator::attributes() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  return attributes_;
}

Result<std::vector<proto::MemberInfo>> Communicator::membership() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  auto view = view_;
  for (auto& m : view) m.key.clear();  // pair keys stay inside the communicator
  return view;
}

Result<std::uint32_t> Communicator::rank() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  return rank_;
}

}  // namespace lockstep::peer
