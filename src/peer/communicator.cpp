// Communicator implementation. Link is the IO shell of a peer: one Asio thread that
// owns the master connection (heartbeats, silence detection, routing replies into a
// bounded mailbox that the owning thread waits on) and the listening sockets (p2p
// handshakes with a deadline; accepted ring connections are handed over as plain
// file descriptors). The first fatal error sticks: every later call fails fast.
#include "peer/communicator.h"

#include "common/log.h"
#include "protocol/codec.h"
#include "transport/framed.h"

#include <asio.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>

namespace lockstep::peer {
namespace {

constexpr const char* kLog = "peer";
// Replies the master may have queued for us before we read them.
constexpr std::size_t kMailboxMessagesMax = 256;
// Accepted p2p connections waiting to be claimed by an establishment.
constexpr std::size_t kInboundMax = 1024;
constexpr std::uint32_t kInboundHandshakeTimeoutMs = 5'000;
// Incoming connections still in their handshake; more are closed at once.
constexpr std::size_t kInboundHandshakesMax = 256;

using Clock = std::chrono::steady_clock;

}  // namespace

struct Inbound {
  PeerId from;
  PeerId to;
  std::uint64_t epoch = 0;
  std::uint32_t pool_index = 0;
  transport::Fd fd;
};

class Link {
 public:
  explicit Link(const Options& options) : options_(options), master_(io_), heartbeat_(io_) {}

  ~Link() { stop(); }

  Status open_listeners() {
    int base = options_.base_port;
    for (std::size_t i = 0; i < listeners_.size(); ++i) {
      auto listener = transport::listen_tcp(options_.bind_host, base);
      if (!listener.is_ok()) return listener.status();
      ports_[i] = listener.value().port;
      if (base != 0) base = ports_[i] + 1;  // bump allocation for the next socket
      listeners_[i] = std::make_unique<asio::ip::tcp::acceptor>(io_);
      asio::error_code ec;
      listeners_[i]->assign(asio::ip::tcp::v4(), listener.value().fd.release(), ec);
      if (ec) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "acceptor: " + ec.message());
    }
    for (std::size_t i = 0; i < listeners_.size(); ++i) accept_on(i);
    thread_ = std::thread([this] { io_.run(); });
    return Status::ok();
  }

  std::uint16_t port(proto::Channel channel) const { return ports_[static_cast<std::size_t>(channel) - 1]; }

  void set_identity(PeerId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    id_ = id;
  }

