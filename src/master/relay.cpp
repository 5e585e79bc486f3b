// A relay (relay.h): one Asio loop on its own thread.
#include "master/relay.h"

#include "common/limits.h"
#include "common/log.h"
#include "master/listen.h"
#include "protocol/codec.h"
#include "protocol/messages.h"
#include "transport/socket.h"

#include <asio.hpp>

#include <array>
#include <compare>
#include <deque>
#include <functional>
#include <set>
#include <utility>
#include <vector>

namespace lockstep::master {
namespace {

constexpr const char* kLog = "relay";

// One relayed connection: the sending peer (ring) or the serving one (shared state),
// the receiving or asking one, the slot (the pool_index of the P2PHellos) and the
// connection's own channel (their epoch).
struct Edge {
  PeerId sender;
  PeerId receiver;
  std::uint32_t slot = 0;
  std::uint64_t channel = 0;
  auto operator<=>(const Edge&) const = default;
};

}  // namespace

class Relay::Impl {
 public:
  explicit Impl(RelayOptions options) : options_(std::move(options)), acceptor_(io_) {}

  Status bind() { return listen_on(acceptor_, options_.listen_host, options_.port); }
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  void run() {
    accept();
    io_.run();
  }

  void stop() {
    asio::post(io_, [self = this] {
      asio::error_code ignored;
      self->acceptor_.close(ignored);
      for (const auto& c : std::set<std::shared_ptr<Conn>>(self->conns_)) self->drop(c);
      self->io_.stop();
    });
  }

  void assign(RelayPairs pairs) {
    asio::post(io_, [self = this, pairs = std::move(pairs)]() mutable {
      self->assigned_ = std::move(pairs);
      for (const auto& c : std::set<ConnPtr>(self->unassigned_)) {
        if (!self->allowed(c->hello.from, c->hello.to)) continue;
        self->unassigned_.erase(c);
        self->challenge(c);
      }
      for (const auto& c : std::set<std::shared_ptr<Conn>>(self->conns_)) {
        if (c->edge && !self->allowed(c->edge->sender, c->edge->receiver)) {
          LOG_INFO(kLog, "closing the relayed edge " << c->edge->sender.to_string() << " -> "
                                                     << c->edge->receiver.to_string() << ": the master no longer "
                                                        "assigns it to the relay");
          self->drop(c);
        }
      }
    });
  }

  RelayStats stats() const {
    RelayStats s;
    s.bytes = bytes_.load();
    s.pairs = pairs_.load();
    s.refused = refused_.load();
    s.active = active_.load();
    s.waiting = waiting_count_.load();
    return s;
  }

 private:
  struct Conn {
    explicit Conn(asio::ip::tcp::socket s) : socket(std::move(s)), timer(socket.get_executor()) {}
    asio::ip::tcp::socket socket;
    // The handshake's deadline, then the wait for the other end's; once joined, the
    // deadline of the write of this side's bytes to the other end.
    asio::steady_timer timer;
    std::string remote;
    std::array<std::uint8_t, proto::kFrameHeaderBytes> header{};
    std::vector<std::uint8_t> payload;
    std::vector<std::uint8_t> reply;
    proto::P2PHello hello;
    std::vector<std::uint8_t> transcript;
    security::Key key{};
    security::Nonce client{};
    security::Nonce server{};
    std::optional<Edge> edge;          // set once the handshake has proven it
    std::weak_ptr<Conn> partner;       // set once joined
    std::vector<std::uint8_t> buffer;  // this side's bytes on their way to the partner
  };
  using ConnPtr = std::shared_ptr<Conn>;

  bool allowed(PeerId a, PeerId b) const { return assigned_.count(relay_pair(a, b)) != 0; }

  void accept() {
    acceptor_.async_accept([self = this](const asio::error_code& ec, asio::ip::tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !self->acceptor_.is_open()) return;
      if (!ec) self->start(std::move(socket));
      self->accept();
    });
  }

