// The peer's side of a shared-state sync. The owning thread hashes every tensor, votes,
// and waits for the master's plan; then, until the outcome arrives:
//  - a server thread hands each shared-state connection of this attempt to a handler
//    thread that answers requests for byte ranges of our tensors (only tensors whose
//    digest is the one requested, only ranges inside them);
//  - a fetch thread opens up to four connections per source named in the plan
//    (p2p_streams when set), which share that source's pieces out between them a unit
//    at a time (peer/transfer_queue.h), keeps a few requests in flight on each (the
//    first ones sent with the handshake), receives the pieces straight into the
//    tensors, digesting each 1 MiB leaf of the content hash as soon as it is whole,
//    checks every received tensor's digest and reports to the master.
// A source that accepts no inbound connection is dialled by nobody: the plan names the
// receivers it dials instead (SyncPlan.dials), and its server answers on those
// connections as on accepted ones; such a receiver's fetch thread takes the connection
// its source dialled (P2PHello flag reversed) instead of dialling. Roles do not follow
// the TCP connection: the requester seals with to_server, the server with to_client.
// The outcome (one for the whole group) stops both; on failure open transfers are cut
// by shutting their sockets down. Memory stays bounded: bytes move from the sender's
// tensor into the receiver's tensor, and a receiver never accepts more bytes than its
// own descriptor of the tensor holds.
// With encrypt_data, every frame of a transfer connection is sealed (security/frames.h)
// and tensor bytes travel as sealed chunks of at most limits::kSealedChunkBytes, each
// opened into the tensor only once it verifies; one chunk buffer per connection.
// Each request carries the fetcher's own digests of the 1 MiB segments it covers, and the
// server sends only the segments whose digest differs from its own (delta transfer: a
// peer one revision behind receives what changed, and it costs no round trip). Both ends
// use the leaf digests they computed for the vote; nothing is hashed twice.
// Unless the fetcher's compress_state is off, it asks for blocks (state/blocks.h): the
// server compresses each where its policy says it pays, and the fetcher decompresses a
// compressed block into a buffer of its own, copying it into the tensor only once it
// decompressed to exactly its size.
#include "common/dtype.h"
#include "common/limits.h"
#include "common/log.h"
#include "peer/communicator.h"
#include "peer/handshake.h"
#include "peer/link.h"
#include "peer/mailbox.h"
#include "peer/transfer_queue.h"
#include "state/blocks.h"
#include "state/hash.h"
#include "transport/framed.h"

#include <sys/socket.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <set>

namespace lockstep::peer {
namespace {

// Bytes per send/receive call of tensor data (each bounded by the stall timeout).
constexpr std::size_t kTransferChunkBytes = std::size_t{4} << 20;
// Connections one attempt's server accepts (more are closed): as many receivers as
// limits::kServeConnectionsMax, each with its default connections.
constexpr std::size_t kServeConnectionsPerAttempt = limits::kServeConnectionsMax * limits::kStateStreamsDefault;

struct LocalTensor {
  std::uint8_t* data = nullptr;
  std::uint64_t bytes = 0;
  std::vector<state::Digest> leaves;  // the content hash's leaf digests, from the vote
  state::Digest hash;
};

// The leaf digests of the segments of [offset, offset + bytes) (state/blocks.h).
std::vector<state::Digest> segment_digests(const LocalTensor& t, std::uint64_t offset, std::uint64_t bytes) {
  const auto first = static_cast<std::ptrdiff_t>(offset / state::kHashLeafBytes);
  const auto count = static_cast<std::ptrdiff_t>(state::segment_count(offset, bytes));
  return {t.leaves.begin() + first, t.leaves.begin() + first + count};
}

// One bit per segment (bit k % 8 of byte k / 8): set where `theirs` differs from `mine`.
std::vector<std::uint8_t> differing(const std::vector<state::Digest>& mine, const std::vector<state::Digest>& theirs) {
  std::vector<std::uint8_t> out((mine.size() + 7) / 8, 0);
  for (std::size_t k = 0; k < mine.size(); ++k) {
    if (k >= theirs.size() || mine[k] != theirs[k]) out[k / 8] = static_cast<std::uint8_t>(out[k / 8] | (1u << (k % 8)));
  }
  return out;
}

// The ranges (offset, bytes) of the segments of [offset, offset + bytes) whose bit is set
// in `sending` (differing()), adjacent ones merged.
std::vector<std::pair<std::uint64_t, std::uint64_t>> runs(std::uint64_t offset, std::uint64_t bytes,
                                                          const std::vector<std::uint8_t>& sending) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  const std::uint64_t n = state::segment_count(offset, bytes);
  for (std::uint64_t k = 0; k < n; ++k) {
    if (k / 8 >= sending.size() || ((unsigned{sending[k / 8]} >> (k % 8)) & 1u) == 0) continue;
    const std::uint64_t start = state::segment_start(offset, k);
    const std::uint64_t end = k + 1 < n ? state::segment_start(offset, k + 1) : offset + bytes;
    if (!out.empty() && out.back().first + out.back().second == start) {
      out.back().second += end - start;
    } else {
      out.emplace_back(start, end - start);
    }
  }
  return out;
}

// Sockets in use by transfer threads, so that another thread can cut them.
class SocketSet {
 public:
  bool add(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return false;
    fds_.insert(fd);
    return true;
  }
  void remove(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.erase(fd);
  }
  // Every socket in use, now and later, is shut down: blocked calls return at once.
  void shutdown_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    for (const int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  std::mutex mutex_;
  std::set<int> fds_;
  bool closed_ = false;
};

Status send_bytes(int fd, const std::uint8_t* data, std::uint64_t bytes) {
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kTransferChunkBytes, bytes - at));
    Status s = transport::send_all(fd, std::span<const std::uint8_t>(data + at, n), limits::kStateTransferStallMsDefault);
    if (!s.is_ok()) return s;
    at += n;
  }
  return Status::ok();
}

