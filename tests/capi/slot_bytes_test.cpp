// The per-slot byte counters through the public C API alone (no internals): a master
// and two peers of pool 4 on threads of this process run all-reduces concurrently; every
// slot of the pool carried bytes both ways, the slots add up to the communicator's
// all-reduce totals, a broadcast's bytes are sent on the root's slots and received on the
// other's, and bad arguments are refused without touching the outputs.
#include <lockstep/lockstep.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

constexpr std::uint32_t kPool = 4;
constexpr std::size_t kInFlight = 8;
constexpr std::size_t kCount = 1u << 20;  // f32 elements: all-reduce k has (k + 1) / 8 of it, far above 16 KiB

// Connects and takes part in update topology until the group has `world` peers.
bool join(lockstep_comm_t* comm, std::int64_t world) {
  if (lockstep_comm_connect(comm) != LOCKSTEP_OK) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    std::int64_t size = 0;
    if (lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &size) != LOCKSTEP_OK) return false;
    if (size >= world) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    int pending = 0;
    if (lockstep_comm_are_peers_pending(comm, &pending) != LOCKSTEP_OK) return false;
    if (!pending) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    const lockstep_status_t s = lockstep_comm_update_topology(comm);
    if (s != LOCKSTEP_OK && s != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return false;
  }
}

