// Whole frames over a blocking socket with a deadline: used for handshakes.
#pragma once

#include "protocol/codec.h"
#include "security/frames.h"
#include "transport/socket.h"

namespace lockstep::transport {

// With crypto, the frame is sent sealed. cancel_fd: see connect_tcp in socket.h.
Status send_message(int fd, const proto::Message& message, std::uint32_t timeout_ms,
                    security::FrameCrypto* crypto = nullptr, int cancel_fd = -1);
// Reads one frame; malformed input becomes a PROTOCOL_ERROR status. With crypto, only
// a sealed frame that opens is accepted (or a plain Goodbye, see framed.cpp).
Result<proto::Message> recv_message(int fd, std::uint32_t timeout_ms, security::FrameCrypto* crypto = nullptr,
                                    int cancel_fd = -1);

}  // namespace lockstep::transport