  // Hands the connected, welcomed master socket to the loop.
  void attach_master(transport::Fd fd, std::uint32_t heartbeat_timeout_ms) {
    heartbeat_timeout_ms_ = heartbeat_timeout_ms;
    asio::post(io_, [this, raw = fd.release()] {
      asio::error_code ec;
      master_.assign(asio::ip::tcp::v4(), raw, ec);
      if (ec) return set_fatal(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "assign master socket: " + ec.message()));
      last_rx_ = Clock::now();
      read_master();
      heartbeat();
    });
  }

  void send(const proto::Message& message) {
    auto frame = std::make_shared<std::vector<std::uint8_t>>(proto::encode_frame(message));
    asio::post(io_, [this, frame] {
      writes_.push_back(std::move(*frame));
      if (writes_.size() == 1) write_next();
    });
  }

  // Blocks until a message accepted by `match` arrives (it is removed from the
  // mailbox) or the link fails. Messages nobody waits for stay queued (bounded).
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      for (auto it = mailbox_.begin(); it != mailbox_.end(); ++it) {
        if (match(*it)) {
          proto::Message out = std::move(*it);
          mailbox_.erase(it);
          return out;
        }
      }
      if (!fatal_.is_ok()) return fatal_;
      cv_.wait(lock);
    }
  }

  Status fatal() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return fatal_;
  }

  // Takes pool_size ring connections from `from` for `epoch`, waiting until the deadline.
  std::vector<transport::Fd> take_inbound(PeerId from, std::uint64_t epoch, std::uint32_t pool_size,
                                          Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::vector<transport::Fd> out(pool_size);
    std::uint32_t have = 0;
    for (;;) {
      for (auto it = inbound_.begin(); it != inbound_.end();) {
        if (it->epoch < epoch) {
          it = inbound_.erase(it);  // stale: a previous establishment
        } else if (it->to != id_) {
          it = inbound_.erase(it);  // meant for someone else
        } else if (it->epoch == epoch && it->from == from && it->pool_index < pool_size &&
                   !out[it->pool_index].valid()) {
          out[it->pool_index] = std::move(it->fd);
          ++have;
          it = inbound_.erase(it);
        } else {
          ++it;
        }
      }
      if (have == pool_size || !fatal_.is_ok()) break;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) break;
    }
    if (have != pool_size) out.clear();
    return out;
  }

  void stop() {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] {
      asio::error_code ec;
      master_.close(ec);
      heartbeat_.cancel();
      for (auto& l : listeners_) {
        if (l) l->close(ec);
      }
      io_.stop();
    });
    thread_.join();
  }

 private:
  void set_fatal(Status status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!fatal_.is_ok()) return;
      fatal_ = std::move(status);
      LOG_WARN(kLog, "connection to the master ended: " << fatal_.to_string());
    }
    cv_.notify_all();
    asio::error_code ec;
    master_.close(ec);
    heartbeat_.cancel();
  }

  void deliver(proto::Message message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (mailbox_.size() >= kMailboxMessagesMax) {
        mailbox_.clear();
        fatal_ = Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent more unanswered messages than allowed");
      } else {
        mailbox_.push_back(std::move(message));
      }
    }
    cv_.notify_all();
  }

  void read_master() {
    asio::async_read(master_, asio::buffer(header_), [this](const asio::error_code& ec, std::size_t) {
      if (ec) {
        return set_fatal(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                                ec == asio::error::eof ? "the master closed the connection" : ec.message()));
      }
      auto header = proto::decode_header(header_);
      if (!header.is_ok()) return set_fatal(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "from master: " + header.status().message()));
      payload_.resize(header.value().payload_bytes);
      const auto type = header.value().type;
      asio::async_read(master_, asio::buffer(payload_), [this, type](const asio::error_code& ec2, std::size_t) {
        if (ec2) return set_fatal(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, ec2.message()));
        auto message = proto::decode_payload(type, payload_);
        if (!message.is_ok()) return set_fatal(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "from master: " + message.status().message()));
        last_rx_ = Clock::now();
        if (const auto* bye = std::get_if<proto::Goodbye>(&message.value())) {
          return set_fatal(Status(bye->status, "master: " + bye->reason));
        }
        if (!std::holds_alternative<proto::HeartbeatAck>(message.value())) deliver(std::move(message.value()));
        read_master();
      });
    });
  }

  void write_next() {
    asio::async_write(master_, asio::buffer(writes_.front()), [this](const asio::error_code& ec, std::size_t) {
      if (ec) {
        writes_.clear();
        return set_fatal(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "write to master: " + ec.message()));
      }
      writes_.pop_front();
      if (!writes_.empty()) write_next();
    });
  }

  void heartbeat(std::chrono::milliseconds delay = std::chrono::milliseconds(0)) {
    const auto interval = std::chrono::milliseconds(std::max<std::uint32_t>(heartbeat_timeout_ms_ / 4, 10));
    heartbeat_.expires_after(delay.count() > 0 ? delay : interval);
    heartbeat_.async_wait([this](const asio::error_code& ec) {
      if (ec || !fatal().is_ok()) return;
      const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_rx_).count();
      if (silent > static_cast<long long>(heartbeat_timeout_ms_)) {
        // Look once more shortly: after this process was stopped, the timer and the
        // bytes that arrived meanwhile (perhaps the master's reason for closing)
        // become ready together, and the bytes must win.
        if (!suspect_silence_) {
          suspect_silence_ = true;
          return heartbeat(std::chrono::milliseconds(20));
        }
        return set_fatal(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                                "no message from the master for " + std::to_string(silent) + " ms"));
      }
      suspect_silence_ = false;
      auto frame = proto::encode_frame(proto::Heartbeat{});
      writes_.push_back(std::move(frame));
      if (writes_.size() == 1) write_next();
      heartbeat();
    });
  }

  // One incoming connection until its P2PHello is answered; counted while alive.
  struct Handshake {
    Handshake(asio::ip::tcp::socket s, std::size_t* counter)
        : socket(std::move(s)), timer(socket.get_executor()), live(counter) {
      ++*live;
    }
    ~Handshake() { --*live; }
    Handshake(const Handshake&) = delete;
    Handshake& operator=(const Handshake&) = delete;
    asio::ip::tcp::socket socket;
    asio::steady_timer timer;
    std::size_t* live;
    std::array<std::uint8_t, proto::kFrameHeaderBytes> header{};
    std::vector<std::uint8_t> payload;
    std::vector<std::uint8_t> reply;
    proto::P2PHello hello;
  };

  void accept_on(std::size_t index) {
    listeners_[index]->async_accept([this, index](const asio::error_code& ec, asio::ip::tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (!ec && handshakes_ >= kInboundHandshakesMax) {
        LOG_WARN(kLog, "too many unfinished p2p handshakes; closing a new connection");
        asio::error_code ignored;
        socket.close(ignored);
      } else if (!ec) {
        handshake(std::make_shared<Handshake>(std::move(socket), &handshakes_), static_cast<proto::Channel>(index + 1));
      }
      accept_on(index);
    });
  }

  // Reads one P2PHello within a deadline; anything else closes the connection.
  void handshake(const std::shared_ptr<Handshake>& h, proto::Channel channel) {
    asio::error_code ignored;
    h->socket.set_option(asio::ip::tcp::no_delay(true), ignored);
    h->timer.expires_after(std::chrono::milliseconds(kInboundHandshakeTimeoutMs));
    h->timer.async_wait([h](const asio::error_code& ec) {
      asio::error_code e;
      if (!ec) h->socket.close(e);
    });
    asio::async_read(h->socket, asio::buffer(h->header), [this, h, channel](const asio::error_code& ec, std::size_t) {
      if (ec) return;
      auto header = proto::decode_header(h->header);
      if (!header.is_ok() || header.value().type != proto::MsgType::kP2PHello) {
        LOG_DEBUG(kLog, "p2p socket: dropping a connection that did not start with P2PHello");
        return close(h);
      }
      h->payload.resize(header.value().payload_bytes);
      asio::async_read(h->socket, asio::buffer(h->payload), [this, h, channel](const asio::error_code& ec2, std::size_t) {
        if (ec2) return;
        auto message = proto::decode_payload(proto::MsgType::kP2PHello, h->payload);
        if (!message.is_ok()) return close(h);
        h->hello = std::get<proto::P2PHello>(message.value());
        StatusCode verdict = LOCKSTEP_OK;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          // Before the Welcome is processed our identity is still unknown; such a
          // connection is kept and its target checked when it is claimed.
          if (h->hello.channel != channel || (!id_.is_nil() && h->hello.to != id_)) verdict = LOCKSTEP_STATUS_REJECTED;
        }
        if (verdict == LOCKSTEP_OK && channel != proto::Channel::kRing) verdict = LOCKSTEP_STATUS_INVALID_USAGE;
        h->reply = proto::encode_frame(proto::P2PHelloAck{verdict});
        asio::async_write(h->socket, asio::buffer(h->reply), [this, h, verdict](const asio::error_code& ec3, std::size_t) {
          h->timer.cancel();
          if (ec3 || verdict != LOCKSTEP_OK) return close(h);
          asio::error_code e;
          h->socket.non_blocking(false, e);
          Inbound in{h->hello.from, h->hello.to, h->hello.epoch, h->hello.pool_index, transport::Fd(h->socket.release())};
          {
            std::lock_guard<std::mutex> lock(mutex_);
            if (inbound_.size() >= kInboundMax) inbound_.pop_front();
            inbound_.push_back(std::move(in));
          }
          cv_.notify_all();
        });
      });
    });
  }

  static void close(const std::shared_ptr<Handshake>& h) {
    asio::error_code e;
    h->timer.cancel();
    h->socket.close(e);
  }

  Options options_;
  asio::io_context io_;
  asio::ip::tcp::socket master_;
  asio::steady_timer heartbeat_;
  std::array<std::unique_ptr<asio::ip::tcp::acceptor>, 3> listeners_;
  std::array<std::uint16_t, 3> ports_{};
  std::size_t handshakes_ = 0;  // io thread only
  std::thread thread_;
  std::uint32_t heartbeat_timeout_ms_ = limits::kHeartbeatTimeoutMsDefault;
  Clock::time_point last_rx_;
  bool suspect_silence_ = false;
  std::array<std::uint8_t, proto::kFrameHeaderBytes> header_{};
  std::vector<std::uint8_t> payload_;
  std::deque<std::vector<std::uint8_t>> writes_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  Status fatal_;
  PeerId id_;
  std::deque<proto::Message> mailbox_;
  std::deque<Inbound> inbound_;
};