Status recv_bytes(int fd, std::uint8_t* data, std::uint64_t bytes, std::atomic<std::uint64_t>& counter) {
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kTransferChunkBytes, bytes - at));
    Status s = transport::recv_exact(fd, std::span<std::uint8_t>(data + at, n), limits::kStateTransferStallMsDefault);
    if (!s.is_ok()) return s;
    at += n;
    counter += n;
  }
  return Status::ok();
}

// One end of an encrypted transfer connection: the frames' and the chunks' cipher state
// and the buffer of one sealed chunk.
struct SealedStream {
  SealedStream(const security::SessionKeys& keys, bool client)
      : crypto(keys, client), chunk(limits::kSealedChunkBytes + security::kTagBytes) {}
  security::FrameCrypto crypto;
  std::vector<std::uint8_t> chunk;
};

Status send_bytes(int fd, const std::uint8_t* data, std::uint64_t bytes, SealedStream* sealed) {
  if (sealed == nullptr) return send_bytes(fd, data, bytes);
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(limits::kSealedChunkBytes, bytes - at));
    sealed->crypto.seal_bytes(std::span<const std::uint8_t>(data + at, n), sealed->chunk.data());
    Status s = transport::send_all(fd, std::span<const std::uint8_t>(sealed->chunk.data(), n + security::kTagBytes),
                                   limits::kStateTransferStallMsDefault);
    if (!s.is_ok()) return s;
    at += n;
  }
  return Status::ok();
}

Status recv_bytes(int fd, std::uint8_t* data, std::uint64_t bytes, std::atomic<std::uint64_t>& counter,
                  SealedStream* sealed) {
  if (sealed == nullptr) return recv_bytes(fd, data, bytes, counter);
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(limits::kSealedChunkBytes, bytes - at));
    const std::span<std::uint8_t> box(sealed->chunk.data(), n + security::kTagBytes);
    Status s = transport::recv_exact(fd, box, limits::kStateTransferStallMsDefault);
    if (!s.is_ok()) return s;
    if (!sealed->crypto.open_bytes(box, data + at)) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                    "a sealed chunk of tensor bytes does not verify (altered on the way, or sent with another key)");
    }
    at += n;
    counter += n;
  }
  return Status::ok();
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The serving end of block transfers on one connection: the policy, its compressor, the
// size of the next block, and what the link measurement needs. A connection's first
// block is small and each next one twice as large, up to state::kBlockBytes: the first
// bytes leave after compressing 256 KiB, not 4 MiB, while the connection's window is
// still opening.
struct BlockSender {
  static constexpr std::size_t kFirstBlockBytes = std::size_t{256} << 10;
  state::CompressionPolicy policy;
  state::BlockCompressor compressor;
  std::size_t block_bytes = kFirstBlockBytes;
  std::optional<Clock::time_point> last_sent;  // the end of the last block's send
  const LocalTensor* tensor = nullptr;          // whose bytes it sent last
};

// Sends `bytes` bytes at `data` as blocks; `wire` counts what went on the connection.
Status send_blocks(int fd, const LocalTensor& tensor, std::uint64_t offset, std::uint64_t bytes, SealedStream* sealed,
                   BlockSender& out, std::atomic<std::uint64_t>& wire) {
  // Another tensor may compress otherwise; the next range of the same one is more of it.
  if (out.tensor != &tensor) out.policy.on_new_range();
  out.tensor = &tensor;
  const std::uint8_t* data = tensor.data + offset;
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(out.block_bytes, bytes - at));
    out.block_bytes = std::min(state::kBlockBytes, 2 * out.block_bytes);
    state::BlockHeader h{static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(n), false};
    const std::uint8_t* payload = data + at;
    if (out.policy.compress_next()) {
      const auto start = Clock::now();
      const std::size_t c = out.compressor.compress(data + at, n, out.policy.level());
      out.policy.on_compressed(n, c == 0 ? n : c, seconds_since(start));
      if (c != 0) {
        h = state::BlockHeader{static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(c), true};
        payload = out.compressor.data();
      }
    } else {
      out.policy.on_skipped();
    }
    std::uint8_t header[state::kBlockHeaderBytes];
    state::put_block_header(header, h);
    const std::uint64_t queued = transport::queued_bytes(fd);
    const auto start = Clock::now();
    Status s = send_bytes(fd, header, sizeof header, sealed);
    if (s.is_ok()) s = send_bytes(fd, payload, h.wire, sealed);
    if (!s.is_ok()) return s;
    const auto end = Clock::now();
    out.policy.on_sent(sizeof header + h.wire, std::chrono::duration<double>(end - start).count(), queued,
                       transport::queued_bytes(fd),
                       out.last_sent ? std::chrono::duration<double>(end - *out.last_sent).count() : -1.0);
    out.last_sent = end;
    wire += sizeof header + h.wire;
    at += n;
  }
  return Status::ok();
}

