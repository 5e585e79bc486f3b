// Frame codec. Writer appends little-endian fields; Reader consumes them and turns
// every underflow or out-of-range value into a PROTOCOL_ERROR naming the field.
#include "protocol/codec.h"

#include "common/limits.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

namespace lockstep::proto {
namespace {

Status protocol_error(std::string what) { return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, std::move(what)); }

class Writer {
 public:
  explicit Writer(std::vector<std::uint8_t>& out) : out_(out) {}
  template <typename T>
  void u(T value) {
    static_assert(std::is_unsigned_v<T>);
    for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  void boolean(bool value) { u<std::uint8_t>(value ? 1 : 0); }
  void status(StatusCode code) { u<std::uint32_t>(static_cast<std::uint32_t>(code)); }
  // Strings longer than the wire bound are cut (only reasons can be that long).
  void str(const std::string& value) {
    const std::size_t n = std::min<std::size_t>(value.size(), limits::kWireStringBytesMax);
    u<std::uint16_t>(static_cast<std::uint16_t>(n));
    out_.insert(out_.end(), value.begin(), value.begin() + static_cast<std::ptrdiff_t>(n));
  }
  // Byte strings are cut at the bound the decoder enforces (a u16 length at most).
  void bytes(const std::vector<std::uint8_t>& value, std::size_t bytes_max = limits::kAuthBytesMax) {
    const std::size_t n = std::min<std::size_t>(value.size(), std::min<std::size_t>(bytes_max, 0xffff));
    u<std::uint16_t>(static_cast<std::uint16_t>(n));
    out_.insert(out_.end(), value.begin(), value.begin() + static_cast<std::ptrdiff_t>(n));
  }
  // Byte strings with a u32 length, cut at bytes_max.
  void bytes32(const std::vector<std::uint8_t>& value, std::size_t bytes_max) {
    const std::size_t n = std::min<std::size_t>(value.size(), bytes_max);
    u<std::uint32_t>(static_cast<std::uint32_t>(n));
    out_.insert(out_.end(), value.begin(), value.begin() + static_cast<std::ptrdiff_t>(n));
  }
  void id(const PeerId& value) {
    u(value.hi);
    u(value.lo);
  }

 private:
  std::vector<std::uint8_t>& out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> in) : in_(in) {}

