// Frame codec. Each message, and each structure inside one, has one description,
// `fields(io, m)`: its fields in wire order, with the conditions a decoded value must
// meet placed where the decoder checks them. The description runs with a Writer, which
// appends the fields little-endian and ignores names and conditions (it cuts what is
// too long where its primitives say so), or with a Reader, which consumes them and
// turns every underflow or out-of-range value into a PROTOCOL_ERROR naming the field.
#include "protocol/codec.h"

#include "common/limits.h"

#include <algorithm>
#include <string>
#include <type_traits>

namespace lockstep::proto {
namespace {

Status protocol_error(std::string what) { return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, std::move(what)); }

template <typename E>
constexpr std::underlying_type_t<E> underlying(E value) {
  return static_cast<std::underlying_type_t<E>>(value);
}

// Enumerations travel as their underlying type. Only scoped ones with an unsigned
// underlying type (which hold any raw value, so the reader can store a value before it
// checks the range); StatusCode, a C enum, has its own primitive.
template <typename E>
constexpr bool kWireEnum =
    std::is_enum_v<E> && !std::is_convertible_v<E, int> && std::is_unsigned_v<std::underlying_type_t<E>>;

// What the writer does with a list longer than the reader's maximum.
enum class Excess {
  kWrite,  // writes it whole (the receiver refuses the frame)
  kCut,    // writes the first count_max elements
};

class Writer {
 public:
  static constexpr bool kReading = false;
  explicit Writer(std::vector<std::uint8_t>& out) : out_(out) {}

  template <typename T>
  bool u(T value, const char* /*field*/) {
    static_assert(std::is_unsigned_v<T>);
    std::uint8_t le[sizeof(T)];
    for (std::size_t i = 0; i < sizeof(T); ++i) le[i] = static_cast<std::uint8_t>(value >> (8 * i));
    out_.insert(out_.end(), le, le + sizeof(T));
    return true;
  }
  template <typename E>
  bool enumeration(E value, const char* field) {
    static_assert(kWireEnum<E>);
    return u(underlying(value), field);
  }
  bool boolean(bool value, const char* field) { return u(static_cast<std::uint8_t>(value ? 1 : 0), field); }
  bool status(StatusCode code, const char* field) { return u(static_cast<std::uint32_t>(code), field); }
  // Strings are cut at the wire's bound, not the field's: only reasons can be that long,
  // and a longer host or key is written whole for the reader to refuse.
  bool str(const std::string& value, std::uint32_t /*bytes_max*/, const char* /*field*/) {
    return sized<std::uint16_t>(value, limits::kWireStringBytesMax);
  }
  // Byte strings are cut at the reader's bound (and at the u16 length), or at cut_at
  // where a field gives one.
  bool bytes(const std::vector<std::uint8_t>& value, std::uint32_t bytes_max, const char* field) {
    return bytes(value, bytes_max, field, bytes_max);
  }
  bool bytes(const std::vector<std::uint8_t>& value, std::uint32_t /*bytes_max*/, const char* /*field*/,
             std::uint32_t cut_at) {
    return sized<std::uint16_t>(value, std::min<std::size_t>(cut_at, 0xffff));
  }
  // Byte strings with a u32 length, cut at bytes_max.
  bool bytes32(const std::vector<std::uint8_t>& value, std::uint32_t bytes_max, const char* /*field*/) {
    return sized<std::uint32_t>(value, bytes_max);
  }
  // A u32 count, then each element as `element` describes it.
  template <typename T, typename Element>
  bool list(const std::vector<T>& values, std::uint32_t count_max, std::size_t /*element_bytes_min*/,
            const char* field, Element&& element, Excess excess = Excess::kWrite) {
    std::size_t n = values.size();
    if (excess == Excess::kCut) n = std::min<std::size_t>(n, count_max);
    u(static_cast<std::uint32_t>(n), field);
    for (std::size_t i = 0; i < n; ++i) element(values[i]);
    return true;
  }
  // Conditions are the reader's.
  template <typename What>
  bool check(bool /*ok*/, const What& /*what*/) {
    return true;
  }

 private:
  template <typename Length, typename Container>
  bool sized(const Container& value, std::size_t bytes_max) {
    const std::size_t n = std::min<std::size_t>(value.size(), bytes_max);
    u(static_cast<Length>(n), nullptr);
    out_.insert(out_.end(), value.begin(), value.begin() + static_cast<std::ptrdiff_t>(n));
    return true;
  }
  std::vector<std::uint8_t>& out_;
};

class Reader {
 public:
  static constexpr bool kReading = true;
  explicit Reader(std::span<const std::uint8_t> in) : in_(in) {}