// The fetching end of block transfers on one connection: its buffers are made on the
// first compressed block (a sender that never compresses costs none).
struct BlockReceiver {
  std::unique_ptr<state::BlockDecompressor> decompressor;
  std::vector<std::uint8_t> frame;
};

// Called with the bytes of a piece received so far, after every block or chunk.
using Progress = std::function<void(std::uint64_t)>;

// Receives `bytes` bytes into dst as blocks; `raw` counts tensor bytes, `wire` what came
// over the connection.
Status recv_blocks(int fd, std::uint8_t* dst, std::uint64_t bytes, SealedStream* sealed, BlockReceiver& in,
                   std::atomic<std::uint64_t>& raw, std::atomic<std::uint64_t>& wire, const Progress& progress) {
  for (std::uint64_t at = 0; at < bytes;) {
    std::uint8_t header[state::kBlockHeaderBytes];
    Status s = recv_bytes(fd, header, sizeof header, wire, sealed);
    if (!s.is_ok()) return s;
    auto h = state::parse_block_header(header, bytes - at);
    if (!h.is_ok()) return h.status();
    const state::BlockHeader& b = h.value();
    if (!b.compressed) {
      s = recv_bytes(fd, dst + at, b.raw, wire, sealed);
    } else {
      if (!in.decompressor) {
        in.decompressor = std::make_unique<state::BlockDecompressor>();
        in.frame.resize(state::compress_bound(state::kBlockBytes));
      }
      s = recv_bytes(fd, in.frame.data(), b.wire, wire, sealed);
      if (s.is_ok()) s = in.decompressor->decompress(in.frame.data(), b.wire, dst + at, b.raw);
    }
    if (!s.is_ok()) return s;
    raw += b.raw;
    at += b.raw;
    progress(at);
  }
  return Status::ok();
}

// Answers the requests of one sync attempt until stopped: on the connections it accepts,
// and on those it dials to the receivers of its plan's dials.
class StateServer {
 public:
  StateServer(Link& link, std::uint64_t attempt, const std::map<std::string, LocalTensor>& tensors,
              const Options& options, PeerId self, const std::vector<proto::SyncDial>& dials, RelayAddress relay)
      : link_(link), attempt_(attempt), tensors_(tensors), options_(options), self_(self),
        encrypt_(options.encrypt_data), relay_(std::move(relay)) {
    acceptor_ = std::thread([this] { accept_loop(); });
    for (const auto& dial : dials) {
      for (std::uint32_t c = 0; c < dial.connections && dialers_.size() < kServeConnectionsPerAttempt; ++c) {
        dialers_.emplace_back([this, &dial, c] { dial_and_serve(dial.receiver, c); });
      }
    }
  }
  ~StateServer() { stop(); }
  StateServer(const StateServer&) = delete;
  StateServer& operator=(const StateServer&) = delete;

  void stop() {
    if (!acceptor_.joinable()) return;
    stop_ = true;
    link_.wake();
    cancel_.cancel();  // ends the dials and handshakes in progress
    acceptor_.join();
    sockets_.shutdown_all();
    for (auto& t : handlers_) t.join();
    handlers_.clear();
    for (auto& t : dialers_) t.join();
    dialers_.clear();
  }
  std::uint64_t bytes_sent() const { return bytes_sent_.load(); }
  std::uint64_t wire_bytes_sent() const { return wire_sent_.load(); }

 private:
  void accept_loop() {
    while (!stop_.load() && link_.fatal().is_ok()) {
      auto connection = link_.take_connection(proto::Channel::kSharedState, attempt_, std::nullopt, &stop_,
                                              Clock::now() + std::chrono::seconds(1));
      if (!connection) continue;
      if (encrypt_ && !connection->keys) continue;  // cannot happen: encrypt_data needs the secret
      if (handlers_.size() >= kServeConnectionsPerAttempt || !sockets_.add(connection->fd.get())) {
        LOG_WARN(kLog, "shared-state server: too many connections; closing one from " << connection->from.to_string());
        continue;
      }
      std::unique_ptr<SealedStream> sealed;
      if (encrypt_) sealed = std::make_unique<SealedStream>(*connection->keys, /*client=*/false);
      handlers_.emplace_back([this, fd = std::make_shared<transport::Fd>(std::move(connection->fd)),
                              sealed = std::shared_ptr<SealedStream>(std::move(sealed))] {
        serve(fd->get(), sealed.get());
        sockets_.remove(fd->get());
      });
    }
  }

