// Every bound driven by remote input or time, in one place. Units last in names.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace lockstep::limits {

// Wire framing: a frame header is 8 bytes (length, type, flags); the payload of a
// control frame never exceeds this, whatever its type says (per-type bounds are tighter).
inline constexpr std::uint32_t kControlFramePayloadBytesMax = 1u << 20;
// Strings on the wire (addresses, reasons).
inline constexpr std::uint32_t kWireStringBytesMax = 1024;
// Members listed in one membership message.
inline constexpr std::uint32_t kMembersPerMessageMax = 4096;
// Per-field bounds of the codec (docs/protocol.md, "Frames"): host names, the `auth`
// field of Hello and P2PHello, and the payload of the small message types.
inline constexpr std::uint32_t kHostBytesMax = 255;
inline constexpr std::uint32_t kAuthBytesMax = 512;
// Nonces, proofs and pair keys are 32 bytes; the decoder allows up to this.
inline constexpr std::uint32_t kAuthFieldBytesMax = 64;
inline constexpr std::uint32_t kSmallPayloadBytesMax = 4096;
// Pairs of peers one RelayAssign names (a lockstep-relay forwards for those only): every
// pair of one group's peers that accept no inbound connection, up to this many.
inline constexpr std::uint32_t kRelayPairsMax = 8192;
// lockstep-relay processes one master keeps registered; more are refused (REJECTED).
inline constexpr std::size_t kRelayProcessesMax = 16;
// Peers (registered + accepted) a master serves, unless configured otherwise.
inline constexpr std::uint32_t kPeersMaxDefault = 1024;
// Bytes queued for sending to one connection before it is dropped as too slow.
inline constexpr std::size_t kSendQueueBytesMax = 16u << 20;
// The master closes a connection gracefully: after its queued messages and the
// shutdown of the send side, at most kDrainBytesMax further bytes are read, for at most
// kCloseGrace, before the socket is closed.
inline constexpr std::size_t kDrainBytesMax = 64 * 1024;
// A payload buffer larger than this is freed after use rather than kept.
inline constexpr std::size_t kKeptPayloadBytesMax = 64 * 1024;
inline constexpr auto kCloseGrace = std::chrono::milliseconds(1000);
// Connections that have not finished the handshake, and how long they may take
// (master: lockstep-master --handshake-timeout-ms, --max-pending-handshakes).
inline constexpr std::uint32_t kHandshakeTimeoutMsDefault = 10'000;
// How long the master tries to connect to a newcomer's p2p port (at the address the
// newcomer connected from) before it registers the newcomer as accepting no inbound
// connection (docs/deployment.md, "NAT"). Below the handshake timeout.
inline constexpr std::uint32_t kReachabilityProbeMs = 2'000;
inline constexpr std::uint32_t kPendingHandshakesMax = 256;
// The same for a peer's p2p, shared-state and benchmark sockets (communicator options
// inbound_handshake_timeout_ms, inbound_handshakes_max); more are closed at once.
inline constexpr std::uint32_t kInboundHandshakeTimeoutMsDefault = 5'000;
inline constexpr std::uint32_t kInboundHandshakesMaxDefault = 256;
// A peer's messages from the master that no call has taken yet, in the master link's
// mailbox (peer::Session) and in each in-flight collective's (peer::OpChannel); one more
// is a PROTOCOL_ERROR that ends the link (or that collective's waits).
inline constexpr std::size_t kMailboxMessagesMax = 256;
// Accepted p2p, shared-state or benchmark connections waiting to be claimed, per
// channel; the oldest is closed to make room.
inline constexpr std::size_t kInboundMax = 1024;