  template <typename T>
  bool u(T& value, const char* field) {
    static_assert(std::is_unsigned_v<T>);
    if (!need(sizeof(T), field)) return false;
    T out = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) out = static_cast<T>(out | (static_cast<T>(in_[pos_ + i]) << (8 * i)));
    pos_ += sizeof(T);
    value = out;
    return true;
  }
  // Any raw value is stored; the description checks the range.
  template <typename E>
  bool enumeration(E& value, const char* field) {
    static_assert(kWireEnum<E>);
    std::underlying_type_t<E> raw = 0;
    if (!u(raw, field)) return false;
    value = static_cast<E>(raw);
    return true;
  }
  bool boolean(bool& value, const char* field) {
    std::uint8_t raw = 0;
    if (!u(raw, field)) return false;
    if (raw > 1) return fail(std::string(field) + ": boolean out of range");
    value = raw == 1;
    return true;
  }
  bool status(StatusCode& value, const char* field) {
    std::uint32_t raw = 0;
    if (!u(raw, field)) return false;
    if (raw > static_cast<std::uint32_t>(kStatusCodeMax)) return fail(std::string(field) + ": unknown status code");
    value = static_cast<StatusCode>(raw);
    return true;
  }
  bool str(std::string& value, std::uint32_t bytes_max, const char* field) {
    return sized<std::uint16_t>(value, bytes_max, field, ": string longer than ");
  }
  bool bytes(std::vector<std::uint8_t>& value, std::uint32_t bytes_max, const char* field) {
    return sized<std::uint16_t>(value, bytes_max, field, ": longer than ");
  }
  bool bytes(std::vector<std::uint8_t>& value, std::uint32_t bytes_max, const char* field, std::uint32_t /*cut_at*/) {
    return bytes(value, bytes_max, field);
  }
  bool bytes32(std::vector<std::uint8_t>& value, std::uint32_t bytes_max, const char* field) {
    return sized<std::uint32_t>(value, bytes_max, field, ": longer than ");
  }
  // A count of elements each at least element_bytes_min long, bounded by count_max and
  // by what is left in the payload (so a lying count cannot make us allocate), then
  // each element as `element` describes it.
  template <typename T, typename Element>
  bool list(std::vector<T>& values, std::uint32_t count_max, std::size_t element_bytes_min, const char* field,
            Element&& element, Excess /*excess*/ = Excess::kWrite) {
    std::uint32_t n = 0;
    if (!u(n, field)) return false;
    if (n > count_max) return fail(std::string(field) + ": count above " + std::to_string(count_max));
    if (static_cast<std::size_t>(n) * element_bytes_min > in_.size() - pos_) {
      return fail(std::string(field) + ": count exceeds payload");
    }
    values.resize(n);
    for (auto& value : values) {
      if (!element(value)) return false;
    }
    return true;
  }
  // A condition the value read so far must meet; `what` is the error, a text or a
  // callable that makes it (only on failure).
  template <typename What>
  bool check(bool ok, const What& what) {
    if (ok) return true;
    if constexpr (std::is_invocable_v<const What&>) {
      return fail(what());
    } else {
      return fail(std::string(what));
    }
  }
  bool fail(std::string what) {
    if (error_.empty()) error_ = std::move(what);
    return false;
  }
  bool finish() {
    if (!error_.empty()) return false;
    if (pos_ != in_.size()) return fail(std::to_string(in_.size() - pos_) + " trailing bytes");
    return true;
  }
  const std::string& error() const { return error_; }

 private:
  bool need(std::size_t n, const char* field) {
    if (in_.size() - pos_ < n) return fail(std::string(field) + ": truncated");
    return true;
  }
  // A length of type Length, at most bytes_max, then that many bytes.
  template <typename Length, typename Container>
  bool sized(Container& value, std::uint32_t bytes_max, const char* field, const char* longer_than) {
    Length len = 0;
    if (!u(len, field)) return false;
    if (len > bytes_max) return fail(std::string(field) + longer_than + std::to_string(bytes_max) + " bytes");
    if (!need(len, field)) return false;
    const std::uint8_t* first = in_.data() + pos_;
    if constexpr (std::is_same_v<Container, std::string>) {
      value.assign(reinterpret_cast<const char*>(first), len);
    } else {
      value.assign(first, first + len);
    }
    pos_ += len;
    return true;
  }
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::string error_;
};

// The type a description sees: const for the writer, mutable for the reader.
template <typename Io, typename T>
using Of = std::conditional_t<Io::kReading, T, const T>;

// ---- structures inside messages

// Ids and digests are two u64 (hi, lo); both halves carry the name of the field.
template <typename Io>
bool fields(Io& io, Of<Io, PeerId>& id, const char* field) {
  return io.u(id.hi, field) && io.u(id.lo, field);
}
template <typename Io>
bool fields(Io& io, Of<Io, state::Digest>& digest, const char* field) {
  return io.u(digest.hi, field) && io.u(digest.lo, field);
}

// A list of peer ids: a u32 count (bounded) and 16 bytes per id.
template <typename Io, typename Ids>
bool id_list(Io& io, Ids& ids, const char* field) {
  return io.list(ids, limits::kMembersPerMessageMax, 16, field, [&](auto& id) { return fields(io, id, field); });
}

// The member's key is bounded at kAuthFieldBytesMax by the reader; the writer cuts it at
// kAuthBytesMax, like every authentication byte string.
template <typename Io>
bool fields(Io& io, Of<Io, MemberInfo>& m) {
  return fields(io, m.id, "member.id") && io.str(m.host, limits::kHostBytesMax, "member.host") &&
         io.u(m.p2p_port, "member.p2p_port") && io.u(m.shared_state_port, "member.shared_state_port") &&
         io.u(m.benchmark_port, "member.benchmark_port") &&
         io.bytes(m.key, limits::kAuthFieldBytesMax, "member.key", limits::kAuthBytesMax);
}
constexpr std::size_t kMemberBytesMin = 16 + 2 + 6 + 2;

template <typename Io, typename Members>
bool member_list(Io& io, Members& members) {
  return io.list(members, limits::kMembersPerMessageMax, kMemberBytesMin, "members",
                 [&](auto& member) { return fields(io, member); });
}