  // A receiver this peer must dial (this peer accepts no inbound connection): at its
  // address, or through the relay where it accepts none either (its connection `index`
  // of those the plan asks for; sealed whatever encrypt_data says).
  void dial_and_serve(const proto::MemberInfo& to, std::uint32_t index) {
    const bool relayed = !proto::accepts_inbound(to);
    const std::string where = "shared-state receiver " + to.id.to_string() +
                              (relayed ? " through the relay" : " at " + to.host + ":" + std::to_string(to.shared_state_port));
    auto fd = relayed ? dial_relay(relay_, self_, to, proto::Channel::kSharedState, index, /*receiver=*/false,
                                   options_.p2p_connect_timeout_ms, cancel_.event_fd())
                      : transport::connect_tcp(to.host, to.shared_state_port, options_.p2p_connect_timeout_ms,
                                               cancel_.event_fd());
    if (!fd.is_ok()) {
      if (!stop_.load()) LOG_WARN(kLog, "shared-state server: cannot dial " << where << ": " << fd.status().message());
      return;
    }
    const int raw = fd.value().get();
    if (!options_.tcp_congestion.empty()) (void)transport::set_congestion_control(raw, options_.tcp_congestion);
    proto::P2PHello hello;
    hello.channel = proto::Channel::kSharedState;
    hello.from = self_;
    hello.to = to.id;
    hello.epoch = attempt_;
    hello.flags = proto::kP2PFlagReversed;
    if (encrypt_ || relayed) hello.flags |= proto::kP2PFlagEncryptData;
    security::SessionKeys keys;
    Status s = p2p_handshake(raw, hello, options_.secret.has_value(), to.key, options_.p2p_connect_timeout_ms, &keys,
                             cancel_.event_fd());
    if (!s.is_ok()) {
      if (!stop_.load()) LOG_WARN(kLog, "shared-state server: handshake with " << where << ": " << s.message());
      return;
    }
    if (!sockets_.add(raw)) return;
    std::unique_ptr<SealedStream> sealed;
    if (encrypt_ || relayed) sealed = std::make_unique<SealedStream>(keys, /*client=*/false);
    serve(raw, sealed.get());
    sockets_.remove(raw);
  }

  void serve(int fd, SealedStream* sealed) {
    transport::set_nodelay(fd);
    security::FrameCrypto* crypto = sealed != nullptr ? &sealed->crypto : nullptr;
    std::unique_ptr<BlockSender> blocks;  // made on the first request for blocks
    for (;;) {
      auto message = transport::recv_message(fd, limits::kStateTransferStallMsDefault, crypto);
      if (!message.is_ok() && message.status().code() == LOCKSTEP_STATUS_PROTOCOL_ERROR) {
        LOG_WARN(kLog, "shared-state server: closing a connection: " << message.status().message());
      }
      if (!message.is_ok()) return;  // the receiver is done (or gone): it closes the connection
      const auto* request = std::get_if<proto::StateRequest>(&message.value());
      if (request == nullptr) return;
      std::string refusal;
      const LocalTensor* tensor =
          find(request->attempt, request->key, request->hash, request->offset, request->bytes, request->have.size(),
               &refusal);
      if (tensor == nullptr) {
        LOG_WARN(kLog, "shared-state server: refusing a request: " << refusal);
        [[maybe_unused]] Status s = transport::send_message(
            fd, proto::StateResponse{LOCKSTEP_STATUS_INVALID_USAGE, 0, refusal, {}}, limits::kStateTransferStallMsDefault,
            crypto);
        return;
      }
      // The segments whose digest differs from the requester's, by runs of adjacent ones.
      const auto sending = differing(segment_digests(*tensor, request->offset, request->bytes), request->have);
      const auto send = runs(request->offset, request->bytes, sending);
      std::uint64_t total = 0;
      for (const auto& [offset, bytes] : send) total += bytes;
      Status s = transport::send_message(fd, proto::StateResponse{LOCKSTEP_OK, total, {}, sending},
                                         limits::kStateTransferStallMsDefault, crypto);
      for (std::size_t k = 0; k < send.size() && s.is_ok(); ++k) {
        const auto [offset, bytes] = send[k];
        if (request->encoding == proto::kStateEncodingBlocks) {
          if (!blocks) blocks = std::make_unique<BlockSender>();
          s = send_blocks(fd, *tensor, offset, bytes, sealed, *blocks, wire_sent_);
        } else {
          s = send_bytes(fd, tensor->data + offset, bytes, sealed);
          if (s.is_ok()) wire_sent_ += bytes;
        }
        if (s.is_ok()) bytes_sent_ += bytes;
      }
      if (!s.is_ok()) return;
    }
  }

  // The tensor a request may be served from, or null and why not.
  const LocalTensor* find(std::uint64_t attempt, const std::string& key, const state::Digest& hash,
                          std::uint64_t offset, std::uint64_t bytes, std::size_t have, std::string* refusal) const {
    if (attempt != attempt_) {
      *refusal = "request for sync attempt " + std::to_string(attempt) + ", serving " + std::to_string(attempt_);
    } else if (auto it = tensors_.find(key); it == tensors_.end()) {
      *refusal = "no tensor '" + key + "' here";
    } else if (it->second.hash != hash) {
      *refusal = "tensor '" + key + "' here is not the requested content";
    } else if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
      *refusal = "range outside tensor '" + key + "'";
    } else if (have != state::segment_count(offset, bytes)) {  // the codec checks it too
      *refusal = "not one digest per segment of the range";
    } else {
      return &it->second;
    }
    return nullptr;
  }

  Link& link_;
  const std::uint64_t attempt_;
  const std::map<std::string, LocalTensor>& tensors_;
  const Options& options_;
  const PeerId self_;
  const bool encrypt_;
  const RelayAddress relay_;
  std::atomic<bool> stop_{false};
  OpChannel cancel_;  // its event fd wakes blocked dials and handshakes on stop()
  std::thread acceptor_;
  std::list<std::thread> handlers_;  // acceptor thread only, then stop()
  std::vector<std::thread> dialers_;  // made by the constructor, joined by stop()
  SocketSet sockets_;
  std::atomic<std::uint64_t> bytes_sent_{0};
  std::atomic<std::uint64_t> wire_sent_{0};  // tensor data as sent: raw, or blocks and their headers
};

