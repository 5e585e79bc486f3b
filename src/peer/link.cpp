// The peer's IO shell (link.h): Asio reads and writes for the master connection, the
// heartbeat timer, and peer::Session fed under the mutex.
#include "peer/link.h"

#include "common/log.h"

#include <unistd.h>

#include <algorithm>

#include <string>
#include <utility>

namespace lockstep::peer {

Link::Link(const Options& options)
    : options_(options),
      master_(io_),
      heartbeat_(io_),
      inbound_(io_, options_),
      session_(/*learns_pair_keys=*/options.secret.has_value()) {
  session_.set_failover(std::chrono::milliseconds(options.failover_timeout_ms));
}

Status Link::start(bool listen) {
  if (listen) {
    if (Status s = inbound_.open(); !s.is_ok()) return s;
  }
  thread_ = std::thread([this] {
    // Runs until stop(), with or without listening sockets to wait on.
    const auto work = asio::make_work_guard(io_);
    io_.run();
  });
  if (options_.failover_timeout_ms > 0) reconnector_ = std::thread([this] { reconnect_loop(); });
  return Status::ok();
}

void Link::set_identity(PeerId id, std::uint64_t term) {
  std::lock_guard<std::mutex> lock(mutex_);
  session_.set_identity(id);
  session_.grant_term(term);
  inbound_.set_identity(id);
}

void Link::attach_master(transport::Fd fd, std::uint32_t heartbeat_timeout_ms,
                         std::shared_ptr<security::FrameCrypto> crypto, proto::Hello hello) {
  asio::post(io_, [this, raw = fd.release(), heartbeat_timeout_ms, crypto, hello = std::move(hello)] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      hello_ = hello;
    }
    if (!assign_master(raw, crypto)) return;
    const auto now = Clock::now();
    if (feed([&](Session& s) { return s.attach(now, heartbeat_timeout_ms); }) == Session::State::kConnected) {
      read_master();
    } else {
      close_master();  // the link ended before the connection was attached
    }
  });
}

bool Link::assign_master(int fd, std::shared_ptr<security::FrameCrypto> crypto) {
  close_master();
  crypto_ = std::move(crypto);
  asio::error_code ec;
  master_.assign(transport::socket_family(fd) == AF_INET6 ? asio::ip::tcp::v6() : asio::ip::tcp::v4(), fd, ec);
  if (ec) {
    ::close(fd);
    fail(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "assign master socket: " + ec.message()));
    return false;
  }
  return true;
}

// Closes the master connection; what its handlers still bring (an error for the
// reads and writes in progress) belongs to the old generation and is ignored.
void Link::close_master() {
  asio::error_code ec;
  master_.close(ec);
  writes_.clear();
  ++connection_;
}

void Link::send(const proto::Message& message) {
  auto copy = std::make_shared<proto::Message>(message);
  asio::post(io_, [this, copy] { feed([&](Session& s) { return s.send(*copy); }); });
}

Result<proto::Message> Link::wait(const std::function<bool(const proto::Message&)>& match) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    if (auto message = session_.take(match)) return std::move(*message);
    if (!session_.status().is_ok()) return session_.status();
    cv_.wait(lock);
  }
}

Status Link::fatal() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_.status();
}

void Link::wake() {
  { std::lock_guard<std::mutex> lock(mutex_); }
  cv_.notify_all();
  inbound_.wake();
}

void Link::register_op(std::uint64_t tag, const std::shared_ptr<OpChannel>& channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_[tag] = channel;
  execute(session_.register_op(tag));
}

void Link::unregister_op(std::uint64_t tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_.erase(tag);
  session_.unregister_op(tag);
}

bool Link::settled_early(std::uint64_t tag, std::uint64_t attempt, std::uint32_t world_size) {
  std::lock_guard<std::mutex> lock(mutex_);
  return session_.settled_early(tag, attempt, world_size);
}

void Link::set_establishment(std::uint64_t epoch, std::shared_ptr<OpChannel> channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  establishment_ = std::move(channel);
  execute(session_.set_establishment(epoch, establishment_ != nullptr));
}

bool Link::wait_slot_turn(std::uint32_t slot, std::uint64_t attempt, OpChannel& channel) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    const Session::Turn turn = session_.slot_turn(slot, attempt);
    if (turn == Session::Turn::kMine) return true;
    if (channel.aborted() || turn == Session::Turn::kNotQueued) return false;
    cv_.wait(lock);
  }
}

void Link::release_slot(std::uint32_t slot, std::uint64_t attempt) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    session_.release_slot(slot, attempt);
  }
  cv_.notify_all();
}

