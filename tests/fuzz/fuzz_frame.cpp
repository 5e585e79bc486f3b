// fuzz_frame: the input is a byte stream as a peer or the master receives it. It is
// split into frames with decode_header, and every payload is decoded with
// decode_payload. Properties:
//  - nothing crashes, leaks or hangs (ASan, UBSan, libFuzzer's timeout);
//  - a decoded message has the header's type, encodes back to exactly the bytes it was
//    decoded from (the encoding is canonical), and decoding that gives the same message;
//  - transport::recv_message (how handshakes, the shared-state channel and the p2p
//    hellos are read, here from a socket pair) returns the same messages, and fails
//    where the split fails, with the same status.
#include "fuzz_support.h"
#include "transport/framed.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <optional>

namespace {

using namespace lockstep;
namespace p = lockstep::proto;
using fuzz::fail;

// What a stream reader gets: every frame up to the first failure, then that failure
// (a header that does not decode, a truncated frame or the end of the stream, a
// payload that does not decode).
struct Expected {
  std::vector<p::Message> messages;
  Status failure;  // the decoder's status; ok: the stream ended (or was cut)
};

Expected split(std::span<const std::uint8_t> data) {
  Expected expected;
  bool stopped = false;
  std::size_t pos = 0;
  while (data.size() - pos >= p::kFrameHeaderBytes) {
    const auto header = p::decode_header(data.subspan(pos).first<p::kFrameHeaderBytes>());
    if (!header.is_ok()) {
      if (header.status().code() != LOCKSTEP_STATUS_PROTOCOL_ERROR) fail("decode_header failed without PROTOCOL_ERROR");
      if (!stopped) expected.failure = header.status();
      return expected;
    }
    const std::uint32_t bound = p::payload_bytes_max(static_cast<std::uint16_t>(header.value().type));
    if (bound == 0 || (bound == p::kEmptyPayload ? 0 : bound) < header.value().payload_bytes) {
      fail("decode_header accepted a length above the type's bound");
    }
    const std::size_t length = header.value().payload_bytes;
    if (data.size() - pos - p::kFrameHeaderBytes < length) return expected;  // cut: the stream ends mid-frame
    const auto frame = data.subspan(pos, p::kFrameHeaderBytes + length);
    pos += frame.size();
    const auto decoded = p::decode_payload(header.value().type, frame.subspan(p::kFrameHeaderBytes));
    if (!decoded.is_ok()) {
      if (decoded.status().code() != LOCKSTEP_STATUS_PROTOCOL_ERROR || decoded.status().message().empty()) {
        fail("decode_payload failed without a PROTOCOL_ERROR that names the problem");
      }
      // A stream reader stops here; the rest is still decoded for the other properties.
      if (!stopped) expected.failure = decoded.status();
      stopped = true;
      continue;
    }
    const p::Message& message = decoded.value();
    if (p::type_of(message) != header.value().type) fail("decode_payload returned another type");
    const std::vector<std::uint8_t> encoded = p::encode_frame(message);
    if (!std::equal(encoded.begin(), encoded.end(), frame.begin(), frame.end())) {
      fail(std::string(p::msg_type_name(header.value().type)) + ": the encoding of the decoded message differs from its bytes");
    }
    fuzz::check_round_trip(message);
    if (!stopped) expected.messages.push_back(message);
  }
  return expected;
}

// Reads the same bytes with transport::recv_message from a socket pair.
void compare_with_socket(std::span<const std::uint8_t> data, const Expected& expected) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) fail("socketpair failed");
  const transport::Fd reader(fds[0]);
  const transport::Fd writer(fds[1]);
  if (!data.empty()) {
    const ssize_t sent = ::send(writer.get(), data.data(), data.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    // Larger than the socket buffer: this input is not compared (it stays deterministic).
    if (sent != static_cast<ssize_t>(data.size())) return;
  }
  ::shutdown(writer.get(), SHUT_WR);
  for (const auto& message : expected.messages) {
    auto got = transport::recv_message(reader.get(), 1000);
    if (!got.is_ok()) fail("recv_message failed where the split decoded a frame: " + got.status().to_string());
    if (!(got.value() == message)) fail("recv_message returned another message than the split");
  }
  auto last = transport::recv_message(reader.get(), 1000);
  if (last.is_ok()) fail("recv_message returned a message where the split stopped");
  if (expected.failure.is_ok()) {
    if (last.status().code() != LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
      fail("recv_message at the end of the stream: " + last.status().to_string());
    }
  } else if (last.status().code() != expected.failure.code() || last.status().message() != expected.failure.message()) {
    fail("recv_message failed with " + last.status().to_string() + " where the split failed with " +
         expected.failure.to_string());
  }
}