// Fetches the pieces of one plan from their sources, each source's over up to
// `streams` connections (peer/transfer_queue.h), one thread each.
class Fetcher {
 public:
  Fetcher(Link& link, PeerId self, std::uint32_t connect_timeout_ms, bool secret, bool encrypt, bool compress,
          std::uint32_t streams, const proto::SyncPlan& plan, const std::vector<SharedTensor>& tensors,
          const std::vector<LocalTensor>& local, RelayAddress relay)
      : link_(link), self_(self), connect_timeout_ms_(connect_timeout_ms), secret_(secret), encrypt_(encrypt),
        compress_(compress), streams_(streams), plan_(plan), tensors_(tensors), local_(local), relay_(std::move(relay)),
        self_relayed_(relay_.port != 0) {
    for (const auto& e : plan_.expect) {
      if (e.tensor >= local_.size()) continue;  // check_plan refuses the plan
      expected_[e.tensor] = e.hash;
      Received& r = received_[e.tensor];
      r.leaves = local_[e.tensor].leaves;
      r.state = std::make_unique<std::atomic<std::uint8_t>[]>(r.leaves.size());
    }
  }

  // Runs every transfer, then checks every received tensor's digest.
  Status run() {
    std::vector<std::vector<proto::SyncFetch>> by_source(plan_.sources.size());
    for (const auto& f : plan_.fetches) by_source[f.source].push_back(f);
    std::vector<std::pair<std::size_t, std::uint32_t>> work;  // a source index and its connection per connection
    for (std::size_t i = 0; i < by_source.size(); ++i) {
      // A source that dials this peer opens as many connections as its plan says, which
      // the master counted with the default streams.
      const bool dials_us = !proto::accepts_inbound(plan_.sources[i]);
      queues_.push_back(std::make_unique<SharedQueue>(by_source[i], dials_us ? limits::kStateStreamsDefault : streams_));
      if (queues_.back()->queue.bytes_left() == 0) continue;
      for (std::uint32_t c = 0; c < queues_.back()->queue.connections(); ++c) work.emplace_back(i, c);
    }
    connections_ = static_cast<std::uint32_t>(work.size());
    std::vector<Status> results(work.size());
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < work.size(); ++k) {
      threads.emplace_back([this, k, &work, &results] {
        const auto [source, index] = work[k];
        results[k] = fetch_from(plan_.sources[source], *queues_[source], index);
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& r : results) {
      if (!r.is_ok()) return r;
    }
    for (const auto& e : plan_.expect) {
      const LocalTensor& t = local_[e.tensor];
      Received& r = received_.at(e.tensor);
      // Leaves shared by two pieces are digested now that both are in.
      for (std::size_t i = 0; i < r.leaves.size(); ++i) {
        if (r.state[i].load(std::memory_order_relaxed) == kTouched) r.leaves[i] = state::leaf_digest(t.data, t.bytes, i);
      }
      const state::Digest got = state::root_digest(r.leaves, t.bytes);
      if (got != e.hash) {
        return Status(LOCKSTEP_STATUS_HASH_MISMATCH, "tensor '" + tensors_[e.tensor].key + "' hashes to " + got.to_hex() +
                                                         " after transfer, expected " + e.hash.to_hex());
      }
    }
    return Status::ok();
  }
  void abort() {
    aborted_ = true;
    sockets_.shutdown_all();
    link_.wake();
  }
  std::uint64_t bytes_received() const { return bytes_received_.load(); }
  std::uint64_t wire_bytes_received() const { return wire_received_.load(); }
  std::uint32_t connections() const { return connections_; }  // after run()

 private:
  // One source's queue, shared by the connections that fetch from it.
  struct SharedQueue {
    SharedQueue(const std::vector<proto::SyncFetch>& pieces, std::uint32_t streams) : queue(pieces, streams) {}
    std::optional<proto::SyncFetch> take() {
      std::lock_guard<std::mutex> lock(mutex);
      return queue.take();
    }
    std::mutex mutex;
    TransferQueue queue;
  };

  Status fetch_from(const proto::MemberInfo& source, SharedQueue& work, std::uint32_t index) {
    if (!proto::accepts_inbound(source)) return fetch_reversed(source, work, index);
    const std::string where = "shared-state source " + source.id.to_string() + " at " + source.host + ":" +
                              std::to_string(source.shared_state_port);
    auto fd = transport::connect_tcp(source.host, source.shared_state_port, connect_timeout_ms_);
    if (!fd.is_ok()) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, where + ": " + fd.status().message());
    const int raw = fd.value().get();
    if (!sockets_.add(raw)) return Status(LOCKSTEP_STATUS_INTERRUPTED, "the sync ended");
    Status s = exchange(raw, source, work);
    sockets_.remove(raw);
    if (!s.is_ok()) return Status(s.code(), where + ": " + s.message());
    return s;
  }

