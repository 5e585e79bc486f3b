// The peer side: a communicator connects to the master, is voted into the run,
// opens p2p connections to its ring neighbours, and takes part in the run-wide and
// group-wide votes. One background thread (an Asio loop) keeps the master
// connection alive with heartbeats, routes the master's messages to the waiting
// call, and accepts p2p connections; the owning thread makes the calls.
#pragma once

#include "common/ids.h"
#include "common/limits.h"
#include "common/status.h"
#include "protocol/messages.h"
#include "collectives/ring.h"
#include "security/crypto.h"
#include "transport/socket.h"
#include "peer/streams.h"
#include "peer/worker_pool.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <set>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep::peer {

struct Options {
  std::string master_host = "127.0.0.1";
  std::uint16_t master_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  std::uint32_t peer_group = 0;
  std::uint32_t p2p_pool_size = 1;
  int base_port = -1;  // semantics rule 9
  std::uint32_t connect_timeout_ms = limits::kConnectTimeoutMsDefault;
  std::uint32_t p2p_connect_timeout_ms = limits::kP2PConnectTimeoutMsDefault;
  std::uint32_t p2p_stall_timeout_ms = limits::kP2PStallTimeoutMsDefault;  // 0: never
  std::string advertised_host;
  std::string bind_host;
  // The run secret's key (security::load_secret_file or derive_secret_key). With it the
  // peer joins only a master that proves the same secret, and every p2p connection is
  // authenticated with the pair keys the master hands out (docs/security.md). Without
  // it, only a master without a secret admits this peer.
  std::optional<security::Key> secret;
  // Seal the data plane (ring sub-chunks, shared-state requests, responses and tensor
  // bytes) with ChaCha20-Poly1305 under the p2p connections' session keys. Needs the
  // secret; every peer of the run must use the same setting (docs/security.md).
  bool encrypt_data = false;
  // Incoming p2p connections: how long one may take to finish its handshake, and how
  // many may be unfinished at once (beyond that a new one displaces the oldest of the
  // address holding the most).
  std::uint32_t inbound_handshake_timeout_ms = limits::kInboundHandshakeTimeoutMsDefault;
  std::uint32_t inbound_handshakes_max = limits::kInboundHandshakesMaxDefault;
  // Connections one all-reduce stripes over towards each ring neighbour: 0 adapts to
  // the path (peer/streams.h, up to limits::kP2PStreamsAdaptiveMax), 1..kP2PStreamsMax
  // fixes the count.
  std::uint32_t p2p_streams = 0;
  // The TCP congestion control of the p2p connections (TCP_CONGESTION, e.g. "bbr");
  // empty: the system's default. One the kernel refuses is warned about once, at
  // create, and the default is used.
  std::string tcp_congestion;
  // Check this peer's contribution to each float collective for NaN and infinity first;
  // one found ends the collective on every peer with NON_FINITE_CONTRIBUTION.
  bool check_finite = false;
  // Ask for shared-state transfers in blocks, compressed where the sender finds that it
  // pays (state/blocks.h); false: raw bytes.
  bool compress_state = true;
  // How all-reduces between the peers move their data (coll::runs_by_doubling): auto
  // chooses by size and world. Left at auto, the environment's
  // LOCKSTEP_ALLREDUCE_ALGORITHM (auto, ring or doubling) decides. Every peer must
  // choose alike: it travels with the vote, and differing choices fail the collective
  // with OPERATION_MISMATCH.
  proto::Algorithm allreduce_algorithm = proto::Algorithm::kAuto;
  // false: this peer accepts no inbound connection (behind a NAT or a firewall). It opens
  // no listening socket and names no port; its neighbours accept the ring connections it
  // dials (connection reversal), it dials its shared-state sources and bandwidth
  // partners, and it is never a shared-state source (docs/deployment.md).
  bool accept_inbound = true;
  // Failover (docs/architecture.md, "Failover"): once accepted, a peer that loses its
  // master looks for one to take it back (the master's address, then each of these in
  // turn) for this long, holding its operations in flight; 0: off (the loss is fatal:
  // MASTER_CONNECTION_LOST).
  std::uint32_t failover_timeout_ms = 0;
  std::vector<std::pair<std::string, std::uint16_t>> master_fallbacks;
  // The master's address, then each fallback: the order connect and failover try them in.
  std::vector<std::pair<std::string, std::uint16_t>> master_addresses() const {
    std::vector<std::pair<std::string, std::uint16_t>> all{{master_host, master_port}};
    all.insert(all.end(), master_fallbacks.begin(), master_fallbacks.end());
    return all;
  }
};