  void start(asio::ip::tcp::socket socket) {
    auto c = std::make_shared<Conn>(std::move(socket));
    asio::error_code ignored;
    const auto remote = c->socket.remote_endpoint(ignored);
    c->remote = transport::join_host_port(transport::unmapped(remote.address().to_string()), remote.port());
    if (conns_.size() >= options_.connections_max && !displace_unproven()) {
      if (refused_++ % 100 == 0) {
        LOG_WARN(kLog, "refusing a connection from " << c->remote << ": " << conns_.size()
                                                     << " connections open (the cap), all of them proven");
      }
      c->socket.close(ignored);
      return;
    }
    c->socket.set_option(asio::ip::tcp::no_delay(true), ignored);
    conns_.insert(c);
    // Entries of connections closed or proven since leave from the front (one unproven
    // lives at most the handshake timeout, so the list holds only recent accepts).
    while (!unproven_.empty()) {
      const auto front = unproven_.front().lock();
      if (front != nullptr && !front->edge && conns_.count(front) != 0) break;
      unproven_.pop_front();
    }
    unproven_.push_back(c);
    arm(c, options_.handshake_timeout_ms, "its handshake did not finish in time");
    read_frame(c, proto::MsgType::kP2PHello, [this, c] { on_hello(c); });
  }

  // At the cap: the oldest connection that has not proven a pair key yet makes room, so
  // that connections held open idle (a flood of strangers) cannot keep the run's peers
  // out until their handshake timeout. False if every connection has proven one.
  bool displace_unproven() {
    while (!unproven_.empty()) {
      const auto oldest = unproven_.front().lock();
      unproven_.pop_front();
      if (oldest == nullptr || oldest->edge || conns_.count(oldest) == 0) continue;
      if (displaced_++ % 100 == 0) {
        LOG_WARN(kLog, options_.connections_max << " relay connections open (the cap); closing the oldest that has "
                                                   "not proven a pair key, from "
                                                << oldest->remote << " (" << displaced_ << " so far)");
      }
      refuse(oldest);
      return true;
    }
    return false;
  }

  // Drops `c` unless the timer is re-armed or cancelled before it fires.
  void arm(const ConnPtr& c, std::uint32_t ms, const char* why) {
    c->timer.expires_after(std::chrono::milliseconds(ms));
    c->timer.async_wait([self = this, c, why](const asio::error_code& ec) {
      if (ec) return;
      LOG_INFO(kLog, "dropping the relay connection from " << c->remote << ": " << why);
      self->refuse(c);
    });
  }

  // Reads one whole frame of `type` (within the codec's bound for it) into c->payload.
  void read_frame(const ConnPtr& c, proto::MsgType type, std::function<void()> then) {
    asio::async_read(c->socket, asio::buffer(c->header),
                     [this, c, type, then = std::move(then)](const asio::error_code& ec, std::size_t) mutable {
                       if (ec) return refuse(c);
                       auto header = proto::decode_header(c->header);
                       if (!header.is_ok() || header.value().type != type) return refuse(c);
                       c->payload.resize(header.value().payload_bytes);
                       asio::async_read(c->socket, asio::buffer(c->payload),
                                        [this, c, then = std::move(then)](const asio::error_code& ec2, std::size_t) {
                                          if (ec2) return refuse(c);
                                          then();
                                        });
                     });
  }

  void on_hello(const ConnPtr& c) {
    auto message = proto::decode_payload(proto::MsgType::kP2PHello, c->payload);
    if (!message.is_ok()) return refuse(c);
    c->hello = std::get<proto::P2PHello>(message.value());
    const proto::P2PHello& h = c->hello;
    const bool relayable = h.epoch == static_cast<std::uint64_t>(proto::Channel::kRing) ||
                           h.epoch == static_cast<std::uint64_t>(proto::Channel::kSharedState) ||
                           h.epoch == static_cast<std::uint64_t>(proto::Channel::kBenchmark);
    if (h.channel != proto::Channel::kRelay || !relayable || !security::to_nonce(h.auth, &c->client)) return refuse(c);
    c->transcript = c->payload;
    if (!allowed(h.from, h.to)) {
      // Perhaps not yet: wait a little for the master's assignment (assign() goes on).
      unassigned_.insert(c);
      c->timer.expires_after(std::chrono::milliseconds(options_.assignment_wait_ms));
      c->timer.async_wait([self = this, c](const asio::error_code& ec) {
        if (ec || self->unassigned_.erase(c) == 0) return;
        LOG_INFO(kLog, "refusing " << c->remote << ": the master assigns no relayed edge between "
                                   << c->hello.from.to_string() << " and " << c->hello.to.to_string());
        self->answer_and_drop(c, LOCKSTEP_STATUS_REJECTED);
      });
      return;
    }
    challenge(c);
  }