void Link::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reconnector_.joinable()) reconnector_.join();
  asio::post(io_, [this] {
    fail(Status(LOCKSTEP_STATUS_INTERRUPTED, "the communicator is being destroyed"));
    asio::error_code ec;
    master_.close(ec);
    heartbeat_.cancel();
    inbound_.close_listeners();
    io_.stop();
  });
  thread_.join();
}

Session::State Link::feed(const std::function<Commands(Session&)>& event) {
  Session::State state;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    execute(event(session_));
    state = session_.state();
  }
  cv_.notify_all();
  return state;
}

// The session answers the owner's calls (register_op, set_establishment) with aborts
// and cancellations only; every command that touches the connection, the timer or the
// handshakes answers an event of the loop thread, which is the thread running it here.
void Link::execute(Commands commands) {
  for (auto& command : commands) {
    if (auto* send = std::get_if<cmd::SendFrame>(&command)) {
      push_write(std::move(send->frame));
    } else if (auto* route = std::get_if<cmd::RouteToOp>(&command)) {
      if (auto it = ops_.find(route->tag); it != ops_.end()) it->second->push(std::move(route->message));
    } else if (const auto* abort = std::get_if<cmd::AbortOp>(&command)) {
      if (auto it = ops_.find(abort->tag); it != ops_.end()) it->second->abort(abort->status);
    } else if (std::holds_alternative<cmd::CancelEstablishment>(command)) {
      if (establishment_) establishment_->cancel();
    } else if (const auto* arm = std::get_if<cmd::ArmTimer>(&command)) {
      arm_timer(arm->at);
    } else if (const auto* learn = std::get_if<cmd::LearnPairKeys>(&command)) {
      inbound_.learn_pair_keys(*learn);
    } else if (const auto* relay = std::get_if<cmd::UseRelay>(&command)) {
      const RelayAddress next{relay->host.empty() ? options_.master_host : relay->host, relay->port};
      LOG_INFO(kLog, (next.port == 0 ? std::string("the run has no relay any more")
                                     : "relayed connections go to " + transport::join_host_port(next.host, next.port)));
      set_relay(next);
    } else if (const auto* close = std::get_if<cmd::CloseMaster>(&command)) {
      if (close->status.code() == LOCKSTEP_STATUS_INTERRUPTED) {
        LOG_DEBUG(kLog, "connection to the master closed: " << close->status.to_string());
      } else {
        LOG_WARN(kLog, "connection to the master ended: " << close->status.to_string());
      }
      inbound_.end();
      close_master();
      heartbeat_.cancel();
    } else if (const auto* lost = std::get_if<cmd::Reconnect>(&command)) {
      LOG_WARN(kLog, "connection to the master lost (" << lost->status.to_string()
                                                       << "); looking for a master to take this peer back");
      close_master();
    }
  }
}

// ---------------------------------------------------------------- failover

void Link::reconnect_loop() {
  const auto addresses = options_.master_addresses();
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] {
      return stopping_ || session_.state() == Session::State::kReconnecting || session_.state() == Session::State::kEnded;
    });
    if (stopping_ || session_.state() == Session::State::kEnded) return;
    // One round over every address, then a pause that doubles up to 1 s (a hot standby
    // takes over about a lease's TTL after its master died: found within a second).
    auto pause = std::chrono::milliseconds(100);
    while (!stopping_ && session_.state() == Session::State::kReconnecting) {
      for (const auto& address : addresses) {
        lock.unlock();
        const bool done = try_resume(address);
        lock.lock();
        if (done || stopping_ || session_.state() != Session::State::kReconnecting) break;
      }
      if (stopping_ || session_.state() != Session::State::kReconnecting) break;
      cv_.wait_for(lock, pause, [&] { return stopping_ || session_.state() != Session::State::kReconnecting; });
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }
}