void peer(std::uint16_t port, std::size_t index) {
  lockstep_comm_config_t config;
  ASSERT_EQ(lockstep_comm_config_init(&config), LOCKSTEP_OK);
  config.master_host = "127.0.0.1";
  config.master_port = port;
  config.base_port = 0;
  config.p2p_pool_size = kPool;
  lockstep_comm_t* comm = nullptr;
  ASSERT_EQ(lockstep_comm_create(&config, &comm), LOCKSTEP_OK);
  ASSERT_TRUE(join(comm, 2)) << lockstep_comm_last_error(comm);

  // Before any all-reduce every slot is at zero.
  std::uint64_t sent = 1, received = 1;
  ASSERT_EQ(lockstep_comm_get_slot_bytes(comm, 0, &sent, &received), LOCKSTEP_OK);
  EXPECT_EQ(sent, 0u);
  EXPECT_EQ(received, 0u);

  // Sizes differ, so that the slots carry different amounts.
  std::vector<std::vector<float>> buffers;
  for (std::size_t k = 0; k < kInFlight; ++k) buffers.emplace_back((k + 1) * kCount / kInFlight);
  std::vector<lockstep_async_t*> handles(kInFlight, nullptr);
  for (std::size_t k = 0; k < kInFlight; ++k) {
    for (std::size_t i = 0; i < buffers[k].size(); i += 4096) buffers[k][i] = static_cast<float>(k + index);
    lockstep_reduce_desc_t d = {buffers[k].data(), buffers[k].data(), buffers[k].size(), LOCKSTEP_F32, LOCKSTEP_SUM,
                                LOCKSTEP_QUANT_NONE, 10 + k, nullptr, LOCKSTEP_DIST_NONE};
    ASSERT_EQ(lockstep_comm_all_reduce_async(comm, &d, &handles[k]), LOCKSTEP_OK) << lockstep_comm_last_error(comm);
  }
  std::uint64_t reported_sent = 0, reported_received = 0;
  for (std::size_t k = 0; k < kInFlight; ++k) {
    lockstep_reduce_info_t info;
    ASSERT_EQ(lockstep_async_wait(handles[k], &info), LOCKSTEP_OK) << lockstep_comm_last_error(comm);
    EXPECT_EQ(buffers[k][0], static_cast<float>(2 * k + 1));  // (k + 0) + (k + 1)
    reported_sent += info.bytes_sent;
    reported_received += info.bytes_received;
  }

  // Launched at once, the eight ran on every slot of the pool; the slots add up to the totals.
  lockstep_counters_t counters;
  counters.struct_size = sizeof counters;
  ASSERT_EQ(lockstep_comm_get_counters(comm, &counters), LOCKSTEP_OK);
  std::uint64_t sum_sent = 0, sum_received = 0;
  for (std::uint32_t slot = 0; slot < kPool; ++slot) {
    ASSERT_EQ(lockstep_comm_get_slot_bytes(comm, slot, &sent, &received), LOCKSTEP_OK);
    EXPECT_GT(sent, 0u) << "slot " << slot << " of peer " << index;
    EXPECT_GT(received, 0u) << "slot " << slot << " of peer " << index;
    sum_sent += sent;
    sum_received += received;
  }
  EXPECT_EQ(sum_sent, counters.all_reduce_bytes_sent);
  EXPECT_EQ(sum_received, counters.all_reduce_bytes_received);
  EXPECT_EQ(sum_sent, reported_sent);
  EXPECT_EQ(sum_received, reported_received);

  // The direction: a broadcast moves bytes one way only, from the root (rank 0) to the
  // other peer: the root's slots count them as sent, the other's as received.
  std::uint32_t rank = 0;
  ASSERT_EQ(lockstep_comm_get_rank(comm, &rank), LOCKSTEP_OK);
  std::vector<float> payload(kCount, static_cast<float>(index));
  lockstep_broadcast_desc_t b = {payload.data(), payload.size(), LOCKSTEP_F32, 0, 99};
  ASSERT_EQ(lockstep_comm_broadcast(comm, &b, nullptr), LOCKSTEP_OK) << lockstep_comm_last_error(comm);
  std::uint64_t after_sent = 0, after_received = 0;
  for (std::uint32_t slot = 0; slot < kPool; ++slot) {
    ASSERT_EQ(lockstep_comm_get_slot_bytes(comm, slot, &sent, &received), LOCKSTEP_OK);
    after_sent += sent;
    after_received += received;
  }
  const std::uint64_t payload_bytes = kCount * sizeof(float);
  const std::uint64_t moved_out = after_sent - sum_sent, moved_in = after_received - sum_received;
  EXPECT_GE(rank == 0 ? moved_out : moved_in, payload_bytes) << "peer " << index << " of rank " << rank;
  EXPECT_LT(rank == 0 ? moved_in : moved_out, payload_bytes / 16) << "peer " << index << " of rank " << rank;

  // Bad arguments: INVALID_ARGUMENT, outputs untouched.
  sent = 7;
  received = 7;
  EXPECT_EQ(lockstep_comm_get_slot_bytes(comm, kPool, &sent, &received), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(lockstep_comm_get_slot_bytes(comm, UINT32_MAX, &sent, &received), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(sent, 7u);
  EXPECT_EQ(received, 7u);
  EXPECT_EQ(lockstep_comm_get_slot_bytes(comm, 0, nullptr, &received), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(lockstep_comm_get_slot_bytes(comm, 0, &sent, nullptr), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(lockstep_comm_get_slot_bytes(nullptr, 0, &sent, &received), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(received, 7u);
  lockstep_comm_destroy(comm);
}

TEST(CapiSlotBytes, ConcurrentAllReducesFillEverySlotAndAddUpToTheTotals) {
  lockstep_master_config_t config;
  ASSERT_EQ(lockstep_master_config_init(&config), LOCKSTEP_OK);
  config.listen_host = "127.0.0.1";
  config.listen_port = 0;
  lockstep_master_t* master = nullptr;
  ASSERT_EQ(lockstep_master_create(&config, &master), LOCKSTEP_OK);
  ASSERT_EQ(lockstep_master_run(master), LOCKSTEP_OK);
  std::uint16_t port = 0;
  ASSERT_EQ(lockstep_master_port(master, &port), LOCKSTEP_OK);
  std::vector<std::thread> peers;
  for (std::size_t i = 0; i < 2; ++i) peers.emplace_back(peer, port, i);
  for (auto& t : peers) t.join();
  EXPECT_EQ(lockstep_master_interrupt(master), LOCKSTEP_OK);
  EXPECT_EQ(lockstep_master_await(master), LOCKSTEP_OK);
  EXPECT_EQ(lockstep_master_destroy(master), LOCKSTEP_OK);
}

}  // namespace
