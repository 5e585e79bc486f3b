// Sealed control frames: after an authenticated handshake every frame of a control
// connection travels as one Sealed frame (type 192) whose payload is the whole inner
// frame, encrypted and authenticated with ChaCha20-Poly1305 under the direction's
// session key, a counter nonce and the outer header as associated data. A frame that
// was altered, replayed, dropped or reordered does not open, and the connection ends.
#pragma once

#include "protocol/codec.h"
#include "security/crypto.h"

#include <cstdint>
#include <span>
#include <vector>

namespace lockstep::security {

class FrameCrypto {
 public:
  // The client (the side that connected) sends with to_server; the server with to_client.
  FrameCrypto(const SessionKeys& keys, bool client)
      : tx_(client ? keys.to_server : keys.to_client), rx_(client ? keys.to_client : keys.to_server) {}

  // Appends one Sealed frame carrying the inner frame (header and payload).
  void seal_frame(std::span<const std::uint8_t> inner, std::vector<std::uint8_t>& out);
  std::vector<std::uint8_t> seal(const proto::Message& message);
  // Opens the payload of a frame whose header decoded as Sealed and decodes the inner
  // frame within its own type's bound. PROTOCOL_ERROR if it does not verify.
  Result<proto::Message> open(std::span<const std::uint8_t, proto::kFrameHeaderBytes> header,
                              std::span<const std::uint8_t> payload);

  // Raw bytes between frames (shared-state tensor bytes, whose lengths both ends know):
  // out = ciphertext || tag, kTagBytes longer than plain. Same key and counter as the
  // frames, so their place in the stream is authenticated too; a fixed label as the
  // associated data keeps them apart from frames.
  void seal_bytes(std::span<const std::uint8_t> plain, std::uint8_t* out);
  // plain = the opened box (box.size() - kTagBytes bytes); false if it does not verify.
  [[nodiscard]] bool open_bytes(std::span<const std::uint8_t> box, std::uint8_t* plain);

 private:
  Aead tx_;
  Aead rx_;
  std::vector<std::uint8_t> plain_;
};

}  // namespace lockstep::security