// The dtype, op, quantization and kind are checked once the whole descriptor is read.
template <typename Io>
bool fields(Io& io, Of<Io, CollectiveDescriptor>& d) {
  return io.u(d.count, "descriptor.count") && io.u(d.dtype, "descriptor.dtype") && io.u(d.op, "descriptor.op") &&
         io.u(d.quantization, "descriptor.quantization") && io.enumeration(d.kind, "descriptor.kind") &&
         io.u(d.root, "descriptor.root") && io.u(d.world, "descriptor.world") &&
         io.list(
             d.counts, limits::kMembersPerMessageMax, 8, "descriptor.counts",
             [&](auto& count) { return io.u(count, "descriptor.counts"); }, Excess::kCut) &&
         io.enumeration(d.algorithm, "descriptor.algorithm") &&
         io.check(underlying(d.algorithm) <= kAlgorithmMax, "descriptor.algorithm: unknown algorithm") &&
         io.check(d.dtype <= LOCKSTEP_F64, "descriptor.dtype: unknown dtype") &&
         io.check(d.op <= LOCKSTEP_MIN, "descriptor.op: unknown reduce op") &&
         io.check(d.quantization <= LOCKSTEP_QUANT_CAST_BF16, "descriptor.quantization: unknown kind") &&
         io.check(underlying(d.kind) <= kCollectiveKindMax, "descriptor.kind: unknown collective");
}

template <typename Io>
bool fields(Io& io, Of<Io, Attributes>& a) {
  return io.u(a.global_world_size, "topology.global_world_size") &&
         io.u(a.group_world_size, "topology.group_world_size") && io.u(a.num_groups, "topology.num_groups") &&
         io.u(a.largest_group_size, "topology.largest_group_size");
}

// A SyncVote's entry; the key and dtype are checked once the entry is read.
template <typename Io>
bool fields(Io& io, Of<Io, TensorEntry>& t) {
  return io.str(t.key, limits::kSharedStateKeyBytesMax, "sync_vote.key") && io.u(t.dtype, "sync_vote.dtype") &&
         io.u(t.count, "sync_vote.count") && fields(io, t.hash, "sync_vote.hash") &&
         io.boolean(t.allow_content_inequality, "sync_vote.allow_content_inequality") &&
         io.check(!t.key.empty(), "sync_vote.key: empty") &&
         io.check(t.dtype <= LOCKSTEP_F64, "sync_vote.dtype: unknown dtype");
}
constexpr std::size_t kTensorEntryBytesMin = 2 + 1 + 8 + 16 + 1;

// A SyncPlan's fetch (its source is checked against the plan's sources there).
template <typename Io>
bool fields(Io& io, Of<Io, SyncFetch>& f) {
  return io.u(f.tensor, "sync_plan.fetch.tensor") && io.u(f.offset, "sync_plan.fetch.offset") &&
         io.u(f.bytes, "sync_plan.fetch.bytes") && io.u(f.source, "sync_plan.fetch.source");
}
constexpr std::size_t kSyncFetchBytes = 4 + 8 + 8 + 4;

template <typename Io>
bool fields(Io& io, Of<Io, SyncExpect>& e) {
  return io.u(e.tensor, "sync_plan.expect.tensor") && fields(io, e.hash, "sync_plan.expect.hash");
}
constexpr std::size_t kSyncExpectBytes = 4 + 16;

// ---- messages

// Heartbeat, VoteUpdateTopology, VotePeersPending, HeartbeatAck, VoteOptimizeTopology.
template <typename Io, typename M>
  requires std::is_empty_v<std::remove_const_t<M>>
bool fields(Io& /*io*/, M& /*m*/) {
  return true;
}

template <typename Io>
bool fields(Io& io, Of<Io, Hello>& m) {
  return io.u(m.magic, "hello.magic") && io.check(m.magic == kMagic, "hello.magic: not a lockstep peer") &&
         io.u(m.version, "hello.version") &&
         io.check(m.version == kProtocolVersion,
                  [&] { return "hello.version: unsupported protocol version " + std::to_string(m.version); }) &&
         io.u(m.group, "hello.group") && io.u(m.pool_size, "hello.pool_size") &&
         io.check(m.pool_size != 0 && m.pool_size <= limits::kP2PPoolSizeMax, "hello.pool_size: out of range") &&
         io.u(m.p2p_port, "hello.p2p_port") && io.u(m.shared_state_port, "hello.shared_state_port") &&
         io.u(m.benchmark_port, "hello.benchmark_port") &&
         io.str(m.advertised_host, limits::kHostBytesMax, "hello.advertised_host") &&
         io.bytes(m.auth, limits::kAuthBytesMax, "hello.auth") && fields(io, m.resume_id, "hello.resume_id") &&
         io.u(m.term, "hello.term");
}

template <typename Io>
bool fields(Io& io, Of<Io, P2PReport>& m) {
  return io.u(m.epoch, "p2p_report.epoch") && id_list(io, m.unreachable, "p2p_report.unreachable");
}

// The mode is checked after the value.
template <typename Io>
bool fields(Io& io, Of<Io, VoteAgree>& m) {
  return io.boolean(m.flag, "vote_agree.flag") && io.enumeration(m.mode, "vote_agree.mode") &&
         io.bytes(m.value, limits::kAgreeValueBytesMax, "vote_agree.value") &&
         io.check(underlying(m.mode) <= kAgreeModeMax, "vote_agree.mode: unknown mode");
}

template <typename Io>
bool fields(Io& io, Of<Io, CollectiveInit>& m) {
  return io.u(m.tag, "init.tag") && fields(io, m.descriptor) &&
         io.bytes(m.data, limits::kVoteCarriedBytesMax, "init.data") &&
         io.str(m.refusal, limits::kWireStringBytesMax, "init.refusal") &&
         io.status(m.refusal_status, "init.refusal_status") &&
         io.check(m.refusal_status == LOCKSTEP_STATUS_INVALID_ARGUMENT ||
                      m.refusal_status == LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION,
                  "init.refusal_status: not a status a refusal may carry");
}

// The operation is checked after the whole request.
template <typename Io>
bool fields(Io& io, Of<Io, KvRequest>& m) {
  return io.u(m.request, "kv_request.request") && io.enumeration(m.op, "kv_request.op") &&
         io.str(m.key, limits::kKvKeyBytesMaxLimit, "kv_request.key") &&
         io.bytes32(m.value, limits::kKvValueBytesMaxLimit, "kv_request.value") &&
         io.u(m.timeout_ms, "kv_request.timeout_ms") &&
         io.check(underlying(m.op) >= 1 && underlying(m.op) <= kKvOpMax, "kv_request.op: unknown operation");
}