// ------------------------------------------------------------------ Communicator

Communicator::Communicator(const Options& options) : options_(options), owner_(std::this_thread::get_id()) {}

Communicator::~Communicator() {
  if (link_) link_->stop();
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
  std::unique_ptr<Communicator> comm(new Communicator(options));
  comm->link_ = std::make_unique<Link>(options);
  Status s = comm->link_->open_listeners();
  if (!s.is_ok()) return s;
  return comm;
}

Status Communicator::remember(Status status) {
  if (!status.is_ok()) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    last_error_ = status.to_string();
  }
  return status;
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
  auto fd = transport::connect_tcp(options_.master_host, options_.master_port, options_.connect_timeout_ms);
  if (!fd.is_ok()) {
    return remember(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "master at " + options_.master_host + ":" +
                                                                         std::to_string(options_.master_port) +
                                                                         " unreachable: " + fd.status().message()));
  }
  proto::Hello hello;
  hello.group = options_.peer_group;
  hello.p2p_port = link_->port(proto::Channel::kRing);
  hello.shared_state_port = link_->port(proto::Channel::kSharedState);
  hello.benchmark_port = link_->port(proto::Channel::kBenchmark);
  hello.advertised_host = options_.advertised_host;
  Status sent = transport::send_message(fd.value().get(), hello, options_.connect_timeout_ms);
  if (!sent.is_ok()) return remember(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "sending Hello: " + sent.message()));
  auto reply = transport::recv_message(fd.value().get(), options_.connect_timeout_ms);
  if (!reply.is_ok()) {
    return remember(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "no Welcome from the master: " + reply.status().message()));
  }
  if (const auto* bye = std::get_if<proto::Goodbye>(&reply.value())) {
    return remember(Status(bye->status, "master: " + bye->reason));
  }
  const auto* welcome = std::get_if<proto::Welcome>(&reply.value());
  if (welcome == nullptr) return remember(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "master answered Hello with something else"));
  id_ = welcome->id;
  link_->set_identity(id_);
  link_->attach_master(std::move(fd.value()), welcome->heartbeat_timeout_ms);
  connected_ = true;
  LOG_DEBUG(kLog, "registered as " << id_.to_string() << ", waiting to be accepted");
  // A newcomer waits for the accepted peers' vote; failed attempts are retried by
  // the master with the next vote, unless it rejects us (a fatal Goodbye).
  for (;;) {
    auto result = run_establishment(/*newcomer=*/true);
    if (!result.is_ok()) return remember(result.status());
    if (result.value().status == LOCKSTEP_OK) break;
    LOG_INFO(kLog, "admission attempt failed, waiting for the next one: " << result.value().reason);
  }
  accepted_ = true;
  return Status::ok();
}

