// The peer's IO shell (link.h): Asio reads and writes for the master connection, the
// heartbeat timer, and peer::Session fed under the mutex.
#include "peer/link.h"

#include "common/log.h"

#include <string>
#include <utility>

namespace lockstep::peer {

Link::Link(const Options& options)
    : options_(options),
      master_(io_),
      heartbeat_(io_),
      inbound_(io_, options_),
      session_(/*learns_pair_keys=*/options.secret.has_value()) {}

Status Link::start(bool listen) {
  if (listen) {
    if (Status s = inbound_.open(); !s.is_ok()) return s;
  }
  thread_ = std::thread([this] {
    // Runs until stop(), with or without listening sockets to wait on.
    const auto work = asio::make_work_guard(io_);
    io_.run();
  });
  return Status::ok();
}

void Link::set_identity(PeerId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  session_.set_identity(id);
  inbound_.set_identity(id);
}

void Link::attach_master(transport::Fd fd, std::uint32_t heartbeat_timeout_ms,
                         std::shared_ptr<security::FrameCrypto> crypto) {
  asio::post(io_, [this, raw = fd.release(), heartbeat_timeout_ms, crypto] {
    crypto_ = crypto;
    asio::error_code ec;
    master_.assign(transport::socket_family(raw) == AF_INET6 ? asio::ip::tcp::v6() : asio::ip::tcp::v4(), raw, ec);
    if (ec) return fail(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "assign master socket: " + ec.message()));
    const auto now = Clock::now();
    if (feed([&](Session& s) { return s.attach(now, heartbeat_timeout_ms); }) == Session::State::kConnected) {
      read_master();
    } else {
      master_.close(ec);  // the link ended before the connection was attached
    }
  });
}

void Link::send(const proto::Message& message) {
  auto frame = std::make_shared<std::vector<std::uint8_t>>(proto::encode_frame(message));
  asio::post(io_, [this, frame] { feed([&](Session& s) { return s.send(std::move(*frame)); }); });
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

void Link::settled_early(std::uint64_t tag, std::uint64_t attempt) {
  std::lock_guard<std::mutex> lock(mutex_);
  session_.settled_early(tag, attempt);
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
      asio::error_code ec;
      master_.close(ec);
      heartbeat_.cancel();
    }
  }
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
  asio::async_read(master_, asio::buffer(header_), [this](const asio::error_code& ec, std::size_t) {
    if (ec) {
      return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
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
    asio::async_read(master_, asio::buffer(payload_), [this, type](const asio::error_code& ec2, std::size_t) {
      if (ec2) return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, ec2.message()));
      auto message = crypto_ ? crypto_->open(header_, payload_) : proto::decode_payload(type, payload_);
      if (!message.is_ok()) return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "from master: " + message.status().message()));
      const auto now = Clock::now();
      if (feed([&](Session& s) { return s.on_message(now, std::move(message.value())); }) == Session::State::kConnected) {
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
  asio::async_write(master_, asio::buffer(writes_.front()), [this](const asio::error_code& ec, std::size_t) {
    if (ec) {
      writes_.clear();
      return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "write to master: " + ec.message()));
    }
    writes_.pop_front();
    if (!writes_.empty()) write_next();
  });
}

}  // namespace lockstep::peer