// ---- seeds: one valid frame of every type, and six streams

state::Digest digest(std::uint64_t n) { return state::Digest{n * 0x9e3779b97f4a7c15ull, ~n}; }

std::vector<p::Message> sample_messages() {
  const PeerId a{0x1234, 1};
  const PeerId b{0x1234, 2};
  const p::MemberInfo ma{a, "10.0.0.1", 48150, 48151, 48152};
  const p::MemberInfo mb{b, "10.0.0.2", 48150, 48151, 0, std::vector<std::uint8_t>(32, 0x6b)};
  const p::CollectiveDescriptor d{1024, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_MINMAX_U8};
  std::vector<p::Message> m;
  m.emplace_back(p::Hello{p::kMagic, p::kProtocolVersion, 1, 2, 48150, 48151, 48152, "node-1", {1, 2, 3}});
  m.emplace_back(p::Heartbeat{});
  m.emplace_back(p::VoteUpdateTopology{});
  m.emplace_back(p::P2PReport{3, {b}});
  m.emplace_back(p::VotePeersPending{});
  m.emplace_back(p::VoteAgree{true});
  m.emplace_back(p::CollectiveInit{7, d});
  m.emplace_back(p::CollectiveInit{8, {4, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE}, std::vector<std::uint8_t>(16, 7)});
  m.emplace_back(p::CollectiveDone{7, 4, false, "reset by peer"});
  m.emplace_back(p::SyncVote{p::SyncStrategy::kEnforcePopular, 5,
                             {p::TensorEntry{"weights", LOCKSTEP_F32, 4096, digest(1), false},
                              p::TensorEntry{"step", LOCKSTEP_I64, 1, digest(2), true}}});
  m.emplace_back(p::SyncDone{9, LOCKSTEP_STATUS_HASH_MISMATCH, "digest differs"});
  m.emplace_back(p::Welcome{a, "10.0.0.1", 5000, 48160, "10.0.0.9"});
  m.emplace_back(p::RelayHello{p::kMagic, p::kProtocolVersion, 48160, "", std::vector<std::uint8_t>(32, 3)});
  m.emplace_back(p::RelayAssign{{p::RelayPair{a, b, std::vector<std::uint8_t>(32, 4)}}});
  m.emplace_back(p::RelayAddress{"10.0.0.9", 48160});
  m.emplace_back(p::HeartbeatAck{});
  m.emplace_back(p::EstablishP2P{3, {ma, mb}});
  m.emplace_back(p::TopologyResult{3, LOCKSTEP_OK, "", {ma, mb}, p::Attributes{2, 2, 1, 2}});
  m.emplace_back(p::PeersPendingResult{LOCKSTEP_OK, true, ""});
  m.emplace_back(p::AgreeResult{LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false, "peer lost"});
  m.emplace_back(p::Refused{p::MsgType::kCollectiveInit, 7, LOCKSTEP_STATUS_INVALID_USAGE, "tag in flight"});
  m.emplace_back(p::Goodbye{LOCKSTEP_STATUS_KICKED, "heartbeat timeout"});
  m.emplace_back(p::CollectiveGo{7, 4, 1, 2, {a, b}});
  m.emplace_back(p::CollectiveResult{7, 4, LOCKSTEP_OK, 2, ""});
  m.emplace_back(p::CollectiveResult{8, 5, LOCKSTEP_OK, 2, "", std::vector<std::uint8_t>(16, 9)});
  m.emplace_back(p::P2PHello{p::kMagic, p::kProtocolVersion, p::Channel::kSharedState, a, b, 3, 0, {}});
  m.emplace_back(p::P2PHelloAck{LOCKSTEP_OK});
  m.emplace_back(p::SyncPlan{9, 6, {mb}, {p::SyncFetch{0, 0, 16384, 0}}, {p::SyncExpect{0, digest(1)}}});
  m.emplace_back(p::SyncResult{9, LOCKSTEP_OK, 6, ""});
  m.emplace_back(p::StateRequest{9, "weights", 0, 16384, digest(1), p::kStateEncodingRaw, {digest(2)}});
  m.emplace_back(p::StateRequest{9, "weights", 16384, 3u << 20, digest(1), p::kStateEncodingBlocks,
                                 {digest(2), digest(3), digest(4), digest(5)}});
  m.emplace_back(p::StateResponse{LOCKSTEP_OK, 16384, "", {0x01}});
  m.emplace_back(p::StateResponse{LOCKSTEP_OK, 2u << 20, "", {0x0a}});
  m.emplace_back(p::VoteOptimizeTopology{});
  m.emplace_back(p::BandwidthReport{11, b, 125'000'000});
  m.emplace_back(p::BandwidthTest{11, mb, true, 1000, 4});
  m.emplace_back(p::AuthChallenge{std::vector<std::uint8_t>(32, 0x4e), std::vector<std::uint8_t>(32, 0x50)});
  m.emplace_back(p::AuthProof{std::vector<std::uint8_t>(32, 0x51)});
  m.emplace_back(p::ResumeReport{3, {a, b}, 4, 9, true, 6, 2, static_cast<std::uint16_t>(p::MsgType::kVoteAgree),
                                 p::encode_frame(p::AgreeResult{LOCKSTEP_OK, true, "", {}}),
                                 {p::ResumeOp{7, 9}},
                                 {p::ResumeOutcome{8, 5, LOCKSTEP_OK, 2, "", std::vector<std::uint8_t>(16, 9)}},
                                 3, LOCKSTEP_OK, true});
  m.emplace_back(p::Resumed{2, 3});
  return m;
}