  // A source that accepts no inbound connection dials this peer: one of the connections
  // its plan made it dial (`index` of them), whose requests this peer sends. Where this
  // peer accepts none either, both meet at the relay (sealed whatever encrypt_data says).
  Status fetch_reversed(const proto::MemberInfo& source, SharedQueue& work, std::uint32_t index) {
    const bool relayed = self_relayed_;
    const std::string where =
        "shared-state source " + source.id.to_string() + (relayed ? " (through the relay)" : " (it dials this peer)");
    if (relayed) {
      auto joined = dial_relay(relay_, self_, source, proto::Channel::kSharedState, index, /*receiver=*/true,
                               2 * connect_timeout_ms_);
      if (!joined.is_ok()) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, where + ": " + joined.status().message());
      link_.adopt_relayed(std::move(joined.value()), proto::Channel::kSharedState);
    }
    // The source learns of the transfer when its own plan arrives, then dials.
    const std::uint32_t wait_ms = 2 * connect_timeout_ms_;
    auto connection = link_.take_connection(proto::Channel::kSharedState, plan_.attempt, source.id, &aborted_,
                                            Clock::now() + std::chrono::milliseconds(wait_ms), /*reversed=*/true);
    if (!connection) {
      if (aborted_.load()) return Status(LOCKSTEP_STATUS_INTERRUPTED, "the sync ended");
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                    where + ": no connection from it within " + std::to_string(wait_ms) + " ms");
    }
    if ((encrypt_ || relayed) && !connection->keys) {
      return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, where + ": its connection has no session keys");
    }
    const int raw = connection->fd.get();
    if (!sockets_.add(raw)) return Status(LOCKSTEP_STATUS_INTERRUPTED, "the sync ended");
    transport::set_nodelay(raw);
    std::unique_ptr<SealedStream> sealed;
    if (encrypt_ || relayed) sealed = std::make_unique<SealedStream>(*connection->keys, /*client=*/true);
    Asked asked;
    Status s = drain(raw, sealed.get(), work, asked);
    sockets_.remove(raw);
    if (!s.is_ok()) return Status(s.code(), where + ": " + s.message());
    return s;
  }

  // The requests in flight on one connection, oldest first.
  struct Asked {
    std::deque<proto::SyncFetch> units;
    std::uint64_t bytes = 0;
  };

  // The handshake, with the first requests in its last flight; then the rest.
  Status exchange(int fd, const proto::MemberInfo& source, SharedQueue& work) {
    proto::P2PHello hello;
    hello.channel = proto::Channel::kSharedState;
    hello.from = self_;
    hello.to = source.id;
    hello.epoch = plan_.attempt;
    if (encrypt_) hello.flags = proto::kP2PFlagEncryptData;
    std::unique_ptr<SealedStream> sealed;
    Asked asked;
    Status s = p2p_handshake(fd, hello, secret_, source.key, connect_timeout_ms_, nullptr, -1,
                             [&](const security::SessionKeys& keys) {
                               if (encrypt_) sealed = std::make_unique<SealedStream>(keys, /*client=*/true);
                               return ask(fd, sealed.get(), work, asked);
                             });
    if (!s.is_ok()) return lost(Status(s.code(), "shared-state handshake: " + s.message()));
    return drain(fd, sealed.get(), work, asked);
  }

  // Units from `work`, a few requests in flight, until it has none left.
  Status drain(int fd, SealedStream* sealed, SharedQueue& work, Asked& asked) {
    BlockReceiver blocks;
    for (;;) {
      if (Status r = ask(fd, sealed, work, asked); !r.is_ok()) return lost(r);
      if (asked.units.empty()) return Status::ok();
      const proto::SyncFetch f = asked.units.front();
      asked.units.pop_front();
      asked.bytes -= f.bytes;
      if (Status r = receive_answer(fd, f, sealed, blocks); !r.is_ok()) return lost(r);
    }
  }

  // Sends requests for the next units while the connection has room for them.
  Status ask(int fd, SealedStream* sealed, SharedQueue& work, Asked& asked) {
    while (TransferQueue::wants_more(asked.units.size(), asked.bytes)) {
      const auto unit = work.take();
      if (!unit) break;
      Status r = transport::send_message(
          fd,
          proto::StateRequest{plan_.attempt, tensors_[unit->tensor].key, unit->offset, unit->bytes,
                              expected_digest(unit->tensor),
                              compress_ ? proto::kStateEncodingBlocks : proto::kStateEncodingRaw,
                              segment_digests(local_[unit->tensor], unit->offset, unit->bytes)},
          limits::kStateTransferStallMsDefault, sealed ? &sealed->crypto : nullptr);
      if (!r.is_ok()) return r;
      asked.units.push_back(*unit);
      asked.bytes += unit->bytes;
    }
    return Status::ok();
  }

  state::Digest expected_digest(std::uint32_t tensor) const {
    auto expected = expected_.find(tensor);
    return expected == expected_.end() ? state::Digest{} : expected->second;
  }

  // Reads the answer to the request for unit f and the segments it sends.
  Status receive_answer(int fd, const proto::SyncFetch& f, SealedStream* sealed, BlockReceiver& blocks) {
    auto reply = transport::recv_message(fd, limits::kStateTransferStallMsDefault, sealed ? &sealed->crypto : nullptr);
    if (!reply.is_ok()) return reply.status();
    const auto* response = std::get_if<proto::StateResponse>(&reply.value());
    if (response == nullptr) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it answered a request with something else");
    if (response->status != LOCKSTEP_OK) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "it refused a request: " + response->reason);
    }
    // What follows comes from our own plan and the bitmap, never from the wire's sizes.
    const std::uint64_t n = state::segment_count(f.offset, f.bytes);
    if (response->sending.size() != (n + 7) / 8 || (n % 8 != 0 && (unsigned{response->sending.back()} >> (n % 8)) != 0)) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it answered a request for " + std::to_string(n) +
                                                        " segments with a bitmap of " +
                                                        std::to_string(response->sending.size()) + " bytes");
    }
    const auto pieces = runs(f.offset, f.bytes, response->sending);
    std::uint64_t total = 0;
    for (const auto& [offset, bytes] : pieces) total += bytes;
    if (response->bytes != total) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it announced " + std::to_string(response->bytes) +
                                                        " bytes for segments of " + std::to_string(total));
    }
    for (const auto& [offset, bytes] : pieces) {
      if (Status r = receive(fd, proto::SyncFetch{f.tensor, offset, bytes, f.source}, sealed, blocks); !r.is_ok()) return r;
    }
    return Status::ok();
  }

  // Receives piece f into its tensor, digesting each leaf that lies wholly inside the
  // piece as soon as it is in (the rest of the leaves it touches: by run()).
  Status receive(int fd, const proto::SyncFetch& f, SealedStream* sealed, BlockReceiver& blocks) {
    const LocalTensor& t = local_[f.tensor];
    Received& r = received_.at(f.tensor);
    constexpr std::uint64_t L = state::kHashLeafBytes;
    const std::uint64_t end_leaf = (f.offset + f.bytes + L - 1) / L;
    for (std::uint64_t i = f.offset / L; i < end_leaf; ++i) r.state[i].store(kTouched, std::memory_order_relaxed);
    std::uint64_t next = (f.offset + L - 1) / L;  // the first leaf starting inside the piece
    const Progress progress = [&](std::uint64_t done) {
      for (; next < end_leaf && std::min((next + 1) * L, t.bytes) <= f.offset + done; ++next) {
        r.leaves[next] = state::leaf_digest(t.data, t.bytes, next);
        r.state[next].store(kDigested, std::memory_order_relaxed);
      }
    };
    std::uint8_t* into = t.data + f.offset;
    if (compress_) return recv_blocks(fd, into, f.bytes, sealed, blocks, bytes_received_, wire_received_, progress);
    for (std::uint64_t at = 0; at < f.bytes;) {
      const std::uint64_t n = std::min<std::uint64_t>(kTransferChunkBytes, f.bytes - at);
      if (Status s = recv_bytes(fd, into + at, n, bytes_received_, sealed); !s.is_ok()) return s;
      wire_received_ += n;
      at += n;
      progress(at);
    }
    return Status::ok();
  }

  static Status lost(const Status& s) {
    return s.code() == LOCKSTEP_STATUS_PROTOCOL_ERROR ? s : Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, s.message());
  }

  Link& link_;
  const PeerId self_;
  const std::uint32_t connect_timeout_ms_;
  const bool secret_;
  const bool encrypt_;
  const bool compress_;
  const std::uint32_t streams_;
  const proto::SyncPlan& plan_;
  const std::vector<SharedTensor>& tensors_;
  const std::vector<LocalTensor>& local_;
  // The relay, given only where this peer accepts no inbound connection: its transfers
  // from sources that accept none either run through it.
  const RelayAddress relay_;
  const bool self_relayed_;
  std::map<std::uint32_t, state::Digest> expected_;  // by tensor index
  // What run() checks a received tensor's digest from: its leaf digests, this peer's own
  // from the vote until a piece brings new bytes. Each fetch thread writes only the
  // leaves inside its pieces; a leaf two pieces share is left to run().
  static constexpr std::uint8_t kTouched = 1;   // new bytes arrive in it
  static constexpr std::uint8_t kDigested = 2;  // they have, and leaves[i] is their digest
  struct Received {
    std::vector<state::Digest> leaves;
    std::unique_ptr<std::atomic<std::uint8_t>[]> state;
  };
  std::map<std::uint32_t, Received> received_;  // by tensor index, for each expected tensor
  std::vector<std::unique_ptr<SharedQueue>> queues_;  // by source index
  SocketSet sockets_;
  std::atomic<bool> aborted_{false};
  std::atomic<std::uint64_t> bytes_received_{0};
  std::atomic<std::uint64_t> wire_received_{0};
  std::uint32_t connections_ = 0;
};

