// Sealed frames (frames.h).
#include "security/frames.h"

namespace lockstep::security {
namespace {

constexpr std::string_view kBytesLabel = "lockstep sealed bytes v1";

std::span<const std::uint8_t> bytes_label() {
  return {reinterpret_cast<const std::uint8_t*>(kBytesLabel.data()), kBytesLabel.size()};
}

}  // namespace

void FrameCrypto::seal_bytes(std::span<const std::uint8_t> plain, std::uint8_t* out) { tx_.seal(plain, bytes_label(), out); }

bool FrameCrypto::open_bytes(std::span<const std::uint8_t> box, std::uint8_t* plain) {
  return rx_.open(box, bytes_label(), plain);
}

void FrameCrypto::seal_frame(std::span<const std::uint8_t> inner, std::vector<std::uint8_t>& out) {
  const auto length = static_cast<std::uint32_t>(inner.size() + kTagBytes);
  const std::size_t start = out.size();
  out.resize(start + proto::kFrameHeaderBytes + length);
  std::uint8_t* h = out.data() + start;
  proto::write_header(h, proto::MsgType::kSealed, length);
  tx_.seal(inner, std::span<const std::uint8_t>(h, proto::kFrameHeaderBytes), h + proto::kFrameHeaderBytes);
}

std::vector<std::uint8_t> FrameCrypto::seal(const proto::Message& message) {
  const auto inner = proto::encode_frame(message);
  std::vector<std::uint8_t> out;
  seal_frame(inner, out);
  return out;
}

Result<proto::Message> FrameCrypto::open(std::span<const std::uint8_t, proto::kFrameHeaderBytes> header,
                                         std::span<const std::uint8_t> payload) {
  if (payload.size() < kTagBytes + proto::kFrameHeaderBytes) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "Sealed: shorter than a tag and a frame header");
  }
  plain_.resize(payload.size() - kTagBytes);
  if (!rx_.open(payload, header, plain_.data())) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                  "Sealed: the frame does not verify (altered, replayed, reordered or sent with another key)");
  }
  const std::span<const std::uint8_t> plain(plain_);
  auto inner = proto::decode_header(plain.first<proto::kFrameHeaderBytes>());
  if (!inner.is_ok()) return inner.status();
  if (inner.value().type == proto::MsgType::kSealed) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "Sealed: a sealed frame inside a sealed frame");
  if (inner.value().payload_bytes != plain.size() - proto::kFrameHeaderBytes) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "Sealed: the inner frame's length does not match");
  }
  return proto::decode_payload(inner.value().type, plain.subspan(proto::kFrameHeaderBytes));
}

}  // namespace lockstep::security
