// The wire protocol's messages as plain structs. Every connection starts with a
// handshake (Hello from the peer, Welcome or Goodbye from the master; P2PHello on
// peer-to-peer channels; with a run secret, AuthChallenge and AuthProof in between);
// after it, length-prefixed frames of these types flow (sealed, with a secret).
// docs/protocol.md describes the encoding; codec.h turns bytes into these safely.
#pragma once

#include "common/ids.h"
#include "common/status.h"
#include "state/hash.h"

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace lockstep::proto {

inline constexpr std::uint32_t kMagic = 0x4c4b5354;  // "LKST"
// 2: pair keys in MemberInfo, bytes in CollectiveDone/SyncDone, sealed frames;
// 3: P2PHello flags (data-plane encryption);
// 4: small all-reduces carried by CollectiveInit and CollectiveResult (data);
// 5: ring frame header with stream index and count (striping), streams in pool_index
// 6: collective kinds (broadcast, all-gather, reduce-scatter, barrier) in the
//    descriptor, with root, world and per-rank counts; a vote may carry its refusal
// 7: the key-value store (KvRequest, KvResult); a refusal carries its status
// 8: shared-state blocks (compression) and delta transfers (StateRequest.have,
//    StateResponse.sending)
// 9: CollectiveGo names the epoch of the view and the view's peers absent from the
//    attempt instead of the whole ring; the descriptor names the all-reduce algorithm
// 10: completion among the peers: CollectiveDone.committed, CollectiveAbort, and the
//    ring's commit tokens (docs/protocol.md, "Completion")
// 11: peers that accept no inbound connection (Hello ports 0), reversed ring edges
// 12: reversed shared-state transfers (SyncPlan.dials)
// 13: relays: Welcome.relay_port, P2PHello channel 4 (to the master's relay)
// 14: relay processes (lockstep-relay): RelayHello, RelayAssign, RelayAddress,
//    Welcome.relay_host; the ends of a relayed edge prove security::relay_key
// 15: failover: Hello.resume_id and term, Welcome.term, ResumeReport, Resumed
// 16: a standby's Goodbye(NOT_SERVING)
// 17: ResumeReport.pending_count, last_pending_status and last_pending (the run-wide
//    are-peers-pending rounds)
inline constexpr std::uint16_t kProtocolVersion = 17;

enum class MsgType : std::uint16_t {
  // peer -> master
  kHello = 1,
  kHeartbeat = 2,
  kVoteUpdateTopology = 3,
  kP2PReport = 4,
  kVotePeersPending = 5,
  kVoteAgree = 6,
  kCollectiveInit = 7,
  kCollectiveDone = 8,
  kSyncVote = 9,
  kSyncDone = 10,
  kVoteOptimizeTopology = 11,
  kBandwidthReport = 12,
  kKvRequest = 14,
  kResumeReport = 16,
  // relay -> master (lockstep-relay, in place of a Hello)
  kRelayHello = 15,
  // peer -> master, and on p2p channels connector -> acceptor (with a secret)
  kAuthProof = 13,
  // master -> peer
  kWelcome = 64,
  kHeartbeatAck = 65,
  kEstablishP2P = 66,
  kTopologyResult = 67,
  kPeersPendingResult = 68,
  kAgreeResult = 69,
  kRefused = 70,
  kGoodbye = 71,
  kCollectiveGo = 72,
  kCollectiveResult = 73,
  kSyncPlan = 74,
  kSyncResult = 75,
  kBandwidthTest = 76,
  kKvResult = 78,
  kCollectiveAbort = 79,
  kRelayAddress = 81,
  kResumed = 82,
  // master -> relay
  kRelayAssign = 80,
  // master -> peer, and on p2p channels acceptor -> connector (with a secret)
  kAuthChallenge = 77,
  // peer -> peer (p2p, shared-state and benchmark sockets)
  kP2PHello = 128,
  kP2PHelloAck = 129,
  kStateRequest = 130,
  kStateResponse = 131,
  // 132, 133: unused (retired before a release).
  // Any direction after an authenticated handshake: an encrypted whole frame
  // (security/frames.h). Never decoded as a message by itself.
  kSealed = 192,
};

const char* msg_type_name(MsgType type);

// The kind of socket a P2PHello opens. kRelay: a connection to the master's relay for a
// ring edge between two peers that both accept no inbound connection (since version 13;
// docs/protocol.md, "Relays"): `to` is the other end, pool_index the slot, flag reversed
// says the connector receives on it.
enum class Channel : std::uint8_t { kRing = 1, kSharedState = 2, kBenchmark = 3, kRelay = 4 };

struct MemberInfo {
  PeerId id;
  std::string host;
  // 0 with the two other ports: this member accepts no inbound connection (behind a NAT
  // or a firewall); its ring edges run reversed (kP2PFlagReversed). Since version 11.
  std::uint16_t p2p_port = 0;
  std::uint16_t shared_state_port = 0;
  std::uint16_t benchmark_port = 0;
  // With a run secret: the pair key of this member and the recipient, filled in per
  // recipient by the master's IO shell (32 bytes; empty without a secret). Internal:
  // never part of the public membership view.
  std::vector<std::uint8_t> key = {};
  bool operator==(const MemberInfo&) const = default;
};
inline bool accepts_inbound(const MemberInfo& m) { return m.p2p_port != 0; }
// Connection reversal: the ring edge from -> to is dialled by `to`, its receiver, when
// only `from` accepts inbound connections (where neither does, it cannot be made).
inline bool reversed_edge(const MemberInfo& from, const MemberInfo& to) {
  return !accepts_inbound(to) && accepts_inbound(from);
}

struct Attributes {
  std::uint32_t global_world_size = 0;
  std::uint32_t group_world_size = 0;
  std::uint32_t num_groups = 0;
  std::uint32_t largest_group_size = 0;
  bool operator==(const Attributes&) const = default;
};

// ---- peer -> master
struct Hello {
  static constexpr MsgType kType = MsgType::kHello;
  std::uint32_t magic = kMagic;
  std::uint16_t version = kProtocolVersion;
  std::uint32_t group = 0;
  std::uint16_t pool_size = 1;  // p2p connections per ring neighbour
  std::uint16_t p2p_port = 0;  // all three 0: this peer accepts no inbound connection
  std::uint16_t shared_state_port = 0;
  std::uint16_t benchmark_port = 0;
  std::string advertised_host;      // empty: use the address the master observes
  std::vector<std::uint8_t> auth;   // room for an authentication proof (security issue)
  // Failover (docs/protocol.md, "Failover"): the identity of a peer that lost its master
  // and asks a new one to take it back (nil: a new peer), and the highest master term
  // it has granted (0: none).
  PeerId resume_id = {};
  std::uint64_t term = 0;
  bool operator==(const Hello&) const = default;
};
struct Heartbeat {
  static constexpr MsgType kType = MsgType::kHeartbeat;
  bool operator==(const Heartbeat&) const = default;
};
struct VoteUpdateTopology {
  static constexpr MsgType kType = MsgType::kVoteUpdateTopology;
  bool operator==(const VoteUpdateTopology&) const = default;
};
struct P2PReport {
  static constexpr MsgType kType = MsgType::kP2PReport;
  std::uint64_t epoch = 0;
  std::vector<PeerId> unreachable;  // empty: every required connection is up
  bool operator==(const P2PReport&) const = default;
};
struct VotePeersPending {
  static constexpr MsgType kType = MsgType::kVotePeersPending;
  bool operator==(const VotePeersPending&) const = default;
};
// How an agree decides (docs/collectives.md, "Agree"): the AND of one flag per peer, a
// value every peer proposes alike, or the value of the peer accepted first.
enum class AgreeMode : std::uint8_t { kFlag = 0, kAllEqual = 1, kFirstAccepted = 2 };
inline constexpr std::uint8_t kAgreeModeMax = 2;
struct VoteAgree {
  static constexpr MsgType kType = MsgType::kVoteAgree;
  bool flag = false;
  AgreeMode mode = AgreeMode::kFlag;
  std::vector<std::uint8_t> value = {};  // kAllEqual, kFirstAccepted: the proposal
  bool operator==(const VoteAgree&) const = default;
};

// The collectives (docs/collectives.md). Broadcast, all-gather and reduce-scatter have
// a shape that depends on the world: they are bound to the membership view they were
// called in (CollectiveDescriptor::world).
enum class CollectiveKind : std::uint8_t {
  kAllReduce = 0,
  kBroadcast = 1,
  kAllGather = 2,
  kReduceScatter = 3,
  kBarrier = 4,
};
inline constexpr std::uint8_t kCollectiveKindMax = 4;
// How an all-reduce that runs between the peers moves its data (docs/collectives.md):
// chosen by size and world (auto), or forced. Part of the voted descriptor, so that every
// peer of an attempt runs the same one.
enum class Algorithm : std::uint8_t {
  kAuto = 0,
  kRing = 1,
  kDoubling = 2,  // log2(N) pairwise exchanges of the whole buffer
};
inline constexpr std::uint8_t kAlgorithmMax = 2;
inline bool shape_bound(CollectiveKind kind) {
  return kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kAllGather ||
         kind == CollectiveKind::kReduceScatter;
}

// What every participant of a collective must agree on (semantics rule 4).
struct CollectiveDescriptor {
  // All-reduce and broadcast: the buffer's elements; all-gather: each rank's elements
  // (0 with `counts`); reduce-scatter: the elements each rank ends with; barrier: 0.
  std::uint64_t count = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t quantization = 0;
  CollectiveKind kind = CollectiveKind::kAllReduce;
  std::uint32_t root = 0;   // broadcast: the root's rank in the view
  std::uint32_t world = 0;  // shape-bound kinds: the size of the view the call was made in
  // All-gather with a count per rank (all_gatherv), in rank order; empty otherwise.
  std::vector<std::uint64_t> counts = {};
  Algorithm algorithm = Algorithm::kAuto;  // all-reduce
  bool operator==(const CollectiveDescriptor&) const = default;
};
// Vote to initiate a collective with this tag.
struct CollectiveInit {
  static constexpr MsgType kType = MsgType::kCollectiveInit;
  std::uint64_t tag = 0;
  CollectiveDescriptor descriptor;
  // This peer's contribution when the all-reduce travels with the votes
  // (coll::travels_with_votes: count x dtype size bytes); empty otherwise.
  std::vector<std::uint8_t> data = {};
  // Non-empty: this peer found the call's arguments unusable (a destination too small
  // for the world, a root outside it, ...). It still votes, so that every peer of the
  // collective ends it with `refusal_status` (INVALID_ARGUMENT, or
  // NON_FINITE_CONTRIBUTION from the optional check) and this reason, rather than waiting.
  std::string refusal = {};
  StatusCode refusal_status = LOCKSTEP_STATUS_INVALID_ARGUMENT;
  bool operator==(const CollectiveInit&) const = default;
};
// Vote to complete: this peer finished its part of the attempt (ok: it holds the
// result) or failed it (it never will). `committed` (with ok): the ring's commit tokens
// told this peer that every participant holds the result, and it has returned success
// to its caller; the attempt can only succeed (docs/protocol.md, "Completion").
struct CollectiveDone {
  static constexpr MsgType kType = MsgType::kCollectiveDone;
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  bool ok = false;
  std::string reason;
  // What this peer's ring moved in the attempt (headers included), for the master's
  // metrics; it decides nothing with them.
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  bool committed = false;
  bool operator==(const CollectiveDone&) const = default;
};

// ---- shared state (semantics rules 5-7)
enum class SyncStrategy : std::uint8_t { kEnforcePopular = 0, kReceiveOnly = 1, kSendOnly = 2 };
const char* to_string(SyncStrategy strategy);

// One tensor as a peer presents it to the election.
struct TensorEntry {
  std::string key;
  std::uint8_t dtype = 0;
  std::uint64_t count = 0;
  state::Digest hash;
  bool allow_content_inequality = false;
  bool operator==(const TensorEntry&) const = default;
};
// Vote to synchronize the shared state: this peer's revision and tensors.
struct SyncVote {
  static constexpr MsgType kType = MsgType::kSyncVote;
  SyncStrategy strategy = SyncStrategy::kEnforcePopular;
  std::uint64_t revision = 0;
  std::vector<TensorEntry> tensors;
  bool operator==(const SyncVote&) const = default;
};
// This peer's transfers of an attempt are over (ok: every received tensor verified).
struct SyncDone {
  static constexpr MsgType kType = MsgType::kSyncDone;
  std::uint64_t attempt = 0;
  StatusCode status = LOCKSTEP_OK;
  std::string reason;
  // Tensor bytes this peer served and received in the attempt (for the metrics).
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  bool operator==(const SyncDone&) const = default;
};

// Vote to optimize the topology (run-wide): measure missing bandwidths, then rewire
// every group's ring in the solver's order, admitting nobody.
struct VoteOptimizeTopology {
  static constexpr MsgType kType = MsgType::kVoteOptimizeTopology;
  bool operator==(const VoteOptimizeTopology&) const = default;
};
// The rate at which this peer received from `from` during bandwidth test `test`.
struct BandwidthReport {
  static constexpr MsgType kType = MsgType::kBandwidthReport;
  std::uint64_t test = 0;
  PeerId from;
  std::uint64_t bytes_per_s = 0;  // 0: could not measure (the edge counts as unusable)
  bool operator==(const BandwidthReport&) const = default;
};

// ---- master -> peer
struct Welcome {
  static constexpr MsgType kType = MsgType::kWelcome;
  PeerId id;
  std::string observed_host;
  std::uint32_t heartbeat_timeout_ms = 0;
  // The master's relay (its port on the master's address; 0: none): ring edges between
  // two peers that both accept no inbound connection run through it. Since version 13.
  std::uint16_t relay_port = 0;
  // The relay's host (empty: the master's own address): a relay process's. Since 14.
  std::string relay_host;
  // The master's term (since 15): a peer taking part in a failover grants it only if it
  // is above every term it has granted before.
  std::uint64_t term = 0;
  bool operator==(const Welcome&) const = default;
};
struct HeartbeatAck {
  static constexpr MsgType kType = MsgType::kHeartbeatAck;
  bool operator==(const HeartbeatAck&) const = default;
};
// Sent to every participant of an update topology: the new ring of its group.
struct EstablishP2P {
  static constexpr MsgType kType = MsgType::kEstablishP2P;
  std::uint64_t epoch = 0;
  std::vector<MemberInfo> ring;
  bool operator==(const EstablishP2P&) const = default;
};
struct TopologyResult {
  static constexpr MsgType kType = MsgType::kTopologyResult;
  std::uint64_t epoch = 0;
  StatusCode status = LOCKSTEP_OK;
  std::string reason;
  std::vector<MemberInfo> ring;  // on success: the membership view, ordered by rank
  Attributes attributes;
  bool operator==(const TopologyResult&) const = default;
};
struct PeersPendingResult {
  static constexpr MsgType kType = MsgType::kPeersPendingResult;
  StatusCode status = LOCKSTEP_OK;
  bool pending = false;
  std::string reason;
  bool operator==(const PeersPendingResult&) const = default;
};
struct AgreeResult {
  static constexpr MsgType kType = MsgType::kAgreeResult;
  StatusCode status = LOCKSTEP_OK;
  bool value = false;
  std::string reason;
  std::vector<std::uint8_t> agreed = {};  // the value agreed on (modes other than kFlag)
  bool operator==(const AgreeResult&) const = default;
};
// The master's key-value store of run metadata (run-wide, not per group).
enum class KvOp : std::uint8_t { kSet = 1, kGet = 2, kWait = 3, kDelete = 4 };
inline constexpr std::uint8_t kKvOpMax = 4;
// A peer's request; `value` only for kSet, `timeout_ms` only for kWait (0: no deadline).
struct KvRequest {
  static constexpr MsgType kType = MsgType::kKvRequest;
  std::uint64_t request = 0;  // chosen by the peer, echoed in the result
  KvOp op = KvOp::kGet;
  std::string key;
  std::vector<std::uint8_t> value = {};
  std::uint32_t timeout_ms = 0;
  bool operator==(const KvRequest&) const = default;
};
// The answer to one KvRequest: OK (with the value for kGet and kWait), KEY_NOT_FOUND,
// TIMEOUT, INVALID_ARGUMENT or LIMIT_EXCEEDED with the reason.
struct KvResult {
  static constexpr MsgType kType = MsgType::kKvResult;
  std::uint64_t request = 0;
  StatusCode status = LOCKSTEP_OK;
  std::string reason;
  std::vector<std::uint8_t> value = {};
  bool operator==(const KvResult&) const = default;
};
// A well-formed request that is illegal in the current state; nothing changed.
struct Refused {
  static constexpr MsgType kType = MsgType::kRefused;
  MsgType request = MsgType::kHello;
  std::uint64_t tag = 0;  // the collective's tag when the request was a CollectiveInit
  StatusCode status = LOCKSTEP_STATUS_INVALID_USAGE;
  std::string reason;
  bool operator==(const Refused&) const = default;
};
// The master ends the connection (kicked, rejected, shutting down) and says why.
struct Goodbye {
  static constexpr MsgType kType = MsgType::kGoodbye;
  StatusCode status = LOCKSTEP_STATUS_KICKED;
  std::string reason;
  bool operator==(const Goodbye&) const = default;
};

// Everyone voted: perform attempt `attempt` of `tag` over this ring of participants,
// on p2p pool slot `slot`.
struct CollectiveGo {
  static constexpr MsgType kType = MsgType::kCollectiveGo;
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  std::uint32_t slot = 0;
  // The attempt's ring: the membership view of this epoch (the last successful update
  // or optimize topology) less the peers listed here (removed since), in view order.
  // Empty in the common case, so that the message does not grow with the world.
  std::uint64_t epoch = 0;
  std::vector<PeerId> absent = {};
  bool operator==(const CollectiveGo&) const = default;
};
// The attempt cannot end by commit any more (a participant was lost, or reported
// without committing): stop, and report with CollectiveDone. The outcome follows.
struct CollectiveAbort {
  static constexpr MsgType kType = MsgType::kCollectiveAbort;
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  bool operator==(const CollectiveAbort&) const = default;
};
// The outcome of a collective, the same for every participant. attempt 0: the
// collective ended before an attempt started (a descriptor mismatch).
struct CollectiveResult {
  static constexpr MsgType kType = MsgType::kCollectiveResult;
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  StatusCode status = LOCKSTEP_OK;
  std::uint32_t world_size = 0;
  std::string reason;
  // The result of a successful all-reduce that travelled with the votes; empty otherwise.
  std::vector<std::uint8_t> data = {};
  bool operator==(const CollectiveResult&) const = default;
};

// A piece of a tensor to fetch: bytes [offset, offset + bytes) of the receiver's
// tensor number `tensor` (its position in the receiver's SyncVote) from distributor
// number `source` of the plan.
struct SyncFetch {
  std::uint32_t tensor = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t source = 0;
  bool operator==(const SyncFetch&) const = default;
};
// A tensor this peer receives and the digest it must have afterwards.
struct SyncExpect {
  std::uint32_t tensor = 0;
  state::Digest hash;
  bool operator==(const SyncExpect&) const = default;
};
// A receiver that a source accepting no inbound connection dials (since version 12):
// it opens `connections` shared-state connections to the receiver (P2PHello flag
// reversed) and answers the requests that arrive on them. The receiver expects exactly
// limits::state_connections(bytes it fetches from that source, kStateStreamsDefault).
struct SyncDial {
  MemberInfo receiver;
  std::uint32_t connections = 1;
  bool operator==(const SyncDial&) const = default;
};
// The election's outcome for one peer: what it must fetch from whom. Every
// participant gets one (most fetch nothing) and serves requests until the result.
// A source that accepts no inbound connection is dialled by nobody: it dials `dials`.
struct SyncPlan {
  static constexpr MsgType kType = MsgType::kSyncPlan;
  std::uint64_t attempt = 0;
  std::uint64_t revision = 0;  // the elected revision: every peer's revision afterwards
  std::vector<MemberInfo> sources;
  std::vector<SyncFetch> fetches;
  std::vector<SyncExpect> expect;
  std::vector<SyncDial> dials = {};
  bool operator==(const SyncPlan&) const = default;
};
// The outcome of a sync, the same for every participant. attempt 0: it ended before
// any transfer (no shared state available, a vote mismatch).
struct SyncResult {
  static constexpr MsgType kType = MsgType::kSyncResult;
  std::uint64_t attempt = 0;
  StatusCode status = LOCKSTEP_OK;
  std::uint64_t revision = 0;
  std::string reason;
  bool operator==(const SyncResult&) const = default;
};

// Measure the link with `partner` in both directions at once: the initiator opens
// `streams` connections to the partner's benchmark socket; both send for duration_ms;
// each reports the rate it received.
struct BandwidthTest {
  static constexpr MsgType kType = MsgType::kBandwidthTest;
  std::uint64_t test = 0;
  MemberInfo partner;
  bool initiator = false;
  std::uint32_t duration_ms = 0;
  std::uint32_t streams = 1;
  bool operator==(const BandwidthTest&) const = default;
};

// The relay the peers use from now on (RelayAddress) changed: another relay process
// registered, or the one in use was lost (port 0: there is none). Since version 14.
struct RelayAddress {
  static constexpr MsgType kType = MsgType::kRelayAddress;
  std::string host;  // empty: the master's own address
  std::uint16_t port = 0;
  bool operator==(const RelayAddress&) const = default;
};

// ---- relay <-> master (docs/deployment.md, "Relays"; since version 14)
// A lockstep-relay process registers in place of a Hello, with the same challenge-response
// (relays need a run secret), then sends Heartbeats.
struct RelayHello {
  static constexpr MsgType kType = MsgType::kRelayHello;
  std::uint32_t magic = kMagic;
  std::uint16_t version = kProtocolVersion;
  std::uint16_t port = 0;        // where it relays
  std::string advertised_host;   // empty: the address the master observes
  std::vector<std::uint8_t> auth;
  bool operator==(const RelayHello&) const = default;
};
// One pair of peers a relay may join, and the key both ends prove to it
// (security::relay_key of their pair key: 32 bytes).
struct RelayPair {
  PeerId a;
  PeerId b;
  std::vector<std::uint8_t> key;
  bool operator==(const RelayPair&) const = default;
};
// Every pair the relay may join now (at most kRelayPairsMax); connections of other
// pairs are closed.
struct RelayAssign {
  static constexpr MsgType kType = MsgType::kRelayAssign;
  std::vector<RelayPair> pairs;
  bool operator==(const RelayAssign&) const = default;
};

// ---- peer -> peer
struct P2PHello {
  static constexpr MsgType kType = MsgType::kP2PHello;
  std::uint32_t magic = kMagic;
  std::uint16_t version = kProtocolVersion;
  Channel channel = Channel::kRing;
  PeerId from;
  PeerId to;
  std::uint64_t epoch = 0;
  std::uint32_t pool_index = 0;
  std::vector<std::uint8_t> auth;
  // kP2PFlag* bits; part of the transcript that the proofs cover.
  std::uint8_t flags = 0;
  bool operator==(const P2PHello&) const = default;
};
// The connector seals its data plane (the communicator option encrypt_data). An acceptor
// whose own setting differs answers P2PHelloAck{kP2PEncryptionMismatch}.
inline constexpr std::uint8_t kP2PFlagEncryptData = 1;
// A reversed connection (ring since version 11, shared state since 12): the connector
// is the receiver of its data and the acceptor sends (ring), or the connector answers
// the acceptor's requests (shared state), because that side accepts no inbound
// connection.
inline constexpr std::uint8_t kP2PFlagReversed = 2;
inline constexpr std::uint8_t kP2PFlagsKnown = kP2PFlagEncryptData | kP2PFlagReversed;
inline constexpr StatusCode kP2PEncryptionMismatch = LOCKSTEP_STATUS_INVALID_ARGUMENT;
struct P2PHelloAck {
  static constexpr MsgType kType = MsgType::kP2PHelloAck;
  StatusCode status = LOCKSTEP_OK;
  bool operator==(const P2PHelloAck&) const = default;
};
// How the bytes of a StateRequest's answer travel: as they are, or as blocks, each raw or
// zstd-compressed (state/blocks.h; since version 8).
inline constexpr std::uint8_t kStateEncodingRaw = 0;
inline constexpr std::uint8_t kStateEncodingBlocks = 1;
// On a shared-state connection: send bytes [offset, offset + bytes) of tensor `key`,
// which must have digest `hash` (the elected content of sync attempt `attempt`), in
// `encoding`, except the segments the requester already holds. The range is cut at
// every multiple of state::kHashLeafBytes of the tensor (state/blocks.h: at most
// limits::kStateSegmentsPerRequestMax segments); `have` holds one digest per segment,
// the requester's own leaf digest there (delta transfers, since version 8).
struct StateRequest {
  static constexpr MsgType kType = MsgType::kStateRequest;
  std::uint64_t attempt = 0;
  std::string key;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  state::Digest hash;
  std::uint8_t encoding = kStateEncodingRaw;
  std::vector<state::Digest> have;
  bool operator==(const StateRequest&) const = default;
};
// The answer: on OK, `sending` has one bit per segment of the request (bit k % 8 of byte
// k / 8), set where the source's leaf digest differs from the requester's, and `bytes`
// is the size of those segments; each run of adjacent set segments follows the frame,
// in order, as it is or as blocks (the request's encoding; a block sequence per run).
struct StateResponse {
  static constexpr MsgType kType = MsgType::kStateResponse;
  StatusCode status = LOCKSTEP_OK;
  std::uint64_t bytes = 0;
  std::string reason;
  std::vector<std::uint8_t> sending;
  bool operator==(const StateResponse&) const = default;
};

// ---- authentication (docs/security.md): the side that was connected to proves first.
// The master (or a p2p acceptor) answers the opening Hello (P2PHello), which carries the
// client's nonce in `auth`, with its own nonce and its proof.
struct AuthChallenge {
  static constexpr MsgType kType = MsgType::kAuthChallenge;
  std::vector<std::uint8_t> nonce;
  std::vector<std::uint8_t> proof;
  bool operator==(const AuthChallenge&) const = default;
};
// The client's proof; after it, every frame in both directions of a control
// connection is sealed.
struct AuthProof {
  static constexpr MsgType kType = MsgType::kAuthProof;
  std::vector<std::uint8_t> proof;
  bool operator==(const AuthProof&) const = default;
};


// ---- failover (docs/protocol.md, "Failover")
// A collective of the peer's in flight when it lost its master: the attempt it was
// given (0: it had voted, no attempt had started).
struct ResumeOp {
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  bool operator==(const ResumeOp&) const = default;
};
// The last outcome the peer received for a tag (a ring commit counts as a success).
struct ResumeOutcome {
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  StatusCode status = LOCKSTEP_OK;
  std::uint32_t world_size = 0;
  std::string reason;
  std::vector<std::uint8_t> data = {};  // a vote-carried all-reduce's result
  bool operator==(const ResumeOutcome&) const = default;
};
// What a peer that lost its master knew, sent to the master that welcomed it back.
struct ResumeReport {
  static constexpr MsgType kType = MsgType::kResumeReport;
  std::uint64_t epoch = 0;       // of its membership view (the last successful topology result)
  std::vector<PeerId> view;      // that view's ids, in rank order
  std::uint64_t epoch_seen = 0;  // the highest epoch of an establishment it was sent
  std::uint64_t attempt_seen = 0;  // the highest attempt (collective, sync, bandwidth test) it was sent
  bool has_revision = false;     // it took part in a successful sync since joining
  std::uint64_t revision = 0;    // the revision of the last one
  // The group's rounds (are-peers-pending, agree, sync) whose outcome it received since
  // its view began, the request it waits on (0: none; otherwise the type of the vote or
  // report it sent last), and the last of those outcomes as a frame.
  std::uint64_t control_count = 0;
  std::uint16_t waiting = 0;
  std::vector<std::uint8_t> last_control = {};
  std::vector<ResumeOp> ops = {};
  std::vector<ResumeOutcome> outcomes = {};
  // The are-peers-pending rounds whose outcome it received since its view began (they
  // are run-wide: every group's peers count the same rounds) and the last outcome.
  std::uint64_t pending_count = 0;
  StatusCode last_pending_status = LOCKSTEP_OK;
  bool last_pending = false;
  bool operator==(const ResumeReport&) const = default;
};
// Recovery is over: the peer is an accepted member again, under this term, in the view
// of this epoch less the peers that did not come back. Outcomes it missed came before.
struct Resumed {
  static constexpr MsgType kType = MsgType::kResumed;
  std::uint64_t term = 0;
  std::uint64_t epoch = 0;
  bool operator==(const Resumed&) const = default;
};

using Message = std::variant<Hello, Heartbeat, VoteUpdateTopology, P2PReport, VotePeersPending,
                             VoteAgree, CollectiveInit, CollectiveDone, Welcome, HeartbeatAck,
                             EstablishP2P, TopologyResult, PeersPendingResult, AgreeResult, Refused,
                             Goodbye, CollectiveGo, CollectiveResult, P2PHello, P2PHelloAck, SyncVote,
                             SyncDone, SyncPlan, SyncResult, StateRequest, StateResponse, VoteOptimizeTopology,
                             BandwidthReport, BandwidthTest, AuthChallenge, AuthProof, KvRequest, KvResult,
                             CollectiveAbort, RelayHello, RelayAssign, RelayAddress, ResumeReport, Resumed>;

MsgType type_of(const Message& message);

}  // namespace lockstep::proto
