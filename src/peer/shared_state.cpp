// The peer's side of a shared-state sync. The owning thread hashes every tensor, votes,
// and waits for the master's plan; then, until the outcome arrives:
//  - a server thread hands each shared-state connection of this attempt to a handler
//    thread that answers requests for byte ranges of our tensors (only tensors whose
//    digest is the one requested, only ranges inside them);
//  - a fetch thread opens up to four connections per source named in the plan (each
//    with a stripe of that source's pieces; p2p_streams when set), keeps a few
//    requests in flight on each, receives the pieces straight into the tensors,
//    digesting each 1 MiB leaf of the content hash as soon as it is whole, checks every
//    received tensor's digest and reports to the master.
// The outcome (one for the whole group) stops both; on failure open transfers are cut
// by shutting their sockets down. Memory stays bounded: bytes move from the sender's
// tensor into the receiver's tensor, and a receiver never accepts more bytes than its
// own descriptor of the tensor holds.
// With encrypt_data, every frame of a transfer connection is sealed (security/frames.h)
// and tensor bytes travel as sealed chunks of at most limits::kSealedChunkBytes, each
// opened into the tensor only once it verifies; one chunk buffer per connection.
// Before it asks for bytes, the fetcher asks for the digests of the 1 MiB segments of its
// pieces and fetches only the segments whose digest differs from its own bytes there
// (delta transfer: a peer one revision behind receives what changed). Both ends answer
// from the leaf digests they computed for the vote; nothing is hashed twice.
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
#include "state/blocks.h"
#include "state/hash.h"
#include "transport/framed.h"

#include <sys/socket.h>

#include <algorithm>
#include <functional>
#include <list>
#include <set>