class Link;       // the background thread and everything it owns (communicator.cpp)
class OpChannel;  // the master's messages for one in-flight collective

// One collective (docs/collectives.md). All-reduce (the default): count elements from
// src into dst (src may equal dst: in place). Broadcast: dst is the buffer on every
// peer, sent from the peer of rank `root` (src is ignored). All-gather: src holds this
// rank's count elements (or counts[rank] with per-rank counts), dst room for
// dst_capacity elements, of which the first sum(counts) (or world x count) receive every
// rank's part in rank order. Reduce-scatter: src holds world x count elements, dst
// receives this rank's count (chunk `rank` of the reduced whole). Barrier: no buffers.
struct ReduceDescriptor {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t count = 0;
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quantization = LOCKSTEP_QUANT_NONE;
  std::uint64_t tag = 0;
  proto::CollectiveKind kind = proto::CollectiveKind::kAllReduce;
  std::uint32_t root = 0;
  std::vector<std::uint64_t> counts = {};  // all-gather: elements per rank (empty: count each)
  std::uint64_t dst_capacity = 0;     // all-gather: elements dst has room for
  // All-reduce with quantization, op sum or avg: error feedback (coll::RingPlan::residual),
  // count elements of dtype, updated only when the all-reduce succeeds.
  void* residual = nullptr;
  // The quantization's distribution hint (coll::quantize); each peer's own.
  lockstep_distribution_t distribution = LOCKSTEP_DIST_NONE;
};

struct ReduceInfo {
  std::uint32_t world_size = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint32_t streams = 1;  // connections this peer's sends were striped over
};

// One tensor of the shared state; the memory stays the caller's.
struct SharedTensor {
  std::string key;
  void* data = nullptr;
  std::uint64_t count = 0;
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  bool allow_content_inequality = false;
};

struct SyncInfo {
  std::uint64_t bytes_sent = 0;      // tensor bytes served to other peers
  std::uint64_t bytes_received = 0;  // tensor bytes received
  // The same on the wire: compressed blocks and their 8-byte headers where the
  // transfer went in blocks, else equal to the above (seals' tags not counted).
  std::uint64_t wire_bytes_sent = 0;
  std::uint64_t wire_bytes_received = 0;
  std::uint32_t streams = 0;  // connections the received bytes came over
};

// What a communicator did since it was created (docs/observability.md). Operations are
// connect, update topology, optimize topology, all-reduces (each launch, blocking or
// async) and shared-state syncs; the votes are-peers-pending and agree are not counted.
// A retry is an operation started after the previous one of its kind (for an all-reduce:
// of its tag) failed. Times are wall-clock microseconds spent in each call (concurrent
// all-reduces add up).
struct Counters {
  std::uint64_t all_reduce_bytes_sent = 0;      // ring bytes, headers included
  std::uint64_t all_reduce_bytes_received = 0;
  std::uint64_t sync_bytes_sent = 0;            // shared-state tensor bytes served
  std::uint64_t sync_bytes_received = 0;
  std::uint64_t operations_started = 0;
  std::uint64_t operations_succeeded = 0;
  std::uint64_t operations_failed = 0;
  std::uint64_t all_reduces_started = 0;
  std::uint64_t all_reduces_succeeded = 0;
  std::uint64_t all_reduces_failed = 0;
  std::uint64_t syncs_started = 0;
  std::uint64_t syncs_succeeded = 0;
  std::uint64_t syncs_failed = 0;
  std::uint64_t retries = 0;
  std::uint64_t connect_us = 0;
  std::uint64_t update_topology_us = 0;
  std::uint64_t optimize_topology_us = 0;
  std::uint64_t sync_us = 0;
  std::uint64_t all_reduce_us = 0;
  // Ring bytes (headers included) per p2p pool slot: entry k is slot k, one per slot
  // of the pool. Concurrent all-reduces run on different slots while slots are free.
  std::vector<std::uint64_t> slot_bytes_sent;
  std::vector<std::uint64_t> slot_bytes_received;
};

