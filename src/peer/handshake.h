// The connecting side of a p2p handshake (ring, shared-state and benchmark sockets) on
// a connected blocking socket. Without a secret: P2PHello, then the acceptor's
// P2PHelloAck. With one (docs/security.md): the P2PHello carries a fresh nonce, the
// acceptor answers with its nonce and its proof of the pair key, this side checks it
// and sends its own proof, and the acceptor's P2PHelloAck says it was accepted.
// Internal to the peer layer.
#pragma once

#include "common/status.h"
#include "protocol/messages.h"
#include "security/crypto.h"
#include "security/frames.h"
#include "transport/socket.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::peer {

// hello.auth is set here; hello.flags is the caller's (kP2PFlagEncryptData: this peer
// encrypts its data plane; an acceptor with another setting refuses, and the status
// names the difference, with the code INVALID_ARGUMENT). pair_key: the key the master gave for this pair (needed when
// secret is set). On success *keys (if given) holds the connection's session keys.
// PEER_CONNECTION_FAILED when refused, AUTHENTICATION_FAILED when the other side could
// not prove the pair key, the transport's status when the socket failed (or when
// cancel_fd, if >= 0, became readable: see transport::connect_tcp).
// `pipelined`, if given, runs once this side has said all it says in the handshake and
// before it reads the acceptor's P2PHelloAck, with the session keys: what it sends
// travels in the same round trip (an acceptor reads nothing past its handshake until it
// accepts, and closes the connection when it refuses). An error it returns ends the
// handshake with that error.
Status p2p_handshake(int fd, proto::P2PHello hello, bool secret, const std::vector<std::uint8_t>& pair_key,
                     std::uint32_t timeout_ms, security::SessionKeys* keys = nullptr, int cancel_fd = -1,
                     const std::function<Status(const security::SessionKeys&)>& pipelined = {});

// The relay in use, as a peer reaches it (Welcome.relay_host/relay_port, then each
// RelayAddress): the master's own, or a lockstep-relay process's.
struct RelayAddress {
  std::string host;
  std::uint16_t port = 0;  // 0: there is no relay
};

// Connects to the relay for connection `slot` of `channel` (ring or shared state) between
// this peer (`self`) and `other`, proving the relay key of their pair key (other.key), and waits until the
// relay has joined it to `other`'s (docs/protocol.md, "Relays"). `receiver`: this end
// receives the data (ring) or asks for it (shared state). Through the returned socket
// the two then run their own p2p handshake. PEER_CONNECTION_FAILED when the relay refuses,
// the transport's status when it or `other` does not answer within timeout_ms.
Result<transport::Fd> dial_relay(const RelayAddress& relay, PeerId self, const proto::MemberInfo& other,
                                 proto::Channel channel, std::uint32_t slot, bool receiver, std::uint32_t timeout_ms,
                                 int cancel_fd = -1);

// The connecting side of the master handshake (docs/security.md): sends `hello` (a
// Hello, or a lockstep-relay's RelayHello), and with a secret gives it a fresh nonce,
// checks the master's proof of the secret (one of the proofs during a rotation),
// proves it in turn, and seals what follows. Returns the master's answer (a Welcome, or
// a Goodbye for the caller to turn into its status) and the frame keys (null without a
// secret). `master` names the master in messages. MASTER_CONNECTION_FAILED when the
// socket fails, AUTHENTICATION_FAILED when the master does not prove the secret or asks
// for one this side does not have, PROTOCOL_ERROR for a sealed frame that does not open.
struct MasterChannel {
  proto::Message reply;
  std::shared_ptr<security::FrameCrypto> crypto;
};
Result<MasterChannel> master_handshake(int fd, proto::Message hello, const std::optional<security::Key>& secret,
                                       const std::string& master, std::uint32_t timeout_ms);

}  // namespace lockstep::peer