namespace lockstep::peer {
namespace {

// Requests in flight per connection: enough to hide the round trip for small
// tensors, few enough that requests never fill a socket buffer (no deadlock).
constexpr std::size_t kRequestsInFlight = 16;
// Bytes per send/receive call of tensor data (each bounded by the stall timeout).
constexpr std::size_t kTransferChunkBytes = std::size_t{4} << 20;
// Connections one attempt's server accepts (more are closed): as many receivers as
// limits::kServeConnectionsMax, each with its default stripes.
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

// The serving end of block transfers on one connection: the policy and its compressor.
struct BlockSender {
  state::CompressionPolicy policy;
  state::BlockCompressor compressor;
};

// Sends `bytes` bytes at `data` as blocks; `wire` counts what went on the connection.
Status send_blocks(int fd, const std::uint8_t* data, std::uint64_t bytes, SealedStream* sealed, BlockSender& out,
                   std::atomic<std::uint64_t>& wire) {
  out.policy.on_new_range();
  for (std::uint64_t at = 0; at < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(state::kBlockBytes, bytes - at));
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
    const auto start = Clock::now();
    Status s = send_bytes(fd, header, sizeof header, sealed);
    if (s.is_ok()) s = send_bytes(fd, payload, h.wire, sealed);
    if (!s.is_ok()) return s;
    out.policy.on_sent(sizeof header + h.wire, seconds_since(start));
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

// Answers the requests of one sync attempt until stopped.
class StateServer {
 public:
  StateServer(Link& link, std::uint64_t attempt, const std::map<std::string, LocalTensor>& tensors, bool encrypt)
      : link_(link), attempt_(attempt), tensors_(tensors), encrypt_(encrypt) {
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~StateServer() { stop(); }
  StateServer(const StateServer&) = delete;
  StateServer& operator=(const StateServer&) = delete;

  void stop() {
    if (!acceptor_.joinable()) return;
    stop_ = true;
    link_.wake();
    acceptor_.join();
    sockets_.shutdown_all();
    for (auto& t : handlers_) t.join();
    handlers_.clear();
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
      if (const auto* leaves = std::get_if<proto::StateLeavesRequest>(&message.value())) {
        if (!serve_leaves(fd, *leaves, crypto)) return;
        continue;
      }
      const auto* request = std::get_if<proto::StateRequest>(&message.value());
      if (request == nullptr) return;
      std::string refusal;
      const LocalTensor* tensor =
          find(request->attempt, request->key, request->hash, request->offset, request->bytes, &refusal);
      if (tensor == nullptr) {
        LOG_WARN(kLog, "shared-state server: refusing a request: " << refusal);
        [[maybe_unused]] Status s = transport::send_message(
            fd, proto::StateResponse{LOCKSTEP_STATUS_INVALID_USAGE, 0, refusal}, limits::kStateTransferStallMsDefault,
            crypto);
        return;
      }
      Status s = transport::send_message(fd, proto::StateResponse{LOCKSTEP_OK, request->bytes, {}},
                                         limits::kStateTransferStallMsDefault, crypto);
      const std::uint8_t* data = tensor->data + request->offset;
      if (s.is_ok() && request->encoding == proto::kStateEncodingBlocks) {
        if (!blocks) blocks = std::make_unique<BlockSender>();
        s = send_blocks(fd, data, request->bytes, sealed, *blocks, wire_sent_);
      } else if (s.is_ok()) {
        s = send_bytes(fd, data, request->bytes, sealed);
        if (s.is_ok()) wire_sent_ += request->bytes;
      }
      if (!s.is_ok()) return;
      bytes_sent_ += request->bytes;
    }
  }

  // The tensor a request may be served from, or null and why not.
  const LocalTensor* find(std::uint64_t attempt, const std::string& key, const state::Digest& hash,
                          std::uint64_t offset, std::uint64_t bytes, std::string* refusal) const {
    if (attempt != attempt_) {
      *refusal = "request for sync attempt " + std::to_string(attempt) + ", serving " + std::to_string(attempt_);
    } else if (auto it = tensors_.find(key); it == tensors_.end()) {
      *refusal = "no tensor '" + key + "' here";
    } else if (it->second.hash != hash) {
      *refusal = "tensor '" + key + "' here is not the requested content";
    } else if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
      *refusal = "range outside tensor '" + key + "'";
    } else {
      return &it->second;
    }
    return nullptr;
  }

  // Answers a request for a range's segment digests; false when the connection ends.
  bool serve_leaves(int fd, const proto::StateLeavesRequest& request, security::FrameCrypto* crypto) {
    std::string refusal;
    const LocalTensor* tensor = find(request.attempt, request.key, request.hash, request.offset, request.bytes, &refusal);
    if (tensor != nullptr && state::segment_count(request.offset, request.bytes) > limits::kStateSegmentsPerRequestMax) {
      tensor = nullptr;
      refusal = "digests of more than " + std::to_string(limits::kStateSegmentsPerRequestMax) + " segments asked for";
    }
    proto::StateLeavesResponse response;
    if (tensor == nullptr) {
      LOG_WARN(kLog, "shared-state server: refusing a request: " << refusal);
      response.status = LOCKSTEP_STATUS_INVALID_USAGE;
      response.reason = refusal;
    } else {
      response.digests = segment_digests(*tensor, request.offset, request.bytes);
    }
    Status s = transport::send_message(fd, response, limits::kStateTransferStallMsDefault, crypto);
    return s.is_ok() && tensor != nullptr;
  }

  Link& link_;
  const std::uint64_t attempt_;
  const std::map<std::string, LocalTensor>& tensors_;
  const bool encrypt_;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::list<std::thread> handlers_;  // acceptor thread only, then stop()
  SocketSet sockets_;
  std::atomic<std::uint64_t> bytes_sent_{0};
  std::atomic<std::uint64_t> wire_sent_{0};  // tensor data as sent: raw, or blocks and their headers
};

// A source's pieces cut into at most `most` stripes of about equal bytes, each of at
// least limits::kStateStripeBytesMin, one per connection: several connections ramp up
// together after their slow start, share a lossy path's bandwidth as several flows do,
// and let the source compress on as many cores. Cuts fall on 1 MiB leaf boundaries of
// the tensor, so a leaf lies whole in one stripe unless the plan's pieces cut it.
std::vector<std::vector<proto::SyncFetch>> stripes(const std::vector<proto::SyncFetch>& pieces, std::uint32_t most) {
  constexpr std::uint64_t L = state::kHashLeafBytes;
  std::uint64_t total = 0;
  for (const auto& p : pieces) total += p.bytes;
  std::vector<std::vector<proto::SyncFetch>> out;
  if (pieces.empty()) return out;
  const std::uint64_t count =
      std::clamp<std::uint64_t>(total / limits::kStateStripeBytesMin, 1, std::max<std::uint64_t>(most, 1));
  const std::uint64_t quota = (total + count - 1) / count;
  out.emplace_back();
  std::uint64_t filled = 0;
  for (proto::SyncFetch rest : pieces) {
    while (rest.bytes > 0) {
      if (filled >= quota && out.size() < count) {
        out.emplace_back();
        filled = 0;
      }
      std::uint64_t take = rest.bytes;
      if (out.size() < count && quota - filled < rest.bytes) {
        const std::uint64_t cut = (rest.offset + (quota - filled) + L - 1) / L * L;
        take = std::min(rest.bytes, cut - rest.offset);
      }
      out.back().push_back(proto::SyncFetch{rest.tensor, rest.offset, take, rest.source});
      filled += take;
      rest.offset += take;
      rest.bytes -= take;
    }
  }
  return out;
}

// Fetches the pieces of one plan from their sources, each source's over up to
// `streams` connections (stripes()), one thread each.
class Fetcher {
 public:
  Fetcher(PeerId self, std::uint32_t connect_timeout_ms, bool secret, bool encrypt, bool compress,
          std::uint32_t streams, const proto::SyncPlan& plan, const std::vector<SharedTensor>& tensors,
          const std::vector<LocalTensor>& local)
      : self_(self), connect_timeout_ms_(connect_timeout_ms), secret_(secret), encrypt_(encrypt), compress_(compress),
        streams_(streams), plan_(plan), tensors_(tensors), local_(local) {
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
    std::vector<std::vector<proto::SyncFetch>> work;  // one per connection
    std::vector<std::size_t> work_source;
    for (std::size_t i = 0; i < by_source.size(); ++i) {
      for (auto& stripe : stripes(by_source[i], streams_)) {
        work.push_back(std::move(stripe));
        work_source.push_back(i);
      }
    }
    connections_ = static_cast<std::uint32_t>(work.size());
    std::vector<Status> results(work.size());
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < work.size(); ++k) {
      threads.emplace_back([this, k, &work, &work_source, &results] {
        results[k] = fetch_from(plan_.sources[work_source[k]], work[k]);
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
  void abort() { sockets_.shutdown_all(); }
  std::uint64_t bytes_received() const { return bytes_received_.load(); }
  std::uint64_t wire_bytes_received() const { return wire_received_.load(); }
  std::uint32_t connections() const { return connections_; }  // after run()

 private:
  Status fetch_from(const proto::MemberInfo& source, const std::vector<proto::SyncFetch>& pieces) {
    const std::string where = "shared-state source " + source.id.to_string() + " at " + source.host + ":" +
                              std::to_string(source.shared_state_port);
    auto fd = transport::connect_tcp(source.host, source.shared_state_port, connect_timeout_ms_);
    if (!fd.is_ok()) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, where + ": " + fd.status().message());
    const int raw = fd.value().get();
    if (!sockets_.add(raw)) return Status(LOCKSTEP_STATUS_INTERRUPTED, "the sync ended");
    Status s = exchange(raw, source, pieces);
    sockets_.remove(raw);
    if (!s.is_ok()) return Status(s.code(), where + ": " + s.message());
    return s;
  }

  Status exchange(int fd, const proto::MemberInfo& source, const std::vector<proto::SyncFetch>& pieces) {
    proto::P2PHello hello;
    hello.channel = proto::Channel::kSharedState;
    hello.from = self_;
    hello.to = source.id;
    hello.epoch = plan_.attempt;
    if (encrypt_) hello.flags = proto::kP2PFlagEncryptData;
    security::SessionKeys keys;
    Status s = p2p_handshake(fd, hello, secret_, source.key, connect_timeout_ms_, &keys);
    if (!s.is_ok()) return lost(Status(s.code(), "shared-state handshake: " + s.message()));
    std::unique_ptr<SealedStream> sealed = encrypt_ ? std::make_unique<SealedStream>(keys, /*client=*/true) : nullptr;
    security::FrameCrypto* crypto = sealed ? &sealed->crypto : nullptr;
    BlockReceiver blocks;
    std::vector<proto::SyncFetch> differing;
    if (Status d = differing_segments(fd, pieces, crypto, &differing); !d.is_ok()) return lost(d);
    std::vector<const proto::SyncFetch*> wanted;
    for (const auto& f : differing) wanted.push_back(&f);
    return fetch(fd, wanted, sealed.get(), blocks);
  }

  state::Digest expected_digest(std::uint32_t tensor) const {
    auto expected = expected_.find(tensor);
    return expected == expected_.end() ? state::Digest{} : expected->second;
  }

  // Delta transfer: asks the source for the segment digests of every piece (at most
  // kStateSegmentsPerRequestMax segments a request, kRequestsInFlight requests in flight)
  // and keeps the segments whose digest differs from this peer's own bytes there,
  // adjacent ones merged.
  Status differing_segments(int fd, const std::vector<proto::SyncFetch>& pieces, security::FrameCrypto* crypto,
                            std::vector<proto::SyncFetch>* out) {
    std::vector<proto::SyncFetch> queries;
    constexpr std::uint64_t kQueryBytes = std::uint64_t{limits::kStateSegmentsPerRequestMax} * state::kHashLeafBytes;
    for (const auto& f : pieces) {
      for (std::uint64_t at = f.offset; at < f.offset + f.bytes;) {
        const std::uint64_t end = std::min(f.offset + f.bytes, (at / kQueryBytes + 1) * kQueryBytes);
        queries.push_back(proto::SyncFetch{f.tensor, at, end - at, f.source});
        at = end;
      }
    }
    std::size_t sent = 0;
    for (std::size_t received = 0; received < queries.size(); ++received) {
      while (sent < queries.size() && sent < received + kRequestsInFlight) {
        const proto::SyncFetch& q = queries[sent++];
        Status r = transport::send_message(
            fd, proto::StateLeavesRequest{plan_.attempt, tensors_[q.tensor].key, q.offset, q.bytes, expected_digest(q.tensor)},
            limits::kStateTransferStallMsDefault, crypto);
        if (!r.is_ok()) return r;
      }
      const proto::SyncFetch& q = queries[received];
      auto reply = transport::recv_message(fd, limits::kStateTransferStallMsDefault, crypto);
      if (!reply.is_ok()) return reply.status();
      const auto* response = std::get_if<proto::StateLeavesResponse>(&reply.value());
      if (response == nullptr) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it answered a request with something else");
      if (response->status != LOCKSTEP_OK) {
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "it refused a request: " + response->reason);
      }
      const auto mine = segment_digests(local_[q.tensor], q.offset, q.bytes);
      if (response->digests.size() != mine.size()) {
        return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it sent " + std::to_string(response->digests.size()) +
                                                          " segment digests for a range of " + std::to_string(mine.size()));
      }
      for (std::size_t k = 0; k < mine.size(); ++k) {
        if (response->digests[k] == mine[k]) continue;
        const std::uint64_t start = state::segment_start(q.offset, k);
        const std::uint64_t end = k + 1 < mine.size() ? state::segment_start(q.offset, k + 1) : q.offset + q.bytes;
        if (!out->empty() && out->back().tensor == q.tensor && out->back().offset + out->back().bytes == start) {
          out->back().bytes += end - start;
        } else {
          out->push_back(proto::SyncFetch{q.tensor, start, end - start, q.source});
        }
      }
    }
    return Status::ok();
  }