template <typename Io>
bool fields(Io& io, Of<Io, KvResult>& m) {
  return io.u(m.request, "kv_result.request") && io.status(m.status, "kv_result.status") &&
         io.str(m.reason, limits::kWireStringBytesMax, "kv_result.reason") &&
         io.bytes32(m.value, limits::kKvValueBytesMaxLimit, "kv_result.value");
}

template <typename Io>
bool fields(Io& io, Of<Io, CollectiveDone>& m) {
  return io.u(m.tag, "done.tag") && io.u(m.attempt, "done.attempt") && io.boolean(m.ok, "done.ok") &&
         io.str(m.reason, limits::kWireStringBytesMax, "done.reason") && io.u(m.bytes_sent, "done.bytes_sent") &&
         io.u(m.bytes_received, "done.bytes_received") && io.boolean(m.committed, "done.committed");
}

template <typename Io>
bool fields(Io& io, Of<Io, CollectiveAbort>& m) {
  return io.u(m.tag, "abort.tag") && io.u(m.attempt, "abort.attempt");
}

template <typename Io>
bool fields(Io& io, Of<Io, CollectiveGo>& m) {
  return io.u(m.tag, "go.tag") && io.u(m.attempt, "go.attempt") && io.u(m.slot, "go.slot") &&
         io.u(m.epoch, "go.epoch") && id_list(io, m.absent, "go.absent");
}

template <typename Io>
bool fields(Io& io, Of<Io, CollectiveResult>& m) {
  return io.u(m.tag, "result.tag") && io.u(m.attempt, "result.attempt") && io.status(m.status, "result.status") &&
         io.u(m.world_size, "result.world_size") && io.str(m.reason, limits::kWireStringBytesMax, "result.reason") &&
         io.bytes(m.data, limits::kVoteCarriedBytesMax, "result.data");
}

template <typename Io>
bool fields(Io& io, Of<Io, Welcome>& m) {
  return fields(io, m.id, "welcome.id") && io.str(m.observed_host, limits::kHostBytesMax, "welcome.observed_host") &&
         io.u(m.heartbeat_timeout_ms, "welcome.heartbeat_timeout_ms") && io.u(m.relay_port, "welcome.relay_port") &&
         io.str(m.relay_host, limits::kHostBytesMax, "welcome.relay_host") && io.u(m.term, "welcome.term");
}

template <typename Io>
bool fields(Io& io, Of<Io, ResumeOp>& m) {
  return io.u(m.tag, "resume.op.tag") && io.u(m.attempt, "resume.op.attempt");
}

template <typename Io>
bool fields(Io& io, Of<Io, ResumeOutcome>& m) {
  return io.u(m.tag, "resume.outcome.tag") && io.u(m.attempt, "resume.outcome.attempt") &&
         io.status(m.status, "resume.outcome.status") && io.u(m.world_size, "resume.outcome.world_size") &&
         io.str(m.reason, limits::kWireStringBytesMax, "resume.outcome.reason") &&
         io.bytes(m.data, limits::kVoteCarriedBytesMax, "resume.outcome.data");
}

template <typename Io>
bool fields(Io& io, Of<Io, ResumeReport>& m) {
  return io.u(m.epoch, "resume.epoch") && id_list(io, m.view, "resume.view") && io.u(m.epoch_seen, "resume.epoch_seen") &&
         io.u(m.attempt_seen, "resume.attempt_seen") && io.boolean(m.has_revision, "resume.has_revision") &&
         io.u(m.revision, "resume.revision") && io.u(m.control_count, "resume.control_count") &&
         io.u(m.waiting, "resume.waiting") &&
         io.bytes(m.last_control, limits::kResumeControlBytesMax, "resume.last_control") &&
         io.list(m.ops, limits::kCollectivesPerGroupMaxDefault, 16, "resume.ops",
                 [&](auto& op) { return fields(io, op); }) &&
         io.list(m.outcomes, limits::kResumeOutcomesKept, 8 + 8 + 4 + 4 + 2 + 2, "resume.outcomes",
                 [&](auto& o) { return fields(io, o); }) &&
         io.u(m.pending_count, "resume.pending_count") &&
         io.status(m.last_pending_status, "resume.last_pending_status") && io.boolean(m.last_pending, "resume.last_pending");
}

template <typename Io>
bool fields(Io& io, Of<Io, Resumed>& m) {
  return io.u(m.term, "resumed.term") && io.u(m.epoch, "resumed.epoch");
}

template <typename Io>
bool fields(Io& io, Of<Io, RelayAddress>& m) {
  return io.str(m.host, limits::kHostBytesMax, "relay_address.host") && io.u(m.port, "relay_address.port");
}

template <typename Io>
bool fields(Io& io, Of<Io, RelayHello>& m) {
  return io.u(m.magic, "relay_hello.magic") && io.check(m.magic == kMagic, "relay_hello.magic: not a lockstep relay") &&
         io.u(m.version, "relay_hello.version") &&
         io.check(m.version == kProtocolVersion,
                  [&] { return "relay_hello.version: unsupported protocol version " + std::to_string(m.version); }) &&
         io.u(m.port, "relay_hello.port") && io.check(m.port != 0, "relay_hello.port: a relay names its port") &&
         io.str(m.advertised_host, limits::kHostBytesMax, "relay_hello.advertised_host") &&
         io.bytes(m.auth, limits::kAuthBytesMax, "relay_hello.auth");
}

