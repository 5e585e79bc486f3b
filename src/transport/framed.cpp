// Blocking frame IO for handshakes (the master's event loop has its own reader).
#include "transport/framed.h"

#include <array>
#include <vector>

namespace lockstep::transport {

Status send_message(int fd, const proto::Message& message, std::uint32_t timeout_ms, security::FrameCrypto* crypto,
                    int cancel_fd) {
  const auto bytes = crypto != nullptr ? crypto->seal(message) : proto::encode_frame(message);
  return send_all(fd, bytes, timeout_ms, cancel_fd);
}

Result<proto::Message> recv_message(int fd, std::uint32_t timeout_ms, security::FrameCrypto* crypto, int cancel_fd) {
  std::array<std::uint8_t, proto::kFrameHeaderBytes> header{};
  Status s = recv_exact(fd, header, timeout_ms, cancel_fd);
  if (!s.is_ok()) return s;
  auto decoded = proto::decode_header(header);
  if (!decoded.is_ok()) return decoded.status();
  // A plain Goodbye is the master's answer to a proof it rejects (it has no keys for
  // this connection); it can only end the connection, which anyone on the path can do.
  if (crypto != nullptr && decoded.value().type != proto::MsgType::kSealed && decoded.value().type != proto::MsgType::kGoodbye) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, std::string("expected a sealed frame, got ") +
                                                      proto::msg_type_name(decoded.value().type));
  }
  std::vector<std::uint8_t> payload(decoded.value().payload_bytes);
  s = recv_exact(fd, payload, timeout_ms, cancel_fd);
  if (!s.is_ok()) return s;
  if (crypto != nullptr && decoded.value().type == proto::MsgType::kSealed) return crypto->open(header, payload);
  return proto::decode_payload(decoded.value().type, payload);
}

}  // namespace lockstep::transport
