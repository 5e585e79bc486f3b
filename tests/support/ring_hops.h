// Socket pairs standing in for a ring's connections in the ring's unit tests: a hop
// (peer i to peer i+1) with one connection per stream and, when encrypted, the ciphers
// of each; attach() hands a peer its sending hop and its receiving one.
#pragma once

#include "collectives/ring.h"
#include "security/crypto.h"

#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <vector>

namespace lockstep::testing {

using coll::RingIo;
using coll::RingStream;

struct SocketPair {
  int fds[2] = {-1, -1};  // fds[0] sends, fds[1] receives
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds), 0); }
  SocketPair(const SocketPair&) = delete;
  SocketPair& operator=(const SocketPair&) = delete;
  ~SocketPair() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
};

// The connections of one hop (peer i to peer i+1), one per stream, with the ciphers of
// each when encrypted.
struct Hop {
  std::vector<std::unique_ptr<SocketPair>> links;
  std::vector<std::unique_ptr<security::Aead>> seal, open;
  Hop(std::size_t streams, bool encrypted) {
    for (std::size_t k = 0; k < streams; ++k) {
      links.push_back(std::make_unique<SocketPair>());
      if (encrypted) {
        const auto key = security::random_key();
        seal.push_back(std::make_unique<security::Aead>(key));
        open.push_back(std::make_unique<security::Aead>(key));
      }
    }
  }
  security::Aead* seal_of(std::size_t k) const { return seal.empty() ? nullptr : seal[k].get(); }
  security::Aead* open_of(std::size_t k) const { return open.empty() ? nullptr : open[k].get(); }
};

// The sending side of a hop in `io`, and the receiving side of `from` with its streams
// handed over on request (of exactly the count the hop has).
void attach(RingIo& io, const Hop& to, const Hop& from) {
  io.tx_fd = to.links[0]->fds[0];
  io.seal = to.seal_of(0);
  for (std::size_t k = 1; k < to.links.size(); ++k) io.tx_more.push_back(RingStream{to.links[k]->fds[0], to.seal_of(k)});
  io.rx_fd = from.links[0]->fds[1];
  io.open = from.open_of(0);
  io.rx_more = [&from](std::size_t streams, std::vector<RingStream>* out) {
    if (streams != from.links.size()) return lockstep::Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "unexpected stream count");
    for (std::size_t k = 1; k < streams; ++k) out->push_back(RingStream{from.links[k]->fds[1], from.open_of(k)});
    return lockstep::Status::ok();
  };
}

}  // namespace lockstep::testing
