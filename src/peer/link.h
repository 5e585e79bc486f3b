// The IO shell of a peer: Link is one Asio thread that owns the master connection
// (heartbeats, silence detection, routing replies into a bounded mailbox that the
// owning thread waits on) and the listening sockets (handshakes with a deadline;
// accepted ring, shared-state and benchmark connections are handed over as plain file
// descriptors). With a run secret it also seals the master connection's frames, keeps
// the pair keys the master sent, and makes every incoming p2p connection prove its
// pair key before it is handed over (docs/security.md). Internal to the peer layer.
#pragma once

#include "common/ids.h"
#include "common/limits.h"
#include "common/log.h"
#include "common/status.h"
#include "peer/communicator.h"
#include "protocol/codec.h"
#include "protocol/messages.h"
#include "security/frames.h"
#include "transport/socket.h"

#include <asio.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

namespace lockstep::peer {

inline constexpr const char* kLog = "peer";
// Replies the master may have queued for us before we read them.
inline constexpr std::size_t kMailboxMessagesMax = 256;
// Accepted p2p connections waiting to be claimed by an establishment.
inline constexpr std::size_t kInboundMax = 1024;
// (Incoming connections still in their handshake, and how long they may take: the
// options inbound_handshakes_max and inbound_handshake_timeout_ms.)

using Clock = std::chrono::steady_clock;


struct Inbound {
  PeerId from;
  PeerId to;
  std::uint64_t epoch = 0;
  std::uint32_t pool_index = 0;
  transport::Fd fd;
  // With a secret: the connection's session keys (the connector sends with to_server).
  std::optional<security::SessionKeys> keys;
};

// Messages from the master waiting for the call that expects them: each waiting call
// takes only the message its predicate accepts (the "queued socket" idea). A failure
// ends every wait, now and later, with its status. Bounded: a master that sends more
// unanswered messages than allowed fails it.
class Mailbox {
 public:
  bool push(proto::Message message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (messages_.size() >= kMailboxMessagesMax) {
        messages_.clear();
        if (failure_.is_ok()) {
          failure_ = Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent more unanswered messages than allowed");
        }
        return false;
      }
      messages_.push_back(std::move(message));
    }
    cv_.notify_all();
    return true;
  }
  void fail(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_.is_ok()) failure_ = status;
    }
    cv_.notify_all();
  }
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      for (auto it = messages_.begin(); it != messages_.end(); ++it) {
        if (match(*it)) {
          proto::Message out = std::move(*it);
          messages_.erase(it);
          return out;
        }
      }
      if (!failure_.is_ok()) return failure_;
      cv_.wait(lock);
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<proto::Message> messages_;
  Status failure_;
};

// The master's messages for one in-flight collective, and its abort signal: an
// eventfd that the ring's poll() watches plus a flag checked between sub-chunks.
class OpChannel {
 public:
  OpChannel() : event_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~OpChannel() {
    if (event_fd_ >= 0) ::close(event_fd_);
  }
  OpChannel(const OpChannel&) = delete;
  OpChannel& operator=(const OpChannel&) = delete;

  bool valid() const { return event_fd_ >= 0; }
  int event_fd() const { return event_fd_; }
  const std::atomic<bool>* abort_flag() const { return &aborted_; }
  bool aborted() const { return aborted_.load(); }