Status check_tensors(const std::vector<SharedTensor>& tensors) {
  if (tensors.size() > limits::kSharedStateTensorsMax) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "a shared state holds at most " + std::to_string(limits::kSharedStateTensorsMax) + " tensors");
  }
  std::set<std::string> keys;
  for (const auto& t : tensors) {
    if (t.key.empty() || t.key.size() > limits::kSharedStateKeyBytesMax) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "tensor keys are 1.." + std::to_string(limits::kSharedStateKeyBytesMax) + " bytes");
    }
    if (!keys.insert(t.key).second) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor key '" + t.key + "' appears twice");
    const std::uint64_t size = dtype_bytes(static_cast<std::uint32_t>(t.dtype));
    if (size == 0) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor '" + t.key + "' has an unknown dtype");
    if (t.count > kTensorBytesMax / size) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor '" + t.key + "' is too large");
    if (t.data == nullptr && t.count != 0) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor '" + t.key + "' has no data");
  }
  return Status::ok();
}

// The plan must fit our own tensors: a master (or anything posing as one) cannot make
// us write outside them.
Status check_plan(const proto::SyncPlan& plan, const std::vector<LocalTensor>& local) {
  for (const auto& f : plan.fetches) {
    if (f.tensor >= local.size() || f.offset > local[f.tensor].bytes || f.bytes > local[f.tensor].bytes - f.offset) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the sync plan names a range outside this peer's tensors");
    }
  }
  std::set<std::uint32_t> expected;
  for (const auto& e : plan.expect) {
    if (e.tensor >= local.size()) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the sync plan names an unknown tensor");
    expected.insert(e.tensor);
  }
  for (const auto& f : plan.fetches) {
    if (expected.count(f.tensor) == 0) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the sync plan fetches a tensor whose digest it does not give");
    }
  }
  return Status::ok();
}

}  // namespace