  template <typename T>
  bool u(T* value, const char* field) {
    static_assert(std::is_unsigned_v<T>);
    if (!need(sizeof(T), field)) return false;
    T out = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) out = static_cast<T>(out | (static_cast<T>(in_[pos_ + i]) << (8 * i)));
    pos_ += sizeof(T);
    *value = out;
    return true;
  }
  bool boolean(bool* value, const char* field) {
    std::uint8_t raw = 0;
    if (!u(&raw, field)) return false;
    if (raw > 1) return fail(std::string(field) + ": boolean out of range");
    *value = raw == 1;
    return true;
  }
  bool status(StatusCode* value, const char* field) {
    std::uint32_t raw = 0;
    if (!u(&raw, field)) return false;
    if (raw > static_cast<std::uint32_t>(kStatusCodeMax)) return fail(std::string(field) + ": unknown status code");
    *value = static_cast<StatusCode>(raw);
    return true;
  }
  bool str(std::string* value, std::uint32_t bytes_max, const char* field) {
    std::uint16_t len = 0;
    if (!u(&len, field)) return false;
    if (len > bytes_max) return fail(std::string(field) + ": string longer than " + std::to_string(bytes_max) + " bytes");
    if (!need(len, field)) return false;
    value->assign(reinterpret_cast<const char*>(in_.data() + pos_), len);
    pos_ += len;
    return true;
  }
  bool bytes(std::vector<std::uint8_t>* value, std::uint32_t bytes_max, const char* field) {
    std::uint16_t len = 0;
    if (!u(&len, field)) return false;
    if (len > bytes_max) return fail(std::string(field) + ": longer than " + std::to_string(bytes_max) + " bytes");
    if (!need(len, field)) return false;
    value->assign(in_.begin() + static_cast<std::ptrdiff_t>(pos_), in_.begin() + static_cast<std::ptrdiff_t>(pos_ + len));
    pos_ += len;
    return true;
  }
  bool bytes32(std::vector<std::uint8_t>* value, std::uint32_t bytes_max, const char* field) {
    std::uint32_t len = 0;
    if (!u(&len, field)) return false;
    if (len > bytes_max) return fail(std::string(field) + ": longer than " + std::to_string(bytes_max) + " bytes");
    if (!need(len, field)) return false;
    value->assign(in_.begin() + static_cast<std::ptrdiff_t>(pos_), in_.begin() + static_cast<std::ptrdiff_t>(pos_ + len));
    pos_ += len;
    return true;
  }
  bool id(PeerId* value, const char* field) { return u(&value->hi, field) && u(&value->lo, field); }
  // A count of elements each at least element_bytes_min long, bounded by count_max
  // and by what is left in the payload (so a lying count cannot make us allocate).
  bool count(std::uint32_t* value, std::uint32_t count_max, std::size_t element_bytes_min, const char* field) {
    if (!u(value, field)) return false;
    if (*value > count_max) return fail(std::string(field) + ": count above " + std::to_string(count_max));
    if (static_cast<std::size_t>(*value) * element_bytes_min > in_.size() - pos_) return fail(std::string(field) + ": count exceeds payload");
    return true;
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
  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::string error_;
};

// ---- per-message encode/decode

void put(Writer& w, const MemberInfo& m) {
  w.id(m.id);
  w.str(m.host);
  w.u(m.p2p_port);
  w.u(m.shared_state_port);
  w.u(m.benchmark_port);
  w.bytes(m.key);
}
bool get(Reader& r, MemberInfo* m) {
  return r.id(&m->id, "member.id") && r.str(&m->host, limits::kHostBytesMax, "member.host") &&
         r.u(&m->p2p_port, "member.p2p_port") && r.u(&m->shared_state_port, "member.shared_state_port") &&
         r.u(&m->benchmark_port, "member.benchmark_port") && r.bytes(&m->key, limits::kAuthFieldBytesMax, "member.key");
}
constexpr std::size_t kMemberBytesMin = 16 + 2 + 6 + 2;

void put_members(Writer& w, const std::vector<MemberInfo>& members) {
  w.u(static_cast<std::uint32_t>(members.size()));
  for (const auto& m : members) put(w, m);
}
bool get_members(Reader& r, std::vector<MemberInfo>* members) {
  std::uint32_t n = 0;
  if (!r.count(&n, limits::kMembersPerMessageMax, kMemberBytesMin, "members")) return false;
  members->resize(n);
  for (auto& m : *members) {
    if (!get(r, &m)) return false;
  }
  return true;
}

void encode_body(Writer& w, const Hello& m) {
  w.u(m.magic);
  w.u(m.version);
  w.u(m.group);
  w.u(m.pool_size);
  w.u(m.p2p_port);
  w.u(m.shared_state_port);
  w.u(m.benchmark_port);
  w.str(m.advertised_host);
  w.bytes(m.auth);
}
bool decode_body(Reader& r, Hello* m) {
  if (!r.u(&m->magic, "hello.magic")) return false;
  if (m->magic != kMagic) return r.fail("hello.magic: not a lockstep peer");
  if (!r.u(&m->version, "hello.version")) return false;
  if (m->version != kProtocolVersion) return r.fail("hello.version: unsupported protocol version " + std::to_string(m->version));
  if (!r.u(&m->group, "hello.group") || !r.u(&m->pool_size, "hello.pool_size")) return false;
  if (m->pool_size == 0 || m->pool_size > limits::kP2PPoolSizeMax) return r.fail("hello.pool_size: out of range");
  return r.u(&m->p2p_port, "hello.p2p_port") &&
         r.u(&m->shared_state_port, "hello.shared_state_port") && r.u(&m->benchmark_port, "hello.benchmark_port") &&
         r.str(&m->advertised_host, limits::kHostBytesMax, "hello.advertised_host") &&
         r.bytes(&m->auth, limits::kAuthBytesMax, "hello.auth");
}
void encode_body(Writer&, const Heartbeat&) {}
bool decode_body(Reader&, Heartbeat*) { return true; }
void encode_body(Writer&, const VoteUpdateTopology&) {}
bool decode_body(Reader&, VoteUpdateTopology*) { return true; }
// A list of peer ids: a u32 count (bounded) and 16 bytes per id.
void put_ids(Writer& w, const std::vector<PeerId>& ids) {
  w.u(static_cast<std::uint32_t>(ids.size()));
  for (const auto& id : ids) w.id(id);
}
bool get_ids(Reader& r, std::vector<PeerId>* ids, const char* field) {
  std::uint32_t n = 0;
  if (!r.count(&n, limits::kMembersPerMessageMax, 16, field)) return false;
  ids->resize(n);
  for (auto& id : *ids) {
    if (!r.id(&id, field)) return false;
  }
  return true;
}

void encode_body(Writer& w, const P2PReport& m) {
  w.u(m.epoch);
  put_ids(w, m.unreachable);
}
bool decode_body(Reader& r, P2PReport* m) {
  return r.u(&m->epoch, "p2p_report.epoch") && get_ids(r, &m->unreachable, "p2p_report.unreachable");
}
void encode_body(Writer&, const VotePeersPending&) {}
bool decode_body(Reader&, VotePeersPending*) { return true; }
void encode_body(Writer& w, const VoteAgree& m) {
  w.boolean(m.flag);
  w.u(static_cast<std::uint8_t>(m.mode));
  w.bytes(m.value, limits::kAgreeValueBytesMax);
}
bool decode_body(Reader& r, VoteAgree* m) {
  std::uint8_t mode = 0;
  if (!r.boolean(&m->flag, "vote_agree.flag") || !r.u(&mode, "vote_agree.mode") ||
      !r.bytes(&m->value, limits::kAgreeValueBytesMax, "vote_agree.value")) {
    return false;
  }
  if (mode > kAgreeModeMax) return r.fail("vote_agree.mode: unknown mode");
  m->mode = static_cast<AgreeMode>(mode);
  return true;
}

void put(Writer& w, const CollectiveDescriptor& d) {
  w.u(d.count);
  w.u(d.dtype);
  w.u(d.op);
  w.u(d.quantization);
  w.u(static_cast<std::uint8_t>(d.kind));
  w.u(d.root);
  w.u(d.world);
  const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(d.counts.size(), limits::kMembersPerMessageMax));
  w.u(n);
  for (std::uint32_t i = 0; i < n; ++i) w.u(d.counts[i]);
  w.u(static_cast<std::uint8_t>(d.algorithm));
}
bool get(Reader& r, CollectiveDescriptor* d) {
  std::uint8_t kind = 0;
  std::uint8_t algorithm = 0;
  std::uint32_t n = 0;
  if (!r.u(&d->count, "descriptor.count") || !r.u(&d->dtype, "descriptor.dtype") || !r.u(&d->op, "descriptor.op") ||
      !r.u(&d->quantization, "descriptor.quantization") || !r.u(&kind, "descriptor.kind") ||
      !r.u(&d->root, "descriptor.root") || !r.u(&d->world, "descriptor.world") ||
      !r.count(&n, limits::kMembersPerMessageMax, 8, "descriptor.counts")) {
    return false;
  }
  d->counts.resize(n);
  for (auto& c : d->counts) {
    if (!r.u(&c, "descriptor.counts")) return false;
  }
  if (!r.u(&algorithm, "descriptor.algorithm")) return false;
  if (algorithm > kAlgorithmMax) return r.fail("descriptor.algorithm: unknown algorithm");
  d->algorithm = static_cast<Algorithm>(algorithm);
  if (d->dtype > LOCKSTEP_F64) return r.fail("descriptor.dtype: unknown dtype");
  if (d->op > LOCKSTEP_MIN) return r.fail("descriptor.op: unknown reduce op");
  if (d->quantization > LOCKSTEP_QUANT_CAST_BF16) return r.fail("descriptor.quantization: unknown kind");
  if (kind > kCollectiveKindMax) return r.fail("descriptor.kind: unknown collective");
  d->kind = static_cast<CollectiveKind>(kind);
  return true;
}
void encode_body(Writer& w, const CollectiveInit& m) {
  w.u(m.tag);
  put(w, m.descriptor);
  w.bytes(m.data, limits::kVoteCarriedBytesMax);
  w.str(m.refusal);
  w.status(m.refusal_status);
}
bool decode_body(Reader& r, CollectiveInit* m) {
  if (!(r.u(&m->tag, "init.tag") && get(r, &m->descriptor) &&
        r.bytes(&m->data, limits::kVoteCarriedBytesMax, "init.data") &&
        r.str(&m->refusal, limits::kWireStringBytesMax, "init.refusal") &&
        r.status(&m->refusal_status, "init.refusal_status"))) {
    return false;
  }
  if (m->refusal_status != LOCKSTEP_STATUS_INVALID_ARGUMENT &&
      m->refusal_status != LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION) {
    return r.fail("init.refusal_status: not a status a refusal may carry");
  }
  return true;
}
void encode_body(Writer& w, const KvRequest& m) {
  w.u(m.request);
  w.u(static_cast<std::uint8_t>(m.op));
  w.str(m.key);
  w.bytes32(m.value, limits::kKvValueBytesMaxLimit);
  w.u(m.timeout_ms);
}
bool decode_body(Reader& r, KvRequest* m) {
  std::uint8_t op = 0;
  if (!(r.u(&m->request, "kv_request.request") && r.u(&op, "kv_request.op") &&
        r.str(&m->key, limits::kKvKeyBytesMaxLimit, "kv_request.key") &&
        r.bytes32(&m->value, limits::kKvValueBytesMaxLimit, "kv_request.value") &&
        r.u(&m->timeout_ms, "kv_request.timeout_ms"))) {
    return false;
  }
  if (op == 0 || op > kKvOpMax) return r.fail("kv_request.op: unknown operation");
  m->op = static_cast<KvOp>(op);
  return true;
}
void encode_body(Writer& w, const KvResult& m) {
  w.u(m.request);
  w.status(m.status);
  w.str(m.reason);
  w.bytes32(m.value, limits::kKvValueBytesMaxLimit);
}
bool decode_body(Reader& r, KvResult* m) {
  return r.u(&m->request, "kv_result.request") && r.status(&m->status, "kv_result.status") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "kv_result.reason") &&
         r.bytes32(&m->value, limits::kKvValueBytesMaxLimit, "kv_result.value");
}
void encode_body(Writer& w, const CollectiveDone& m) {
  w.u(m.tag);
  w.u(m.attempt);
  w.boolean(m.ok);
  w.str(m.reason);
  w.u(m.bytes_sent);
  w.u(m.bytes_received);
}
bool decode_body(Reader& r, CollectiveDone* m) {
  return r.u(&m->tag, "done.tag") && r.u(&m->attempt, "done.attempt") && r.boolean(&m->ok, "done.ok") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "done.reason") && r.u(&m->bytes_sent, "done.bytes_sent") &&
         r.u(&m->bytes_received, "done.bytes_received");
}
void encode_body(Writer& w, const CollectiveGo& m) {
  w.u(m.tag);
  w.u(m.attempt);
  w.u(m.slot);
  w.u(m.epoch);
  put_ids(w, m.absent);
}
bool decode_body(Reader& r, CollectiveGo* m) {
  return r.u(&m->tag, "go.tag") && r.u(&m->attempt, "go.attempt") && r.u(&m->slot, "go.slot") &&
         r.u(&m->epoch, "go.epoch") && get_ids(r, &m->absent, "go.absent");
}
void encode_body(Writer& w, const CollectiveResult& m) {
  w.u(m.tag);
  w.u(m.attempt);
  w.status(m.status);
  w.u(m.world_size);
  w.str(m.reason);
  w.bytes(m.data, limits::kVoteCarriedBytesMax);
}
bool decode_body(Reader& r, CollectiveResult* m) {
  return r.u(&m->tag, "result.tag") && r.u(&m->attempt, "result.attempt") && r.status(&m->status, "result.status") &&
         r.u(&m->world_size, "result.world_size") && r.str(&m->reason, limits::kWireStringBytesMax, "result.reason") &&
         r.bytes(&m->data, limits::kVoteCarriedBytesMax, "result.data");
}

