// Master event loop. Each connection is a Session with a header-then-payload read
// loop (payload buffers never exceed the codec's per-type bound) and a bounded write
// queue. Closing is graceful: queued messages (a Goodbye) are flushed, the send side
// is shut down, and at most limits::kDrainBytesMax further bytes are read before the
// socket is closed, so that the other side reads the reason rather than a reset.
//
// With a run secret the shell also runs the challenge-response of docs/security.md
// before a connection's Hello reaches the coordinator (which knows nothing of keys),
// seals every later frame, and fills in the pair keys of the members a message names
// for its recipient. A connection that has not proven the secret is still one of the
// coordinator's unfinished handshakes, so its timeout and cap apply to it.
#include "master/master_server.h"

#include "common/limits.h"
#include "common/log.h"
#include "master/listen.h"
#include "master/observer.h"
#include "master/relay.h"
#include "protocol/codec.h"
#include "security/frames.h"
#include "transport/socket.h"

#include <asio.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <vector>

namespace lockstep::master {
namespace {

constexpr const char* kLog = "master";
// Stalls are looked for every this many ticks (about four times a second).
constexpr std::uint64_t kStallCheckTicks = 12;

}  // namespace

Status listen_on(asio::ip::tcp::acceptor& acceptor, const std::string& host, std::uint16_t port) {
  asio::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (ec) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "listen address '" + host + "' is not an IPv4 or IPv6 literal");
  if (address.is_v6() && address.to_v6().is_v4_mapped()) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "listen address '" + host + "' is an IPv4-mapped IPv6 address: give the IPv4 address " +
                      asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6()).to_string());
  }
  const asio::ip::tcp::endpoint endpoint(address, port);
  acceptor.open(endpoint.protocol(), ec);
  // "::" serves IPv4 clients too (as IPv4-mapped addresses, unmapped where they are read).
  if (!ec && address.is_v6()) acceptor.set_option(asio::ip::v6_only(!address.is_unspecified()), ec);
  if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED,
                  "cannot listen on " + transport::join_host_port(host, port) + ": " + ec.message());
  }
  return Status::ok();
}

class MasterServer::Impl {
 public:
  explicit Impl(Options options)
      : options_(std::move(options)),
        coordinator_(options_.coordinator),
        observer_(options_.stall_report_ms),
        acceptor_(io_),
        ticker_(io_),
        start_(std::chrono::steady_clock::now()) {
    if (options_.secret) run_key_ = security::random_key();
    serving_ = options_.election == nullptr;
  }