Result<SyncInfo> Communicator::sync_shared_state(const std::vector<SharedTensor>& tensors, std::uint64_t* revision,
                                                 proto::SyncStrategy strategy) {
  if (Status s = check_call(true); !s.is_ok()) return remember(s);
  if (revision == nullptr) return remember(Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "revision is null"));
  if (Status s = check_tensors(tensors); !s.is_ok()) return remember(s);
  {
    std::lock_guard<std::mutex> lock(ops_mutex_);
    if (!tags_in_flight_.empty()) {
      return remember(Status(LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS,
                             "await every collective in flight before syncing the shared state"));
    }
  }
  OperationScope scope(*this, Counter::kSyncUs, &sync_failed_);
  count(Counter::kSyncsStarted);
  // Counted on every exit: the outcome, and the bytes moved (also by a failed attempt).
  struct SyncOutcome {
    Communicator& comm;
    bool ok = false;
    ~SyncOutcome() { comm.count(ok ? Counter::kSyncsSucceeded : Counter::kSyncsFailed); }
  } sync_outcome{*this};
  proto::SyncVote vote{strategy, *revision, {}};
  std::vector<LocalTensor> local;
  std::map<std::string, LocalTensor> by_key;
  for (const auto& t : tensors) {
    LocalTensor l{static_cast<std::uint8_t*>(t.data), t.count * dtype_bytes(static_cast<std::uint32_t>(t.dtype)), {}, {}};
    l.leaves = state::leaf_digests(l.data, l.bytes);
    l.hash = state::root_digest(l.leaves, l.bytes);
    vote.tensors.push_back(proto::TensorEntry{t.key, static_cast<std::uint8_t>(t.dtype), t.count, l.hash,
                                              t.allow_content_inequality});
    local.push_back(l);
    by_key[t.key] = l;
  }
  link_->send(vote);
  auto reply = link_->wait([](const proto::Message& m) {
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kSyncVote;
    return std::holds_alternative<proto::SyncPlan>(m) || std::holds_alternative<proto::SyncResult>(m);
  });
  if (!reply.is_ok()) return remember(reply.status());
  if (const auto* r = std::get_if<proto::Refused>(&reply.value())) return remember(Status(r->status, "master: " + r->reason));
  if (const auto* r = std::get_if<proto::SyncResult>(&reply.value())) return remember(Status(r->status, r->reason));
  const auto plan = std::get<proto::SyncPlan>(std::move(reply.value()));
  LOG_DEBUG(kLog, "sync attempt " << plan.attempt << ": revision " << plan.revision << ", " << plan.expect.size()
                                  << " tensor(s) to receive in " << plan.fetches.size() << " piece(s)");

  const RelayAddress relay = link_->relay();
  StateServer server(*link_, plan.attempt, by_key, options_, id_, plan.dials, relay);
  const std::uint32_t streams = options_.p2p_streams != 0 ? options_.p2p_streams : limits::kStateStreamsDefault;
  Fetcher fetcher(*link_, id_, options_.p2p_connect_timeout_ms, options_.secret.has_value(), options_.encrypt_data,
                  options_.compress_state, streams, plan, tensors, local,
                  view_p2p_port_.load() == 0 ? relay : RelayAddress{});
  std::thread transfers([&] {
    Status s = check_plan(plan, local);
    if (s.is_ok() && !plan.expect.empty()) s = fetcher.run();
    if (!s.is_ok()) LOG_WARN(kLog, "sync attempt " << plan.attempt << ": " << s.to_string());
    link_->send(proto::SyncDone{plan.attempt, s.code(), s.message(), server.bytes_sent(), fetcher.bytes_received()});
  });
  auto outcome = link_->wait([&](const proto::Message& m) {
    if (const auto* r = std::get_if<proto::SyncResult>(&m)) return r->attempt == plan.attempt;
    if (const auto* r = std::get_if<proto::Refused>(&m)) return r->request == proto::MsgType::kSyncDone;
    return false;
  });
  fetcher.abort();  // a success means every transfer is over already
  transfers.join();
  server.stop();
  count(Counter::kSyncBytesSent, server.bytes_sent());
  count(Counter::kSyncBytesReceived, fetcher.bytes_received());
  if (!outcome.is_ok()) return remember(outcome.status());
  if (const auto* r = std::get_if<proto::Refused>(&outcome.value())) return remember(Status(r->status, "master: " + r->reason));
  const auto& result = std::get<proto::SyncResult>(outcome.value());
  if (result.status != LOCKSTEP_OK) return remember(Status(result.status, result.reason));
  *revision = result.revision;
  scope.succeeded();
  sync_outcome.ok = true;
  return SyncInfo{server.bytes_sent(), fetcher.bytes_received(), server.wire_bytes_sent(), fetcher.wire_bytes_received(),
                  fetcher.connections()};
}

}  // namespace lockstep::peer