void encode_body(Writer& w, const Welcome& m) {
  w.id(m.id);
  w.str(m.observed_host);
  w.u(m.heartbeat_timeout_ms);
}
bool decode_body(Reader& r, Welcome* m) {
  return r.id(&m->id, "welcome.id") && r.str(&m->observed_host, limits::kHostBytesMax, "welcome.observed_host") &&
         r.u(&m->heartbeat_timeout_ms, "welcome.heartbeat_timeout_ms");
}
void encode_body(Writer&, const HeartbeatAck&) {}
bool decode_body(Reader&, HeartbeatAck*) { return true; }
void encode_body(Writer& w, const EstablishP2P& m) {
  w.u(m.epoch);
  put_members(w, m.ring);
}
bool decode_body(Reader& r, EstablishP2P* m) { return r.u(&m->epoch, "establish.epoch") && get_members(r, &m->ring); }
void encode_body(Writer& w, const TopologyResult& m) {
  w.u(m.epoch);
  w.status(m.status);
  w.str(m.reason);
  put_members(w, m.ring);
  w.u(m.attributes.global_world_size);
  w.u(m.attributes.group_world_size);
  w.u(m.attributes.num_groups);
  w.u(m.attributes.largest_group_size);
}
bool decode_body(Reader& r, TopologyResult* m) {
  return r.u(&m->epoch, "topology.epoch") && r.status(&m->status, "topology.status") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "topology.reason") && get_members(r, &m->ring) &&
         r.u(&m->attributes.global_world_size, "topology.global_world_size") &&
         r.u(&m->attributes.group_world_size, "topology.group_world_size") &&
         r.u(&m->attributes.num_groups, "topology.num_groups") &&
         r.u(&m->attributes.largest_group_size, "topology.largest_group_size");
}
void encode_body(Writer& w, const PeersPendingResult& m) {
  w.status(m.status);
  w.boolean(m.pending);
  w.str(m.reason);
}
bool decode_body(Reader& r, PeersPendingResult* m) {
  return r.status(&m->status, "pending.status") && r.boolean(&m->pending, "pending.pending") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "pending.reason");
}
void encode_body(Writer& w, const AgreeResult& m) {
  w.status(m.status);
  w.boolean(m.value);
  w.str(m.reason);
  w.bytes(m.agreed, limits::kAgreeValueBytesMax);
}
bool decode_body(Reader& r, AgreeResult* m) {
  return r.status(&m->status, "agree.status") && r.boolean(&m->value, "agree.value") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "agree.reason") &&
         r.bytes(&m->agreed, limits::kAgreeValueBytesMax, "agree.agreed");
}
void encode_body(Writer& w, const Refused& m) {
  w.u(static_cast<std::uint16_t>(m.request));
  w.u(m.tag);
  w.status(m.status);
  w.str(m.reason);
}
bool decode_body(Reader& r, Refused* m) {
  std::uint16_t raw = 0;
  if (!r.u(&raw, "refused.request")) return false;
  if (payload_bytes_max(raw) == 0) return r.fail("refused.request: unknown message type");
  m->request = static_cast<MsgType>(raw);
  return r.u(&m->tag, "refused.tag") && r.status(&m->status, "refused.status") && r.str(&m->reason, limits::kWireStringBytesMax, "refused.reason");
}
void encode_body(Writer& w, const Goodbye& m) {
  w.status(m.status);
  w.str(m.reason);
}
bool decode_body(Reader& r, Goodbye* m) {
  return r.status(&m->status, "goodbye.status") && r.str(&m->reason, limits::kWireStringBytesMax, "goodbye.reason");
}
void encode_body(Writer& w, const P2PHello& m) {
  w.u(m.magic);
  w.u(m.version);
  w.u(static_cast<std::uint8_t>(m.channel));
  w.id(m.from);
  w.id(m.to);
  w.u(m.epoch);
  w.u(m.pool_index);
  w.bytes(m.auth);
  w.u(m.flags);
}
bool decode_body(Reader& r, P2PHello* m) {
  if (!r.u(&m->magic, "p2p_hello.magic")) return false;
  if (m->magic != kMagic) return r.fail("p2p_hello.magic: not a lockstep peer");
  if (!r.u(&m->version, "p2p_hello.version")) return false;
  if (m->version != kProtocolVersion) return r.fail("p2p_hello.version: unsupported protocol version");
  std::uint8_t channel = 0;
  if (!r.u(&channel, "p2p_hello.channel")) return false;
  if (channel < 1 || channel > 3) return r.fail("p2p_hello.channel: unknown channel");
  m->channel = static_cast<Channel>(channel);
  return r.id(&m->from, "p2p_hello.from") && r.id(&m->to, "p2p_hello.to") && r.u(&m->epoch, "p2p_hello.epoch") &&
         r.u(&m->pool_index, "p2p_hello.pool_index") && r.bytes(&m->auth, limits::kAuthBytesMax, "p2p_hello.auth") &&
         r.u(&m->flags, "p2p_hello.flags") &&
         ((m->flags & ~kP2PFlagsKnown) == 0 || r.fail("p2p_hello.flags: unknown flag"));
}
void encode_body(Writer& w, const P2PHelloAck& m) { w.status(m.status); }
bool decode_body(Reader& r, P2PHelloAck* m) { return r.status(&m->status, "p2p_hello_ack.status"); }

