// The peer side: a communicator connects to the master, is voted into the run,
// opens p2p connections to its ring neighbours, and takes part in the run-wide and
// group-wide votes. One background thread (an Asio loop) keeps the master
// connection alive with heartbeats, routes the master's messages to the waiting
// call, and accepts p2p connections; the owning thread makes the calls.
#pragma once

#include "common/ids.h"
#include "common/limits.h"
#include "common/status.h"
#include "protocol/messages.h"
#include "transport/socket.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep::peer {

struct Options {
  std::string master_host = "127.0.0.1";
  std::uint16_t master_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  std::uint32_t peer_group = 0;
  std::uint32_t p2p_pool_size = 1;
  int base_port = -1;  // semantics rule 9
  std::uint32_t connect_timeout_ms = limits::kConnectTimeoutMsDefault;
  std::uint32_t p2p_connect_timeout_ms = limits::kP2PConnectTimeoutMsDefault;
  std::string advertised_host;
  std::string bind_host;
};

class Link;  // the background thread and everything it owns (communicator.cpp)

class Communicator {
 public:
  static Result<std::unique_ptr<Communicator>> create(const Options& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  Status connect();
  Status update_topology();
  Result<bool> are_peers_pending();
  Result<bool> agree(bool flag);

  Result<proto::Attributes> attributes() const;
  Result<std::vector<proto::MemberInfo>> membership() const;
  Result<std::uint32_t> rank() const;
  PeerId id() const;
  std::string last_error() const;
  std::uint16_t p2p_port() const;

 private:
  explicit Communicator(const Options& options);
  Status check_call(bool need_accepted) const;
  Status remember(Status status);
  // Waits for the master's EstablishP2P, wires the ring, reports, and waits for the
  // outcome. Returns the TopologyResult (its status may be a failure) or a fatal status.
  Result<proto::TopologyResult> run_establishment(bool newcomer);
  std::vector<PeerId> establish(const proto::EstablishP2P& plan);

  Options options_;
  std::thread::id owner_;
  std::unique_ptr<Link> link_;
  bool connected_ = false;
  bool accepted_ = false;
  PeerId id_;
  std::uint64_t epoch_ = 0;
  std::vector<proto::MemberInfo> view_;
  proto::Attributes attributes_;
  std::uint32_t rank_ = 0;
  // Ring connections of the current epoch: pool_size to the next peer, from the previous.
  std::vector<transport::Fd> tx_;
  std::vector<transport::Fd> rx_;
  mutable std::mutex error_mutex_;
  std::string last_error_;
};

}  // namespace lockstep::peer
