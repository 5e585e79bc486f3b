// The master link under a test's control, in one process (an embedded master, peers or
// raw clients on threads):
//  - a proxy between the peers and the master that fails an attempt after every peer
//    finished its ring (it rewrites the second CollectiveDone of the attempt into a
//    failure): each peer must undo the all-reduce it had completed, and the retry works;
//  - a client that sends its Hello and then never reads what the master sends: the master
//    drops it once its send queue passes limits::kSendQueueBytesMax, rather than grow.
#include "cluster.h"

#include "common/limits.h"
#include "protocol/codec.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep::testing {
namespace {

int listen_loopback(std::uint16_t* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 16) != 0) return -1;
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

int connect_loopback(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

bool read_exactly(int fd, std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

bool write_all(int fd, const std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put <= 0) return false;
    p += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

// The next frame the master sent, decoded; nothing if none came within the time.
std::optional<proto::Message> read_message(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return std::nullopt;
  std::uint8_t header_bytes[proto::kFrameHeaderBytes];
  if (!read_exactly(fd, header_bytes, sizeof header_bytes)) return std::nullopt;
  auto header = proto::decode_header(std::span<const std::uint8_t, proto::kFrameHeaderBytes>(header_bytes));
  if (!header.is_ok()) return std::nullopt;
  std::vector<std::uint8_t> payload(header.value().payload_bytes);
  if (!read_exactly(fd, payload.data(), payload.size())) return std::nullopt;
  auto message = proto::decode_payload(header.value().type, payload);
  if (!message.is_ok()) return std::nullopt;
  return message.value();
}

// Forwards every peer's master connection to the master; on the way up it rewrites the
// second CollectiveDone of the first attempt of `tag` into a failure. By then both
// peers of the ring have finished their part (each reports only after its ring ended),
// so the master's failure reaches peers that completed the all-reduce.
class FailingProxy {
 public:
  FailingProxy(std::uint16_t master_port, std::uint64_t tag) : master_port_(master_port), tag_(tag) {
    listen_fd_ = listen_loopback(&port_);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~FailingProxy() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : pumps_) t.join();
    for (const int fd : fds_) ::close(fd);
    ::close(listen_fd_);
  }
  std::uint16_t port() const { return port_; }
  int rewritten() const { return rewritten_.load(); }

 private:
  void accept_loop() {
    for (;;) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) < 0 || stop_) return;
      if ((p.revents & POLLIN) == 0) continue;
      const int peer = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (peer < 0) return;
      const int master = connect_loopback(master_port_);
      std::lock_guard<std::mutex> lock(mutex_);
      fds_.push_back(peer);
      if (master < 0) {
        ::shutdown(peer, SHUT_RDWR);
        continue;
      }
      fds_.push_back(master);
      pumps_.emplace_back([this, peer, master] { up(peer, master); });
      pumps_.emplace_back([master, peer] { down(master, peer); });
    }
  }
  // Master to peer: bytes as they come.
  static void down(int master, int peer) {
    std::vector<std::uint8_t> buffer(1 << 16);
    for (;;) {
      const ssize_t got = ::recv(master, buffer.data(), buffer.size(), 0);
      if (got <= 0 || !write_all(peer, buffer.data(), static_cast<std::size_t>(got))) break;
    }
    ::shutdown(peer, SHUT_RDWR);
    ::shutdown(master, SHUT_RDWR);
  }
  // Peer to master: frame by frame.
  void up(int peer, int master) {
    std::vector<std::uint8_t> frame;
    for (;;) {
      frame.resize(proto::kFrameHeaderBytes);
      if (!read_exactly(peer, frame.data(), frame.size())) break;
      auto header = proto::decode_header(std::span<const std::uint8_t, proto::kFrameHeaderBytes>(frame.data(),
                                                                                                proto::kFrameHeaderBytes));
      if (!header.is_ok()) break;
      frame.resize(proto::kFrameHeaderBytes + header.value().payload_bytes);
      if (!read_exactly(peer, frame.data() + proto::kFrameHeaderBytes, header.value().payload_bytes)) break;
      if (header.value().type == proto::MsgType::kCollectiveDone) {
        auto message = proto::decode_payload(
            header.value().type, std::span<const std::uint8_t>(frame).subspan(proto::kFrameHeaderBytes));
        if (message.is_ok()) {
          auto done = std::get<proto::CollectiveDone>(message.value());
          if (done.tag == tag_ && should_fail(done)) {
            done.ok = false;
            done.reason = "failed by the test's proxy after the ring finished";
            frame = proto::encode_frame(done);
            ++rewritten_;
          }
        }
      }
      if (!write_all(master, frame.data(), frame.size())) break;
    }
    ::shutdown(peer, SHUT_RDWR);
    ::shutdown(master, SHUT_RDWR);
  }
  bool should_fail(const proto::CollectiveDone& done) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_attempt_ == 0) first_attempt_ = done.attempt;
    return done.attempt == first_attempt_ && done.ok && ++dones_of_first_ == 2;
  }

  std::uint16_t master_port_;
  std::uint64_t tag_;
  std::uint16_t port_ = 0;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<int> rewritten_{0};
  std::mutex mutex_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
  std::uint64_t first_attempt_ = 0;
  int dones_of_first_ = 0;
  std::thread acceptor_;
};

