// The peer's listening sockets and inbound handshakes (inbound.h).
#include "peer/inbound.h"

#include "common/limits.h"
#include "common/log.h"
#include "protocol/codec.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

namespace lockstep::peer {

// One incoming connection until its handshake is over.
struct InboundListener::Handshake {
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
  bool relayed = false;  // came through the master's relay: sealed whatever encrypt_data says
};

Status InboundListener::open() {
  int base = options_.base_port;
  for (std::size_t i = 0; i < listeners_.size(); ++i) {
    auto listener = transport::listen_tcp(options_.bind_host, base);
    if (!listener.is_ok()) return listener.status();
    ports_[i] = listener.value().port;
    if (base != 0) base = ports_[i] + 1;  // bump allocation for the next socket
    listeners_[i] = std::make_unique<asio::ip::tcp::acceptor>(io_);
    asio::error_code ec;
    const int fd = listener.value().fd.release();
    listeners_[i]->assign(transport::socket_family(fd) == AF_INET6 ? asio::ip::tcp::v6() : asio::ip::tcp::v4(), fd, ec);
    if (ec) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "acceptor: " + ec.message());
  }
  for (std::size_t i = 0; i < listeners_.size(); ++i) accept_on(i);
  return Status::ok();
}

void InboundListener::close_listeners() {
  asio::error_code ec;
  for (auto& l : listeners_) {
    if (l) l->close(ec);
  }
}

void InboundListener::set_identity(PeerId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  id_ = id;
}

void InboundListener::end() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended_ = true;
  }
  cv_.notify_all();
}

std::optional<Inbound> InboundListener::take_inbound(PeerId from, std::uint32_t slot, std::uint64_t min_generation,
                                                     Clock::time_point deadline, const std::atomic<bool>* abort,
                                                     bool reversed) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    std::optional<Inbound> best;
    for (auto it = inbound_.begin(); it != inbound_.end();) {
      if (it->to != id_) {
        it = inbound_.erase(it);  // meant for someone else
      } else if (it->from == from && it->pool_index == slot && it->reversed == reversed) {
        if (it->epoch > min_generation && (!best || it->epoch > best->epoch)) best = std::move(*it);
        it = inbound_.erase(it);
      } else {
        ++it;
      }
    }
    if (best || ended_ || (abort != nullptr && abort->load())) return best;
    // The abort flag is set by another thread without this mutex: look again soon.
    const auto until = abort != nullptr ? std::min(deadline, Clock::now() + std::chrono::milliseconds(10)) : deadline;
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && Clock::now() >= deadline) return std::nullopt;
  }
}

std::optional<Inbound> InboundListener::take_connection(proto::Channel channel, std::uint64_t operation,
                                                        std::optional<PeerId> from, const std::atomic<bool>* stop,
                                                        Clock::time_point deadline, bool reversed) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto& queue = channel == proto::Channel::kSharedState ? state_inbound_ : bench_inbound_;
  for (;;) {
    for (auto it = queue.begin(); it != queue.end();) {
      if (it->epoch == operation && it->to == id_ && (!from || it->from == *from) && it->reversed == reversed) {
        Inbound out = std::move(*it);
        queue.erase(it);
        return out;
      }
      it = it->epoch < operation || it->to != id_ ? queue.erase(it) : std::next(it);
    }
    if ((stop != nullptr && stop->load()) || ended_) return std::nullopt;
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) return std::nullopt;
  }
}

void InboundListener::wake() {
  { std::lock_guard<std::mutex> lock(mutex_); }
  cv_.notify_all();
}

void InboundListener::prune(const std::set<PeerId>& members) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = inbound_.begin(); it != inbound_.end();) {
    it = members.count(it->from) == 0 ? inbound_.erase(it) : std::next(it);
  }
}

void InboundListener::accept_on(std::size_t index) {
  listeners_[index]->async_accept([this, index](const asio::error_code& ec, asio::ip::tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (!ec) {
      auto h = std::make_shared<Handshake>(std::move(socket));
      asio::error_code ignored;
      h->address = transport::unmapped(h->socket.remote_endpoint(ignored).address().to_string());
      make_room_for_handshake();
      unfinished_.push_back(h);
      handshake(h, static_cast<proto::Channel>(index + 1));
    }
    accept_on(index);
  });
}