inline constexpr std::uint32_t kHeartbeatTimeoutMsDefault = 5'000;
inline constexpr std::uint32_t kHeartbeatTimeoutMsMin = 100;
inline constexpr std::uint32_t kHeartbeatTimeoutMsMax = 3'600'000;
inline constexpr std::uint32_t kConnectTimeoutMsDefault = 10'000;
// The coordinator's defaults (coord::Config, where each is described): how long the
// participants of a p2p establishment may take to report, the collectives (tags) in
// flight per group, and how long a bandwidth measurement round may take.
inline constexpr std::uint32_t kEstablishTimeoutMsDefault = 30'000;
// How long a newcomer may hold an establishment before it is rejected (lockstep-master
// --newcomer-timeout-ms), and the range a user may set.
inline constexpr std::uint32_t kNewcomerTimeoutMsDefault = 5'000;
inline constexpr std::uint32_t kNewcomerTimeoutMsMin = 100;
inline constexpr std::uint32_t kNewcomerTimeoutMsMax = 3'600'000;
inline constexpr std::uint32_t kCollectivesPerGroupMaxDefault = 4096;
inline constexpr std::uint32_t kMeasureRoundTimeoutMsDefault = 30'000;
// How long a peer waits for a p2p connection to a ring neighbour.
inline constexpr std::uint32_t kP2PConnectTimeoutMsDefault = 5'000;
inline constexpr std::uint32_t kP2PPoolSizeMax = 256;
// Connections one all-reduce may stripe over per hop (coll::kRingStreamsMax), and how
// many the adaptive rule (peer/streams.h) goes up to when the count is not fixed.
inline constexpr std::uint32_t kP2PStreamsMax = 16;
inline constexpr std::uint32_t kP2PStreamsAdaptiveMax = 8;
// An unquantized all-reduce of at most this many bytes travels with the votes: each peer
// sends its contribution with its vote to initiate, the master reduces them in ring order
// and sends the result with the outcome (one round trip instead of two and a ring).
inline constexpr std::uint32_t kVoteCarriedBytesMax = 16u << 10;
// The value one peer proposes in an agree on a value (lockstep_comm_agree_value).
inline constexpr std::uint32_t kAgreeValueBytesMax = 4096;
// Failover (docs/protocol.md, "Failover"): a peer keeps the outcomes of this many tags
// for the master that takes it back, and the last control outcome as a frame of at most
// this many bytes (an AgreeResult with its value is the largest).
inline constexpr std::uint32_t kResumeOutcomesKept = 16;
inline constexpr std::uint32_t kResumeControlBytesMax = 8192;
// How long a master that lost its run waits for every peer of the last view before it
// resumes with a quorum of them (lockstep-master --recovery-window-ms).
inline constexpr std::uint32_t kRecoveryWindowMsDefault = 5'000;
// How long a peer of the C API and the Python package looks for a master to take it
// back by default (lockstep_comm_config_t.failover_timeout_ms; 0 turns failover off).
inline constexpr std::uint32_t kFailoverTimeoutMsDefault = 30'000;
// A master that may replace a lost one holds the founding of a new run at most this
// long (lockstep-master --resume-hold-ms).
inline constexpr std::uint32_t kResumeHoldMsMax = 3'600'000;
// The master's key-value store of run metadata (docs/collectives.md, "Key-value
// store"): the defaults of lockstep-master's --kv-keys-max, --kv-key-bytes-max and
// --kv-value-bytes-max, and the most a flag may raise each to (the wire's bounds);
// waits one peer may have open at once (more are refused with LIMIT_EXCEEDED).
inline constexpr std::uint32_t kKvKeysMaxDefault = 4096;
inline constexpr std::uint32_t kKvKeysMaxLimit = 1u << 20;
inline constexpr std::uint32_t kKvKeyBytesMaxDefault = 256;
inline constexpr std::uint32_t kKvKeyBytesMaxLimit = 1024;
inline constexpr std::uint32_t kKvValueBytesMaxDefault = 64u << 10;
inline constexpr std::uint32_t kKvValueBytesMaxLimit = 512u << 10;
inline constexpr std::uint32_t kKvWaitsPerPeerMax = 64;
// Contributions of one peer that the master holds in votes not yet complete; a vote
// beyond it is refused.
inline constexpr std::size_t kVoteCarriedBytesHeldPerPeerMax = 4u << 20;
// An all-reduce attempt in which no byte moves to or from the ring neighbours for this
// long fails (a cut between two peers that both still reach the master).
inline constexpr std::uint32_t kP2PStallTimeoutMsDefault = 30'000;