Status Communicator::update_topology() {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  link_->send(proto::VoteUpdateTopology{});
  auto result = run_establishment(/*newcomer=*/false);
  if (!result.is_ok()) return remember(result.status());
  if (result.value().status != LOCKSTEP_OK) return remember(Status(result.value().status, result.value().reason));
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
  const auto& establish = std::get<proto::EstablishP2P>(plan.value());
  const std::uint64_t epoch = establish.epoch;
  const std::vector<PeerId> unreachable = this->establish(establish);
  link_->send(proto::P2PReport{epoch, unreachable});
  auto outcome = link_->wait([&](const proto::Message& m) {
    if (const auto* t = std::get_if<proto::TopologyResult>(&m)) return t->epoch == epoch;
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kP2PReport;
    return false;
  });
  if (!outcome.is_ok()) return outcome.status();
  if (const auto* r = std::get_if<proto::Refused>(&outcome.value())) return Status(r->status, "master: " + r->reason);
  auto result = std::get<proto::TopologyResult>(std::move(outcome.value()));
  if (result.status == LOCKSTEP_OK) {
    epoch_ = epoch;
    view_ = result.ring;
    attributes_ = result.attributes;
    for (std::uint32_t i = 0; i < view_.size(); ++i) {
      if (view_[i].id == id_) rank_ = i;
    }
  } else {
    tx_.clear();
    rx_.clear();
  }
  return result;
}