// Each pair: two ids and a 32-byte key.
constexpr std::size_t kRelayPairBytes = 16 + 16 + 2 + 32;
template <typename Io>
bool fields(Io& io, Of<Io, RelayAssign>& m) {
  return io.list(m.pairs, limits::kRelayPairsMax, kRelayPairBytes, "relay_assign.pairs", [&](auto& pair) {
    return fields(io, pair.a, "relay_assign.a") && fields(io, pair.b, "relay_assign.b") &&
           io.bytes(pair.key, limits::kAuthFieldBytesMax, "relay_assign.key") &&
           io.check(pair.key.size() == 32, "relay_assign.key: not a 32-byte key") &&
           io.check(pair.a != pair.b, "relay_assign: a pair of one peer");
  });
}

template <typename Io>
bool fields(Io& io, Of<Io, EstablishP2P>& m) {
  return io.u(m.epoch, "establish.epoch") && member_list(io, m.ring);
}

template <typename Io>
bool fields(Io& io, Of<Io, TopologyResult>& m) {
  return io.u(m.epoch, "topology.epoch") && io.status(m.status, "topology.status") &&
         io.str(m.reason, limits::kWireStringBytesMax, "topology.reason") && member_list(io, m.ring) &&
         fields(io, m.attributes);
}

template <typename Io>
bool fields(Io& io, Of<Io, PeersPendingResult>& m) {
  return io.status(m.status, "pending.status") && io.boolean(m.pending, "pending.pending") &&
         io.str(m.reason, limits::kWireStringBytesMax, "pending.reason");
}

template <typename Io>
bool fields(Io& io, Of<Io, AgreeResult>& m) {
  return io.status(m.status, "agree.status") && io.boolean(m.value, "agree.value") &&
         io.str(m.reason, limits::kWireStringBytesMax, "agree.reason") &&
         io.bytes(m.agreed, limits::kAgreeValueBytesMax, "agree.agreed");
}

template <typename Io>
bool fields(Io& io, Of<Io, Refused>& m) {
  return io.enumeration(m.request, "refused.request") &&
         io.check(payload_bytes_max(underlying(m.request)) != 0, "refused.request: unknown message type") &&
         io.u(m.tag, "refused.tag") && io.status(m.status, "refused.status") &&
         io.str(m.reason, limits::kWireStringBytesMax, "refused.reason");
}

template <typename Io>
bool fields(Io& io, Of<Io, Goodbye>& m) {
  return io.status(m.status, "goodbye.status") && io.str(m.reason, limits::kWireStringBytesMax, "goodbye.reason");
}

template <typename Io>
bool fields(Io& io, Of<Io, P2PHello>& m) {
  return io.u(m.magic, "p2p_hello.magic") && io.check(m.magic == kMagic, "p2p_hello.magic: not a lockstep peer") &&
         io.u(m.version, "p2p_hello.version") &&
         io.check(m.version == kProtocolVersion, "p2p_hello.version: unsupported protocol version") &&
         io.enumeration(m.channel, "p2p_hello.channel") &&
         io.check(m.channel >= Channel::kRing && m.channel <= Channel::kRelay, "p2p_hello.channel: unknown channel") &&
         fields(io, m.from, "p2p_hello.from") && fields(io, m.to, "p2p_hello.to") && io.u(m.epoch, "p2p_hello.epoch") &&
         io.u(m.pool_index, "p2p_hello.pool_index") && io.bytes(m.auth, limits::kAuthBytesMax, "p2p_hello.auth") &&
         io.u(m.flags, "p2p_hello.flags") && io.check((m.flags & ~kP2PFlagsKnown) == 0, "p2p_hello.flags: unknown flag");
}

template <typename Io>
bool fields(Io& io, Of<Io, P2PHelloAck>& m) {
  return io.status(m.status, "p2p_hello_ack.status");
}

// ---- shared state
template <typename Io>
bool fields(Io& io, Of<Io, SyncVote>& m) {
  return io.enumeration(m.strategy, "sync_vote.strategy") &&
         io.check(m.strategy <= SyncStrategy::kSendOnly, "sync_vote.strategy: unknown strategy") &&
         io.u(m.revision, "sync_vote.revision") &&
         io.list(m.tensors, limits::kSharedStateTensorsMax, kTensorEntryBytesMin, "sync_vote.tensors",
                 [&](auto& tensor) { return fields(io, tensor); });
}

template <typename Io>
bool fields(Io& io, Of<Io, SyncDone>& m) {
  return io.u(m.attempt, "sync_done.attempt") && io.status(m.status, "sync_done.status") &&
         io.str(m.reason, limits::kWireStringBytesMax, "sync_done.reason") &&
         io.u(m.bytes_sent, "sync_done.bytes_sent") && io.u(m.bytes_received, "sync_done.bytes_received");
}

template <typename Io>
bool fields(Io& io, Of<Io, SyncPlan>& m) {
  return io.u(m.attempt, "sync_plan.attempt") && io.u(m.revision, "sync_plan.revision") &&
         member_list(io, m.sources) &&
         io.list(m.fetches, limits::kSyncFetchesMax, kSyncFetchBytes, "sync_plan.fetches",
                 [&](auto& fetch) {
                   return fields(io, fetch) &&
                          io.check(fetch.source < m.sources.size(), "sync_plan.fetch.source: no such source");
                 }) &&
         io.list(m.expect, limits::kSharedStateTensorsMax, kSyncExpectBytes, "sync_plan.expect",
                 [&](auto& expect) { return fields(io, expect); }) &&
         io.list(m.dials, limits::kMembersPerMessageMax, kMemberBytesMin + 4, "sync_plan.dials", [&](auto& dial) {
           return fields(io, dial.receiver) && io.u(dial.connections, "sync_plan.dial.connections") &&
                  io.check(dial.connections >= 1 && dial.connections <= limits::kStateStreamsDefault,
                           [] {
                             return "sync_plan.dial.connections: not 1.." +
                                    std::to_string(limits::kStateStreamsDefault);
                           });
         });
}