bool Link::try_resume(const std::pair<std::string, std::uint16_t>& address) {
  const std::string name = transport::join_host_port(address.first, address.second);
  const std::uint32_t timeout_ms = std::min<std::uint32_t>(options_.connect_timeout_ms, 2000);
  auto fd = transport::connect_tcp(address.first, address.second, timeout_ms);
  if (!fd.is_ok()) {
    LOG_DEBUG(kLog, "failover: master at " << name << " unreachable: " << fd.status().to_string());
    return false;
  }
  proto::Hello hello;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hello = session_.resume_hello(hello_);
  }
  auto channel = master_handshake(fd.value().get(), hello, options_.secret, name, timeout_ms);
  if (!channel.is_ok()) {
    LOG_WARN(kLog, "failover: master at " << name << ": " << channel.status().to_string());
    return false;
  }
  const proto::Message& reply = channel.value().reply;
  if (const auto* bye = std::get_if<proto::Goodbye>(&reply)) {
    // A master serving a run without this peer ends it; any other refusal (a master
    // that granted a newer term, one still starting) sends it on to the next address.
    Status status(bye->status, "master at " + name + ": " + bye->reason);
    LOG_WARN(kLog, "failover: " << status.to_string());
    if (bye->status == LOCKSTEP_STATUS_KICKED) {
      asio::post(io_, [this, status] { fail(status); });
      return true;
    }
    return false;
  }
  const auto* welcome = std::get_if<proto::Welcome>(&reply);
  if (welcome == nullptr) {
    LOG_WARN(kLog, "failover: master at " << name << " answered the Hello with something else");
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    resume_tried_ = false;
  }
  asio::post(io_, [this, raw = fd.value().release(), crypto = channel.value().crypto, welcome = *welcome,
                   host = address.first] {
    const auto now = Clock::now();
    const bool taken = [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      return session_.state() == Session::State::kReconnecting;
    }();
    if (taken && assign_master(raw, crypto)) {
      const auto state = feed([&](Session& s) { return s.resume(now, welcome); });
      if (state == Session::State::kResuming) {
        set_relay(RelayAddress{welcome.relay_host.empty() ? host : welcome.relay_host, welcome.relay_port});
        read_master();
      } else {
        close_master();
      }
    } else if (!taken) {
      ::close(raw);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      resume_tried_ = true;
    }
    cv_.notify_all();
  });
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return resume_tried_ || stopping_; });
  return session_.state() != Session::State::kReconnecting;
}

void Link::arm_timer(Clock::time_point at) {
  heartbeat_.expires_at(at);
  heartbeat_.async_wait([this](const asio::error_code& ec) {
    if (ec) return;
    const auto now = Clock::now();
    feed([now](Session& s) { return s.on_timer(now); });
  });
}

void Link::read_master() {
  const std::uint64_t generation = connection_;
  const auto lost = [this](Status status) {
    const auto now = Clock::now();
    feed([&](Session& s) { return s.lose(now, std::move(status)); });
  };
  asio::async_read(master_, asio::buffer(header_), [this, generation, lost](const asio::error_code& ec, std::size_t) {
    if (generation != connection_) return;  // a closed connection's
    if (ec) {
      return lost(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                         ec == asio::error::eof ? "the master closed the connection" : ec.message()));
    }
    auto header = proto::decode_header(header_);
    if (!header.is_ok()) return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "from master: " + header.status().message()));
    payload_.resize(header.value().payload_bytes);
    const auto type = header.value().type;
    if (crypto_ && type != proto::MsgType::kSealed) {
      return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                         std::string("from master: expected a sealed frame, got ") + proto::msg_type_name(type)));
    }
    asio::async_read(master_, asio::buffer(payload_), [this, type, generation, lost](const asio::error_code& ec2,
                                                                                    std::size_t) {
      if (generation != connection_) return;
      if (ec2) return lost(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, ec2.message()));
      auto message = crypto_ ? crypto_->open(header_, payload_) : proto::decode_payload(type, payload_);
      if (!message.is_ok()) return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "from master: " + message.status().message()));
      const auto now = Clock::now();
      const auto state = feed([&](Session& s) { return s.on_message(now, std::move(message.value())); });
      if (generation == connection_ && (state == Session::State::kConnected || state == Session::State::kResuming)) {
        read_master();
      }
    });
  });
}

// Every frame to the master goes through here, on the loop's thread, so that sealed
// frames leave in the order of their nonces.
void Link::push_write(std::vector<std::uint8_t> frame) {
  if (crypto_) {
    std::vector<std::uint8_t> sealed;
    crypto_->seal_frame(frame, sealed);
    frame = std::move(sealed);
  }
  writes_.push_back(std::move(frame));
  if (writes_.size() == 1) write_next();
}

void Link::write_next() {
  const std::uint64_t generation = connection_;
  asio::async_write(master_, asio::buffer(writes_.front()), [this, generation](const asio::error_code& ec, std::size_t) {
    if (generation != connection_) return;  // a closed connection's (its queue is gone)
    if (ec) {
      writes_.clear();
      const auto now = Clock::now();
      feed([&](Session& s) { return s.lose(now, Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "write to master: " + ec.message())); });
      return;
    }
    writes_.pop_front();
    if (!writes_.empty()) write_next();
  });
}

}  // namespace lockstep::peer