// An all-reduce in flight on a worker thread. Awaited on the thread that launched it.
class AsyncReduce {
 public:
  bool done() const { return finished_.load(); }

 private:
  friend class Communicator;
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_.store(true);
    }
    cv_.notify_all();
  }
  void wait_finished() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return finished_.load(); });
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> finished_{false};
  Status status_;
  ReduceInfo info_;
  std::thread::id launcher_;
  std::uint64_t tag_ = 0;
  bool awaited_ = false;
};

class Communicator {
 public:
  static Result<std::unique_ptr<Communicator>> create(const Options& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  Status connect();
  Status update_topology();
  // Measures the bandwidth of the missing edges (as the master schedules them) and
  // rewires every group's ring in the order the master's solver chose; admits nobody.
  Status optimize_topology();
  Result<bool> are_peers_pending();
  Result<bool> agree(bool flag);
  // Agree on a value of up to limits::kAgreeValueBytesMax bytes (docs/collectives.md):
  // kAllEqual: every peer's proposal must be byte-equal (else OPERATION_MISMATCH for
  // all); kFirstAccepted: the proposal of the peer accepted first wins. Every peer of
  // the group gets the same value.
  Result<std::vector<std::uint8_t>> agree_value(proto::AgreeMode mode, std::vector<std::uint8_t> value);

  // The master's key-value store (docs/collectives.md), open once connected: set
  // (create or overwrite), get (KEY_NOT_FOUND if absent), wait (until the key is set;
  // TIMEOUT after timeout_ms, 0: no deadline), erase (absent is fine). Bounds beyond the
  // master's: LIMIT_EXCEEDED.
  Status kv_set(const std::string& key, std::vector<std::uint8_t> value);
  Result<std::vector<std::uint8_t>> kv_get(const std::string& key);
  Result<std::vector<std::uint8_t>> kv_wait(const std::string& key, std::uint32_t timeout_ms);
  Status kv_delete(const std::string& key);

  // Collectives of any kind (descriptor.kind). The blocking form is launch + await on
  // the calling thread.
  Result<ReduceInfo> all_reduce(const ReduceDescriptor& descriptor);
  Result<std::shared_ptr<AsyncReduce>> all_reduce_async(const ReduceDescriptor& descriptor);
  Result<ReduceInfo> await(const std::shared_ptr<AsyncReduce>& handle);
  // Runs every descriptor (all-reduces and barriers) with at most max_in_flight at
  // once; failed ones are retried with the survivors once all outstanding ones have
  // ended. Returns when all succeeded, or with the first error that is not a lost peer
  // (TOO_FEW_PEERS once one peer is left).
  Status all_reduce_multiple_with_retry(const std::vector<ReduceDescriptor>& descriptors, std::size_t max_in_flight,
                                        std::vector<ReduceInfo>* infos);

  // Shared state (semantics rules 5-7): a vote with every tensor's digest, then the
  // transfers the master plans. On success *revision is the group's revision.
  Result<SyncInfo> sync_shared_state(const std::vector<SharedTensor>& tensors, std::uint64_t* revision,
                                     proto::SyncStrategy strategy);

  Result<proto::Attributes> attributes() const;
  Result<std::vector<proto::MemberInfo>> membership() const;
  Result<std::uint32_t> rank() const;
  PeerId id() const;
  std::string last_error() const;
  std::uint16_t p2p_port() const;
  // Thread-safe: a copy of the counters (each read atomically, not all at one instant).
  Counters counters() const;

 private:
  explicit Communicator(const Options& options);
  Status check_call(bool need_accepted) const;
  Result<proto::AgreeResult> vote_agree(proto::VoteAgree vote);
  Result<std::vector<std::uint8_t>> kv_request(proto::KvRequest request);
  // With Options::check_finite: turns a vote into a NON_FINITE_CONTRIBUTION refusal when
  // this peer's contribution holds NaN or infinity.
  void check_contribution(const ReduceDescriptor& d, proto::CollectiveInit* init) const;
  Status remember(Status status);
  // Waits for the master's EstablishP2P, wires the ring, reports, and waits for the
  // outcome. Returns the TopologyResult (its status may be a failure) or a fatal status.
  Result<proto::TopologyResult> run_establishment(bool newcomer);
  Result<proto::TopologyResult> finish_establishment(const proto::EstablishP2P& establish);
  // One bandwidth test (peer/bandwidth.cpp): the rate received from the partner, in
  // bytes per second, or 0 if it could not be measured.
  std::uint64_t measure_bandwidth(const proto::BandwidthTest& test);
  // `cancel` is raised when the master ends the epoch: connection setup stops then.
  std::vector<PeerId> establish(const proto::EstablishP2P& plan, const OpChannel& cancel);
  Status check_collective_call(const ReduceDescriptor& d);
  // The wire descriptor of a call, and why this peer cannot take part in it ("" if it
  // can): the other peers learn it with the vote (CollectiveInit::refusal).
  proto::CollectiveDescriptor wire_descriptor(const ReduceDescriptor& d, std::string* refusal) const;
  Result<std::shared_ptr<AsyncReduce>> start_collective(const ReduceDescriptor& d, bool on_own_thread);
  // The body of one collective, on a worker thread or the caller's.
  Status run_collective(const ReduceDescriptor& d, OpChannel& channel, ReduceInfo* info);
  // An attempt's end here, whatever its outcome: the slot, the counters, the scratch.
  void finish_attempt(std::uint32_t slot, std::uint64_t attempt, const coll::RingStats& stats, ReduceInfo* info,
                      std::unique_ptr<coll::RingScratch> scratch);
  // How many peers of `ring` run on this host.
  std::size_t peers_on_this_host(const std::vector<PeerId>& ring);
  // This peer as the view shows it, as far as reversal goes (whether it names a port).
  proto::MemberInfo self_info() const;
  // Its p2p port as the view names it: its own, or 0 where it accepts no inbound
  // connection or the master could not reach it.
  std::atomic<std::uint16_t> view_p2p_port_{0};
  // Ring connections, made on first use and cached per (peer, pool slot). The
  // receiver accepts them, or dials them where only the sender accepts inbound
  // connections (proto::reversed_edge). `channel` (an attempt's, or an establishment's)
  // stops a connect or a wait when it is aborted.
  // With encrypt_data, *seal / *open (if given) receive the connection's cipher state.
  Result<int> tx_connection(const proto::MemberInfo& to, std::uint32_t slot, const OpChannel& channel,
                            security::Aead** seal = nullptr);
  // give_up_cached: the cached connection carries frames of an attempt that ended here
  // before its turn; it is closed (its sender connects anew) and a newer one awaited.
  Result<int> rx_connection(const proto::MemberInfo& from, std::uint32_t slot,
                            std::chrono::steady_clock::time_point deadline, const OpChannel& channel,
                            security::Aead** open = nullptr, bool give_up_cached = false);
  // Dials `to` (kRing): a ring connection this peer sends on, or with `reversed` one it
  // receives on (`relayed`: through the master's relay, sealed). Returns the connected
  // socket and its session keys.
  Result<std::pair<transport::Fd, security::SessionKeys>> dial_ring(const proto::MemberInfo& to, std::uint32_t slot,
                                                                    bool reversed, bool relayed,
                                                                    const OpChannel& channel);
  // Whether the edge runs through the relay in use (Link::relay): both ends accept no
  // inbound connection and the run has a relay (docs/deployment.md, "Relays").
  bool relayed_edge(const proto::MemberInfo& from, const proto::MemberInfo& to) const;
  // Whether a ring connection's frames are sealed: with encrypt_data, and on a relayed
  // edge always.
  bool sealed_edge(bool relayed) const { return options_.encrypt_data || relayed; }
  // Connects to the relay for the edge with `other` on `slot` (`receiver`: this peer
  // receives on it) and waits until the relay has joined it to `other`'s connection.
  Result<transport::Fd> dial_relay(const proto::MemberInfo& other, std::uint32_t slot, bool receiver,
                                   const OpChannel& channel);
  // The connections to `to` and from `from` on `slot` (as tx_connection and
  // rx_connection). Where the edge to `to` is relayed the two are made at once: its
  // receiver answers only once it makes its own connections, and with every edge of a
  // ring relayed each peer would otherwise wait for the next one in a circle.
  std::pair<Result<int>, Result<int>> ring_connections(const proto::MemberInfo& to, const proto::MemberInfo& from,
                                                       std::uint32_t slot, std::chrono::steady_clock::time_point deadline,
                                                       const OpChannel& channel, security::Aead** seal,
                                                       security::Aead** open);
  // The ring's rx_replace for the connections from `from` on `slot` (stream 0) and its stripes.
  std::function<Result<coll::RingStream>(std::size_t)> rx_replacer(const proto::MemberInfo& from, std::uint32_t slot,
                                                                   const OpChannel& channel);
  void open_streams(const proto::MemberInfo& to, std::uint32_t slot, const coll::RingPlan& plan,
                    const OpChannel& channel, coll::RingIo& io);
  void drop_connections(PeerId next, PeerId prev, std::uint32_t slot);
  void prune_connections(const std::vector<proto::MemberInfo>& members);
  // An all-reduce by doubling (collectives/doubling.h): this rank's pair exchanges over
  // the slot's connections to each partner, in order.
  Status run_doubling(const std::vector<PeerId>& ring, std::size_t rank, const coll::RingPlan& plan,
                      std::uint32_t slot, const OpChannel& channel, coll::RingScratch& scratch,
                      coll::RingStats* stats);

  Options options_;
  std::thread::id owner_;
  std::unique_ptr<Link> link_;
  bool connected_ = false;
  bool accepted_ = false;
  std::uint64_t kv_requests_ = 0;  // the last KvRequest id
  PeerId id_;
  std::uint64_t epoch_ = 0;
  std::vector<proto::MemberInfo> view_;
  proto::Attributes attributes_;
  std::uint32_t rank_ = 0;
  // Ring connections: to (tx) and from (rx) other peers, per pool slot.
  struct SlotKey {
    PeerId peer;
    std::uint32_t slot = 0;
    auto operator<=>(const SlotKey&) const = default;
  };
  // With encrypt_data each connection carries its direction's cipher state (key and
  // nonce counter): it lives and dies with the socket, so a new connection starts with
  // new keys and both ends' counters at zero.
  struct TxConnection {
    transport::Fd fd;
    std::uint64_t generation = 0;  // a reversed one's (its receiver dialled it)
    std::unique_ptr<security::Aead> seal;
  };
  struct RxConnection {
    transport::Fd fd;
    std::uint64_t generation = 0;
    std::unique_ptr<security::Aead> open;
  };
  std::mutex connections_mutex_;
  std::map<SlotKey, TxConnection> tx_;
  std::map<SlotKey, RxConnection> rx_;
  // Stream s of pool slot k is keyed (and named in the P2PHello's pool_index) as
  // k | s << 16; stream 0 is the slot's own connection.
  static std::uint32_t stream_key(std::uint32_t slot, std::uint32_t stream) { return slot | (stream << 16); }
  // How many streams the next all-reduce towards each next peer stripes over.
  std::mutex tuners_mutex_;
  std::map<PeerId, StreamTuner> tuners_;
  std::atomic<std::uint64_t> next_generation_{1};
  // Members by id as of the last update topology (read by collective threads).
  std::map<PeerId, proto::MemberInfo> members_;
  // Collectives in flight, and the one thread besides the owner that may launch them.
  std::mutex ops_mutex_;
  std::set<std::uint64_t> tags_in_flight_;
  // view_.size() and rank_, for the thread that launches collectives.
  std::atomic<std::uint32_t> view_size_{0};
  std::atomic<std::uint32_t> view_rank_{0};
  std::optional<std::thread::id> collective_thread_;
  std::vector<std::unique_ptr<coll::RingScratch>> free_scratch_;
  mutable std::mutex error_mutex_;
  std::string last_error_;
  // Why the last establishment could not connect to a neighbour when the reason is a
  // setting that differs (encrypt_data): added to the failure the master reports, which
  // only knows that the neighbour was unreachable (owning thread only).
  std::string p2p_refusal_;
  Status with_p2p_refusal(Status status) const;

  // ---- counters (communicator.cpp): atomics, since collectives run on other threads
  enum class Counter : std::size_t {
    kAllReduceBytesSent, kAllReduceBytesReceived, kSyncBytesSent, kSyncBytesReceived,
    kOperationsStarted, kOperationsSucceeded, kOperationsFailed,
    kAllReducesStarted, kAllReducesSucceeded, kAllReducesFailed,
    kSyncsStarted, kSyncsSucceeded, kSyncsFailed, kRetries,
    kConnectUs, kUpdateTopologyUs, kOptimizeTopologyUs, kSyncUs, kAllReduceUs, kCount
  };
  void count(Counter counter, std::uint64_t n = 1) {
    counters_[static_cast<std::size_t>(counter)].fetch_add(n, std::memory_order_relaxed);
  }
  class OperationScope;  // times one operation and counts its outcome
  std::array<std::atomic<std::uint64_t>, static_cast<std::size_t>(Counter::kCount)> counters_{};
  struct SlotBytes {
    std::atomic<std::uint64_t> sent{0};
    std::atomic<std::uint64_t> received{0};
  };
  std::array<SlotBytes, limits::kP2PPoolSizeMax> slot_bytes_{};
  // Whether the last operation of each kind failed (owning thread only), and the
  // all-reduce tags whose last attempt failed (ops_mutex_), for the retry count.
  bool update_failed_ = false;
  bool optimize_failed_ = false;
  bool sync_failed_ = false;
  std::set<std::uint64_t> failed_tags_;
  // Runs async collectives; stopped (every one finished) before the members above go.
  WorkerPool workers_;
};

// Counts one operation as started (and as a retry if the previous one of its kind
// failed), and on leaving the scope its time and outcome: failed unless succeeded()
// was called.
class Communicator::OperationScope {
 public:
  OperationScope(Communicator& comm, Counter time_us, bool* last_failed)
      : comm_(comm), time_us_(time_us), last_failed_(last_failed), start_(std::chrono::steady_clock::now()) {
    comm_.count(Counter::kOperationsStarted);
    if (last_failed_ != nullptr && *last_failed_) comm_.count(Counter::kRetries);
  }
  ~OperationScope() {
    comm_.count(time_us_, static_cast<std::uint64_t>(
                              std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count()));
    comm_.count(ok_ ? Counter::kOperationsSucceeded : Counter::kOperationsFailed);
    if (last_failed_ != nullptr) *last_failed_ = !ok_;
  }
  OperationScope(const OperationScope&) = delete;
  OperationScope& operator=(const OperationScope&) = delete;
  void succeeded() { ok_ = true; }

 private:
  Communicator& comm_;
  Counter time_us_;
  bool* last_failed_;
  std::chrono::steady_clock::time_point start_;
  bool ok_ = false;
};

}  // namespace lockstep::peer