  // The hello names an assigned pair: the relay proves the pair's key and reads the proof.
  void challenge(const ConnPtr& c) {
    arm(c, options_.handshake_timeout_ms, "its handshake did not finish in time");
    const proto::P2PHello& h = c->hello;
    c->key = assigned_.at(relay_pair(h.from, h.to));
    c->server = security::random_nonce();
    const auto proof = security::proof(c->key, security::kAcceptorRole, c->client, c->server, c->transcript);
    c->reply = proto::encode_frame(proto::AuthChallenge{security::to_bytes(c->server), security::to_bytes(proof)});
    asio::async_write(c->socket, asio::buffer(c->reply), [this, c](const asio::error_code& ec, std::size_t) {
      if (ec) return refuse(c);
      read_frame(c, proto::MsgType::kAuthProof, [this, c] { on_proof(c); });
    });
  }

  void on_proof(const ConnPtr& c) {
    auto message = proto::decode_payload(proto::MsgType::kAuthProof, c->payload);
    if (!message.is_ok() || !security::verify(c->key, security::kConnectorRole, c->client, c->server, c->transcript,
                                              std::get<proto::AuthProof>(message.value()).proof)) {
      LOG_WARN(kLog, "dropping " << c->remote << " claiming to be " << c->hello.from.to_string()
                                 << ": wrong proof of the pair key");
      return refuse(c);
    }
    // Assignments may have changed while the proof was on its way.
    if (!allowed(c->hello.from, c->hello.to)) return answer_and_drop(c, LOCKSTEP_STATUS_REJECTED);
    const bool receiver = (c->hello.flags & proto::kP2PFlagReversed) != 0;
    const Edge edge = receiver ? Edge{c->hello.to, c->hello.from, c->hello.pool_index, c->hello.epoch}
                               : Edge{c->hello.from, c->hello.to, c->hello.pool_index, c->hello.epoch};
    c->edge = edge;
    // A newer connection of the same end replaces its older one (it gave up and came back).
    if (const auto w = waiting_.find(edge); w != waiting_.end()) {
      if (const auto older = (receiver ? w->second.second : w->second.first).lock()) drop(older);
    }
    auto& [sender_side, receiver_side] = waiting_[edge];
    if (const auto other = (receiver ? sender_side : receiver_side).lock()) {
      waiting_.erase(edge);
      return join(receiver ? other : c, receiver ? c : other);
    }
    auto& mine = receiver ? receiver_side : sender_side;
    mine = c;
    waiting_count_ = static_cast<std::uint32_t>(waiting_.size());
    arm(c, options_.match_timeout_ms, "the other end of its edge did not come");
  }

  // Both ends are here: each is told, then bytes flow.
  void join(const ConnPtr& sender, const ConnPtr& receiver) {
    sender->partner = receiver;
    receiver->partner = sender;
    waiting_count_ = static_cast<std::uint32_t>(waiting_.size());
    ++pairs_;
    active_ = active_ + 1;
    auto acked = std::make_shared<int>(0);
    for (const auto& c : {sender, receiver}) {
      c->timer.cancel();
      c->buffer.resize(options_.buffer_bytes);
      c->reply = proto::encode_frame(proto::P2PHelloAck{LOCKSTEP_OK});
      asio::async_write(c->socket, asio::buffer(c->reply),
                        [this, sender, receiver, acked](const asio::error_code& ec, std::size_t) {
                          if (ec) return drop(sender);
                          if (++*acked < 2) return;
                          pump(sender, receiver);
                          pump(receiver, sender);
                        });
    }
  }

  // Copies from `from` to `to` through from->buffer, one buffer at a time.
  void pump(const ConnPtr& from, const ConnPtr& to) {
    from->socket.async_read_some(asio::buffer(from->buffer), [this, from, to](const asio::error_code& ec, std::size_t n) {
      if (ec) return drop(from);
      bytes_ += n;
      arm(from, options_.stall_timeout_ms, "its other end did not read what it sent in time");
      asio::async_write(to->socket, asio::buffer(from->buffer.data(), n),
                        [this, from, to](const asio::error_code& ec2, std::size_t) {
                          if (ec2) return drop(from);
                          from->timer.cancel();
                          pump(from, to);
                        });
    });
  }