  Status bind() {
    if (options_.relay_port && !options_.secret) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "a relay needs a run secret (--secret-file): the frames of a relayed edge are sealed end to end "
                    "with the keys of its two peers (docs/deployment.md, \"Relays\")");
    }
    if (Status s = listen_on(acceptor_, options_.listen_host, options_.listen_port); !s.is_ok()) return s;
    if (!options_.relay_port) return Status::ok();
    RelayOptions relay;
    relay.listen_host = options_.listen_host;
    relay.port = *options_.relay_port;
    relay.match_timeout_ms = options_.relay_match_timeout_ms;
    relay_ = std::make_unique<Relay>(relay);
    return relay_->start();
  }

  std::uint16_t relay_port() const { return relay_ ? relay_->port() : 0; }

  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

  void run(const std::string& self) {
    self_ = self;
    if (options_.election) {
      // The election's thread hands its news to the loop.
      Election::Handlers handlers;
      handlers.elected = [this](std::uint64_t term, Election::Clock::time_point until) {
        asio::post(io_, [this, term, until] { take_over(term, until); });
      };
      handlers.renewed = [this](Election::Clock::time_point until) {
        asio::post(io_, [this, until] {
          if (serving_) lease_until_ = until;
        });
      };
      handlers.lost = [this](const std::string& why) {
        asio::post(io_, [this, why] { step_down(why, /*resign=*/false); });
      };
      LOG_WARN(kLog, "a hot standby (" << options_.election->describe() << "): serving only while this master holds "
                                       << "the run's lease, refusing peers until then");
      options_.election->start(self, std::move(handlers));
    }
    do_accept();
    schedule_tick();
    io_.run();
  }

  void interrupt() {
    asio::post(io_, [this] { shutdown(); });
  }

  // Called from any thread: the view is rendered by a handler on the loop thread.
  Result<std::string> render(View view, std::uint32_t timeout_ms) {
    return on_loop(timeout_ms, [this, view]() -> Result<std::string> {
      if (options_.election) {
        observer_.set_ha(Observer::Ha{options_.election->describe(), serving_, options_.election->holder(), elections_,
                                      step_downs_});
      }
      if (view == View::kStateJson) return observer_.state_json(coordinator_, now_ms());
      std::string text = observer_.metrics_text(coordinator_, now_ms());
      if (relay_) text += relay_metrics(relay_->stats());
      if (options_.secret) {
        text += "# HELP lockstep_relay_processes lockstep-relay processes registered now (the first carries the relayed "
                "edges).\n# TYPE lockstep_relay_processes gauge\nlockstep_relay_processes " +
                std::to_string(relay_processes_.size()) + "\n";
      }
      return text;
    });
  }

  Result<std::string> evict(const std::string& name, const std::string& reason, std::uint32_t timeout_ms) {
    return on_loop(timeout_ms, [this, name, reason]() -> Result<std::string> {
      std::optional<PeerId> target;
      for (const auto& [id, peer] : coordinator_.peers()) {
        if (id.to_string() == name || hex_id(id) == name) target = id;  // a copy: eviction erases the entry
      }
      if (!target) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "no registered or accepted peer is named '" + name + "'");
      LOG_WARN(kLog, "the operator evicts peer " << target->to_string() << (reason.empty() ? "" : ": " + reason));
      coord::Outbox out;
      const bool found = coordinator_.on_evict(*target, reason, now_ms(), out);
      apply(out);
      if (!found) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "the coordinator did not find " + target->to_string());
      return target->to_string();
    });
  }

  Status rotate_secret(const security::Key& secret, std::uint32_t window_ms, std::uint32_t timeout_ms) {
    auto done = on_loop(timeout_ms, [this, secret, window_ms]() -> Result<std::string> {
      if (!options_.secret) {
        return Status(LOCKSTEP_STATUS_INVALID_USAGE,
                      "this master runs without a secret; a run cannot gain one (start the master with --secret-file)");
      }
      if (*options_.secret == secret) return std::string("unchanged");
      previous_secret_ = *options_.secret;
      previous_secret_until_ms_ = now_ms() + window_ms;
      options_.secret = secret;
      LOG_WARN(kLog, "run secret rotated: new handshakes must prove the new secret; the previous one is accepted for "
                         << window_ms << " ms more; peers already in the run stay");
      return std::string("rotated");
    });
    return done.is_ok() ? Status::ok() : done.status();
  }

 private:
  // Where a connection stands in the challenge-response (with a secret only).
  enum class Auth { kAwaitHello, kAwaitProof, kDone };
  // An encoded frame, queued for one session or shared by several.
  using Frame = std::shared_ptr<const std::vector<std::uint8_t>>;
  struct Session : std::enable_shared_from_this<Session> {
    Session(asio::ip::tcp::socket s, coord::ConnId c) : socket(std::move(s)), conn(c), close_timer(socket.get_executor()) {}
    asio::ip::tcp::socket socket;
    coord::ConnId conn;
    std::string host;
    Auth auth = Auth::kAwaitHello;
    security::Nonce client_nonce{};
    security::Nonce server_nonce{};
    std::vector<std::uint8_t> transcript;  // the Hello's payload
    proto::Hello hello;
    std::optional<proto::RelayHello> relay_hello;  // a lockstep-relay process, not a peer
    std::unique_ptr<security::FrameCrypto> crypto;  // set once the secret is proven
    std::array<std::uint8_t, proto::kFrameHeaderBytes> header{};
    std::vector<std::uint8_t> payload;
    std::deque<Frame> writes;  // plain frames may be shared by several sessions
    std::size_t queued_bytes = 0;
    bool writing = false;
    bool closing = false;  // no more input is decoded
    bool closed = false;
    std::size_t drained_bytes = 0;
    asio::steady_timer close_timer;
  };
  using SessionPtr = std::shared_ptr<Session>;

  // Runs fn on the loop thread (the only one that touches the coordinator) and waits at
  // most timeout_ms for its answer.
  Result<std::string> on_loop(std::uint32_t timeout_ms, std::function<Result<std::string>()> fn) {
    auto promise = std::make_shared<std::promise<Result<std::string>>>();
    auto future = promise->get_future();
    asio::post(io_, [promise, fn = std::move(fn)] { promise->set_value(fn()); });
    if (future.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
      return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master's loop did not answer within " +
                                                                std::to_string(timeout_ms) + " ms");
    }
    try {
      return future.get();
    } catch (const std::future_error&) {  // the loop was destroyed with the request queued
      return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master stopped");
    }
  }

  static std::string hex_id(PeerId id) {
    char buf[33];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(id.hi),
                  static_cast<unsigned long long>(id.lo));
    return buf;
  }

  // The secrets a handshake may prove now: the current one, and during a rotation's
  // window the previous one.
  std::vector<security::Key> accepted_secrets() const {
    std::vector<security::Key> keys{*options_.secret};
    if (previous_secret_ && now_ms() < previous_secret_until_ms_) keys.push_back(*previous_secret_);
    return keys;
  }

  TimeMs now_ms() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start_).count();
  }

  void do_accept() {
    acceptor_.async_accept([this](const asio::error_code& ec, asio::ip::tcp::socket socket) {
      if (stopping_) return;
      if (!ec) on_accept(std::move(socket));
      else LOG_WARN(kLog, "accept failed: " << ec.message());
      do_accept();
    });
  }

  void on_accept(asio::ip::tcp::socket socket) {
    asio::error_code ec;
    socket.set_option(asio::ip::tcp::no_delay(true), ec);
    const auto remote = socket.remote_endpoint(ec);
    if (ec) return;  // already gone
    const coord::ConnId conn = next_conn_++;
    auto session = std::make_shared<Session>(std::move(socket), conn);
    sessions_[conn] = session;
    const std::string host = transport::unmapped(remote.address().to_string());
    session->host = host;
    LOG_DEBUG(kLog, "connection " << conn << " from " << transport::join_host_port(host, remote.port()));
    coord::Outbox out;
    coordinator_.on_connect(conn, host, now_ms(), out);
    apply(out);
    if (!session->closing) read_header(session);
  }

  void read_header(const SessionPtr& s) {
    asio::async_read(s->socket, asio::buffer(s->header), [this, s](const asio::error_code& ec, std::size_t) {
      if (s->closed || s->closing) return;
      if (ec) return lost(s, ec == asio::error::eof ? "closed by peer" : ec.message());
      auto header = proto::decode_header(s->header);
      if (!header.is_ok()) return violation(s, header.status().message());
      const auto type = header.value().type;
      // Before its Hello is accepted a connection may send nothing else, so the
      // larger bounds of other types never apply to strangers. With a secret: Hello,
      // AuthProof, then sealed frames only.
      if (options_.secret) {
        const proto::MsgType expected = s->crypto                         ? proto::MsgType::kSealed
                                        : s->auth == Auth::kAwaitProof ? proto::MsgType::kAuthProof
                                                                       : proto::MsgType::kHello;
        const bool relay_hello = expected == proto::MsgType::kHello && type == proto::MsgType::kRelayHello;
        if (type != expected && !relay_hello) {
          return violation(s, std::string("expected ") + proto::msg_type_name(expected) + ", got " + proto::msg_type_name(type));
        }
      } else if (type != proto::MsgType::kHello && type != proto::MsgType::kRelayHello &&
                 !coordinator_.peer_of(s->conn)) {
        return violation(s, std::string("expected Hello, got ") + proto::msg_type_name(type));
      }
      if (s->payload.capacity() > limits::kKeptPayloadBytesMax) std::vector<std::uint8_t>().swap(s->payload);
      s->payload.resize(header.value().payload_bytes);
      if (s->payload.empty()) return on_frame(s, type);
      asio::async_read(s->socket, asio::buffer(s->payload), [this, s, type](const asio::error_code& ec2, std::size_t) {
        if (s->closed || s->closing) return;
        if (ec2) return lost(s, ec2 == asio::error::eof ? "closed by peer mid-frame" : ec2.message());
        on_frame(s, type);
      });
    });
  }

  void on_frame(const SessionPtr& s, proto::MsgType type) {
    auto message = s->crypto ? s->crypto->open(s->header, s->payload) : proto::decode_payload(type, s->payload);
    if (!message.is_ok()) return violation(s, message.status().message());
    if (s->relay_hello && s->crypto) return on_relay_frame(s, message.value());
    if (options_.secret && !s->crypto) return on_auth_frame(s, message.value());
    if (!serving_ && std::holds_alternative<proto::Hello>(message.value())) return refuse_standby(s);
    if (std::holds_alternative<proto::RelayHello>(message.value())) {
      return refuse_relay(s, LOCKSTEP_STATUS_INVALID_ARGUMENT,
                          "this master runs without a run secret, and a relay needs one (--secret-file on both): the "
                          "frames of a relayed edge are sealed with keys derived from it");
    }
    if (const auto* hello = std::get_if<proto::Hello>(&message.value())) return probe_then_register(s, *hello);
    observe_report(s->conn, message.value());
    deliver(s, message.value());
  }

  // Hands a message to the coordinator and reads the connection's next frame.
  void deliver(const SessionPtr& s, const proto::Message& message) {
    coord::Outbox out;
    coordinator_.on_message(s->conn, message, now_ms(), out);
    apply(out);
    if (!s->closing && !s->closed) read_header(s);
  }

  // Reachability as a measured fact (docs/deployment.md, "NAT"): before a Hello that
  // names ports and no advertised host reaches the coordinator, the master connects to
  // the newcomer's p2p port at the address the newcomer connected from (never another:
  // the master cannot be made to dial elsewhere), once, for at most
  // limits::kReachabilityProbeMs, and closes at once. A port it cannot reach is
  // registered as none: the newcomer then runs as a peer that accepts no inbound
  // connection, and its neighbours never dial it. Nothing else is read from the
  // connection meanwhile.
  void probe_then_register(const SessionPtr& s, proto::Hello hello) {
    asio::error_code ec;
    const auto address = asio::ip::make_address(s->host, ec);
    if (hello.p2p_port == 0 || !hello.advertised_host.empty() || ec) return deliver(s, hello);
    struct Probe {
      explicit Probe(asio::io_context& io) : socket(io), timer(io) {}
      asio::ip::tcp::socket socket;
      asio::steady_timer timer;
      bool done = false;
    };
    auto probe = std::make_shared<Probe>(io_);
    const auto finish = [this, s, probe, hello](const std::string& failure) {
      if (probe->done) return;
      probe->done = true;
      asio::error_code ignored;
      probe->timer.cancel();
      probe->socket.close(ignored);
      if (s->closed || s->closing) return;
      if (!failure.empty()) {
        LOG_INFO(kLog, "connection " << s->conn << " from " << s->host << ": its p2p port " << hello.p2p_port
                                     << " cannot be reached from here (" << failure
                                     << "); it joins as a peer that accepts no inbound connection");
        proto::Hello unreachable = hello;
        unreachable.p2p_port = unreachable.shared_state_port = unreachable.benchmark_port = 0;
        return deliver(s, unreachable);
      }
      deliver(s, hello);
    };
    probe->timer.expires_after(std::chrono::milliseconds(limits::kReachabilityProbeMs));
    probe->timer.async_wait([finish](const asio::error_code& e) {
      if (!e) finish("no answer within " + std::to_string(limits::kReachabilityProbeMs) + " ms");
    });
    probe->socket.async_connect(asio::ip::tcp::endpoint(address, hello.p2p_port),
                                [finish](const asio::error_code& e) { finish(e ? e.message() : ""); });
  }

  // The challenge-response: Hello (client nonce) -> AuthChallenge (server nonce, the
  // master's proof) -> AuthProof (the peer's proof); then the Hello goes on to the
  // coordinator and both directions are sealed with keys of this connection alone.
  // During a rotation's window the master proves both secrets (the new one's proof
  // first; the peer checks each 32-byte proof) and accepts a peer's proof of either.
  void on_auth_frame(const SessionPtr& s, const proto::Message& message) {
    const std::vector<security::Key> secrets = accepted_secrets();
    const auto* hello = std::get_if<proto::Hello>(&message);
    const auto* relay_hello = std::get_if<proto::RelayHello>(&message);
    if (hello != nullptr || relay_hello != nullptr) {
      if (!security::to_nonce(hello != nullptr ? hello->auth : relay_hello->auth, &s->client_nonce)) {
        return auth_failed(s, "its Hello carries no proof of the run secret (a peer started without the secret)");
      }
      if (hello != nullptr) s->hello = *hello;
      if (relay_hello != nullptr) s->relay_hello = *relay_hello;
      s->transcript = s->payload;
      s->server_nonce = security::random_nonce();
      std::vector<std::uint8_t> proofs;
      for (const auto& secret : secrets) {
        const auto proof = security::proof(secret, security::kMasterRole, s->client_nonce, s->server_nonce, s->transcript);
        proofs.insert(proofs.end(), proof.begin(), proof.end());
      }
      s->auth = Auth::kAwaitProof;
      enqueue(s->conn, proto::AuthChallenge{security::to_bytes(s->server_nonce), std::move(proofs)});
      if (!s->closing && !s->closed) read_header(s);
      return;
    }
    const auto& proof = std::get<proto::AuthProof>(message);
    const auto proven = std::find_if(secrets.begin(), secrets.end(), [&](const security::Key& secret) {
      return security::verify(secret, security::kPeerRole, s->client_nonce, s->server_nonce, s->transcript, proof.proof);
    });
    if (proven == secrets.end()) {
      return auth_failed(s, "its proof of the run secret is wrong (a different secret, or a replayed handshake)");
    }
    if (proven != secrets.begin()) {
      LOG_INFO(kLog, "connection " << s->conn << " from " << s->host << " proved the previous run secret (rotation window)");
    }
    s->crypto = std::make_unique<security::FrameCrypto>(
        security::session_keys(*proven, s->client_nonce, s->server_nonce, s->transcript), /*client=*/false);
    s->auth = Auth::kDone;
    LOG_DEBUG(kLog, "connection " << s->conn << " from " << s->host << " proved the run secret");
    if (!serving_) return refuse_standby(s);
    if (s->relay_hello) return register_relay(s);
    probe_then_register(s, s->hello);
  }

  // ---- lockstep-relay processes (docs/deployment.md, "Relays")

  // A relay process proved the secret: it is no peer (the coordinator forgets its
  // handshake); it gets a Welcome with no id (its heartbeat timeout), then the pairs it
  // may join while it is the relay in use (refresh_relays).
  void register_relay(const SessionPtr& s) {
    if (relay_processes_.size() >= limits::kRelayProcessesMax) {
      return refuse_relay(s, LOCKSTEP_STATUS_REJECTED,
                          std::to_string(limits::kRelayProcessesMax) + " relay processes are registered already");
    }
    coord::Outbox out;
    coordinator_.on_disconnect(s->conn, "a relay process, not a peer", now_ms(), out);
    const proto::RelayHello& hello = *s->relay_hello;
    asio::error_code ec;
    const auto observed = asio::ip::make_address(s->host, ec);
    // A relay on the master's host that reaches it over loopback is announced as the
    // master's own address, which every peer can reach.
    const std::string host = !hello.advertised_host.empty() ? hello.advertised_host
                             : !ec && observed.is_loopback() ? std::string()
                                                             : s->host;
    relay_processes_[s->conn] = RelayProcess{host, hello.port, now_ms()};
    LOG_INFO(kLog, "relay process registered from " << s->host << ", relaying at "
                                                     << transport::join_host_port(host.empty() ? "(the master's address)" : host, hello.port)
                                                     << " (connection " << s->conn << ")");
    proto::Welcome welcome;
    welcome.observed_host = s->host;
    welcome.heartbeat_timeout_ms = options_.coordinator.heartbeat_timeout_ms;
    enqueue(s->conn, welcome);
    apply(out);
    if (!s->closing && !s->closed) read_header(s);
  }

  void on_relay_frame(const SessionPtr& s, const proto::Message& message) {
    if (!std::holds_alternative<proto::Heartbeat>(message)) {
      return violation(s, std::string("a relay process sent ") + proto::msg_type_name(proto::type_of(message)));
    }
    if (auto r = relay_processes_.find(s->conn); r != relay_processes_.end()) r->second.last_rx_ms = now_ms();
    enqueue(s->conn, proto::HeartbeatAck{});
    read_header(s);
  }

  void refuse_relay(const SessionPtr& s, StatusCode status, const std::string& reason) {
    LOG_WARN(kLog, "connection " << s->conn << " from " << s->host << " refused as a relay: " << reason);
    refuse(s, status, reason, "refused as a relay");
  }

  // Ends a connection that was not registered: its Goodbye says why, and the coordinator
  // forgets the unfinished handshake (`as`: the reason it is given).
  void refuse(const SessionPtr& s, StatusCode status, const std::string& reason, const char* as) {
    enqueue(s->conn, proto::Goodbye{status, reason});
    begin_close(s);
    coord::Outbox out;
    coordinator_.on_disconnect(s->conn, as, now_ms(), out);
    apply(out);
  }

  // ---- the hot standby (Options::election)

  // A standby answers every Hello (after the secret's proof, where there is one) with
  // NOT_SERVING, naming the master that serves: a peer goes on to its next address.
  void refuse_standby(const SessionPtr& s) {
    const std::string holder = options_.election->holder();
    const std::string why = "a standby master: " + (holder.empty() || holder == self_
                                                        ? std::string("no master holds the run's lease yet")
                                                        : "the run is served by " + holder);
    LOG_DEBUG(kLog, "connection " << s->conn << " from " << s->host << " refused: " << why);
    refuse(s, LOCKSTEP_STATUS_NOT_SERVING, why, "refused by a standby");
  }

  // The election gave this master the lease: it serves from now on, with the election's
  // term, as a master that has just started (the run's peers come back to it as to a
  // restarted master, docs/architecture.md, "Failover"). The connections it refused
  // meanwhile are dropped.
  void take_over(std::uint64_t term, Election::Clock::time_point until) {
    if (stopping_ || serving_) return;
    for (auto& [conn, s] : std::map<coord::ConnId, SessionPtr>(sessions_)) destroy(s);
    fresh_coordinator(term);
    serving_ = true;
    lease_until_ = until;
    ++elections_;
    LOG_WARN(kLog, "this master serves the run now (it holds the lease), term " << term);
  }

  // The lease is lost, or about to end unrenewed: this master stops serving before any
  // other can be elected, tells every peer (which go on to the next master), forgets the
  // run and competes again as a standby.
  void step_down(const std::string& why, bool resign) {
    if (stopping_ || !serving_) return;
    LOG_WARN(kLog, "stepping down (" << why << "): this master no longer serves the run");
    say_goodbye_to_all("the master stepped down (" + why + "); another master takes the run over");
    fresh_coordinator(0);
    serving_ = false;
    ++step_downs_;
    if (resign) options_.election->resign();
  }

  void fresh_coordinator(std::uint64_t term) {
    coord::Config config = options_.coordinator;
    config.term = term;
    config.started_ms = now_ms();
    coordinator_ = coord::Coordinator(config);
    announced_relay_.reset();
    relay_holder_ = 0;
    relay_members_.reset();
  }

  // The relay in use: the first relay process still registered, else the master's own
  // (none without either). When it changes, the coordinator and every peer are told
  // (RelayAddress), and the pairs go to the new one; they follow the coordinator's
  // relay members after every event.
  void refresh_relays(coord::Outbox& out) {
    std::optional<proto::RelayAddress> current;
    coord::ConnId holder = 0;  // 0: the master's own relay
    if (!relay_processes_.empty()) {
      const auto& [conn, relay] = *relay_processes_.begin();
      current = proto::RelayAddress{relay.host, relay.port};
      holder = conn;
    } else if (relay_) {
      current = proto::RelayAddress{"", relay_->port()};
    }
    if (current != announced_relay_) {
      LOG_INFO(kLog, (current ? "relayed edges run through " +
                                    transport::join_host_port(current->host.empty() ? "the master's address" : current->host,
                                                              current->port)
                              : std::string("the run has no relay any more")));
      announced_relay_ = current;
      coordinator_.on_relay_change(current.has_value(), now_ms(), out);  // a takeover, too
      const proto::Message announce = current.value_or(proto::RelayAddress{});
      for (const auto& [conn, session] : sessions_) {
        if (coordinator_.peer_of(conn)) enqueue(conn, announce);
      }
      assign_pairs(relay_holder_, {});
      relay_holder_ = holder;
      relay_members_.reset();
    }
    if (!current) return;
    auto members = coordinator_.relay_members();
    if (relay_members_ && members == *relay_members_) return;
    assign_pairs(holder, relay_pairs(members, run_key_));
    relay_members_ = std::move(members);
  }

  void assign_pairs(coord::ConnId holder, RelayPairs pairs) {
    if (holder == 0) {
      if (relay_) relay_->assign(std::move(pairs));
      return;
    }
    proto::RelayAssign assign;
    for (const auto& [pair, key] : pairs) assign.pairs.push_back({pair.first, pair.second, security::to_bytes(key)});
    enqueue(holder, assign);
  }

  void auth_failed(const SessionPtr& s, const std::string& reason) {
    LOG_WARN(kLog, "connection " << s->conn << " from " << s->host << " refused: " << reason);
    refuse(s, LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "this run requires its secret: " + reason, "authentication failed");
  }

  // With a secret: a copy of the message with the pair key of the recipient and each
  // member it names filled in, and a Welcome with the relay's port; nothing when the
  // message needs neither.
  std::optional<proto::Message> with_pair_keys(coord::ConnId conn, const proto::Message& message) const {
    if (const auto* m = std::get_if<proto::Welcome>(&message); m != nullptr && announced_relay_) {
      auto copy = *m;
      copy.relay_host = announced_relay_->host;
      copy.relay_port = announced_relay_->port;
      return copy;
    }
    const auto self = coordinator_.peer_of(conn);
    if (!self) return std::nullopt;
    const auto fill = [&](std::vector<proto::MemberInfo>& members) {
      for (auto& m : members) m.key = security::to_bytes(security::pair_key(run_key_, *self, m.id));
    };
    if (const auto* m = std::get_if<proto::EstablishP2P>(&message)) {
      auto copy = *m;
      fill(copy.ring);
      return copy;
    }
    if (const auto* m = std::get_if<proto::TopologyResult>(&message)) {
      auto copy = *m;
      fill(copy.ring);
      return copy;
    }
    if (const auto* m = std::get_if<proto::SyncPlan>(&message)) {
      auto copy = *m;
      fill(copy.sources);
      for (auto& dial : copy.dials) {
        dial.receiver.key = security::to_bytes(security::pair_key(run_key_, *self, dial.receiver.id));
      }
      return copy;
    }
    if (const auto* m = std::get_if<proto::BandwidthTest>(&message)) {
      auto copy = *m;
      copy.partner.key = security::to_bytes(security::pair_key(run_key_, *self, copy.partner.id));
      return copy;
    }
    return std::nullopt;
  }

  void violation(const SessionPtr& s, const std::string& reason) {
    LOG_WARN(kLog, "connection " << s->conn << " sent a malformed frame: " << reason);
    coord::Outbox out;
    coordinator_.on_protocol_error(s->conn, reason, now_ms(), out);
    apply(out);
    begin_close(s);  // in case the coordinator did not know the connection
  }

  void lost(const SessionPtr& s, const std::string& reason) {
    if (options_.secret && s->auth == Auth::kAwaitProof) {
      LOG_WARN(kLog, "connection " << s->conn << " from " << s->host << " ended during authentication ("
                                   << reason << "): a peer with a different secret refuses this master's proof");
    }
    destroy(s);
    coord::Outbox out;
    coordinator_.on_disconnect(s->conn, reason, now_ms(), out);
    apply(out);
  }

  // Bytes a peer reports with its vote to complete, for the metrics (decides nothing).
  void observe_report(coord::ConnId conn, const proto::Message& message) {
    const auto peer = coordinator_.peer_of(conn);
    if (!peer) return;
    if (const auto* done = std::get_if<proto::CollectiveDone>(&message)) {
      observer_.on_bytes_reported(*peer, true, done->bytes_sent, done->bytes_received, now_ms());
      observer_.on_slot_bytes_reported(coordinator_, *peer, done->tag, done->attempt, done->bytes_sent,
                                       done->bytes_received);
    } else if (const auto* init = std::get_if<proto::CollectiveInit>(&message); init != nullptr && !init->data.empty()) {
      // A small all-reduce travels with the votes: the contribution now, the result of the
      // same size with the outcome.
      observer_.on_bytes_reported(*peer, true, init->data.size(), init->data.size(), now_ms());
    } else if (const auto* sync = std::get_if<proto::SyncDone>(&message)) {
      observer_.on_bytes_reported(*peer, false, sync->bytes_sent, sync->bytes_received, now_ms());
    }
  }

  // Runs after every event the coordinator takes. Debug builds first check its
  // invariants (a walk over every peer, too slow for release builds): a broken one is a
  // bug, logged with the whole decision state, and the master aborts at the event that
  // broke it.
  void apply(coord::Outbox& out) {
#ifndef NDEBUG
    if (const auto broken = coordinator_.check_invariants()) {
      LOG_ERROR(kLog, "coordinator invariant broken: " << *broken << "; state: " << coordinator_.digest());
      std::abort();
    }
#endif
    refresh_relays(out);
    for (auto& command : out) {
      if (auto* send = std::get_if<coord::Send>(&command)) {
        enqueue(send->conn, send->message);
      } else if (auto* all = std::get_if<coord::Broadcast>(&command)) {
        // One outcome to every participant (a CollectiveGo carries the whole ring): its
        // plain frame is encoded once and shared by every plain session's queue.
        Frame plain;
        for (const auto conn : all->conns) enqueue(conn, all->message, &plain);
      } else if (auto* close = std::get_if<coord::Close>(&command)) {
        if (auto it = sessions_.find(close->conn); it != sessions_.end()) begin_close(it->second);
      } else if (auto* event = std::get_if<coord::Event>(&command)) {
        observer_.on_event(*event, now_ms());
        if (event->routine) {
          LOG_DEBUG(kLog, event->text);
        } else {
          LOG_INFO(kLog, event->text);
        }
      }
    }
    out.clear();
  }

  // `plain`: where apply() keeps the plain frame of a message to several peers (encoded
  // by the first plain session), or null.
  void enqueue(coord::ConnId conn, const proto::Message& message, Frame* plain = nullptr) {
    auto it = sessions_.find(conn);
    if (it == sessions_.end()) return;
    const SessionPtr& s = it->second;
    if (s->closed || s->closing) return;
    Frame frame;
    if (s->crypto) {
      // Keys only ever travel sealed.
      const std::optional<proto::Message> keyed = with_pair_keys(conn, message);
      frame = std::make_shared<const std::vector<std::uint8_t>>(s->crypto->seal(keyed ? *keyed : message));
    } else if (plain == nullptr) {
      frame = std::make_shared<const std::vector<std::uint8_t>>(proto::encode_frame(message));
    } else {
      if (!*plain) *plain = std::make_shared<const std::vector<std::uint8_t>>(proto::encode_frame(message));
      frame = *plain;
    }
    s->queued_bytes += frame->size();
    if (s->queued_bytes > limits::kSendQueueBytesMax) {
      LOG_WARN(kLog, "connection " << conn << " does not read its messages; dropping it");
      // Report the loss after the current batch of commands is applied.
      asio::post(io_, [this, s] {
        if (!s->closed) lost(s, "send queue above " + std::to_string(limits::kSendQueueBytesMax) + " bytes");
      });
      s->closing = true;
      return;
    }
    s->writes.push_back(std::move(frame));
    if (!s->writing) write_next(s);
  }

  void write_next(const SessionPtr& s) {
    if (s->writes.empty()) {
      s->writing = false;
      if (s->closing) finish_close(s);
      return;
    }
    s->writing = true;
    asio::async_write(s->socket, asio::buffer(*s->writes.front()), [this, s](const asio::error_code& ec, std::size_t) {
      if (s->closed) return;
      s->queued_bytes -= s->writes.front()->size();
      s->writes.pop_front();
      if (ec) {
        if (s->closing) return destroy(s);
        return lost(s, "write failed: " + ec.message());
      }
      write_next(s);
    });
  }

  // Stop decoding input; flush what is queued, then finish_close.
  void begin_close(const SessionPtr& s) {
    if (s->closed || s->closing) return;
    s->closing = true;
    s->close_timer.expires_after(limits::kCloseGrace);
    s->close_timer.async_wait([this, s](const asio::error_code& ec) {
      if (!ec) destroy(s);
    });
    if (!s->writing) finish_close(s);
  }

  void finish_close(const SessionPtr& s) {
    asio::error_code ec;
    s->socket.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
    drain(s);
  }

  // Read and discard until the other side closes, a bound is hit, or the timer fires.
  void drain(const SessionPtr& s) {
    if (s->closed) return;
    auto buffer = std::make_shared<std::array<std::uint8_t, 4096>>();
    s->socket.async_read_some(asio::buffer(*buffer), [this, s, buffer](const asio::error_code& ec, std::size_t n) {
      if (s->closed) return;
      s->drained_bytes += n;
      if (ec || s->drained_bytes >= limits::kDrainBytesMax) return destroy(s);
      drain(s);
    });
  }

  void destroy(const SessionPtr& s) {
    if (s->closed) return;
    s->closed = true;
    asio::error_code ec;
    s->close_timer.cancel();
    s->socket.close(ec);
    sessions_.erase(s->conn);
    if (relay_processes_.erase(s->conn) != 0) {
      LOG_WARN(kLog, "relay process of connection " << s->conn << " from " << s->host << " lost");
      // The relay in use may change: after the current batch of commands.
      asio::post(io_, [this] {
        if (stopping_) return;
        coord::Outbox out;
        apply(out);
      });
    }
  }

  void schedule_tick() {
    ticker_.expires_after(std::chrono::milliseconds(options_.tick_ms));
    ticker_.async_wait([this](const asio::error_code& ec) {
      if (ec || stopping_) return;
      if (serving_ && options_.election &&
          Election::Clock::now() >= lease_until_ - options_.election->lease_ttl() / 5) {
        step_down("its lease was not renewed in time", /*resign=*/true);
      }
      coord::Outbox out;
      coordinator_.on_tick(now_ms(), out);
      apply(out);
      for (const auto& [conn, relay] : std::map<coord::ConnId, RelayProcess>(relay_processes_)) {
        if (now_ms() - relay.last_rx_ms <= static_cast<TimeMs>(options_.coordinator.heartbeat_timeout_ms)) continue;
        if (auto it = sessions_.find(conn); it != sessions_.end()) lost(it->second, "a relay process sent no heartbeat in time");
      }
      if (previous_secret_ && now_ms() >= previous_secret_until_ms_) {
        previous_secret_.reset();
        LOG_WARN(kLog, "the rotation window has passed: the previous run secret is no longer accepted");
      }
      if (++ticks_ % kStallCheckTicks == 0) {
        for (const auto& line : observer_.check_stalls(coordinator_, now_ms())) LOG_WARN(kLog, line);
      }
      schedule_tick();
    });
  }

  void shutdown() {
    if (stopping_) return;
    stopping_ = true;
    LOG_INFO(kLog, "shutting down; closing " << sessions_.size() << " connection(s)");
    asio::error_code ec;
    acceptor_.close(ec);
    ticker_.cancel();
    say_goodbye_to_all("master shutting down");
    // Released at once, so that a standby takes over without waiting for the TTL.
    if (options_.election) options_.election->stop();
    io_.stop();
  }

  // Best effort: tell every connection why it ends, without waiting for slow readers,
  // and close it.
  void say_goodbye_to_all(const std::string& why) {
    asio::error_code ec;
    for (auto& [conn, s] : std::map<coord::ConnId, SessionPtr>(sessions_)) {
      if (s->closed) continue;
      const proto::Message bye = proto::Goodbye{LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, why};
      auto frame = s->crypto ? s->crypto->seal(bye) : proto::encode_frame(bye);
      s->socket.non_blocking(true, ec);
      s->socket.write_some(asio::buffer(frame), ec);
      destroy(s);
    }
  }

  Options options_;
  coord::Coordinator coordinator_;
  Observer observer_;
  std::uint64_t ticks_ = 0;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer ticker_;
  std::chrono::steady_clock::time_point start_;
  std::map<coord::ConnId, SessionPtr> sessions_;
  coord::ConnId next_conn_ = 1;
  security::Key run_key_{};  // with a secret: the root of every pair key
  std::unique_ptr<Relay> relay_;  // with --relay-port
  struct RelayProcess {
    std::string host;  // empty: the master's own address
    std::uint16_t port = 0;
    TimeMs last_rx_ms = 0;
  };
  // Registered lockstep-relay processes, by connection: in registration order.
  std::map<coord::ConnId, RelayProcess> relay_processes_;
  std::optional<proto::RelayAddress> announced_relay_;  // the relay in use, as peers were told
  coord::ConnId relay_holder_ = 0;  // its connection (0: the master's own relay)
  // The members whose pairs the relay in use was last given (none: give them again).
  std::optional<std::map<PeerId, std::uint32_t>> relay_members_;
  // After a rotation: the secret new handshakes may still prove until the window ends.
  std::optional<security::Key> previous_secret_;
  TimeMs previous_secret_until_ms_ = 0;
  bool stopping_ = false;
  // The hot standby: whether this master serves (always, without an election), until
  // when its lease runs unrenewed, and how often it was elected and stepped down.
  bool serving_ = true;
  Election::Clock::time_point lease_until_{};
  std::uint64_t elections_ = 0;
  std::uint64_t step_downs_ = 0;
  std::string self_;  // the address the election names this master by
};