template <typename Io>
bool fields(Io& io, Of<Io, SyncResult>& m) {
  return io.u(m.attempt, "sync_result.attempt") && io.status(m.status, "sync_result.status") &&
         io.u(m.revision, "sync_result.revision") &&
         io.str(m.reason, limits::kWireStringBytesMax, "sync_result.reason");
}

// The key, the encoding and the digests' agreement with the range are checked once the
// whole request is read.
template <typename Io>
bool fields(Io& io, Of<Io, StateRequest>& m) {
  return io.u(m.attempt, "state_request.attempt") &&
         io.str(m.key, limits::kSharedStateKeyBytesMax, "state_request.key") &&
         io.u(m.offset, "state_request.offset") && io.u(m.bytes, "state_request.bytes") &&
         fields(io, m.hash, "state_request.hash") && io.u(m.encoding, "state_request.encoding") &&
         io.list(
             m.have, limits::kStateSegmentsPerRequestMax, 16, "state_request.have",
             [&](auto& digest) { return fields(io, digest, "state_request.have"); }, Excess::kCut) &&
         io.check(!m.key.empty(), "state_request.key: empty") &&
         io.check(m.encoding <= kStateEncodingBlocks, "state_request.encoding: unknown encoding") &&
         io.check(m.offset <= UINT64_MAX - m.bytes && state::segment_count(m.offset, m.bytes) == m.have.size(),
                  "state_request.have: not one digest per segment of the range");
}

template <typename Io>
bool fields(Io& io, Of<Io, StateResponse>& m) {
  return io.status(m.status, "state_response.status") && io.u(m.bytes, "state_response.bytes") &&
         io.str(m.reason, limits::kWireStringBytesMax, "state_response.reason") &&
         io.bytes(m.sending, limits::kStateSendingBytesMax, "state_response.sending");
}

// ---- authentication: nonces and proofs are bounded at kAuthFieldBytesMax by the reader
// and cut at kAuthBytesMax by the writer, like the member's key.
template <typename Io>
bool fields(Io& io, Of<Io, AuthChallenge>& m) {
  return io.bytes(m.nonce, limits::kAuthFieldBytesMax, "auth_challenge.nonce", limits::kAuthBytesMax) &&
         io.bytes(m.proof, limits::kAuthFieldBytesMax, "auth_challenge.proof", limits::kAuthBytesMax);
}

template <typename Io>
bool fields(Io& io, Of<Io, AuthProof>& m) {
  return io.bytes(m.proof, limits::kAuthFieldBytesMax, "auth_proof.proof", limits::kAuthBytesMax);
}

// ---- topology optimization
template <typename Io>
bool fields(Io& io, Of<Io, BandwidthReport>& m) {
  return io.u(m.test, "bandwidth_report.test") && fields(io, m.from, "bandwidth_report.from") &&
         io.u(m.bytes_per_s, "bandwidth_report.bytes_per_s");
}

template <typename Io>
bool fields(Io& io, Of<Io, BandwidthTest>& m) {
  return io.u(m.test, "bandwidth_test.test") && fields(io, m.partner) &&
         io.boolean(m.initiator, "bandwidth_test.initiator") && io.u(m.duration_ms, "bandwidth_test.duration_ms") &&
         io.u(m.streams, "bandwidth_test.streams") &&
         io.check(m.duration_ms != 0 && m.duration_ms <= 60'000, "bandwidth_test.duration_ms: out of range") &&
         io.check(m.streams != 0 && m.streams <= limits::kP2PPoolSizeMax, "bandwidth_test.streams: out of range");
}

template <typename T>
Result<Message> decode_as(std::span<const std::uint8_t> payload) {
  Reader r(payload);
  T message;
  if (!fields(r, message) || !r.finish()) {
    return protocol_error(std::string(msg_type_name(T::kType)) + ": " + r.error());
  }
  return Message(std::move(message));
}

}  // namespace

const char* to_string(SyncStrategy strategy) {
  switch (strategy) {
    case SyncStrategy::kEnforcePopular: return "enforce-popular";
    case SyncStrategy::kReceiveOnly: return "receive-only";
    case SyncStrategy::kSendOnly: return "send-only";
  }
  return "?";
}

const char* msg_type_name(MsgType type) {
  switch (type) {
    case MsgType::kHello: return "Hello";
    case MsgType::kHeartbeat: return "Heartbeat";
    case MsgType::kVoteUpdateTopology: return "VoteUpdateTopology";
    case MsgType::kP2PReport: return "P2PReport";
    case MsgType::kVotePeersPending: return "VotePeersPending";
    case MsgType::kVoteAgree: return "VoteAgree";
    case MsgType::kCollectiveInit: return "CollectiveInit";
    case MsgType::kCollectiveDone: return "CollectiveDone";
    case MsgType::kCollectiveGo: return "CollectiveGo";
    case MsgType::kCollectiveAbort: return "CollectiveAbort";
    case MsgType::kRelayHello: return "RelayHello";
    case MsgType::kRelayAssign: return "RelayAssign";
    case MsgType::kRelayAddress: return "RelayAddress";
    case MsgType::kCollectiveResult: return "CollectiveResult";
    case MsgType::kWelcome: return "Welcome";
    case MsgType::kHeartbeatAck: return "HeartbeatAck";
    case MsgType::kEstablishP2P: return "EstablishP2P";
    case MsgType::kTopologyResult: return "TopologyResult";
    case MsgType::kPeersPendingResult: return "PeersPendingResult";
    case MsgType::kAgreeResult: return "AgreeResult";
    case MsgType::kRefused: return "Refused";
    case MsgType::kGoodbye: return "Goodbye";
    case MsgType::kP2PHello: return "P2PHello";
    case MsgType::kP2PHelloAck: return "P2PHelloAck";
    case MsgType::kSyncVote: return "SyncVote";
    case MsgType::kSyncDone: return "SyncDone";
    case MsgType::kSyncPlan: return "SyncPlan";
    case MsgType::kSyncResult: return "SyncResult";
    case MsgType::kStateRequest: return "StateRequest";
    case MsgType::kStateResponse: return "StateResponse";
    case MsgType::kVoteOptimizeTopology: return "VoteOptimizeTopology";
    case MsgType::kBandwidthReport: return "BandwidthReport";
    case MsgType::kBandwidthTest: return "BandwidthTest";
    case MsgType::kAuthChallenge: return "AuthChallenge";
    case MsgType::kAuthProof: return "AuthProof";
    case MsgType::kKvRequest: return "KvRequest";
    case MsgType::kKvResult: return "KvResult";
    case MsgType::kResumeReport: return "ResumeReport";
    case MsgType::kResumed: return "Resumed";
    case MsgType::kSealed: return "Sealed";
  }
  return "Unknown";
}

