// The connector's side of the p2p handshake (handshake.h); the acceptor's side is in
// InboundListener::handshake (inbound.cpp).
#include "peer/handshake.h"

#include "common/log.h"
#include "transport/framed.h"

#include <span>

namespace lockstep::peer {
namespace {

constexpr const char* kLog = "peer";

// The acceptor refused because its encrypt_data differs from ours (hello.flags).
Status refused(const proto::P2PHello& hello, StatusCode status) {
  const std::string to = hello.to.to_string();
  if (status == proto::kP2PEncryptionMismatch) {
    const bool mine = (hello.flags & proto::kP2PFlagEncryptData) != 0;
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  mine ? "peer " + to + " does not encrypt the data plane and this peer does (encrypt_data differs)"
                       : "peer " + to + " encrypts the data plane and this peer does not (encrypt_data differs)");
  }
  return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "peer " + to + " refused the p2p handshake");
}

}  // namespace

Status p2p_handshake(int fd, proto::P2PHello hello, bool secret, const std::vector<std::uint8_t>& pair_key,
                     std::uint32_t timeout_ms, security::SessionKeys* keys, int cancel_fd,
                     const std::function<Status(const security::SessionKeys&)>& pipelined) {
  const std::string to = hello.to.to_string();
  security::Key key{};
  security::Nonce client{};
  if (secret) {
    if (!security::to_key(pair_key, &key)) {
      return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "the master gave no pair key for peer " + to);
    }
    client = security::random_nonce();
    hello.auth = security::to_bytes(client);
  } else {
    hello.auth.clear();
  }
  const auto frame = proto::encode_frame(hello);
  Status s = transport::send_all(fd, frame, timeout_ms, cancel_fd);
  if (!s.is_ok()) return s;
  security::SessionKeys session;
  if (!secret && pipelined) {
    if (s = pipelined(session); !s.is_ok()) return s;
  }
  auto reply = transport::recv_message(fd, timeout_ms, nullptr, cancel_fd);
  if (!reply.is_ok()) return reply.status();
  if (secret) {
    const auto* challenge = std::get_if<proto::AuthChallenge>(&reply.value());
    if (challenge == nullptr) {
      if (const auto* a = std::get_if<proto::P2PHelloAck>(&reply.value()); a != nullptr && a->status != LOCKSTEP_OK) {
        return refused(hello, a->status);
      }
      return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "peer " + to + " did not ask for a proof of the pair key");
    }
    security::Nonce server{};
    const std::span<const std::uint8_t> transcript(frame.data() + proto::kFrameHeaderBytes,
                                                   frame.size() - proto::kFrameHeaderBytes);
    if (!security::to_nonce(challenge->nonce, &server) ||
        !security::verify(key, security::kAcceptorRole, client, server, transcript, challenge->proof)) {
      return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "peer " + to + " could not prove the pair key");
    }
    const auto mine = security::proof(key, security::kConnectorRole, client, server, transcript);
    s = transport::send_message(fd, proto::AuthProof{security::to_bytes(mine)}, timeout_ms, nullptr, cancel_fd);
    if (!s.is_ok()) return s;
    session = security::session_keys(key, client, server, transcript);
    if (keys != nullptr) *keys = session;
    if (pipelined) {
      if (s = pipelined(session); !s.is_ok()) return s;
    }
    reply = transport::recv_message(fd, timeout_ms, nullptr, cancel_fd);
    if (!reply.is_ok()) return reply.status();
  }
  const auto* ack = std::get_if<proto::P2PHelloAck>(&reply.value());
  if (ack == nullptr) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "peer " + to + " refused the p2p handshake");
  if (ack->status != LOCKSTEP_OK) return refused(hello, ack->status);
  return Status::ok();
}

Result<transport::Fd> dial_relay(const RelayAddress& relay, PeerId self, const proto::MemberInfo& other,
                                 proto::Channel channel, std::uint32_t slot, bool receiver, std::uint32_t timeout_ms,
                                 int cancel_fd) {
  auto fd = transport::connect_tcp(relay.host, relay.port, timeout_ms, cancel_fd);
  if (!fd.is_ok()) return fd.status();
  proto::P2PHello hello;
  hello.channel = proto::Channel::kRelay;
  hello.from = self;
  hello.to = other.id;
  hello.epoch = static_cast<std::uint64_t>(channel);  // the relayed connection's own channel
  hello.pool_index = slot;
  if (receiver) hello.flags |= proto::kP2PFlagReversed;
  // The relay is given the relay key of the pair, never the pair key itself.
  security::Key pair{};
  if (!security::to_key(other.key, &pair)) {
    return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "the master gave no pair key for peer " + other.id.to_string());
  }
  Status s = p2p_handshake(fd.value().get(), hello, true, security::to_bytes(security::relay_key(pair)), timeout_ms,
                           nullptr, cancel_fd);
  if (!s.is_ok()) {
    return Status(s.code(), "the relay at " + transport::join_host_port(relay.host, relay.port) +
                                " did not join this peer to " + other.id.to_string() + ": " + s.message());
  }
  return std::move(fd.value());
}