// Opens pool_size connections to the next peer of the ring and waits for pool_size
// from the previous one. Returns the peers that could not be reached.
std::vector<PeerId> Communicator::establish(const proto::EstablishP2P& plan) {
  tx_.clear();
  rx_.clear();
  const auto& ring = plan.ring;
  const auto self = std::find_if(ring.begin(), ring.end(), [&](const auto& m) { return m.id == id_; });
  if (self == ring.end() || ring.size() < 2) return {};
  const std::size_t n = ring.size();
  const std::size_t i = static_cast<std::size_t>(self - ring.begin());
  const proto::MemberInfo& next = ring[(i + 1) % n];
  const proto::MemberInfo& prev = ring[(i + n - 1) % n];
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
  std::vector<PeerId> unreachable;
  for (std::uint32_t k = 0; k < options_.p2p_pool_size; ++k) {
    auto fd = transport::connect_tcp(next.host, next.p2p_port, options_.p2p_connect_timeout_ms);
    Status s = fd.is_ok() ? Status::ok() : fd.status();
    if (s.is_ok()) {
      proto::P2PHello hello;
      hello.channel = proto::Channel::kRing;
      hello.from = id_;
      hello.to = next.id;
      hello.epoch = plan.epoch;
      hello.pool_index = k;
      s = transport::send_message(fd.value().get(), hello, options_.p2p_connect_timeout_ms);
    }
    if (s.is_ok()) {
      auto ack = transport::recv_message(fd.value().get(), options_.p2p_connect_timeout_ms);
      if (!ack.is_ok()) {
        s = ack.status();
      } else if (const auto* a = std::get_if<proto::P2PHelloAck>(&ack.value()); a == nullptr || a->status != LOCKSTEP_OK) {
        s = Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "peer refused the p2p handshake");
      }
    }
    if (!s.is_ok()) {
      LOG_WARN(kLog, "cannot connect to ring neighbour " << next.id.to_string() << " at " << next.host << ":"
                                                          << next.p2p_port << ": " << s.message());
      unreachable.push_back(next.id);
      break;
    }
    tx_.push_back(std::move(fd.value()));
  }
  rx_ = link_->take_inbound(prev.id, plan.epoch, options_.p2p_pool_size, deadline);
  if (rx_.empty()) {
    LOG_WARN(kLog, "ring neighbour " << prev.id.to_string() << " did not connect within "
                                     << options_.p2p_connect_timeout_ms << " ms");
    if (prev.id != next.id || unreachable.empty()) unreachable.push_back(prev.id);
  }
  return unreachable;
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

Result<bool> Communicator::agree(bool flag) {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  link_->send(proto::VoteAgree{flag});
  auto reply = link_->wait([](const proto::Message& m) {
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kVoteAgree;
    return std::holds_alternative<proto::AgreeResult>(m);
  });
  if (!reply.is_ok()) return remember(reply.status());
  if (const auto* r = std::get_if<proto::Refused>(&reply.value())) return remember(Status(r->status, "master: " + r->reason));
  const auto& result = std::get<proto::AgreeResult>(reply.value());
  if (result.status != LOCKSTEP_OK) return remember(Status(result.status, result.reason));
  return result.value;
}

Result<proto::Attributes> Communicator::attributes() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  return attributes_;
}

Result<std::vector<proto::MemberInfo>> Communicator::membership() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  return view_;
}

Result<std::uint32_t> Communicator::rank() const {
  if (!accepted_) return Status(LOCKSTEP_STATUS_NOT_INITIALIZED, "not accepted yet");
  return rank_;
}

}  // namespace lockstep::peer