// guarantee 2: a peer that holds the result when the master fails the attempt puts the
// destination back as it was before the call, in place and out of place alike. (The
// attempts run by recursive doubling, which has no commit exchange: a ring's peers would
// commit among themselves, and a report rewritten on the way could not undo that,
// docs/protocol.md, "Completion".)
TEST(MasterLink, AnAttemptFailedAfterTheRingFinishedIsUndoneOnEveryPeer) {
  constexpr std::uint64_t kTag = 5;
  constexpr std::size_t kCount = 100'000;  // f32: a ring, not the votes
  Cluster cluster;
  FailingProxy proxy(cluster.port(), kTag);
  std::vector<std::thread> threads;
  for (std::size_t index = 0; index < 2; ++index) {
    threads.emplace_back([&, index] {
      peer::Options options;
      options.master_port = proxy.port();
      options.base_port = 0;
      options.allreduce_algorithm = proto::Algorithm::kDoubling;
      auto created = peer::Communicator::create(options);
      ASSERT_TRUE(created.is_ok()) << created.status().to_string();
      auto& comm = *created.value();
      ASSERT_TRUE(Cluster::join(comm, 2)) << comm.last_error();
      std::vector<float> in_place(kCount), src(kCount), dst(kCount, -7.0f);
      for (std::size_t i = 0; i < kCount; ++i) {
        in_place[i] = static_cast<float>(index * 1000 + i % 1000);
        src[i] = static_cast<float>(index + 1);
      }
      const std::vector<float> in_place_before = in_place, dst_before = dst;
      peer::ReduceDescriptor a{in_place.data(), in_place.data(), kCount, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE,
                               kTag};
      auto failed = comm.all_reduce(a);
      ASSERT_FALSE(failed.is_ok());
      EXPECT_EQ(failed.status().code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << failed.status().to_string();
      EXPECT_NE(failed.status().message().find("after the ring finished"), std::string::npos)
          << failed.status().to_string();
      EXPECT_TRUE(in_place == in_place_before) << "peer " << index << ": the finished all-reduce was not undone";
      // The retry of the same tag succeeds with the survivors (both).
      auto retried = comm.all_reduce(a);
      ASSERT_TRUE(retried.is_ok()) << retried.status().to_string();
      EXPECT_EQ(in_place[3], static_cast<float>(0 * 1000 + 3 + 1 * 1000 + 3));
      // Out of place: the first attempt of another tag goes through the proxy untouched.
      peer::ReduceDescriptor b{src.data(), dst.data(), kCount, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, kTag + 1};
      auto other = comm.all_reduce(b);
      ASSERT_TRUE(other.is_ok()) << other.status().to_string();
      EXPECT_EQ(dst[0], 3.0f);
      EXPECT_FALSE(dst == dst_before);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(proxy.rewritten(), 1);
}

// README: all-reduce-multiple-with-retry retries an all-reduce that failed with the
// survivors and returns once every one succeeded. The proxy fails the first attempt of
// one of four (after its ring finished); every result is still the full sum.
TEST(MasterLink, MultipleWithRetryRetriesTheAttemptThatFailed) {
  constexpr std::uint64_t kFailedTag = 32;
  constexpr std::size_t kCount = 50'000;
  Cluster cluster;
  FailingProxy proxy(cluster.port(), kFailedTag);
  std::vector<std::thread> threads;
  for (std::size_t index = 0; index < 2; ++index) {
    threads.emplace_back([&, index] {
      peer::Options options;
      options.master_port = proxy.port();
      options.base_port = 0;
      options.p2p_pool_size = 2;
      options.allreduce_algorithm = proto::Algorithm::kDoubling;  // no commit exchange (see above)
      auto created = peer::Communicator::create(options);
      ASSERT_TRUE(created.is_ok()) << created.status().to_string();
      auto& comm = *created.value();
      ASSERT_TRUE(Cluster::join(comm, 2)) << comm.last_error();
      std::vector<std::vector<std::int32_t>> buffers(4, std::vector<std::int32_t>(kCount));
      std::vector<peer::ReduceDescriptor> list;
      for (std::size_t k = 0; k < buffers.size(); ++k) {
        for (std::size_t i = 0; i < kCount; ++i) buffers[k][i] = static_cast<std::int32_t>(k * 100 + index + 1);
        list.push_back(peer::ReduceDescriptor{buffers[k].data(), buffers[k].data(), kCount, LOCKSTEP_I32, LOCKSTEP_SUM,
                                              LOCKSTEP_QUANT_NONE, 30 + k});
      }
      std::vector<peer::ReduceInfo> infos;
      const Status s = comm.all_reduce_multiple_with_retry(list, 2, &infos);
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      for (std::size_t k = 0; k < buffers.size(); ++k) {
        EXPECT_EQ(buffers[k][0], static_cast<std::int32_t>(2 * k * 100 + 3)) << "tag " << 30 + k;
        EXPECT_EQ(buffers[k][kCount - 1], static_cast<std::int32_t>(2 * k * 100 + 3)) << "tag " << 30 + k;
        EXPECT_EQ(infos[k].world_size, 2u);
      }
      EXPECT_EQ(comm.counters().retries, 1u);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(proxy.rewritten(), 1);
}

// Bad input: a client that never reads. Two raw clients say Hello and are admitted to
// one group (the first alone, then the second by the first's update vote); then both
// start the same small all-reduces as fast as they can, the second reading every
// result and the first none. The master queues the first's results until the queue
// passes kSendQueueBytesMax, then drops the connection (the client's writes fail) and
// says why.
TEST(MasterLink, AClientThatNeverReadsIsDroppedAtTheSendQueueBound) {
  Cluster cluster;
  proto::Hello hello;
  hello.p2p_port = 1;  // never dialled: the clients report no ring connections missing
  hello.shared_state_port = hello.benchmark_port = hello.p2p_port;  // a peer names all three ports or none
  hello.advertised_host = "127.0.0.1";  // taken at its word: the master does not probe the port
  const auto hello_frame = proto::encode_frame(hello);
  // Answers EstablishP2P with an empty report; true once the topology result came.
  const auto establish = [](int fd) {
    std::optional<proto::Message> m;
    while ((m = read_message(fd, 10'000)) && !std::holds_alternative<proto::EstablishP2P>(*m)) {}
    if (!m) return false;
    const auto report = proto::encode_frame(proto::P2PReport{std::get<proto::EstablishP2P>(*m).epoch, {}});
    if (!write_all(fd, report.data(), report.size())) return false;
    while ((m = read_message(fd, 10'000)) && !std::holds_alternative<proto::TopologyResult>(*m)) {}
    return m.has_value() && std::get<proto::TopologyResult>(*m).status == LOCKSTEP_OK;
  };
  const int fd = connect_loopback(cluster.port());
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(write_all(fd, hello_frame.data(), hello_frame.size()));
  ASSERT_TRUE(establish(fd)) << "the first client was not admitted";
  const int reader = connect_loopback(cluster.port());
  ASSERT_GE(reader, 0);
  ASSERT_TRUE(write_all(reader, hello_frame.data(), hello_frame.size()));
  // The update vote admits the second only once the master has registered it.
  for (bool pending = false; !pending;) {
    const auto ask = proto::encode_frame(proto::VotePeersPending{});
    ASSERT_TRUE(write_all(fd, ask.data(), ask.size()));
    std::optional<proto::Message> m;
    while ((m = read_message(fd, 10'000)) && !std::holds_alternative<proto::PeersPendingResult>(*m)) {}
    ASSERT_TRUE(m.has_value()) << "no PeersPendingResult";
    pending = std::get<proto::PeersPendingResult>(*m).pending;
    if (!pending) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto vote = proto::encode_frame(proto::VoteUpdateTopology{});
  ASSERT_TRUE(write_all(fd, vote.data(), vote.size()));
  std::thread admit_first([&] { EXPECT_TRUE(establish(fd)); });
  ASSERT_TRUE(establish(reader)) << "the second client was not admitted";
  admit_first.join();
  // From here on the first client reads nothing. Each batch: eight all-reduces of 8 KiB
  // that travel with the votes, with tags of their own; the second client votes for the
  // batches the first has sent, and reads every 8 KiB result.
  constexpr std::uint64_t kCount = 2048;
  const auto batch_of = [&](std::uint64_t first_tag) {
    std::vector<std::uint8_t> batch;
    for (std::uint64_t t = 0; t < 8; ++t) {
      proto::CollectiveInit init;
      init.tag = first_tag + t;
      init.descriptor.count = kCount;
      init.descriptor.dtype = static_cast<std::uint8_t>(LOCKSTEP_F32);
      init.data.assign(kCount * sizeof(float), 0);
      proto::encode_frame(init, batch);
    }
    return batch;
  };
  std::atomic<std::uint64_t> batches_sent{0};
  std::atomic<bool> stop{false};
  std::thread drain([&] {
    while (!stop.load()) {
      if (!read_message(reader, 100) && stop.load()) break;
    }
  });
  std::thread second([&] {
    std::uint64_t voted = 0;
    while (!stop.load()) {
      if (voted == batches_sent.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      const auto batch = batch_of(1 + 8 * voted++);
      if (!write_all(reader, batch.data(), batch.size())) break;
    }
  });
  // What the master may hold before it must drop the client: its queue, plus what both
  // kernels buffer on the way (a few MiB each on loopback), with room to spare.
  const std::size_t written_bytes_max = 4 * limits::kSendQueueBytesMax;
  std::size_t written = 0;
  bool dropped = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120 * LOCKSTEP_TEST_TIME_SCALE);
  std::vector<std::uint8_t> batch = batch_of(1);
  std::size_t at = 0;  // bytes of the batch already sent
  while (written < written_bytes_max && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 100) < 0) break;
    if ((p.revents & (POLLERR | POLLHUP)) != 0) {
      dropped = true;
      break;
    }
    if ((p.revents & POLLOUT) == 0) continue;
    const ssize_t put = ::send(fd, batch.data() + at, batch.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (put <= 0) {
      dropped = true;
      break;
    }
    written += static_cast<std::size_t>(put);
    at += static_cast<std::size_t>(put);
    if (at == batch.size()) {
      batches_sent.fetch_add(1);
      batch = batch_of(1 + 8 * batches_sent.load());
      at = 0;
    }
  }
  stop.store(true);
  second.join();
  ::shutdown(reader, SHUT_RDWR);
  drain.join();
  ::close(reader);
  ::close(fd);
  ASSERT_TRUE(dropped) << "the master still took requests after " << written
                       << " bytes of requests: its send queue to a client that never reads is unbounded";
  EXPECT_GT(written, limits::kSendQueueBytesMax / 2) << "dropped before the bound";
  // The removal says why.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::string reasons;
  for (;;) {
    auto state = cluster.master().render(master::View::kStateJson, 5000);
    ASSERT_TRUE(state.is_ok());
    const auto json = nlohmann::json::parse(state.value());
    reasons.clear();
    for (const auto& e : json["events"]) {
      if (e["kind"] == "removed") reasons += e["reason"].get<std::string>() + "\n";
    }
    if (reasons.find("send queue above " + std::to_string(limits::kSendQueueBytesMax) + " bytes") != std::string::npos) {
      break;
    }
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "removals: " << reasons;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The master serves the others as before: two peers join and reduce.
  cluster.run(2, [](peer::Communicator& comm, std::size_t index) {
    std::vector<float> x(1000, static_cast<float>(index + 1));
    peer::ReduceDescriptor d{x.data(), x.data(), x.size(), LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 1};
    auto r = comm.all_reduce(d);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(x[0], 3.0f);
  });
}

}  // namespace
}  // namespace lockstep::testing
