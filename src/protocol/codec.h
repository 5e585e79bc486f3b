// Encoding and bounds-checked decoding of frames. Every frame is an 8-byte header
// (u32 payload length, u16 type, u16 flags = 0; little-endian) and a payload. The
// decoder never trusts a length or count from the wire: each type has a maximum
// payload size, every read is bounds-checked, trailing bytes are an error, and each
// failure names what was wrong.
#pragma once

#include "common/limits.h"
#include "protocol/messages.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace lockstep::proto {

inline constexpr std::size_t kFrameHeaderBytes = 8;
// A sealed frame's payload: a whole inner frame (header and payload within the inner
// type's bound) encrypted, plus the 16-byte authentication tag.
inline constexpr std::uint32_t kSealTagBytes = 16;
inline constexpr std::uint32_t kSealedPayloadBytesMax =
    limits::kControlFramePayloadBytesMax + static_cast<std::uint32_t>(kFrameHeaderBytes) + kSealTagBytes;

struct FrameHeader {
  std::uint32_t payload_bytes = 0;
  MsgType type = MsgType::kHello;
};

// Largest payload a frame of this type may carry; 0 if the type is unknown
// (a known type with an empty payload returns kEmptyPayload).
inline constexpr std::uint32_t kEmptyPayload = 0xffffffffu;
std::uint32_t payload_bytes_max(std::uint16_t raw_type);

// Validates a header: known type, flags zero, length within the type's bound.
Result<FrameHeader> decode_header(std::span<const std::uint8_t, kFrameHeaderBytes> bytes);

// Decodes a payload of a validated header into a message.
Result<Message> decode_payload(MsgType type, std::span<const std::uint8_t> payload);

// Writes a frame header (little-endian length, type, zero flags) at h.
void write_header(std::uint8_t* h, MsgType type, std::uint32_t payload_bytes);

// Appends one whole frame (header and payload) for the message to out.
void encode_frame(const Message& message, std::vector<std::uint8_t>& out);
std::vector<std::uint8_t> encode_frame(const Message& message);

}  // namespace lockstep::proto
