// An in-process run for tests: an embedded master and N peer threads, each owning
// its communicator (as the threading rules require), all admitted into one group
// before the test body runs on every thread.
#pragma once

#include "master/master_server.h"
#include "peer/communicator.h"

#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

namespace lockstep::testing {

class Cluster {
 public:
  // With a secret, the master and every peer of run() hold it (docs/security.md).
  explicit Cluster(std::uint32_t heartbeat_timeout_ms = 5000 * LOCKSTEP_TEST_TIME_SCALE,
                   std::optional<security::Key> secret = std::nullopt)
      : secret_(secret) {
    master::Options options;
    options.secret = secret;
    options.listen_host = "127.0.0.1";
    options.listen_port = 0;
    options.coordinator.heartbeat_timeout_ms = heartbeat_timeout_ms;
    options.coordinator.instance_nonce = std::random_device{}();
    master_ = std::make_unique<master::MasterServer>(options);
    Status s = master_->start();
    if (!s.is_ok()) throw std::runtime_error(s.to_string());
  }

  std::uint16_t port() const { return master_->port(); }
  const master::MasterServer& master() const { return *master_; }

  // Runs body(comm, index) on `peers` threads once all of them are accepted. index is
  // the thread's number, not its rank (ranks come from the membership view).
  void run(std::size_t peers, const std::function<void(peer::Communicator&, std::size_t)>& body,
           std::uint32_t pool_size = 1) {
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < peers; ++i) {
      threads.emplace_back([&, i] {
        peer::Options options;
        options.master_port = port();
        options.base_port = 0;
        options.p2p_pool_size = pool_size;
        options.secret = secret_;
        auto created = peer::Communicator::create(options);
        ASSERT_TRUE(created.is_ok()) << created.status().to_string();
        auto& comm = *created.value();
        ASSERT_TRUE(join(comm, peers)) << comm.last_error();
        body(comm, i);
      });
    }
    for (auto& t : threads) t.join();
  }

  // Connects and updates the topology until the group has `world` members. All
  // accepted peers run the same loop, so they vote in lockstep.
  static bool join(peer::Communicator& comm, std::size_t world) {
    if (!comm.connect().is_ok()) return false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60 * LOCKSTEP_TEST_TIME_SCALE);
    for (;;) {
      auto attributes = comm.attributes();
      if (!attributes.is_ok()) return false;
      if (attributes.value().group_world_size >= world) return true;
      if (std::chrono::steady_clock::now() > deadline) return false;
      auto pending = comm.are_peers_pending();
      if (!pending.is_ok()) return false;
      if (!pending.value()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      Status s = comm.update_topology();
      if (!s.is_ok() && s.code() != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return false;
    }
  }

 private:
  std::optional<security::Key> secret_;
  std::unique_ptr<master::MasterServer> master_;
};

}  // namespace lockstep::testing