fuzz::Seeds make_seeds() {
  fuzz::Seeds seeds;
  const auto messages = sample_messages();
  for (const auto& message : messages) {
    seeds.emplace_back(std::string("msg-") + p::msg_type_name(p::type_of(message)), p::encode_frame(message));
  }
  const auto stream = [&](const char* name, std::initializer_list<p::MsgType> types) {
    std::vector<std::uint8_t> bytes;
    for (const auto type : types) {
      for (const auto& message : messages) {
        if (p::type_of(message) == type) p::encode_frame(message, bytes);
      }
    }
    seeds.emplace_back(name, std::move(bytes));
  };
  using T = p::MsgType;
  stream("stream-membership", {T::kHello, T::kWelcome, T::kEstablishP2P, T::kP2PReport, T::kTopologyResult,
                               T::kHeartbeat, T::kHeartbeatAck, T::kGoodbye});
  stream("stream-collective", {T::kCollectiveInit, T::kCollectiveGo, T::kP2PHello, T::kP2PHelloAck,
                               T::kCollectiveDone, T::kCollectiveResult, T::kRefused});
  stream("stream-optimize", {T::kVoteOptimizeTopology, T::kBandwidthTest, T::kP2PHello, T::kP2PHelloAck,
                             T::kBandwidthReport, T::kEstablishP2P, T::kP2PReport, T::kTopologyResult});
  stream("stream-auth", {T::kHello, T::kAuthChallenge, T::kAuthProof, T::kP2PHello, T::kP2PHelloAck});
  stream("stream-failover", {T::kHello, T::kWelcome, T::kResumeReport, T::kCollectiveResult, T::kResumed,
                             T::kHeartbeat});
  stream("stream-sync", {T::kSyncVote, T::kSyncPlan, T::kP2PHello, T::kP2PHelloAck, T::kStateRequest,
                         T::kStateResponse, T::kSyncDone, T::kSyncResult});
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::write_seeds_if_asked(make_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  const Expected expected = split(bytes);
  compare_with_socket(bytes, expected);
  return 0;
}