  void answer_and_drop(const ConnPtr& c, StatusCode status) {
    ++refused_;
    c->reply = proto::encode_frame(proto::P2PHelloAck{status});
    asio::async_write(c->socket, asio::buffer(c->reply), [this, c](const asio::error_code&, std::size_t) { drop(c); });
  }

  void refuse(const ConnPtr& c) {
    if (c->partner.expired()) ++refused_;
    drop(c);
  }

  // Closes `c` and, once joined, its other end.
  void drop(const ConnPtr& c) {
    unassigned_.erase(c);
    if (conns_.erase(c) == 0) return;
    if (c->edge) {
      if (auto w = waiting_.find(*c->edge); w != waiting_.end()) {
        auto& [s, r] = w->second;
        if (s.lock() == c) s.reset();
        if (r.lock() == c) r.reset();
        if (s.expired() && r.expired()) waiting_.erase(w);
      }
    }
    waiting_count_ = static_cast<std::uint32_t>(waiting_.size());
    const auto partner = c->partner.lock();
    if (partner) {
      active_ = active_ - 1;
      c->partner.reset();
      partner->partner.reset();
    }
    // Closed once the counts are right: whoever sees the close sees them too.
    asio::error_code ignored;
    c->timer.cancel();
    c->socket.close(ignored);
    if (partner) drop(partner);
  }

  const RelayOptions options_;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  std::set<ConnPtr> conns_;
  std::deque<std::weak_ptr<Conn>> unproven_;  // in accept order; entries of proven or closed ones are skipped
  std::uint64_t displaced_ = 0;
  std::map<Edge, std::pair<std::weak_ptr<Conn>, std::weak_ptr<Conn>>> waiting_;  // (sender, receiver)
  RelayPairs assigned_;
  std::set<ConnPtr> unassigned_;  // hellos of pairs not assigned (yet), waiting at most the assignment wait
  std::atomic<std::uint64_t> bytes_{0};
  std::atomic<std::uint64_t> pairs_{0};
  std::atomic<std::uint64_t> refused_{0};
  std::atomic<std::uint32_t> active_{0};
  std::atomic<std::uint32_t> waiting_count_{0};
};

RelayPairs relay_pairs(const std::map<PeerId, std::uint32_t>& members, const security::Key& run_key) {
  RelayPairs out;
  for (auto a = members.begin(); a != members.end(); ++a) {
    for (auto b = std::next(a); b != members.end(); ++b) {
      if (a->second != b->second) continue;
      if (out.size() == limits::kRelayPairsMax) {
        LOG_WARN(kLog, "more than " << limits::kRelayPairsMax << " pairs of peers that accept no inbound connection: "
                                    "the relay forwards for the first " << limits::kRelayPairsMax << " only");
        return out;
      }
      out.emplace(relay_pair(a->first, b->first),
                  security::relay_key(security::pair_key(run_key, a->first, b->first)));
    }
  }
  return out;
}

std::string relay_metrics(const RelayStats& stats) {
  std::string out;
  const auto metric = [&](const char* name, const char* type, const char* help, std::uint64_t value) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " +
           std::to_string(value) + "\n";
  };
  metric("lockstep_relay_bytes_total", "counter", "Bytes the relay forwarded, both directions.", stats.bytes);
  metric("lockstep_relay_pairs_total", "counter", "Relayed connections joined (one per edge and slot).", stats.pairs);
  metric("lockstep_relay_refused_total", "counter",
         "Relay connections refused or dropped before their other end came.", stats.refused);
  metric("lockstep_relay_active", "gauge", "Relayed connections carrying bytes now.", stats.active);
  metric("lockstep_relay_waiting", "gauge", "Relayed edges whose one end waits for the other now.", stats.waiting);
  return out;
}

Relay::Relay(RelayOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}

Relay::~Relay() { stop(); }

Status Relay::start() {
  if (thread_.joinable()) return Status(LOCKSTEP_STATUS_INVALID_USAGE, "relay already started");
  if (Status s = impl_->bind(); !s.is_ok()) return s;
  port_ = impl_->port();
  thread_ = std::thread([impl = impl_] { impl->run(); });
  LOG_INFO(kLog, "relaying on port " << port_);
  return Status::ok();
}

void Relay::stop() {
  if (!thread_.joinable()) return;
  impl_->stop();
  thread_.join();
}

void Relay::assign(RelayPairs pairs) { impl_->assign(std::move(pairs)); }

RelayStats Relay::stats() const { return impl_->stats(); }

}  // namespace lockstep::master