void InboundListener::adopt_relayed(transport::Fd fd, proto::Channel channel) {
  asio::post(io_, [this, raw = fd.release(), channel] {
    transport::Fd owned(raw);
    asio::ip::tcp::socket socket(io_);
    asio::error_code ec;
    socket.assign(transport::socket_family(raw) == AF_INET6 ? asio::ip::tcp::v6() : asio::ip::tcp::v4(), raw, ec);
    if (ec) return;
    (void)owned.release();  // the socket owns it now
    auto h = std::make_shared<Handshake>(std::move(socket));
    h->address = "relay";
    h->relayed = true;
    make_room_for_handshake();
    unfinished_.push_back(h);
    handshake(h, channel);
  });
}

// At the cap of unfinished handshakes, the oldest of the address holding the most is
// closed, so that connections held open idle cannot keep ring neighbours out until
// the handshake timeout, and a flooding address displaces its own connections first.
void InboundListener::make_room_for_handshake() {
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
void InboundListener::handshake(const std::shared_ptr<Handshake>& h, proto::Channel channel) {
  asio::error_code ignored;
  h->socket.set_option(asio::ip::tcp::no_delay(true), ignored);
  h->channel = channel;
  const auto remote = h->socket.remote_endpoint(ignored);
  h->remote = transport::join_host_port(transport::unmapped(remote.address().to_string()), remote.port());
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
    // Closed before a whole header (the master's reachability probe does this): gone at
    // once, without waiting for the handshake's deadline.
    if (ec) return close(h);
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
        // Ring and shared-state connections run reversed, benchmark ones never.
        if ((h->hello.flags & proto::kP2PFlagReversed) != 0 && channel == proto::Channel::kBenchmark) {
          verdict = LOCKSTEP_STATUS_REJECTED;
        }
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
void InboundListener::challenge(const std::shared_ptr<Handshake>& h) {
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
bool InboundListener::encryption_differs(const std::shared_ptr<Handshake>& h) const {
  const bool theirs = (h->hello.flags & proto::kP2PFlagEncryptData) != 0;
  if (theirs == (options_.encrypt_data || h->relayed)) return false;
  LOG_WARN(kLog, "p2p connection from " << h->remote << " refused: peer " << h->hello.from.to_string()
                                        << (theirs ? " encrypts the data plane and this peer does not"
                                                   : " does not encrypt the data plane and this peer does")
                                        << " (encrypt_data must be the same on every peer of the run)");
  return true;
}

// Answers with the verdict; an accepted connection is handed over.
void InboundListener::finish(const std::shared_ptr<Handshake>& h, StatusCode verdict) {
  h->reply = proto::encode_frame(proto::P2PHelloAck{verdict});
  asio::async_write(h->socket, asio::buffer(h->reply), [this, h, verdict](const asio::error_code& ec3, std::size_t) {
    h->timer.cancel();
    if (ec3 || verdict != LOCKSTEP_OK) return close(h);
    asio::error_code e;
    h->socket.non_blocking(false, e);
    Inbound in{h->hello.from, h->hello.to, h->hello.epoch, h->hello.pool_index, transport::Fd(h->socket.release()), {},
               (h->hello.flags & proto::kP2PFlagReversed) != 0};
    // Shared-state transfers send their bytes on the connections this peer accepted.
    if (!options_.tcp_congestion.empty()) (void)transport::set_congestion_control(in.fd.get(), options_.tcp_congestion);
    if (options_.secret) in.keys = security::session_keys(h->key, h->client_nonce, h->server_nonce, h->transcript);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& queue = h->hello.channel == proto::Channel::kRing          ? inbound_
                    : h->hello.channel == proto::Channel::kSharedState ? state_inbound_
                                                                       : bench_inbound_;
      if (queue.size() >= limits::kInboundMax) queue.pop_front();
      queue.push_back(std::move(in));
    }
    cv_.notify_all();
  });
}

void InboundListener::unpark(const std::shared_ptr<Handshake>& h) {
  if (!h->parked) return;
  h->parked = false;
  parked_.erase(std::remove(parked_.begin(), parked_.end(), h), parked_.end());
}

void InboundListener::close(const std::shared_ptr<Handshake>& h) {
  asio::error_code e;
  unpark(h);
  h->timer.cancel();
  h->socket.close(e);
}

// The pair keys peer::Session found in a master's message (a successful
// TopologyResult names the whole membership view: keys of peers outside it are
// forgotten, so that a removed peer cannot connect any more).
void InboundListener::learn_pair_keys(const cmd::LearnPairKeys& learn) {
  if (learn.forget_others) pair_keys_.clear();
  for (const auto& [id, bytes] : learn.keys) {
    security::Key key{};
    if (security::to_key(bytes, &key)) pair_keys_[id] = key;
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

}  // namespace lockstep::peer