// Shared state: tensors per state, key length, and the pieces one sync plan may list
// (together they keep every shared-state message under the control frame bound).
inline constexpr std::uint32_t kSharedStateTensorsMax = 2048;
inline constexpr std::uint32_t kSharedStateKeyBytesMax = 255;
inline constexpr std::uint32_t kSyncFetchesMax = 16384;
// A tensor is split into pieces fetched from different distributors only above this.
inline constexpr std::uint64_t kSyncPieceBytesMin = 4u << 20;
// A source's pieces travel over up to kStateStreamsDefault connections (p2p_streams
// when set), each carrying at least kStateStripeBytesMin (peer/shared_state.cpp).
inline constexpr std::uint32_t kStateStreamsDefault = 4;
inline constexpr std::uint64_t kStateStripeBytesMin = 16u << 20;
// The connections that carry `bytes` from one source: one per kStateStripeBytesMin, at
// least 1, at most `streams`.
constexpr std::uint32_t state_connections(std::uint64_t bytes, std::uint32_t streams) {
  const std::uint64_t most = streams == 0 ? 1 : streams;
  const std::uint64_t n = bytes / kStateStripeBytesMin;
  return static_cast<std::uint32_t>(n < 1 ? 1 : n > most ? most : n);
}
// A shared-state transfer that makes no progress for this long fails.
inline constexpr std::uint32_t kStateTransferStallMsDefault = 60'000;
// Segments (1 MiB leaves of the content hash) one StateRequest may cover: 4 GiB of a
// tensor, 64 KiB of the requester's digests, a 512-byte bitmap in the answer.
inline constexpr std::uint32_t kStateSegmentsPerRequestMax = 4096;
inline constexpr std::uint32_t kStateSendingBytesMax = (kStateSegmentsPerRequestMax + 7) / 8;
// Shared-state transfers (peer/shared_state.cpp). Plain bytes per sealed chunk of
// tensor data (encrypt_data): the buffer each connection holds is this plus a tag.
inline constexpr std::size_t kSealedChunkBytes = std::size_t{1} << 20;
// Receivers one distributor serves in a sync attempt (x kStateStreamsDefault conns).
inline constexpr std::size_t kServeConnectionsMax = 256;

// The master's observability (docs/observability.md): the recent events it keeps for
// its status page (notable ones and everyday successes apart, so that routine traffic
// cannot push a failure out), the throughput history (one-second buckets), the largest
// group whose bandwidth matrix is shown, and the HTTP endpoint's bounds: request size,
// worker threads, connections waiting for a worker, socket timeouts, and how long a
// request waits for the master's loop to render the answer.
inline constexpr std::size_t kObservedEventsMax = 1000;
inline constexpr std::size_t kObservedRoutineEventsMax = 200;
inline constexpr std::size_t kEventPeersListedMax = 64;
inline constexpr std::int64_t kThroughputHistorySeconds = 600;
inline constexpr std::size_t kBandwidthMatrixPeersMax = 64;
inline constexpr std::size_t kHttpRequestBytesMax = 8192;
inline constexpr std::size_t kHttpWorkerThreads = 4;
inline constexpr std::size_t kHttpQueuedConnectionsMax = 32;
inline constexpr std::uint32_t kHttpSocketTimeoutMs = 5'000;
inline constexpr std::uint32_t kHttpRenderTimeoutMs = 2'000;

// The hot standby's election in etcd (master/etcd.h; docs/operations.md, "Hot standby"):
// the lease's time to live (default and bounds), the key's and the advertised address's
// length, the endpoints one master may list, the size of an answer it reads, each
// request's timeout, and how often a standby looks whether the key is free. A master
// renews its lease every third of the TTL and stops serving a fifth of the TTL before the
// lease would end unrenewed (measured from when it sent the request that granted or
// renewed it), so that it has stopped before etcd lets another master take the key.
inline constexpr std::uint32_t kHaLeaseTtlSecondsDefault = 5;
inline constexpr std::uint32_t kHaLeaseTtlSecondsMin = 2;
inline constexpr std::uint32_t kHaLeaseTtlSecondsMax = 60;
inline constexpr std::size_t kHaKeyBytesMax = 256;
inline constexpr std::size_t kHaAdvertiseBytesMax = 300;
inline constexpr std::size_t kHaEndpointsMax = 16;
inline constexpr std::size_t kEtcdResponseBytesMax = 64u << 10;
inline constexpr std::uint32_t kEtcdRequestTimeoutMs = 1'000;
inline constexpr std::uint32_t kHaStandbyPollMs = 250;

}  // namespace lockstep::limits