// ---- shared state
void put(Writer& w, const state::Digest& d) {
  w.u(d.hi);
  w.u(d.lo);
}
bool get(Reader& r, state::Digest* d, const char* field) { return r.u(&d->hi, field) && r.u(&d->lo, field); }

void encode_body(Writer& w, const SyncVote& m) {
  w.u(static_cast<std::uint8_t>(m.strategy));
  w.u(m.revision);
  w.u(static_cast<std::uint32_t>(m.tensors.size()));
  for (const auto& t : m.tensors) {
    w.str(t.key);
    w.u(t.dtype);
    w.u(t.count);
    put(w, t.hash);
    w.boolean(t.allow_content_inequality);
  }
}
bool decode_body(Reader& r, SyncVote* m) {
  std::uint8_t strategy = 0;
  if (!r.u(&strategy, "sync_vote.strategy")) return false;
  if (strategy > static_cast<std::uint8_t>(SyncStrategy::kSendOnly)) return r.fail("sync_vote.strategy: unknown strategy");
  m->strategy = static_cast<SyncStrategy>(strategy);
  std::uint32_t n = 0;
  constexpr std::size_t kEntryBytesMin = 2 + 1 + 8 + 16 + 1;
  if (!r.u(&m->revision, "sync_vote.revision") ||
      !r.count(&n, limits::kSharedStateTensorsMax, kEntryBytesMin, "sync_vote.tensors")) {
    return false;
  }
  m->tensors.resize(n);
  for (auto& t : m->tensors) {
    if (!r.str(&t.key, limits::kSharedStateKeyBytesMax, "sync_vote.key") || !r.u(&t.dtype, "sync_vote.dtype") ||
        !r.u(&t.count, "sync_vote.count") || !get(r, &t.hash, "sync_vote.hash") ||
        !r.boolean(&t.allow_content_inequality, "sync_vote.allow_content_inequality")) {
      return false;
    }
    if (t.key.empty()) return r.fail("sync_vote.key: empty");
    if (t.dtype > LOCKSTEP_F64) return r.fail("sync_vote.dtype: unknown dtype");
  }
  return true;
}
void encode_body(Writer& w, const SyncDone& m) {
  w.u(m.attempt);
  w.status(m.status);
  w.str(m.reason);
  w.u(m.bytes_sent);
  w.u(m.bytes_received);
}
bool decode_body(Reader& r, SyncDone* m) {
  return r.u(&m->attempt, "sync_done.attempt") && r.status(&m->status, "sync_done.status") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "sync_done.reason") &&
         r.u(&m->bytes_sent, "sync_done.bytes_sent") && r.u(&m->bytes_received, "sync_done.bytes_received");
}
void encode_body(Writer& w, const SyncPlan& m) {
  w.u(m.attempt);
  w.u(m.revision);
  put_members(w, m.sources);
  w.u(static_cast<std::uint32_t>(m.fetches.size()));
  for (const auto& f : m.fetches) {
    w.u(f.tensor);
    w.u(f.offset);
    w.u(f.bytes);
    w.u(f.source);
  }
  w.u(static_cast<std::uint32_t>(m.expect.size()));
  for (const auto& e : m.expect) {
    w.u(e.tensor);
    put(w, e.hash);
  }
}
bool decode_body(Reader& r, SyncPlan* m) {
  if (!r.u(&m->attempt, "sync_plan.attempt") || !r.u(&m->revision, "sync_plan.revision") ||
      !get_members(r, &m->sources)) {
    return false;
  }
  std::uint32_t n = 0;
  if (!r.count(&n, limits::kSyncFetchesMax, 4 + 8 + 8 + 4, "sync_plan.fetches")) return false;
  m->fetches.resize(n);
  for (auto& f : m->fetches) {
    if (!r.u(&f.tensor, "sync_plan.fetch.tensor") || !r.u(&f.offset, "sync_plan.fetch.offset") ||
        !r.u(&f.bytes, "sync_plan.fetch.bytes") || !r.u(&f.source, "sync_plan.fetch.source")) {
      return false;
    }
    if (f.source >= m->sources.size()) return r.fail("sync_plan.fetch.source: no such source");
  }
  if (!r.count(&n, limits::kSharedStateTensorsMax, 4 + 16, "sync_plan.expect")) return false;
  m->expect.resize(n);
  for (auto& e : m->expect) {
    if (!r.u(&e.tensor, "sync_plan.expect.tensor") || !get(r, &e.hash, "sync_plan.expect.hash")) return false;
  }
  return true;
}
void encode_body(Writer& w, const SyncResult& m) {
  w.u(m.attempt);
  w.status(m.status);
  w.u(m.revision);
  w.str(m.reason);
}
bool decode_body(Reader& r, SyncResult* m) {
  return r.u(&m->attempt, "sync_result.attempt") && r.status(&m->status, "sync_result.status") &&
         r.u(&m->revision, "sync_result.revision") && r.str(&m->reason, limits::kWireStringBytesMax, "sync_result.reason");
}
void encode_body(Writer& w, const StateRequest& m) {
  w.u(m.attempt);
  w.str(m.key);
  w.u(m.offset);
  w.u(m.bytes);
  put(w, m.hash);
  w.u(m.encoding);
  const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(m.have.size(), limits::kStateSegmentsPerRequestMax));
  w.u(n);
  for (std::uint32_t i = 0; i < n; ++i) put(w, m.have[i]);
}
bool decode_body(Reader& r, StateRequest* m) {
  std::uint32_t n = 0;
  if (!r.u(&m->attempt, "state_request.attempt") ||
      !r.str(&m->key, limits::kSharedStateKeyBytesMax, "state_request.key") ||
      !r.u(&m->offset, "state_request.offset") || !r.u(&m->bytes, "state_request.bytes") ||
      !get(r, &m->hash, "state_request.hash") || !r.u(&m->encoding, "state_request.encoding") ||
      !r.count(&n, limits::kStateSegmentsPerRequestMax, 16, "state_request.have")) {
    return false;
  }
  m->have.resize(n);
  for (auto& d : m->have) {
    if (!get(r, &d, "state_request.have")) return false;
  }
  if (m->key.empty()) return r.fail("state_request.key: empty");
  if (m->encoding > kStateEncodingBlocks) return r.fail("state_request.encoding: unknown encoding");
  if (m->offset > UINT64_MAX - m->bytes || state::segment_count(m->offset, m->bytes) != n) {
    return r.fail("state_request.have: not one digest per segment of the range");
  }
  return true;
}
void encode_body(Writer& w, const StateResponse& m) {
  w.status(m.status);
  w.u(m.bytes);
  w.str(m.reason);
  w.bytes(m.sending, limits::kStateSendingBytesMax);
}
bool decode_body(Reader& r, StateResponse* m) {
  return r.status(&m->status, "state_response.status") && r.u(&m->bytes, "state_response.bytes") &&
         r.str(&m->reason, limits::kWireStringBytesMax, "state_response.reason") &&
         r.bytes(&m->sending, limits::kStateSendingBytesMax, "state_response.sending");
}