static_assert(8 + 4 + 16 * limits::kMembersPerMessageMax + 8 * 5 + 1 + 2 + 4 + limits::kResumeControlBytesMax + 4 +
                      16 * limits::kCollectivesPerGroupMaxDefault +
                      4 + limits::kResumeOutcomesKept * (8 + 8 + 4 + 4 + 2 + limits::kWireStringBytesMax + 4 +
                                                        limits::kVoteCarriedBytesMax) <=
                  limits::kControlFramePayloadBytesMax,
              "a resume report must fit a control frame");
static_assert(4 + kRelayPairBytes * limits::kRelayPairsMax <= limits::kControlFramePayloadBytesMax,
              "a relay's pairs must fit a control frame");
static_assert(8 + 1 + 2 + limits::kKvKeyBytesMaxLimit + 4 + limits::kKvValueBytesMaxLimit + 4 <=
                  limits::kControlFramePayloadBytesMax,
              "a key-value request must fit a control frame (and so a sealed one)");

std::uint32_t payload_bytes_max(std::uint16_t raw_type) {
  switch (static_cast<MsgType>(raw_type)) {
    case MsgType::kHeartbeat:
    case MsgType::kVoteUpdateTopology:
    case MsgType::kVotePeersPending:
    case MsgType::kHeartbeatAck:
    case MsgType::kVoteOptimizeTopology:
      return kEmptyPayload;
    case MsgType::kVoteAgree: return 1 + 1 + 2 + limits::kAgreeValueBytesMax;
    case MsgType::kP2PHelloAck: return 4;
    case MsgType::kCollectiveAbort: return 16;
    case MsgType::kAuthChallenge: return 2 + limits::kAuthFieldBytesMax + 2 + limits::kAuthFieldBytesMax;
    case MsgType::kAuthProof: return 2 + limits::kAuthFieldBytesMax;
    case MsgType::kSealed: return kSealedPayloadBytesMax;
    case MsgType::kHello:
    case MsgType::kWelcome:
    case MsgType::kPeersPendingResult:
    case MsgType::kRefused:
    case MsgType::kGoodbye:
    case MsgType::kP2PHello:
    case MsgType::kCollectiveDone:
    case MsgType::kSyncDone:
    case MsgType::kSyncResult:
    case MsgType::kBandwidthReport:
    case MsgType::kBandwidthTest:
    case MsgType::kRelayHello:
    case MsgType::kRelayAddress:
    case MsgType::kResumed:
      return limits::kSmallPayloadBytesMax;
    case MsgType::kRelayAssign:
      return 4 + kRelayPairBytes * limits::kRelayPairsMax;
    case MsgType::kAgreeResult:  // and the value agreed on
      return limits::kSmallPayloadBytesMax + 2 + limits::kAgreeValueBytesMax;
    case MsgType::kCollectiveInit:  // and a small all-reduce's data, and all-gather's counts per rank
      return limits::kSmallPayloadBytesMax + 2 + limits::kVoteCarriedBytesMax + 8 * limits::kMembersPerMessageMax;
    case MsgType::kCollectiveResult:
      return limits::kSmallPayloadBytesMax + 2 + limits::kVoteCarriedBytesMax;  // and a small all-reduce's data
    case MsgType::kStateRequest:  // and a digest per segment
      return limits::kSmallPayloadBytesMax + 4 + 16 * limits::kStateSegmentsPerRequestMax;
    case MsgType::kStateResponse:  // and a bit per segment
      return limits::kSmallPayloadBytesMax + 2 + limits::kStateSendingBytesMax;
    case MsgType::kKvRequest:  // id, op, key, value, timeout
      return 8 + 1 + 2 + limits::kKvKeyBytesMaxLimit + 4 + limits::kKvValueBytesMaxLimit + 4;
    case MsgType::kKvResult:  // id, status, reason, value
      return 8 + 4 + 2 + limits::kWireStringBytesMax + 4 + limits::kKvValueBytesMaxLimit;
    case MsgType::kCollectiveGo:
    case MsgType::kResumeReport:
    case MsgType::kP2PReport:
    case MsgType::kEstablishP2P:
    case MsgType::kTopologyResult:
    case MsgType::kSyncVote:
    case MsgType::kSyncPlan:
      return limits::kControlFramePayloadBytesMax;
  }
  return 0;
}

