// The IO shell of a peer: Link is one Asio thread that owns the master connection and
// the listening sockets (peer/inbound.h). It only moves bytes: every decision about the
// master link (heartbeats, silence, what each message means, where it goes, when the
// link ends) is peer::Session's (peer/session.h), which the Link feeds under its mutex
// with the events and the current time, carrying out the commands it answers with.
// With a run secret it also seals the master connection's frames. The owning thread
// waits for the master's replies in the session's bounded mailbox; each in-flight
// collective has its own (peer/mailbox.h). Internal to the peer layer.
#pragma once

#include "common/ids.h"
#include "common/status.h"
#include "peer/communicator.h"
#include "peer/handshake.h"
#include "peer/inbound.h"
#include "peer/mailbox.h"
#include "peer/session.h"
#include "protocol/codec.h"
#include "protocol/messages.h"
#include "security/frames.h"
#include "transport/socket.h"

#include <asio.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

namespace lockstep::peer {

class Link {
 public:
  explicit Link(const Options& options);
  ~Link() { stop(); }

  // Opens the listening sockets (unless `listen` is false: the peer accepts no inbound
  // connection) and starts the loop thread.
  Status start(bool listen);
  std::uint16_t port(proto::Channel channel) const { return inbound_.port(channel); }

  // This peer's identity and its first master's term, from the Welcome.
  void set_identity(PeerId id, std::uint64_t term);

  // Hands the connected, welcomed master socket to the loop (with the keys that seal
  // its frames, when the run has a secret). `hello` is what this peer said: with
  // failover (Options::failover_timeout_ms) a lost master is replaced by one that takes
  // the same hello with the session's resume fields (docs/architecture.md, "Failover").
  void attach_master(transport::Fd fd, std::uint32_t heartbeat_timeout_ms, std::shared_ptr<security::FrameCrypto> crypto,
                     proto::Hello hello);

  void send(const proto::Message& message);

  // Blocks until a message accepted by `match` arrives (it is removed from the
  // mailbox) or the link fails. Messages nobody waits for stay queued (bounded).
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match);

  Status fatal() const;

  // Claims of accepted connections (InboundListener::take_inbound, take_connection).
  std::optional<Inbound> take_inbound(PeerId from, std::uint32_t slot, std::uint64_t min_generation,
                                      Clock::time_point deadline, const std::atomic<bool>* abort = nullptr,
                                      bool reversed = false) {
    return inbound_.take_inbound(from, slot, min_generation, deadline, abort, reversed);
  }
  std::optional<Inbound> take_connection(proto::Channel channel, std::uint64_t operation, std::optional<PeerId> from,
                                         const std::atomic<bool>* stop, Clock::time_point deadline,
                                         bool reversed = false) {
    return inbound_.take_connection(channel, operation, from, stop, deadline, reversed);
  }
  void adopt_relayed(transport::Fd fd, proto::Channel channel) { inbound_.adopt_relayed(std::move(fd), channel); }
  // The relay in use (the Welcome's, then each RelayAddress's; the master's host where
  // the master names none). Port 0: there is none.
  RelayAddress relay() const {
    std::lock_guard<std::mutex> lock(relay_mutex_);
    return relay_;
  }
  void set_relay(RelayAddress relay) {
    std::lock_guard<std::mutex> lock(relay_mutex_);
    relay_ = std::move(relay);
  }
  // Wakes every wait of this link so that it re-checks its stop condition.
  void wake();
  // Forgets buffered connections from peers that are not members any more.
  void prune_inbound(const std::set<PeerId>& members) { inbound_.prune(members); }

  // ---- collectives: each in-flight collective has a channel that receives the
  // master's messages for its tag; a failure outcome also raises its abort signal.
  void register_op(std::uint64_t tag, const std::shared_ptr<OpChannel>& channel);
  void unregister_op(std::uint64_t tag);
  // The collective's attempt ended here on its commit (Session::settled_early): false
  // while the master is away (the attempt then waits for the outcome).
  bool settled_early(std::uint64_t tag, std::uint64_t attempt, std::uint32_t world_size);

  // The p2p establishment of `epoch` in progress (null: none): when the master ends
  // that epoch with a failure, its signal stops connection setup that would otherwise
  // wait for a dead or stopped neighbour until the p2p connect timeout.
  void set_establishment(std::uint64_t epoch, std::shared_ptr<OpChannel> channel);

  // Pool slots are used by one attempt at a time, in the order of the attempts'
  // CollectiveGo messages, which every peer receives in the same order.
  bool wait_slot_turn(std::uint32_t slot, std::uint64_t attempt, OpChannel& channel);
  void release_slot(std::uint32_t slot, std::uint64_t attempt);

  void stop();

 private:
  // Feeds one event to the session under the mutex, carries out its commands (still
  // under it, in order) and wakes the waits. Returns the session's state afterwards.
  Session::State feed(const std::function<Commands(Session&)>& event);
  void execute(Commands commands);  // mutex_ held
  void fail(Status status) { feed([&](Session& s) { return s.fail(std::move(status)); }); }

  void read_master();
  void push_write(std::vector<std::uint8_t> frame);
  void write_next();
  void arm_timer(Clock::time_point at);
  // The loop's side of a master connection: assigns the socket and its keys (the
  // connection before it is closed, and its handlers, which hold its generation, ignored).
  bool assign_master(int fd, std::shared_ptr<security::FrameCrypto> crypto);
  void close_master();
  // Failover: the thread that looks for a master to take this peer back while the
  // session is reconnecting (one try of every address per round, with backoff).
  void reconnect_loop();
  // One try at `address`: true if the session is resuming (or ended) afterwards.
  bool try_resume(const std::pair<std::string, std::uint16_t>& address);

  Options options_;
  asio::io_context io_;
  asio::ip::tcp::socket master_;
  asio::steady_timer heartbeat_;
  InboundListener inbound_;
  std::thread thread_;
  // Loop thread only: the master connection's frame keys (with a secret), the frame
  // being read and the frames waiting to be written.
  std::shared_ptr<security::FrameCrypto> crypto_;
  std::array<std::uint8_t, proto::kFrameHeaderBytes> header_{};
  std::vector<std::uint8_t> payload_;
  std::deque<std::vector<std::uint8_t>> writes_;
  std::uint64_t connection_ = 0;  // the master connection's generation
  proto::Hello hello_;
  std::thread reconnector_;

  mutable std::mutex relay_mutex_;
  RelayAddress relay_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  bool stopping_ = false;
  bool resume_tried_ = false;  // the loop has handled the reconnector's last connection
  Session session_;
  std::map<std::uint64_t, std::shared_ptr<OpChannel>> ops_;
  std::shared_ptr<OpChannel> establishment_;
};

}  // namespace lockstep::peer