namespace {
Options with_relay_config(Options options) {
  options.coordinator.relay = options.relay_port.has_value();
  return options;
}

// The host others reach a master listening on `listen_host` at: that address, or the
// host's name where it listens on every address.
std::string reachable_host(const std::string& listen_host) {
  asio::error_code ec;
  const auto address = asio::ip::make_address(listen_host, ec);
  if (ec || !address.is_unspecified()) return listen_host;
  const std::string name = asio::ip::host_name(ec);
  return ec || name.empty() ? listen_host : name;
}
}  // namespace

MasterServer::MasterServer(Options options)
    : secret_(options.secret.has_value()),
      listen_host_(options.listen_host),
      advertise_(options.advertise),
      impl_(std::make_unique<Impl>(with_relay_config(std::move(options)))) {}

MasterServer::~MasterServer() {
  interrupt();
  wait();
}

Status MasterServer::start() {
  if (thread_.joinable()) return Status(LOCKSTEP_STATUS_INVALID_USAGE, "master already started");
  Status s = impl_->bind();
  if (!s.is_ok()) return s;
  port_ = impl_->port();
  relay_port_ = impl_->relay_port();
  running_ = true;
  thread_ = std::thread([this, self = advertise_.empty() ? transport::join_host_port(reachable_host(listen_host_), port_)
                                                         : advertise_] {
    impl_->run(self);
    running_ = false;
  });
  LOG_INFO("master", "listening on port " << port_.load());
  if (!secret_) {
    LOG_WARN("master", "no run secret: this master admits anyone who can reach port "
                           << port_.load()
                           << ", and peers accept p2p connections from anyone; give it --secret-file (and the "
                              "peers the same secret) on any network that is not fully trusted (docs/security.md)");
  }
  return Status::ok();
}

void MasterServer::interrupt() {
  if (running_) impl_->interrupt();
}

Result<std::string> MasterServer::render(View view, std::uint32_t timeout_ms) const {
  if (!running_) return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master is not running");
  return impl_->render(view, timeout_ms);
}

Result<std::string> MasterServer::evict(const std::string& peer, const std::string& reason, std::uint32_t timeout_ms) {
  if (!running_) return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master is not running");
  return impl_->evict(peer, reason, timeout_ms);
}

Status MasterServer::rotate_secret(const security::Key& secret, std::uint32_t window_ms, std::uint32_t timeout_ms) {
  if (!running_) return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master is not running");
  return impl_->rotate_secret(secret, window_ms, timeout_ms);
}

void MasterServer::wait() {
  if (thread_.joinable()) thread_.join();
}

}  // namespace lockstep::master