  // Receives the pieces, kRequestsInFlight requests in flight.
  Status fetch(int fd, const std::vector<const proto::SyncFetch*>& pieces, SealedStream* sealed, BlockReceiver& blocks) {
    security::FrameCrypto* crypto = sealed != nullptr ? &sealed->crypto : nullptr;
    const auto request = [&](const proto::SyncFetch& f) {
      return transport::send_message(
          fd, proto::StateRequest{plan_.attempt, tensors_[f.tensor].key, f.offset, f.bytes, expected_digest(f.tensor),
                                  compress_ ? proto::kStateEncodingBlocks : proto::kStateEncodingRaw},
          limits::kStateTransferStallMsDefault, crypto);
    };
    std::size_t sent = 0;
    for (std::size_t received = 0; received < pieces.size(); ++received) {
      while (sent < pieces.size() && sent < received + kRequestsInFlight) {
        if (Status r = request(*pieces[sent++]); !r.is_ok()) return lost(r);
      }
      const proto::SyncFetch& f = *pieces[received];
      auto reply = transport::recv_message(fd, limits::kStateTransferStallMsDefault, crypto);
      if (!reply.is_ok()) return lost(reply.status());
      const auto* response = std::get_if<proto::StateResponse>(&reply.value());
      if (response == nullptr) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it answered a request with something else");
      if (response->status != LOCKSTEP_OK) {
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "it refused a request: " + response->reason);
      }
      // The size comes from our own plan and descriptor, never from the wire alone.
      if (response->bytes != f.bytes) {
        return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "it announced " + std::to_string(response->bytes) +
                                                          " bytes for a piece of " + std::to_string(f.bytes));
      }
      if (Status r = receive(fd, f, sealed, blocks); !r.is_ok()) return lost(r);
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

  const PeerId self_;
  const std::uint32_t connect_timeout_ms_;
  const bool secret_;
  const bool encrypt_;
  const bool compress_;
  const std::uint32_t streams_;
  const proto::SyncPlan& plan_;
  const std::vector<SharedTensor>& tensors_;
  const std::vector<LocalTensor>& local_;
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
  SocketSet sockets_;
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

  StateServer server(*link_, plan.attempt, by_key, options_.encrypt_data);
  const std::uint32_t streams = options_.p2p_streams != 0 ? options_.p2p_streams : limits::kStateStreamsDefault;
  Fetcher fetcher(id_, options_.p2p_connect_timeout_ms, options_.secret.has_value(), options_.encrypt_data,
                  options_.compress_state, streams, plan, tensors, local);
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
