// The peer's listening sockets (ring, shared-state and benchmark channels) and the
// handshakes of the connections they accept: each must send its P2PHello within a
// deadline and, with a run secret, prove the pair key that the master named for its
// sender (docs/security.md). Accepted connections wait, bounded, as plain file
// descriptors until an establishment, a sync or a bandwidth test claims them.
// The accepting and handshaking run on the Link's Asio thread; the claims come from the
// peer's other threads. Internal to the peer layer.
#pragma once

#include "common/ids.h"
#include "common/status.h"
#include "peer/communicator.h"
#include "peer/session.h"
#include "protocol/messages.h"
#include "security/crypto.h"
#include "transport/socket.h"

#include <asio.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace lockstep::peer {

inline constexpr const char* kLog = "peer";

using Clock = std::chrono::steady_clock;

struct Inbound {
  PeerId from;
  PeerId to;
  std::uint64_t epoch = 0;
  std::uint32_t pool_index = 0;
  transport::Fd fd;
  // With a secret: the connection's session keys (the connector sends with to_server;
  // on a reversed ring connection the acceptor sends, with to_client; on a shared-state
  // connection the requester sends with to_server, whoever connected).
  std::optional<security::SessionKeys> keys;
  bool reversed = false;  // kP2PFlagReversed: its connector receives (ring) or serves (shared state)
};

class InboundListener {
 public:
  InboundListener(asio::io_context& io, const Options& options) : io_(io), options_(options) {}

  // Opens the three listening sockets and starts accepting (the loop runs later).
  Status open();
  std::uint16_t port(proto::Channel channel) const { return ports_[static_cast<std::size_t>(channel) - 1]; }
  // Loop thread: closes the listening sockets.
  void close_listeners();

  void set_identity(PeerId id);
  // The link ended: every claim, now and later, returns at once (empty).
  void end();

  // The newest ring connection from `from` for pool slot `slot` whose generation is
  // above min_generation, waiting until the deadline; older ones from the same
  // sender and slot are closed. Generations grow with every reconnect of the sender.
  // With `abort`, the wait also ends (empty) soon after it is set. `reversed`: the
  // reversed connections `from` dialled to receive on (kP2PFlagReversed), not the others.
  std::optional<Inbound> take_inbound(PeerId from, std::uint32_t slot, std::uint64_t min_generation,
                                      Clock::time_point deadline, const std::atomic<bool>* abort, bool reversed = false);
  // A shared-state or benchmark connection opened for operation `operation` (its
  // P2PHello's epoch: the sync attempt or the bandwidth test), from `from` if given;
  // those of older operations are closed. Waits until one arrives, `stop` is set (see
  // wake()), the deadline passes or the link ends. `reversed`: the reversed shared-state
  // connections `from` dialled to answer this peer's requests, not the others.
  std::optional<Inbound> take_connection(proto::Channel channel, std::uint64_t operation, std::optional<PeerId> from,
                                         const std::atomic<bool>* stop, Clock::time_point deadline,
                                         bool reversed = false);
  // Takes a connection this peer opened to the master's relay, once the relay has joined
  // it to the other end: a ring edge on which this peer sends, or a shared-state
  // connection on which it asks. The other end's P2PHello (reversed) comes through it
  // and is handshaken as an accepted connection's on `channel`, except that its data
  // must be sealed whatever encrypt_data says. It is then claimed with
  // take_inbound(..., reversed=true) or take_connection(..., reversed=true). Any thread.
  void adopt_relayed(transport::Fd fd, proto::Channel channel);
  // Wakes every claim so that it re-checks its stop condition.
  void wake();
  // Forgets buffered connections from peers that are not members any more.
  void prune(const std::set<PeerId>& members);

  // Loop thread, with a secret: the pair keys the master named (peer::Session decides
  // which); handshakes parked for a sender now known go on.
  void learn_pair_keys(const cmd::LearnPairKeys& learn);

 private:
  struct Handshake;

  void accept_on(std::size_t index);
  void make_room_for_handshake();
  void handshake(const std::shared_ptr<Handshake>& h, proto::Channel channel);
  void challenge(const std::shared_ptr<Handshake>& h);
  bool encryption_differs(const std::shared_ptr<Handshake>& h) const;
  void finish(const std::shared_ptr<Handshake>& h, StatusCode verdict);
  void unpark(const std::shared_ptr<Handshake>& h);
  void close(const std::shared_ptr<Handshake>& h);

  asio::io_context& io_;
  const Options options_;
  std::array<std::unique_ptr<asio::ip::tcp::acceptor>, 3> listeners_;
  std::array<std::uint16_t, 3> ports_{};
  std::list<std::weak_ptr<Handshake>> unfinished_;  // loop thread only, in accept order
  std::uint64_t displaced_handshakes_ = 0;           // loop thread only
  // With a secret (loop thread only): the pair key of every member the master named,
  // and handshakes waiting for their sender's key.
  std::map<PeerId, security::Key> pair_keys_;
  std::vector<std::shared_ptr<Handshake>> parked_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  bool ended_ = false;
  PeerId id_;
  std::deque<Inbound> inbound_;        // ring connections
  std::deque<Inbound> state_inbound_;  // shared-state connections (epoch: sync attempt)
  std::deque<Inbound> bench_inbound_;  // benchmark connections (epoch: bandwidth test)
};

}  // namespace lockstep::peer