  // Raises the abort signal without a message (the end of a p2p establishment).
  void cancel() { signal(); }
  // A failure outcome also stops a ring in progress.
  void push(proto::Message message) {
    const auto* result = std::get_if<proto::CollectiveResult>(&message);
    const bool stop = result != nullptr && result->status != LOCKSTEP_OK;
    if (!messages_.push(std::move(message)) || stop) signal();
  }
  // The link failed: every waiting call ends with this status.
  void abort(const Status& status) {
    messages_.fail(status);
    signal();
  }
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match) { return messages_.wait(match); }

 private:
  void signal() {
    aborted_ = true;
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof one);
  }
  int event_fd_;
  std::atomic<bool> aborted_{false};
  Mailbox messages_;
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

  // Hands the connected, welcomed master socket to the loop (with the keys that seal
  // its frames, when the run has a secret).
  void attach_master(transport::Fd fd, std::uint32_t heartbeat_timeout_ms, std::shared_ptr<security::FrameCrypto> crypto) {
    heartbeat_timeout_ms_ = heartbeat_timeout_ms;
    asio::post(io_, [this, raw = fd.release(), crypto] {
      crypto_ = crypto;
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
    asio::post(io_, [this, frame] { push_write(std::move(*frame)); });
  }

  // Blocks until a message accepted by `match` arrives (it is removed from the
  // mailbox) or the link fails. Messages nobody waits for stay queued (bounded).
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match) { return mailbox_.wait(match); }

  Status fatal() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return fatal_;
  }

  // The newest ring connection from `from` for pool slot `slot` whose generation is
  // above min_generation, waiting until the deadline; older ones from the same
  // sender and slot are closed. Generations grow with every reconnect of the sender.
  // With `abort`, the wait also ends (empty) soon after it is set.
  std::optional<Inbound> take_inbound(PeerId from, std::uint32_t slot, std::uint64_t min_generation,
                                      Clock::time_point deadline, const std::atomic<bool>* abort = nullptr) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      std::optional<Inbound> best;
      for (auto it = inbound_.begin(); it != inbound_.end();) {
        if (it->to != id_) {
          it = inbound_.erase(it);  // meant for someone else
        } else if (it->from == from && it->pool_index == slot) {
          if (it->epoch > min_generation && (!best || it->epoch > best->epoch)) best = std::move(*it);
          it = inbound_.erase(it);
        } else {
          ++it;
        }
      }
      if (best || !fatal_.is_ok() || (abort != nullptr && abort->load())) return best;
      // The abort flag is set by another thread without this mutex: look again soon.
      const auto until = abort != nullptr ? std::min(deadline, Clock::now() + std::chrono::milliseconds(10)) : deadline;
      if (cv_.wait_until(lock, until) == std::cv_status::timeout && Clock::now() >= deadline) return std::nullopt;
    }
  }

  // A shared-state or benchmark connection opened for operation `operation` (its
  // P2PHello's epoch: the sync attempt or the bandwidth test), from `from` if given;
  // those of older operations are closed. Waits until one arrives, `stop` is set (see
  // wake()), the deadline passes or the link fails.
  std::optional<Inbound> take_connection(proto::Channel channel, std::uint64_t operation, std::optional<PeerId> from,
                                         const std::atomic<bool>* stop, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& queue = channel == proto::Channel::kSharedState ? state_inbound_ : bench_inbound_;
    for (;;) {
      for (auto it = queue.begin(); it != queue.end();) {
        if (it->epoch == operation && it->to == id_ && (!from || it->from == *from)) {
          Inbound out = std::move(*it);
          queue.erase(it);
          return out;
        }
        it = it->epoch < operation || it->to != id_ ? queue.erase(it) : std::next(it);
      }
      if ((stop != nullptr && stop->load()) || !fatal_.is_ok()) return std::nullopt;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) return std::nullopt;
    }
  }
  // Wakes every wait of this link so that it re-checks its stop condition.
  void wake() {
    { std::lock_guard<std::mutex> lock(mutex_); }
    cv_.notify_all();
  }

  // Forgets buffered connections from peers that are not members any more.
  void prune_inbound(const std::set<PeerId>& members) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = inbound_.begin(); it != inbound_.end();) {
      it = members.count(it->from) == 0 ? inbound_.erase(it) : std::next(it);
    }
  }

  // ---- collectives: each in-flight collective has a channel that receives the
  // master's messages for its tag; a failure outcome also raises its abort signal.
  void register_op(std::uint64_t tag, const std::shared_ptr<OpChannel>& channel) {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_[tag] = channel;
    if (!fatal_.is_ok()) channel->abort(fatal_);
  }
  void unregister_op(std::uint64_t tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    ops_.erase(tag);
  }

  // The p2p establishment of `epoch` in progress (null: none): when the master ends
  // that epoch with a failure, its signal stops connection setup that would otherwise
  // wait for a dead or stopped neighbour until the p2p connect timeout.
  void set_establishment(std::uint64_t epoch, std::shared_ptr<OpChannel> channel) {
    std::lock_guard<std::mutex> lock(mutex_);
    establishment_epoch_ = epoch;
    establishment_ = std::move(channel);
    if (establishment_ && !fatal_.is_ok()) establishment_->cancel();
  }

  // Pool slots are used by one attempt at a time, in the order of the attempts'
  // CollectiveGo messages, which every peer receives in the same order.
  bool wait_slot_turn(std::uint32_t slot, std::uint64_t attempt, OpChannel& channel) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      auto& queue = slots_[slot];
      if (!queue.empty() && queue.front() == attempt) return true;
      if (channel.aborted() || std::find(queue.begin(), queue.end(), attempt) == queue.end()) return false;
      cv_.wait(lock);
    }
  }
  void release_slot(std::uint32_t slot, std::uint64_t attempt) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& queue = slots_[slot];
      queue.erase(std::remove(queue.begin(), queue.end(), attempt), queue.end());
    }
    cv_.notify_all();
  }

  void stop() {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] {
      set_fatal(Status(LOCKSTEP_STATUS_INTERRUPTED, "the communicator is being destroyed"));
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
      if (fatal_.code() == LOCKSTEP_STATUS_INTERRUPTED) {
        LOG_DEBUG(kLog, "connection to the master closed: " << fatal_.to_string());
      } else {
        LOG_WARN(kLog, "connection to the master ended: " << fatal_.to_string());
      }
      for (auto& [tag, channel] : ops_) channel->abort(fatal_);
      if (establishment_) establishment_->cancel();
      mailbox_.fail(fatal_);
    }
    cv_.notify_all();
    asio::error_code ec;
    master_.close(ec);
    heartbeat_.cancel();
  }

  void deliver(proto::Message message) {
    learn_keys(message);
    if (route_to_op(message)) return;
    if (const auto* t = std::get_if<proto::TopologyResult>(&message); t != nullptr && t->status != LOCKSTEP_OK) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (establishment_ && establishment_epoch_ == t->epoch) establishment_->cancel();
    }
    if (!mailbox_.push(std::move(message))) {
      set_fatal(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent more unanswered messages than allowed"));
    }
  }

  // Messages about a collective go to its channel (or are dropped if it is gone).
  bool route_to_op(proto::Message& message) {
    std::uint64_t tag = 0;
    if (const auto* go = std::get_if<proto::CollectiveGo>(&message)) {
      tag = go->tag;
    } else if (const auto* result = std::get_if<proto::CollectiveResult>(&message)) {
      tag = result->tag;
    } else if (const auto* refused = std::get_if<proto::Refused>(&message);
               refused != nullptr && refused->request == proto::MsgType::kCollectiveInit) {
      tag = refused->tag;
    } else {
      return false;
    }
    std::shared_ptr<OpChannel> channel;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = ops_.find(tag); it != ops_.end()) channel = it->second;
      if (const auto* go = std::get_if<proto::CollectiveGo>(&message); go != nullptr && channel) {
        slots_[go->slot].push_back(go->attempt);
      }
    }
    if (channel) {
      channel->push(std::move(message));
    } else {
      LOG_DEBUG(kLog, "dropping a collective message for tag " << tag << " that nobody waits for");
    }
    cv_.notify_all();
    return true;
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
      if (crypto_ && type != proto::MsgType::kSealed) {
        return set_fatal(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                                std::string("from master: expected a sealed frame, got ") + proto::msg_type_name(type)));
      }
      asio::async_read(master_, asio::buffer(payload_), [this, type](const asio::error_code& ec2, std::size_t) {
        if (ec2) return set_fatal(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, ec2.message()));
        auto message = crypto_ ? crypto_->open(header_, payload_) : proto::decode_payload(type, payload_);
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

  // Every frame to the master goes through here, on the loop's thread, so that sealed
  // frames leave in the order of their nonces.
  void push_write(std::vector<std::uint8_t> frame) {
    if (crypto_) {
      std::vector<std::uint8_t> sealed;
      crypto_->seal_frame(frame, sealed);
      frame = std::move(sealed);
    }
    writes_.push_back(std::move(frame));
    if (writes_.size() == 1) write_next();
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
      push_write(proto::encode_frame(proto::Heartbeat{}));
      heartbeat();
    });
  }

  // One incoming connection until its handshake is over.
  struct Handshake {
    explicit Handshake(asio::ip::tcp::socket s) : socket(std::move(s)), timer(socket.get_executor()) {}
    Handshake(const Handshake&) = delete;
    Handshake& operator=(const Handshake&) = delete;
    asio::ip::tcp::socket socket;
    asio::steady_timer timer;
    std::string address;  // the remote address, without the port
    proto::Channel channel = proto::Channel::kRing;
    std::array<std::uint8_t, proto::kFrameHeaderBytes> header{};
    std::vector<std::uint8_t> payload;
    std::vector<std::uint8_t> reply;
    proto::P2PHello hello;
    std::string remote;  // for logs
    // With a secret:
    std::vector<std::uint8_t> transcript;  // the P2PHello's payload
    security::Key key{};
    security::Nonce client_nonce{};
    security::Nonce server_nonce{};
    bool parked = false;  // waiting for the master to name the sender (its pair key)
  };

  void accept_on(std::size_t index) {
    listeners_[index]->async_accept([this, index](const asio::error_code& ec, asio::ip::tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;
      if (!ec) {
        auto h = std::make_shared<Handshake>(std::move(socket));
        asio::error_code ignored;
        h->address = h->socket.remote_endpoint(ignored).address().to_string();
        make_room_for_handshake();
        unfinished_.push_back(h);
        handshake(h, static_cast<proto::Channel>(index + 1));
      }
      accept_on(index);
    });
  }

  // At the cap of unfinished handshakes, the oldest of the address holding the most is
  // closed, so that connections held open idle cannot keep ring neighbours out until
  // the handshake timeout, and a flooding address displaces its own connections first.
  void make_room_for_handshake() {
    unfinished_.remove_if([](const std::weak_ptr<Handshake>& w) {
      const auto h = w.lock();
      return h == nullptr || !h->socket.is_open();
    });
    if (unfinished_.size() < options_.inbound_handshakes_max || unfinished_.empty()) return;
    std::map<std::string, std::size_t> per_address;
    for (const auto& w : unfinished_) ++per_address[w.lock()->address];
    std::size_t most = 0;
    for (const auto& [address, n] : per_address) most = std::max(most, n);
    // The list is in accept order: the first of the busiest address is its oldest.
    for (auto it = unfinished_.begin(); it != unfinished_.end(); ++it) {
      const auto h = it->lock();
      if (per_address[h->address] != most) continue;
      // Logged once per burst: a flood must not flood the log too.
      if (displaced_handshakes_++ % 100 == 0) {
        LOG_WARN(kLog, options_.inbound_handshakes_max << " unfinished p2p handshakes (the cap), " << most << " from "
                                                       << h->address << "; closing the oldest of them ("
                                                       << displaced_handshakes_ << " so far)");
      }
      unfinished_.erase(it);
      close(h);
      return;
    }
  }

  // Reads one P2PHello within a deadline (and, with a secret, runs the challenge-
  // response); anything else closes the connection.
  void handshake(const std::shared_ptr<Handshake>& h, proto::Channel channel) {
    asio::error_code ignored;
    h->socket.set_option(asio::ip::tcp::no_delay(true), ignored);
    h->channel = channel;
    const auto remote = h->socket.remote_endpoint(ignored);
    h->remote = remote.address().to_string() + ":" + std::to_string(remote.port());
    h->timer.expires_after(std::chrono::milliseconds(options_.inbound_handshake_timeout_ms));
    h->timer.async_wait([this, h](const asio::error_code& ec) {
      if (ec) return;
      if (h->parked) {
        LOG_WARN(kLog, "p2p connection from " << h->remote << " claiming to be " << h->hello.from.to_string()
                                              << " dropped: the master named no such member (no pair key)");
      } else {
        LOG_INFO(kLog, "p2p connection from " << h->remote << " dropped: handshake not finished within "
                                              << options_.inbound_handshake_timeout_ms << " ms");
      }
      unpark(h);
      asio::error_code e;
      h->socket.close(e);
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
        if (verdict == LOCKSTEP_OK && !options_.secret && encryption_differs(h)) verdict = proto::kP2PEncryptionMismatch;
        if (verdict != LOCKSTEP_OK || !options_.secret) return finish(h, verdict);
        if (!security::to_nonce(h->hello.auth, &h->client_nonce)) {
          LOG_WARN(kLog, "p2p connection from " << h->remote << " dropped: its P2PHello carries no nonce (a peer without the run secret)");
          return close(h);
        }
        h->transcript = h->payload;
        challenge(h);
      });
    });
  }

  // With a secret: proves the pair key of the claimed sender and checks its proof. A
  // sender the master has not named yet waits (its EstablishP2P may arrive after the
  // sender's own) until a message names it or the handshake times out.
  void challenge(const std::shared_ptr<Handshake>& h) {
    auto it = pair_keys_.find(h->hello.from);
    if (it == pair_keys_.end()) {
      if (!h->parked) {
        h->parked = true;
        parked_.push_back(h);
      }
      return;
    }
    h->key = it->second;
    h->server_nonce = security::random_nonce();
    const auto proof = security::proof(h->key, security::kAcceptorRole, h->client_nonce, h->server_nonce, h->transcript);
    h->reply = proto::encode_frame(proto::AuthChallenge{security::to_bytes(h->server_nonce), security::to_bytes(proof)});
    asio::async_write(h->socket, asio::buffer(h->reply), [this, h](const asio::error_code& ec, std::size_t) {
      if (ec) return close(h);
      asio::async_read(h->socket, asio::buffer(h->header), [this, h](const asio::error_code& ec2, std::size_t) {
        if (ec2) return close(h);
        auto header = proto::decode_header(h->header);
        if (!header.is_ok() || header.value().type != proto::MsgType::kAuthProof) {
          LOG_WARN(kLog, "p2p connection from " << h->remote << " dropped: no AuthProof after the challenge");
          return close(h);
        }
        h->payload.resize(header.value().payload_bytes);
        asio::async_read(h->socket, asio::buffer(h->payload), [this, h](const asio::error_code& ec3, std::size_t) {
          if (ec3) return close(h);
          auto message = proto::decode_payload(proto::MsgType::kAuthProof, h->payload);
          if (!message.is_ok() ||
              !security::verify(h->key, security::kConnectorRole, h->client_nonce, h->server_nonce, h->transcript,
                                std::get<proto::AuthProof>(message.value()).proof)) {
            LOG_WARN(kLog, "p2p connection from " << h->remote << " claiming to be " << h->hello.from.to_string()
                                                  << " dropped: wrong proof of the pair key");
            return close(h);
          }
          // Checked once the sender is known to be a member: a stranger learns nothing.
          finish(h, encryption_differs(h) ? proto::kP2PEncryptionMismatch : LOCKSTEP_OK);
        });
      });
    });
  }

  // Whether the sender's encrypt_data differs from ours (then both sides refuse; logged).
  bool encryption_differs(const std::shared_ptr<Handshake>& h) const {
    const bool theirs = (h->hello.flags & proto::kP2PFlagEncryptData) != 0;
    if (theirs == options_.encrypt_data) return false;
    LOG_WARN(kLog, "p2p connection from " << h->remote << " refused: peer " << h->hello.from.to_string()
                                          << (theirs ? " encrypts the data plane and this peer does not"
                                                     : " does not encrypt the data plane and this peer does")
                                          << " (encrypt_data must be the same on every peer of the run)");
    return true;
  }

  // Answers with the verdict; an accepted connection is handed over.
  void finish(const std::shared_ptr<Handshake>& h, StatusCode verdict) {
    h->reply = proto::encode_frame(proto::P2PHelloAck{verdict});
    asio::async_write(h->socket, asio::buffer(h->reply), [this, h, verdict](const asio::error_code& ec3, std::size_t) {
      h->timer.cancel();
      if (ec3 || verdict != LOCKSTEP_OK) return close(h);
      asio::error_code e;
      h->socket.non_blocking(false, e);
      Inbound in{h->hello.from, h->hello.to, h->hello.epoch, h->hello.pool_index, transport::Fd(h->socket.release()), {}};
      if (options_.secret) in.keys = security::session_keys(h->key, h->client_nonce, h->server_nonce, h->transcript);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto& queue = h->hello.channel == proto::Channel::kRing          ? inbound_
                      : h->hello.channel == proto::Channel::kSharedState ? state_inbound_
                                                                         : bench_inbound_;
        if (queue.size() >= kInboundMax) queue.pop_front();
        queue.push_back(std::move(in));
      }
      cv_.notify_all();
    });
  }

  // With a secret: the pair keys in the master's messages (loop thread). A successful
  // TopologyResult names the whole membership view: keys of peers outside it are
  // forgotten, so that a removed peer cannot connect any more.
  void learn_keys(const proto::Message& message) {
    if (!options_.secret) return;
    const auto add = [this](const proto::MemberInfo& m) {
      security::Key key{};
      if (security::to_key(m.key, &key)) pair_keys_[m.id] = key;
    };
    if (const auto* m = std::get_if<proto::EstablishP2P>(&message)) {
      for (const auto& member : m->ring) add(member);
    } else if (const auto* t = std::get_if<proto::TopologyResult>(&message); t != nullptr && t->status == LOCKSTEP_OK) {
      pair_keys_.clear();
      for (const auto& member : t->ring) add(member);
    } else if (const auto* p = std::get_if<proto::SyncPlan>(&message)) {
      for (const auto& member : p->sources) add(member);
    } else if (const auto* b = std::get_if<proto::BandwidthTest>(&message)) {
      add(b->partner);
    } else {
      return;
    }
    // Parked handshakes whose sender is now known go on.
    auto waiting = std::move(parked_);
    parked_.clear();
    for (auto& h : waiting) {
      if (!h->socket.is_open()) continue;
      if (pair_keys_.count(h->hello.from) != 0) {
        h->parked = false;
        challenge(h);
      } else {
        parked_.push_back(h);
      }
    }
  }

  void unpark(const std::shared_ptr<Handshake>& h) {
    if (!h->parked) return;
    h->parked = false;
    parked_.erase(std::remove(parked_.begin(), parked_.end(), h), parked_.end());
  }

  void close(const std::shared_ptr<Handshake>& h) {
    asio::error_code e;
    unpark(h);
    h->timer.cancel();
    h->socket.close(e);
  }

  Options options_;
  asio::io_context io_;
  asio::ip::tcp::socket master_;
  asio::steady_timer heartbeat_;
  std::array<std::unique_ptr<asio::ip::tcp::acceptor>, 3> listeners_;
  std::array<std::uint16_t, 3> ports_{};
  std::list<std::weak_ptr<Handshake>> unfinished_;  // io thread only, in accept order
  std::uint64_t displaced_handshakes_ = 0;           // io thread only
  // With a secret (io thread only): the master connection's frame keys, the pair key of
  // every member the master named, and handshakes waiting for their sender's key.
  std::shared_ptr<security::FrameCrypto> crypto_;
  std::map<PeerId, security::Key> pair_keys_;
  std::vector<std::shared_ptr<Handshake>> parked_;
  std::thread thread_;
  std::uint32_t heartbeat_timeout_ms_ = limits::kHeartbeatTimeoutMsDefault;
  Clock::time_point last_rx_;
  bool suspect_silence_ = false;
  std::array<std::uint8_t, proto::kFrameHeaderBytes> header_{};
  std::vector<std::uint8_t> payload_;
  std::deque<std::vector<std::uint8_t>> writes_;

  Mailbox mailbox_;  // replies to the owning thread's calls (locks itself)

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  Status fatal_;
  PeerId id_;
  std::deque<Inbound> inbound_;        // ring connections
  std::deque<Inbound> state_inbound_;  // shared-state connections (epoch: sync attempt)
  std::deque<Inbound> bench_inbound_;  // benchmark connections (epoch: bandwidth test)
  std::map<std::uint64_t, std::shared_ptr<OpChannel>> ops_;
  std::shared_ptr<OpChannel> establishment_;
  std::uint64_t establishment_epoch_ = 0;
  std::map<std::uint32_t, std::deque<std::uint64_t>> slots_;
};

}  // namespace lockstep::peer