Result<MasterChannel> master_handshake(int fd, proto::Message hello, const std::optional<security::Key>& secret,
                                       const std::string& master, std::uint32_t timeout_ms) {
  const security::Nonce client_nonce = secret ? security::random_nonce() : security::Nonce{};
  if (secret) {
    std::visit(
        [&](auto& m) {
          if constexpr (requires { m.auth; }) m.auth = security::to_bytes(client_nonce);
        },
        hello);
  }
  const char* what = proto::msg_type_name(proto::type_of(hello));
  const auto hello_frame = proto::encode_frame(hello);
  Status sent = transport::send_all(fd, hello_frame, timeout_ms);
  if (!sent.is_ok()) {
    return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, std::string("sending ") + what + ": " + sent.message());
  }
  auto reply = transport::recv_message(fd, timeout_ms);
  if (!reply.is_ok()) {
    return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "no Welcome from the master: " + reply.status().message());
  }
  // With a secret the master proves it first (a master without the secret, or an
  // impostor, gets nothing from us), then we prove it and everything after is sealed.
  std::shared_ptr<security::FrameCrypto> crypto;
  if (const auto* challenge = std::get_if<proto::AuthChallenge>(&reply.value())) {
    if (!secret) {
      return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED, "the master requires the run secret; this side has none");
    }
    const std::span<const std::uint8_t> transcript(hello_frame.data() + proto::kFrameHeaderBytes,
                                                   hello_frame.size() - proto::kFrameHeaderBytes);
    security::Nonce server_nonce{};
    // During a rotation of the run secret the master proves the new and the previous
    // secret: one 32-byte proof each (docs/operations.md). One of them must be ours.
    bool proven = false;
    const std::span<const std::uint8_t> proofs(challenge->proof);
    if (security::to_nonce(challenge->nonce, &server_nonce) && !proofs.empty() &&
        proofs.size() % security::kProofBytes == 0) {
      for (std::size_t at = 0; at < proofs.size() && !proven; at += security::kProofBytes) {
        proven = security::verify(*secret, security::kMasterRole, client_nonce, server_nonce, transcript,
                                  proofs.subspan(at, security::kProofBytes));
      }
    }
    if (!proven) {
      LOG_WARN(kLog, "the master at " << master << " could not prove the run secret; not joining");
      return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED,
                    "the master could not prove the run secret (a different secret, or not this run's master)");
    }
    const auto proof = security::proof(*secret, security::kPeerRole, client_nonce, server_nonce, transcript);
    sent = transport::send_message(fd, proto::AuthProof{security::to_bytes(proof)}, timeout_ms);
    if (!sent.is_ok()) return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "sending AuthProof: " + sent.message());
    crypto = std::make_shared<security::FrameCrypto>(
        security::session_keys(*secret, client_nonce, server_nonce, transcript), /*client=*/true);
    reply = transport::recv_message(fd, timeout_ms, crypto.get());
    if (!reply.is_ok()) {
      // A frame that does not open: the stream was altered on the way.
      const StatusCode code = reply.status().code() == LOCKSTEP_STATUS_PROTOCOL_ERROR ? LOCKSTEP_STATUS_PROTOCOL_ERROR
                                                                                       : LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED;
      return Status(code, "no Welcome from the master: " + reply.status().message());
    }
  } else if (secret && std::holds_alternative<proto::Welcome>(reply.value())) {
    LOG_WARN(kLog, "the master at " << master << " did not ask for the run secret; not joining");
    return Status(LOCKSTEP_STATUS_AUTHENTICATION_FAILED,
                  "the master did not prove the run secret (it runs without one, or it is not this run's master)");
  }
  return MasterChannel{std::move(reply.value()), std::move(crypto)};
}

}  // namespace lockstep::peer