Result<FrameHeader> decode_header(std::span<const std::uint8_t, kFrameHeaderBytes> b) {
  const std::uint32_t length = static_cast<std::uint32_t>(b[0]) | (static_cast<std::uint32_t>(b[1]) << 8) |
                               (static_cast<std::uint32_t>(b[2]) << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
  const auto raw_type = static_cast<std::uint16_t>(b[4] | (b[5] << 8));
  const auto flags = static_cast<std::uint16_t>(b[6] | (b[7] << 8));
  const std::uint32_t bound = payload_bytes_max(raw_type);
  if (bound == 0) return protocol_error("unknown message type " + std::to_string(raw_type));
  if (flags != 0) return protocol_error("nonzero frame flags " + std::to_string(flags));
  const std::uint32_t effective = bound == kEmptyPayload ? 0 : bound;
  if (length > effective) {
    return protocol_error(std::string(msg_type_name(static_cast<MsgType>(raw_type))) + ": payload of " +
                          std::to_string(length) + " bytes exceeds the maximum of " + std::to_string(effective));
  }
  return FrameHeader{length, static_cast<MsgType>(raw_type)};
}

Result<Message> decode_payload(MsgType type, std::span<const std::uint8_t> payload) {
  switch (type) {
    case MsgType::kHello: return decode_as<Hello>(payload);
    case MsgType::kHeartbeat: return decode_as<Heartbeat>(payload);
    case MsgType::kVoteUpdateTopology: return decode_as<VoteUpdateTopology>(payload);
    case MsgType::kP2PReport: return decode_as<P2PReport>(payload);
    case MsgType::kVotePeersPending: return decode_as<VotePeersPending>(payload);
    case MsgType::kVoteAgree: return decode_as<VoteAgree>(payload);
    case MsgType::kCollectiveInit: return decode_as<CollectiveInit>(payload);
    case MsgType::kCollectiveDone: return decode_as<CollectiveDone>(payload);
    case MsgType::kCollectiveGo: return decode_as<CollectiveGo>(payload);
    case MsgType::kCollectiveAbort: return decode_as<CollectiveAbort>(payload);
    case MsgType::kRelayHello: return decode_as<RelayHello>(payload);
    case MsgType::kRelayAssign: return decode_as<RelayAssign>(payload);
    case MsgType::kRelayAddress: return decode_as<RelayAddress>(payload);
    case MsgType::kResumeReport: return decode_as<ResumeReport>(payload);
    case MsgType::kResumed: return decode_as<Resumed>(payload);
    case MsgType::kCollectiveResult: return decode_as<CollectiveResult>(payload);
    case MsgType::kWelcome: return decode_as<Welcome>(payload);
    case MsgType::kHeartbeatAck: return decode_as<HeartbeatAck>(payload);
    case MsgType::kEstablishP2P: return decode_as<EstablishP2P>(payload);
    case MsgType::kTopologyResult: return decode_as<TopologyResult>(payload);
    case MsgType::kPeersPendingResult: return decode_as<PeersPendingResult>(payload);
    case MsgType::kAgreeResult: return decode_as<AgreeResult>(payload);
    case MsgType::kRefused: return decode_as<Refused>(payload);
    case MsgType::kGoodbye: return decode_as<Goodbye>(payload);
    case MsgType::kP2PHello: return decode_as<P2PHello>(payload);
    case MsgType::kP2PHelloAck: return decode_as<P2PHelloAck>(payload);
    case MsgType::kSyncVote: return decode_as<SyncVote>(payload);
    case MsgType::kSyncDone: return decode_as<SyncDone>(payload);
    case MsgType::kSyncPlan: return decode_as<SyncPlan>(payload);
    case MsgType::kSyncResult: return decode_as<SyncResult>(payload);
    case MsgType::kStateRequest: return decode_as<StateRequest>(payload);
    case MsgType::kStateResponse: return decode_as<StateResponse>(payload);
    case MsgType::kVoteOptimizeTopology: return decode_as<VoteOptimizeTopology>(payload);
    case MsgType::kBandwidthReport: return decode_as<BandwidthReport>(payload);
    case MsgType::kBandwidthTest: return decode_as<BandwidthTest>(payload);
    case MsgType::kAuthChallenge: return decode_as<AuthChallenge>(payload);
    case MsgType::kAuthProof: return decode_as<AuthProof>(payload);
    case MsgType::kKvRequest: return decode_as<KvRequest>(payload);
    case MsgType::kKvResult: return decode_as<KvResult>(payload);
    case MsgType::kSealed:
      return protocol_error("Sealed: an encrypted frame on a connection that has no keys (it was not authenticated)");
  }
  return protocol_error("unknown message type " + std::to_string(static_cast<unsigned>(type)));
}

MsgType type_of(const Message& message) {
  return std::visit([](const auto& m) { return std::decay_t<decltype(m)>::kType; }, message);
}

void encode_frame(const Message& message, std::vector<std::uint8_t>& out) {
  const std::size_t start = out.size();
  out.resize(start + kFrameHeaderBytes);
  Writer w(out);
  std::visit([&](const auto& m) { fields(w, m); }, message);
  write_header(out.data() + start, type_of(message), static_cast<std::uint32_t>(out.size() - start - kFrameHeaderBytes));
}

void write_header(std::uint8_t* h, MsgType type, std::uint32_t payload_bytes) {
  const auto raw = static_cast<std::uint16_t>(type);
  for (int i = 0; i < 4; ++i) h[i] = static_cast<std::uint8_t>(payload_bytes >> (8 * i));
  h[4] = static_cast<std::uint8_t>(raw);
  h[5] = static_cast<std::uint8_t>(raw >> 8);
  h[6] = 0;
  h[7] = 0;
}

std::vector<std::uint8_t> encode_frame(const Message& message) {
  std::vector<std::uint8_t> out;
  encode_frame(message, out);
  return out;
}

}  // namespace lockstep::proto