// ---- authentication
void encode_body(Writer& w, const AuthChallenge& m) {
  w.bytes(m.nonce);
  w.bytes(m.proof);
}
bool decode_body(Reader& r, AuthChallenge* m) {
  return r.bytes(&m->nonce, limits::kAuthFieldBytesMax, "auth_challenge.nonce") &&
         r.bytes(&m->proof, limits::kAuthFieldBytesMax, "auth_challenge.proof");
}
void encode_body(Writer& w, const AuthProof& m) { w.bytes(m.proof); }
bool decode_body(Reader& r, AuthProof* m) { return r.bytes(&m->proof, limits::kAuthFieldBytesMax, "auth_proof.proof"); }

// ---- topology optimization
void encode_body(Writer&, const VoteOptimizeTopology&) {}
bool decode_body(Reader&, VoteOptimizeTopology*) { return true; }
void encode_body(Writer& w, const BandwidthReport& m) {
  w.u(m.test);
  w.id(m.from);
  w.u(m.bytes_per_s);
}
bool decode_body(Reader& r, BandwidthReport* m) {
  return r.u(&m->test, "bandwidth_report.test") && r.id(&m->from, "bandwidth_report.from") &&
         r.u(&m->bytes_per_s, "bandwidth_report.bytes_per_s");
}
void encode_body(Writer& w, const BandwidthTest& m) {
  w.u(m.test);
  put(w, m.partner);
  w.boolean(m.initiator);
  w.u(m.duration_ms);
  w.u(m.streams);
}
bool decode_body(Reader& r, BandwidthTest* m) {
  if (!r.u(&m->test, "bandwidth_test.test") || !get(r, &m->partner) ||
      !r.boolean(&m->initiator, "bandwidth_test.initiator") || !r.u(&m->duration_ms, "bandwidth_test.duration_ms") ||
      !r.u(&m->streams, "bandwidth_test.streams")) {
    return false;
  }
  if (m->duration_ms == 0 || m->duration_ms > 60'000) return r.fail("bandwidth_test.duration_ms: out of range");
  if (m->streams == 0 || m->streams > limits::kP2PPoolSizeMax) return r.fail("bandwidth_test.streams: out of range");
  return true;
}

template <typename T>
Result<Message> decode_as(std::span<const std::uint8_t> payload) {
  Reader r(payload);
  T message;
  if (!decode_body(r, &message) || !r.finish()) {
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
    case MsgType::kSealed: return "Sealed";
  }
  return "Unknown";
}

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
      return limits::kSmallPayloadBytesMax;
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
  std::visit([&](const auto& m) { encode_body(w, m); }, message);
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
