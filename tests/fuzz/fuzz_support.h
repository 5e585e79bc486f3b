// Helpers shared by the libFuzzer targets: a reader that takes fixed-width values from
// the front of the input (and its mirror, for writing seeds), the codec round-trip
// check, and the seed-writing mode (LOCKSTEP_FUZZ_WRITE_SEEDS, see docs/fuzzing.md).
#pragma once

#include "common/limits.h"
#include "protocol/codec.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace lockstep::fuzz {

// A property does not hold: report it and abort (libFuzzer saves the input).
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Little-endian values from the front of the input; past its end every value is 0, so
// that any input, however short, is a complete description.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  bool done() const { return pos_ >= size_; }
  std::size_t left() const { return pos_ < size_ ? size_ - pos_ : 0; }
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <typename T>
  T u() {
    static_assert(std::is_unsigned_v<T>);
    T value = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) value = static_cast<T>(value | (static_cast<T>(byte()) << (8 * i)));
    return value;
  }
  bool flag() { return (byte() & 1) != 0; }
  std::span<const std::uint8_t> bytes(std::size_t n) {
    n = std::min(n, left());
    std::span<const std::uint8_t> out(data_ + pos_, n);
    pos_ += n;
    return out;
  }
  std::string text(std::size_t n) {
    const auto b = bytes(n);
    return std::string(b.begin(), b.end());
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// The mirror of Input, for writing seeds.
class Output {
 public:
  void byte(std::uint8_t value) { out_.push_back(value); }
  template <typename T>
  void u(T value) {
    static_assert(std::is_unsigned_v<T>);
    for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  void append(std::span<const std::uint8_t> bytes) { out_.insert(out_.end(), bytes.begin(), bytes.end()); }
  void append(const std::string& text) { out_.insert(out_.end(), text.begin(), text.end()); }
  const std::vector<std::uint8_t>& bytes() const { return out_; }

 private:
  std::vector<std::uint8_t> out_;
};

// The message a receiver decodes from what the encoder writes: the encoder cuts
// reasons (and authentication proofs) at their wire bounds; nothing else changes.
inline proto::Message as_received(proto::Message message) {
  std::visit(
      [](auto& m) {
        if constexpr (requires { m.reason; }) {
          if (m.reason.size() > limits::kWireStringBytesMax) m.reason.resize(limits::kWireStringBytesMax);
        }
        if constexpr (requires { m.auth; }) {
          if (m.auth.size() > 512) m.auth.resize(512);
        }
      },
      message);
  return message;
}

// Encodes the message, decodes the frame (header and payload), and checks that the
// decoded message is the message as received and that it encodes to the same bytes.
// Returns the frame.
inline std::vector<std::uint8_t> check_round_trip(const proto::Message& message) {
  const std::vector<std::uint8_t> frame = proto::encode_frame(message);
  const std::string name = proto::msg_type_name(proto::type_of(message));
  if (frame.size() < proto::kFrameHeaderBytes) fail(name + ": frame shorter than its header");
  const auto header = proto::decode_header(std::span<const std::uint8_t, proto::kFrameHeaderBytes>(frame.data(), proto::kFrameHeaderBytes));
  if (!header.is_ok()) fail(name + ": the encoded header does not decode: " + header.status().message());
  if (header.value().type != proto::type_of(message)) fail(name + ": the encoded header names another type");
  if (header.value().payload_bytes != frame.size() - proto::kFrameHeaderBytes) fail(name + ": wrong payload length");
  const auto decoded = proto::decode_payload(header.value().type, std::span(frame).subspan(proto::kFrameHeaderBytes));
  if (!decoded.is_ok()) fail(name + ": the encoded payload does not decode: " + decoded.status().message());
  if (!(decoded.value() == as_received(message))) fail(name + ": decoding the encoding gives another message");
  if (proto::encode_frame(decoded.value()) != frame) fail(name + ": re-encoding the decoded message gives other bytes");
  return frame;
}

using Seeds = std::vector<std::pair<std::string, std::vector<std::uint8_t>>>;

// The seed-writing mode: with LOCKSTEP_FUZZ_WRITE_SEEDS=<dir> in the environment, the
// target writes its seeds (name -> bytes) into dir and exits instead of fuzzing.
template <typename MakeSeeds>
void write_seeds_if_asked(MakeSeeds make_seeds) {
  const char* dir = std::getenv("LOCKSTEP_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  std::filesystem::create_directories(dir);
  const Seeds seeds = make_seeds();
  for (const auto& [name, bytes] : seeds) {
    std::ofstream file(std::filesystem::path(dir) / name, std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!file) fail("cannot write seed " + name);
  }
  std::fprintf(stderr, "wrote %zu seeds to %s\n", seeds.size(), dir);
  std::exit(0);
}

}  // namespace lockstep::fuzz
