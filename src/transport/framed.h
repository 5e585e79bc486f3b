// Whole frames over a blocking socket with a deadline: used for handshakes.
#pragma once

#include "protocol/codec.h"
#include "transport/socket.h"

namespace lockstep::transport {

Status send_message(int fd, const proto::Message& message, std::uint32_t timeout_ms, int cancel_fd = -1);
// Reads one frame; malformed input becomes a PROTOCOL_ERROR status.
Result<proto::Message> recv_message(int fd, std::uint32_t timeout_ms, int cancel_fd = -1);

}  // namespace lockstep::transport
