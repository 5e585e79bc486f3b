// Ring all-reduce driver: two cursors (send, receive) walk the same sequence of
// sub-chunk items; a send item of step s may go once the receive of the same
// sub-chunk at step s-1 is complete (it carries what was just reduced or received).
#include "collectives/ring.h"

#include "collectives/quantize.h"
#include "kernels/reduce.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

namespace lockstep::coll {
namespace {

// Which chunk each step sends and receives, what a step does with what it receives,
// and where every element of the collective lives. All-reduce: n chunks, 2(n-1) steps,
// the first n-1 reduce. Reduce-scatter: the same n-1 reducing steps, the ring turned by
// one place so that rank i ends with chunk i (in the user's destination; the partial
// sums of the other chunks go to scratch). All-gather: the all-reduce's last n-1 steps,
// starting from each rank's own chunk (the counts per rank may differ). Broadcast: one chunk passed down the chain root, root+1, ..., root-1: every
// peer but the root receives it and every peer but the last forwards each sub-chunk as
// soon as it has it.
class Layout {
 public:
  explicit Layout(const RingPlan& p)
      : kind_(p.kind), n_(p.world), i_(p.rank), count_(p.count), esize_(dtype_size(p.dtype)),
        sub_elems_(std::max<std::size_t>(1, p.subchunk_bytes / std::max<std::size_t>(1, dtype_size(p.dtype)))) {
    const std::size_t chunks = kind_ == RingKind::kBroadcast ? 1 : n_;
    chunk_start_.resize(chunks + 1, 0);
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t len = kind_ == RingKind::kBroadcast ? count_
                              : !p.counts.empty()          ? p.counts[c]
                                                           : count_ / n_ + (c < count_ % n_ ? 1 : 0);
      chunk_start_[c + 1] = chunk_start_[c] + len;
    }
    sub_offset_.resize(chunks + 1, 0);
    for (std::size_t c = 0; c < chunks; ++c) sub_offset_[c + 1] = sub_offset_[c] + nsub(c);
    if (p.quantization != LOCKSTEP_QUANT_NONE) {
      encoded_start_.assign(1, 0);
      for (std::size_t c = 0; c < chunks; ++c) {
        for (std::size_t j = 0; j < nsub(c); ++j) {
          encoded_start_.push_back(encoded_start_.back() + quantized_bytes(sub_len(c, j), p.quantization));
        }
      }
    }
    const std::size_t position = (i_ + n_ - p.root % n_) % n_;  // broadcast: hops from the root
    switch (kind_) {
      case RingKind::kAllReduce: tx_steps_ = rx_steps_ = 2 * (n_ - 1); break;
      case RingKind::kReduceScatter:
        tx_steps_ = rx_steps_ = n_ - 1;
        turn_ = n_ - 1;  // step 0 sends chunk i-1, the last step receives chunk i
        break;
      case RingKind::kAllGather: tx_steps_ = rx_steps_ = n_ - 1; break;  // step 0 sends chunk i
      case RingKind::kBroadcast:
        tx_steps_ = position + 1 < n_ ? 1 : 0;
        rx_steps_ = position > 0 ? 1 : 0;
        root_ = position == 0;
        break;
    }
    own_ = kind_ == RingKind::kReduceScatter || kind_ == RingKind::kAllGather ? i_ : 0;
  }
  RingKind kind() const { return kind_; }
  std::size_t tx_steps() const { return tx_steps_; }
  std::size_t rx_steps() const { return rx_steps_; }
  std::size_t chunks() const { return chunk_start_.size() - 1; }
  std::size_t start(std::size_t c) const { return chunk_start_[c]; }
  std::size_t len(std::size_t c) const { return start(c + 1) - start(c); }
  std::size_t nsub(std::size_t c) const { return (len(c) + sub_elems_ - 1) / sub_elems_; }
  std::size_t send_chunk(std::size_t s) const {
    return kind_ == RingKind::kBroadcast ? 0 : (i_ + turn_ + 2 * n_ - s) % n_;
  }
  std::size_t recv_chunk(std::size_t s) const {
    return kind_ == RingKind::kBroadcast ? 0 : (i_ + turn_ + 2 * n_ - s - 1) % n_;
  }
  // The receive step whose sub-chunk a send of step s forwards (the same sub-chunk
  // index), or -1 when the send's data is this peer's own.
  std::ptrdiff_t send_after(std::size_t s) const {
    if (kind_ == RingKind::kBroadcast) return root_ ? -1 : 0;
    return static_cast<std::ptrdiff_t>(s) - 1;
  }
  // Whether a send of step s takes this peer's input (else what it reduced or received).
  bool sends_input(std::size_t s) const { return kind_ == RingKind::kBroadcast ? root_ : s == 0; }
  bool reducing(std::size_t s) const {
    return kind_ == RingKind::kReduceScatter || (kind_ == RingKind::kAllReduce && s + 1 < n_);
  }
  // The receive step after which this peer's chunk holds its final reduced value.
  bool finalizing(std::size_t s) const {
    return (kind_ == RingKind::kAllReduce || kind_ == RingKind::kReduceScatter) && s + 2 == n_;
  }
  // Reduce-scatter: the chunk that lands in the user's destination; the others' partial
  // sums live in scratch and need no backup.
  bool in_destination(std::size_t c) const { return kind_ != RingKind::kReduceScatter || c == own_; }
  std::size_t own_chunk() const { return own_; }
  // Byte offsets of element `e` (counted over the whole collective) in the destination
  // (or scratch), the input, and the backup.
  std::size_t dst_offset(std::size_t e) const {
    return (kind_ == RingKind::kReduceScatter ? e - start(own_) : e) * esize_;
  }
  std::size_t src_offset(std::size_t e) const { return (kind_ == RingKind::kAllGather ? e - start(own_) : e) * esize_; }
  std::size_t destination_elems() const { return kind_ == RingKind::kReduceScatter ? len(own_) : count_; }
  // Element offset and length of sub-chunk j of chunk c.
  std::size_t sub_start(std::size_t c, std::size_t j) const { return start(c) + j * sub_elems_; }
  std::size_t sub_len(std::size_t c, std::size_t j) const { return std::min(sub_elems_, len(c) - j * sub_elems_); }
  std::size_t sub_index(std::size_t c, std::size_t j) const { return sub_offset_[c] + j; }
  std::size_t total_subs() const { return sub_offset_.back(); }
  std::size_t esize() const { return esize_; }
  std::size_t n() const { return n_; }
  // Bytes of sub-chunk j of chunk c on the wire.
  std::size_t wire_bytes(std::size_t c, std::size_t j, lockstep_quantization_t q) const {
    return q == LOCKSTEP_QUANT_NONE ? sub_len(c, j) * esize_ : quantized_bytes(sub_len(c, j), q);
  }
  // Where the encoded form of sub-chunk j of chunk c is kept during the all-gather.
  std::size_t encoded_offset(std::size_t c, std::size_t j) const { return encoded_start_[sub_index(c, j)]; }
  std::size_t encoded_total() const { return encoded_start_.back(); }

 private:
  RingKind kind_;
  std::size_t n_, i_, count_, esize_, sub_elems_;
  std::size_t tx_steps_ = 0, rx_steps_ = 0;
  std::size_t turn_ = 0;  // reduce-scatter: the ring turned by one place
  std::size_t own_ = 0;
  bool root_ = false;
  std::vector<std::size_t> chunk_start_;
  std::vector<std::size_t> sub_offset_;
  std::vector<std::size_t> encoded_start_;  // quantized: where each sub-chunk's encoding is kept
};

// Position of one stream in the item sequence: step, sub-chunk, and bytes of the item
// done. A stream takes the sub-chunks first, first + stride, ... of each step's chunk.
struct Cursor {
  std::size_t step = 0;
  std::size_t sub = 0;
  std::size_t item = 0;  // running item number of the stream (the frame's sequence number)
  std::size_t bytes = 0;
  std::size_t first = 0;
  std::size_t stride = 1;
};

std::uint8_t* bytes_of(void* p) { return static_cast<std::uint8_t*>(p); }
const std::uint8_t* bytes_of(const void* p) { return static_cast<const std::uint8_t*>(p); }

// poll(), first retried without sleeping for spin_us: a thread that sleeps each time its
// neighbour is busy for a moment pays a wake-up each time (RingPlan::spin_us). Polling
// rather than retrying the sends keeps the kernel's rule of reporting a socket writable
// only once a good part of its buffer is free, so the spin does not send in crumbs.
int poll_spinning(pollfd* fds, nfds_t nfds, int timeout_ms, std::uint32_t spin_us) {
  if (spin_us > 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    do {
      const int ready = ::poll(fds, nfds, 0);
      if (ready != 0) return ready;
    } while (std::chrono::steady_clock::now() < until);
  }
  return ::poll(fds, nfds, timeout_ms);
}

std::uint64_t pack(std::size_t step, std::size_t sub) {
  return (static_cast<std::uint64_t>(step) << 32) | static_cast<std::uint64_t>(sub);
}

struct TxStream {
  int fd = -1;
  security::Aead* seal = nullptr;
  Cursor cur;
  std::uint8_t header[kRingHeaderBytes] = {};
  // The current item's header and bytes are made (and sealed: that advances the
  // cipher's counter) once, before its first byte goes; a send that the socket refuses
  // at once must not make them again.
  bool prepared = false;
  const std::uint8_t* source = nullptr;
};

struct RxStream {
  int fd = -1;
  security::Aead* open = nullptr;
  Cursor cur;
  std::uint8_t header[kRingHeaderBytes] = {};
  std::size_t lowat = 1;  // the socket's low-water mark, as this attempt set it
  // The frame being read is a commit token of an earlier attempt (run_ring_commit), to
  // be read (its tag checked, when sealed) and skipped.
  bool skipping = false;
  std::uint8_t token[security::kTagBytes] = {};
  // pack(cur.step, cur.sub): everything before it has been received (and reduced);
  // published by the receiving thread for the sending one.
  std::atomic<std::uint64_t> pos{0};
};

constexpr std::uint64_t kStopped = std::uint64_t{1} << 63;

class Runner {
 public:
  Runner(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats)
      : p_(plan), io_(io), s_(scratch), stats_(stats), l_(plan), src_(plan.src) {}

  Status run() {
    if (p_.residual != nullptr) {
      Status st = prepare_feedback();
      if (!st.is_ok()) return st;
    }
    if (p_.world == 1) {
      prepare();
      return single();
    }
    if (io_.tx_more.size() + 1 > kRingStreamsMax) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "more than " + std::to_string(kRingStreamsMax) + " ring streams");
    }
    ntx_ = 1 + io_.tx_more.size();
    if (stats_ != nullptr) stats_->streams = static_cast<std::uint32_t>(ntx_);
    tx_[0].fd = io_.tx_fd;
    tx_[0].seal = io_.seal;
    for (std::size_t k = 1; k < ntx_; ++k) {
      tx_[k].fd = io_.tx_more[k - 1].fd;
      tx_[k].seal = io_.tx_more[k - 1].aead;
    }
    for (std::size_t k = 0; k < ntx_; ++k) start_cursor(tx_[k].cur, k, ntx_, true);
    // Until stream 0's first header names the previous peer's stream count, stream 0's
    // cursor runs as if alone: its first item is the same either way.
    rx_[0].fd = io_.rx_fd;
    rx_[0].open = io_.open;
    start_cursor(rx_[0].cur, 0, 1, false);
    publish(rx_[0]);
    prepare();
    // Tunings: where the kernel refuses one, the ring runs as it would without it.
    for (std::size_t k = 0; k < ntx_; ++k) set_buffer(tx_[k].fd, SO_SNDBUF, p_.tx_buffer_bytes);
    set_buffer(rx_[0].fd, SO_RCVBUF, p_.rx_buffer_bytes);
    if (p_.count * l_.esize() >= p_.sender_thread_bytes_min && start_sender()) return run_receiver();
    // The clock is read only while nothing moves.
    bool idle = false;
    std::chrono::steady_clock::time_point idle_since{};
    while (!sending_done() || !receiving_done()) {
      if (abort_requested()) return aborted();
      bool progress = false;
      Status st = pump_sends(&progress);
      if (!st.is_ok()) return fail(st);
      st = pump_recvs(&progress);
      if (!st.is_ok()) return fail(st);
      if (progress) {
        idle = false;
        continue;
      }
      if (place_own_sub_chunk()) continue;
      int timeout_ms = -1;
      if (io_.stall_timeout_ms > 0) {
        const auto now = std::chrono::steady_clock::now();
        if (!idle) idle_since = now;
        idle = true;
        const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - idle_since).count();
        if (idle_ms >= io_.stall_timeout_ms) return fail(stalled());
        timeout_ms = static_cast<int>(io_.stall_timeout_ms - idle_ms);
      }
      pollfd fds[2 * kRingStreamsMax + 1];
      nfds_t nfds = 0;
      for (std::size_t k = 0; k < ntx_; ++k) {
        if (send_ready(tx_[k])) fds[nfds++] = pollfd{tx_[k].fd, POLLOUT, 0};
      }
      for (std::size_t k = 0; k < nrx(); ++k) {
        if (rx_[k].cur.step < l_.rx_steps()) {
          set_lowat(rx_[k], wanted_lowat(rx_[k]));
          fds[nfds++] = pollfd{rx_[k].fd, POLLIN, 0};
        }
      }
      fds[nfds++] = pollfd{io_.abort_fd, POLLIN, 0};
      if (poll_spinning(fds, nfds, timeout_ms, p_.spin_us) < 0 && errno != EINTR) {
        return fail(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll"));
      }
      if (fds[nfds - 1].revents != 0) return aborted();
    }
    place_own_chunk();
    reset_lowats();
    return Status::ok();
  }

  // ---------------------------------------------------------------- two threads
  // A second thread runs the sends while this one runs the receives: on a machine where
  // the peers share few cores, a peer then holds a fair share of the CPU while its
  // neighbours compete for it, and sending goes on while a sub-chunk is reduced. The
  // sender learns how far the receiver got from the receiving streams' positions
  // (release/acquire orders the reduced bytes before the send that reads them) and
  // sleeps on progress_, which the receiver bumps after every item; wake_fd_ stops
  // whichever side is still waiting when the other fails. The destination is restored
  // only after the sender has been joined.

  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Milliseconds left before the stall timeout (no byte moved either way) fires;
  // -1: no timeout; 0: it fired.
  int stall_left_ms() const {
    if (io_.stall_timeout_ms == 0) return -1;
    const std::int64_t idle_ms = (now_ns() - last_move_ns_.load(std::memory_order_relaxed)) / 1'000'000;
    if (idle_ms >= io_.stall_timeout_ms) return 0;
    return static_cast<int>(io_.stall_timeout_ms - idle_ms);
  }
  Status stalled() const {
    return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "no data moved to or from the ring neighbours for " +
                                                            std::to_string(io_.stall_timeout_ms) + " ms (a cut link?)");
  }
  static Status abort_status() { return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the attempt was aborted"); }
  bool abort_requested() const {
    return io_.abort_flag != nullptr && io_.abort_flag->load(std::memory_order_relaxed);
  }
  void stop_other_side() {
    stop_.store(true, std::memory_order_release);
    progress_.fetch_or(kStopped, std::memory_order_acq_rel);  // a waiting sender wakes
    progress_.notify_all();
    const std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }

  // False (and one thread does it all) when no thread or descriptor can be had.
  bool start_sender() {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return false;
    threaded_ = true;
    last_move_ns_.store(now_ns(), std::memory_order_relaxed);
    try {
      sender_ = std::thread([this] {
        send_status_ = send_loop();
        if (!send_status_.is_ok()) stop_other_side();
      });
    } catch (const std::system_error&) {
      threaded_ = false;
      ::close(wake_fd_);
      wake_fd_ = -1;
      return false;
    }
    return true;
  }

  Status run_receiver() {
    Status st = recv_loop();
    if (!st.is_ok()) stop_other_side();
    sender_.join();
    ::close(wake_fd_);
    wake_fd_ = -1;
    if (!st.is_ok()) return fail(st);
    if (!send_status_.is_ok()) return fail(send_status_);
    place_own_chunk();
    reset_lowats();
    return Status::ok();
  }

  Status send_loop() {
    while (!sending_done()) {
      if (stop_.load(std::memory_order_acquire)) return Status::ok();  // the receiver's status counts
      if (abort_requested()) return abort_status();
      const std::uint64_t seen = progress_.load(std::memory_order_acquire);
      if (!any_send_ready()) {
        if ((seen & kStopped) == 0) progress_.wait(seen, std::memory_order_acquire);
        continue;
      }
      bool progress = false;
      Status st = pump_sends(&progress);
      if (!st.is_ok()) return st;
      if (progress) {
        last_move_ns_.store(now_ns(), std::memory_order_relaxed);
        continue;
      }
      if (!any_send_ready()) continue;
      const int timeout_ms = stall_left_ms();
      if (timeout_ms == 0) return stalled();
      pollfd fds[kRingStreamsMax + 2];
      nfds_t nfds = 0;
      for (std::size_t k = 0; k < ntx_; ++k) {
        if (send_ready(tx_[k])) fds[nfds++] = pollfd{tx_[k].fd, POLLOUT, 0};
      }
      fds[nfds++] = pollfd{io_.abort_fd, POLLIN, 0};
      fds[nfds++] = pollfd{wake_fd_, POLLIN, 0};
      if (::poll(fds, nfds, timeout_ms) < 0 && errno != EINTR) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
      if (fds[nfds - 2].revents != 0) return abort_status();
    }
    return Status::ok();
  }

  Status recv_loop() {
    while (!receiving_done()) {
      if (stop_.load(std::memory_order_acquire)) return Status::ok();  // the sender's status counts
      if (abort_requested()) return abort_status();
      bool progress = false;
      Status st = pump_recvs(&progress);
      if (!st.is_ok()) return st;
      if (progress) {
        last_move_ns_.store(now_ns(), std::memory_order_relaxed);
        continue;
      }
      if (place_own_sub_chunk()) continue;
      const int timeout_ms = stall_left_ms();
      if (timeout_ms == 0) return stalled();
      pollfd fds[kRingStreamsMax + 2];
      nfds_t nfds = 0;
      for (std::size_t k = 0; k < nrx(); ++k) {
        if (rx_[k].cur.step < l_.rx_steps()) fds[nfds++] = pollfd{rx_[k].fd, POLLIN, 0};
      }
      fds[nfds++] = pollfd{io_.abort_fd, POLLIN, 0};
      fds[nfds++] = pollfd{wake_fd_, POLLIN, 0};
      if (::poll(fds, nfds, timeout_ms) < 0 && errno != EINTR) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
      if (fds[nfds - 2].revents != 0) return abort_status();
    }
    return Status::ok();
  }

 private:
  // Receiving streams known so far: 1 until stream 0's first header names the count.
  std::size_t nrx() const {
    const std::size_t n = nrx_.load(std::memory_order_acquire);
    return n == 0 ? 1 : n;
  }
  bool sending_done() const {
    for (std::size_t k = 0; k < ntx_; ++k) {
      if (tx_[k].cur.step < l_.tx_steps()) return false;
    }
    return true;
  }
  bool receiving_done() const {
    for (std::size_t k = 0; k < nrx(); ++k) {
      if (rx_[k].cur.step < l_.rx_steps()) return false;
    }
    return true;
  }

  void set_buffer(int fd, int option, int bytes) {
    if (bytes > 0) (void)::setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof bytes);
  }

  // The receive low-water mark for the next poll: RingPlan::rx_lowat_bytes, but never
  // more than the bytes of the stream's current sub-chunk still due (beyond them the
  // previous peer may send nothing until this one has sent it more). 1: none.
  std::size_t wanted_lowat(const RxStream& r) const {
    if (p_.rx_lowat_bytes == 0 || r.cur.step >= l_.rx_steps()) return 1;
    const std::size_t c = l_.recv_chunk(r.cur.step);
    const std::size_t due = kRingHeaderBytes + on_wire_rx(l_.wire_bytes(c, r.cur.sub, p_.quantization)) - r.cur.bytes;
    return std::max<std::size_t>(1, std::min(p_.rx_lowat_bytes, due));
  }
  static void set_lowat(RxStream& r, std::size_t bytes) {
    if (bytes == r.lowat) return;
    const int value = static_cast<int>(bytes);
    if (::setsockopt(r.fd, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof value) == 0) r.lowat = bytes;
  }
  void reset_lowats() {
    for (std::size_t k = 0; k < nrx(); ++k) set_lowat(rx_[k], 1);
  }

  std::size_t staging_bytes() const {
    return std::min(p_.count * l_.esize(), std::max<std::size_t>(p_.subchunk_bytes, l_.esize())) + kQuantHeaderBytes;
  }

  void prepare() {
    const std::size_t total = l_.destination_elems() * l_.esize();
    if (s_.backup.size() < total) s_.backup.resize(total);
    if (l_.kind() == RingKind::kReduceScatter && s_.work.size() < p_.count * l_.esize()) {
      s_.work.resize(p_.count * l_.esize());
    }
    s_.touched.assign(l_.total_subs() + 1, 0);
    grow_receive_scratch(1);
    const std::size_t staging = staging_bytes();
    if (quantized()) {
      if (s_.encoded_send.size() < ntx_ * staging) s_.encoded_send.resize(ntx_ * staging);
      if (s_.encoded_gather.size() < l_.encoded_total()) s_.encoded_gather.resize(l_.encoded_total());
    }
    if (seals() && s_.sealed_send.size() < ntx_ * (staging + security::kTagBytes)) {
      s_.sealed_send.resize(ntx_ * (staging + security::kTagBytes));
    }
  }
  // Staging (and sealed) room for `streams` receiving streams; only the receiving
  // thread uses these buffers.
  void grow_receive_scratch(std::size_t streams) {
    const std::size_t staging = staging_bytes();
    if (s_.staging.size() < streams * staging) s_.staging.resize(streams * staging);
    if (opens() && s_.sealed_recv.size() < streams * (staging + security::kTagBytes)) {
      s_.sealed_recv.resize(streams * (staging + security::kTagBytes));
    }
  }
  std::uint8_t* staging_of(std::size_t k) { return s_.staging.data() + k * staging_bytes(); }
  std::uint8_t* sealed_recv_of(std::size_t k) {
    return s_.sealed_recv.data() + k * (staging_bytes() + security::kTagBytes);
  }
  std::uint8_t* encoded_send_of(std::size_t k) { return s_.encoded_send.data() + k * staging_bytes(); }
  std::uint8_t* sealed_send_of(std::size_t k) {
    return s_.sealed_send.data() + k * (staging_bytes() + security::kTagBytes);
  }

  // Where element e of chunk c is written (the destination, or scratch for the partial
  // sums a reduce-scatter passes on), and where it is read from the input.
  std::uint8_t* dst_at(std::size_t c, std::size_t e) {
    return l_.in_destination(c) ? bytes_of(p_.dst) + l_.dst_offset(e) : s_.work.data() + e * l_.esize();
  }
  const std::uint8_t* src_at(std::size_t e) const { return bytes_of(src_) + l_.src_offset(e); }

  // Backs up destination elements [start, start+len) of sub-chunk g before the first write.
  void touch(std::size_t g, std::size_t start, std::size_t len) {
    if (s_.touched[g] != 0) return;
    s_.touched[g] = 1;
    std::memcpy(s_.backup.data() + l_.dst_offset(start), bytes_of(p_.dst) + l_.dst_offset(start), len * l_.esize());
  }

  // All-gather: this peer's own chunk goes into its place in the destination (unless the
  // input already is that place), one sub-chunk at a time in the moments the thread that
  // receives would otherwise wait, and the rest at the end: the ring sends the chunk from
  // the input meanwhile, so nothing waits for the copy (and its backup) up front.
  bool own_chunk_to_place() const {
    const std::size_t c = l_.own_chunk();
    return l_.kind() == RingKind::kAllGather && l_.len(c) != 0 && own_placed_ < l_.nsub(c) &&
           src_at(l_.start(c)) != bytes_of(p_.dst) + l_.dst_offset(l_.start(c));
  }
  bool place_own_sub_chunk() {
    if (!own_chunk_to_place()) return false;
    const std::size_t c = l_.own_chunk();
    const std::size_t j = own_placed_++;
    const std::size_t start = l_.sub_start(c, j);
    touch(l_.sub_index(c, j), start, l_.sub_len(c, j));
    std::memcpy(dst_at(c, start), src_at(start), l_.sub_len(c, j) * l_.esize());
    return true;
  }
  void place_own_chunk() {
    while (place_own_sub_chunk()) {
    }
  }

  Status single() {
    if (src_ != p_.dst) {
      touch(0, 0, p_.count);
      std::memcpy(p_.dst, src_, p_.count * l_.esize());
    }
    return Status::ok();  // a world of one: sum, max, ... and avg over one peer are the input
  }

  bool quantized() const { return p_.quantization != LOCKSTEP_QUANT_NONE; }
  bool feedback() const { return p_.residual != nullptr; }

  // Error feedback: the contribution is src + residual, the next residual starts at 0
  // (every element of it is written once by the encodings below; the zeros cover a
  // world of one, where nothing is encoded).
  Status prepare_feedback() {
    if (l_.kind() != RingKind::kAllReduce || !quantized() || (p_.op != LOCKSTEP_SUM && p_.op != LOCKSTEP_AVG)) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "error feedback needs a quantized all-reduce with op sum or avg");
    }
    const std::size_t bytes = p_.count * l_.esize();
    s_.contribution.resize(bytes);
    s_.residual_next.assign(bytes, 0);
    std::memcpy(s_.contribution.data(), p_.src, bytes);
    reduce(s_.contribution.data(), p_.residual, p_.count, p_.dtype, LOCKSTEP_SUM);
    src_ = s_.contribution.data();
    return Status::ok();
  }
  // What encoding `raw` (elements from `start`) as `encoded` dropped, into the next residual.
  void record_error(const std::uint8_t* raw, const std::uint8_t* encoded, std::size_t start, std::size_t elems,
                    double factor) {
    quantization_error(raw, encoded, elems, p_.dtype, p_.quantization, factor,
                       s_.residual_next.data() + start * l_.esize());
  }
  // Each direction is sealed where its connection has a cipher (RingIo::seal, ::open):
  // with encrypt_data every connection, without it a relayed edge's alone.
  bool seals() const { return io_.seal != nullptr; }
  bool opens() const { return io_.open != nullptr; }
  // Bytes after the header: the payload, and its tag when that direction is sealed.
  std::size_t on_wire_tx(std::size_t payload) const { return payload + (seals() ? security::kTagBytes : 0); }
  std::size_t on_wire_rx(std::size_t payload) const { return payload + (opens() ? security::kTagBytes : 0); }

  // The bytes of a send item. Quantized: reduce-scatter encodes the partial sum; the
  // first all-gather step encodes this peer's final chunk and replaces its own copy
  // with the decoded form; later steps forward what was received, unchanged.
  const std::uint8_t* send_data(std::size_t k, std::size_t c, std::size_t start) {
    const Cursor& cur = tx_[k].cur;
    const std::uint8_t* raw = l_.sends_input(cur.step) ? src_at(start) : dst_at(c, start);
    if (!quantized()) return raw;
    const std::size_t elems = l_.sub_len(c, cur.sub);
    if (cur.step + 1 < l_.n()) {
      quantize(raw, elems, p_.dtype, p_.quantization, p_.distribution, encoded_send_of(k));
      if (feedback()) record_error(raw, encoded_send_of(k), start, elems, 1.0);
      return encoded_send_of(k);
    }
    std::uint8_t* kept = s_.encoded_gather.data() + l_.encoded_offset(c, cur.sub);
    if (cur.step + 1 == l_.n()) {
      quantize(raw, elems, p_.dtype, p_.quantization, p_.distribution, kept);
      // The final sum's error, in the units of the contributions (avg: world x).
      if (feedback()) {
        record_error(raw, kept, start, elems, p_.op == LOCKSTEP_AVG ? static_cast<double>(p_.world) : 1.0);
      }
      touch(l_.sub_index(c, cur.sub), start, elems);
      dequantize(kept, elems, p_.dtype, p_.quantization, bytes_of(p_.dst) + start * l_.esize());
    }
    return kept;
  }

  void start_cursor(Cursor& c, std::size_t first, std::size_t stride, bool sending) const {
    c = Cursor{};
    c.first = first;
    c.sub = first;
    c.stride = stride;
    skip_empty(c, sending);
  }
  void skip_empty(Cursor& c, bool sending) const {
    while (c.step < (sending ? l_.tx_steps() : l_.rx_steps()) &&
           c.sub >= l_.nsub(sending ? l_.send_chunk(c.step) : l_.recv_chunk(c.step))) {
      ++c.step;
      c.sub = c.first;
    }
  }
  void advance(Cursor& c, bool sending) const {
    c.sub += c.stride;
    ++c.item;
    c.bytes = 0;
    skip_empty(c, sending);
  }
  static void publish(RxStream& r) { r.pos.store(pack(r.cur.step, r.cur.sub), std::memory_order_release); }

  bool send_ready(const TxStream& t) const {
    if (t.cur.step >= l_.tx_steps()) return false;
    const std::ptrdiff_t after = l_.send_after(t.cur.step);
    if (after < 0) return true;
    // The receive of this sub-chunk at that step must be complete, on the receiving
    // stream that carries it.
    const std::size_t streams = nrx_.load(std::memory_order_acquire);
    if (streams == 0) return false;
    return rx_[t.cur.sub % streams].pos.load(std::memory_order_acquire) >
           pack(static_cast<std::size_t>(after), t.cur.sub);
  }
  bool any_send_ready() const {
    for (std::size_t k = 0; k < ntx_; ++k) {
      if (send_ready(tx_[k])) return true;
    }
    return false;
  }

  Status pump_sends(bool* progress) {
    for (std::size_t k = 0; k < ntx_; ++k) {
      Status st = pump_send(k, progress);
      if (!st.is_ok()) return st;
    }
    return Status::ok();
  }
  Status pump_recvs(bool* progress) {
    for (std::size_t k = 0; k < nrx(); ++k) {
      Status st = pump_recv(k, progress);
      if (!st.is_ok()) return st;
    }
    return Status::ok();
  }

  Status pump_send(std::size_t k, bool* progress) {
    TxStream& t = tx_[k];
    while (send_ready(t)) {
      const std::size_t c = l_.send_chunk(t.cur.step);
      const std::size_t start = l_.sub_start(c, t.cur.sub);
      const std::size_t plain = l_.wire_bytes(c, t.cur.sub, p_.quantization);
      const std::size_t payload = on_wire_tx(plain);
      // Step 0 sends this peer's own input; later steps send what was reduced or received.
      if (!t.prepared) {
        t.prepared = true;
        put_ring_header(t.header, RingHeader{static_cast<std::uint8_t>(k), static_cast<std::uint8_t>(ntx_),
                                             static_cast<std::uint32_t>(t.cur.item), p_.attempt});
        t.source = send_data(k, c, start);
        if (seals()) {
          t.seal->seal(std::span<const std::uint8_t>(t.source, plain),
                       std::span<const std::uint8_t>(t.header, kRingHeaderBytes), sealed_send_of(k));
          t.source = sealed_send_of(k);
        }
      }
      const std::uint8_t* data = t.source;
      iovec iov[2];
      int n = 0;
      if (t.cur.bytes < kRingHeaderBytes) {
        iov[n++] = iovec{t.header + t.cur.bytes, kRingHeaderBytes - t.cur.bytes};
        iov[n++] = iovec{const_cast<std::uint8_t*>(data), payload};
      } else {
        const std::size_t off = t.cur.bytes - kRingHeaderBytes;
        iov[n++] = iovec{const_cast<std::uint8_t*>(data) + off, payload - off};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t sent = ::sendmsg(t.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::ok();
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("sending to the next ring peer: ") + std::strerror(errno));
      }
      *progress = true;
      t.cur.bytes += static_cast<std::size_t>(sent);
      if (stats_ != nullptr) stats_->bytes_sent += static_cast<std::uint64_t>(sent);
      if (t.cur.bytes == kRingHeaderBytes + payload) {
        advance(t.cur, true);
        t.prepared = false;
      }
    }
    return Status::ok();
  }

  Status pump_recv(std::size_t k, bool* progress) {
    RxStream& r = rx_[k];
    while (r.cur.step < l_.rx_steps()) {
      if (r.skipping) {
        Status st = skip_token(r, progress);
        if (!st.is_ok() || r.skipping) return st;
        continue;
      }
      const std::size_t c = l_.recv_chunk(r.cur.step);
      const std::size_t start = l_.sub_start(c, r.cur.sub);
      const std::size_t elems = l_.sub_len(c, r.cur.sub);
      const std::size_t plain = l_.wire_bytes(c, r.cur.sub, p_.quantization);
      const std::size_t payload = on_wire_rx(plain);
      const bool reducing = l_.reducing(r.cur.step);
      const std::size_t g = l_.sub_index(c, r.cur.sub);
      std::uint8_t* iov_base = nullptr;
      std::size_t iov_len = 0;
      if (r.cur.bytes < kRingHeaderBytes) {
        // Read no further than the header until it is checked.
        iov_base = r.header + r.cur.bytes;
        iov_len = kRingHeaderBytes - r.cur.bytes;
      } else {
        // All-gather writes straight into the destination: back it up first.
        if (!reducing && r.cur.bytes == kRingHeaderBytes) touch(g, start, elems);
        // Encrypted: the sealed bytes wait in scratch until they verify.
        std::uint8_t* landing = opens() ? sealed_recv_of(k) : target_of(k, c, start, reducing);
        const std::size_t off = r.cur.bytes - kRingHeaderBytes;
        iov_base = landing + off;
        iov_len = payload - off;
      }
      const ssize_t got = ::read(r.fd, iov_base, iov_len);
      if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::ok();
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("receiving from the previous ring peer: ") + std::strerror(errno));
      }
      if (got == 0) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the previous ring peer closed the connection");
      *progress = true;
      const std::size_t before = r.cur.bytes;
      r.cur.bytes += static_cast<std::size_t>(got);
      if (stats_ != nullptr) stats_->bytes_received += static_cast<std::uint64_t>(got);
      if (before < kRingHeaderBytes && r.cur.bytes == kRingHeaderBytes) {
        Status h = check_header(k);
        if (!h.is_ok()) return h;
        continue;  // the stream count may have changed the buffers: look again
      }
      if (r.cur.bytes == kRingHeaderBytes + payload) {
        std::uint8_t* target = target_of(k, c, start, reducing);
        if (opens() && !r.open->open(std::span<const std::uint8_t>(sealed_recv_of(k), payload),
                                         std::span<const std::uint8_t>(r.header, kRingHeaderBytes), target)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                        "ring sub-chunk " + std::to_string(r.cur.item) + " of stream " + std::to_string(k) +
                            " from the previous peer does not verify (altered on the way, or sent with another key)");
        }
        if (quantized() && !quantized_header_valid(target, p_.dtype, p_.quantization)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "quantized sub-chunk with an impossible header");
        }
        if (!reducing && quantized()) dequantize(target, elems, p_.dtype, p_.quantization, dst_at(c, start));
        if (reducing) reduce_into(k, c, g, start, elems, target, r.cur.step);
        advance(r.cur, false);
        publish(r);
        if (threaded_) {
          progress_.fetch_add(1, std::memory_order_acq_rel);
          progress_.notify_one();
        }
      }
    }
    return Status::ok();
  }

  // Reads the rest of an earlier attempt's commit token (its tag, when sealed: opening
  // it keeps the connection's cipher in step) and makes the stream wait for a header again.
  Status skip_token(RxStream& r, bool* progress) {
    const std::size_t due = kRingHeaderBytes + on_wire_rx(0);
    while (r.cur.bytes < due) {
      const ssize_t got = ::read(r.fd, r.token + (r.cur.bytes - kRingHeaderBytes), due - r.cur.bytes);
      if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::ok();
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("receiving from the previous ring peer: ") + std::strerror(errno));
      }
      if (got == 0) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the previous ring peer closed the connection");
      *progress = true;
      r.cur.bytes += static_cast<std::size_t>(got);  // (not counted: as its sender does not)
    }
    std::uint8_t none[1];
    if (opens() && !r.open->open(std::span<const std::uint8_t>(r.token, security::kTagBytes),
                                     std::span<const std::uint8_t>(r.header, kRingHeaderBytes), none)) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "a commit token from the previous ring peer does not verify");
    }
    r.skipping = false;
    r.cur.bytes = 0;
    return Status::ok();
  }

  // Where a received sub-chunk's payload (decrypted) goes: the stream's staging buffer
  // for a reduce, the destination for the all-gather, or the kept encoded form when quantized.
  std::uint8_t* target_of(std::size_t k, std::size_t c, std::size_t start, bool reducing) {
    if (reducing) return staging_of(k);
    if (quantized()) return s_.encoded_gather.data() + l_.encoded_offset(c, rx_[k].cur.sub);
    return dst_at(c, start);
  }

  void reduce_into(std::size_t k, std::size_t c, std::size_t g, std::size_t start, std::size_t elems,
                   const std::uint8_t* staged, std::size_t step) {
    std::uint8_t* dst = dst_at(c, start);
    const std::uint8_t* src = src_at(start);
    const bool backed = l_.in_destination(c);  // partial sums in scratch need no backup
    if (quantized()) {
      if (backed) touch(g, start, elems);
      if (src != dst) std::memcpy(dst, src, elems * l_.esize());
      dequantize_reduce(dst, staged, elems, p_.dtype, p_.quantization, p_.op);
    } else if (backed && s_.touched[g] == 0) {
      // The reduce takes the backup itself, reading the destination once.
      s_.touched[g] = 1;
      reduce3_saving(dst, s_.backup.data() + l_.dst_offset(start), src, staged, elems, p_.dtype, p_.op);
    } else {
      if (backed) touch(g, start, elems);
      reduce3(dst, src, staged, elems, p_.dtype, p_.op);
    }
    // The last reducing step completes this peer's chunk: finish it here, once, so that
    // the all-gather hands every peer the same bytes.
    if (l_.finalizing(step)) {
      finalize(dst, elems, p_.dtype, p_.op, static_cast<std::uint32_t>(p_.world));
      // A quantized reduce-scatter leaves the decoded form of the chunk's one encoding,
      // as a quantized all-reduce does (the staging buffer is free again).
      if (quantized() && l_.kind() == RingKind::kReduceScatter) {
        quantize(dst, elems, p_.dtype, p_.quantization, p_.distribution, staging_of(k));
        dequantize(staging_of(k), elems, p_.dtype, p_.quantization, dst);
      }
    }
  }

  Status check_header(std::size_t k) {
    RxStream& r = rx_[k];
    auto parsed = parse_ring_header(r.header);
    if (!parsed.is_ok()) return parsed.status();
    const RingHeader& h = parsed.value();
    // What an earlier attempt's commit exchange left on the connection when its outcome
    // came first (run_ring_commit, kSettled): skipped.
    if (k == 0 && h.seq == kRingTokenSeq && h.attempt < p_.attempt && r.cur.item == 0) {
      r.skipping = true;
      // Its header was counted as it came; tokens are left out of the counters, as their
      // sender leaves them out.
      if (stats_ != nullptr) stats_->bytes_received -= kRingHeaderBytes;
      return Status::ok();
    }
    if (h.attempt < p_.attempt && r.cur.item == 0 && io_.rx_replace) {
      auto fresh = io_.rx_replace(k);
      if (!fresh.is_ok()) return fresh.status();
      // (the old connection is closed by now; the new one has the default low-water mark)
      r.fd = fresh.value().fd;
      r.open = fresh.value().aead;
      r.lowat = 1;
      r.cur.bytes = 0;
      set_buffer(r.fd, SO_RCVBUF, p_.rx_buffer_bytes);
      return Status::ok();
    }
    if (h.attempt != p_.attempt) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame of attempt " + std::to_string(h.attempt) +
                                                        " during attempt " + std::to_string(p_.attempt));
    }
    if (h.stream != k) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame of stream " + std::to_string(h.stream) +
                                                        " on the connection of stream " + std::to_string(k));
    }
    const std::size_t known = nrx_.load(std::memory_order_relaxed);
    if (known == 0) {
      Status st = open_streams(h.streams);
      if (!st.is_ok()) return st;
    } else if (h.streams != known) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame announcing " + std::to_string(h.streams) +
                                                        " streams where the attempt began with " + std::to_string(known));
    }
    if (h.seq != static_cast<std::uint32_t>(r.cur.item)) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame out of sequence");
    }
    return Status::ok();
  }

  // The previous peer's first header named its stream count: take the other streams'
  // connections and start their cursors.
  Status open_streams(std::size_t streams) {
    if (streams > 1) {
      if (!io_.rx_more) {
        return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                      "the previous ring peer announced " + std::to_string(streams) + " streams where one is accepted");
      }
      std::vector<RingStream> more;
      Status st = io_.rx_more(streams, &more);
      if (!st.is_ok()) return st;
      if (more.size() != streams - 1) {
        return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the previous ring peer opened " + std::to_string(more.size() + 1) +
                                                          " of the " + std::to_string(streams) + " streams it announced");
      }
      grow_receive_scratch(streams);
      for (std::size_t k = 1; k < streams; ++k) {
        rx_[k].fd = more[k - 1].fd;
        rx_[k].open = more[k - 1].aead;
        start_cursor(rx_[k].cur, k, streams, false);
        publish(rx_[k]);
        set_buffer(rx_[k].fd, SO_RCVBUF, p_.rx_buffer_bytes);
      }
      // Stream 0 is at its first item, the same with any stride.
      rx_[0].cur.stride = streams;
    }
    nrx_.store(streams, std::memory_order_release);
    return Status::ok();
  }

  Status fail(Status st) {
    reset_lowats();
    restore(p_, s_);
    return st;
  }
  Status aborted() { return fail(abort_status()); }

  const RingPlan& p_;
  const RingIo& io_;
  RingScratch& s_;
  RingStats* stats_;
  Layout l_;
  const void* src_;  // this peer's contribution: plan.src, or with error feedback src + residual
  std::array<TxStream, kRingStreamsMax> tx_;
  std::size_t ntx_ = 1;
  std::size_t own_placed_ = 0;  // sub-chunks of the own chunk placed (all-gather)
  std::array<RxStream, kRingStreamsMax> rx_;
  std::atomic<std::size_t> nrx_{0};  // 0 until stream 0's first header names the count
  // Two threads (see start_sender).
  bool threaded_ = false;
  int wake_fd_ = -1;
  std::thread sender_;
  Status send_status_ = Status::ok();
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> progress_{0};  // items received; kStopped once a side stopped
  std::atomic<std::int64_t> last_move_ns_{0};
};

}  // namespace

void put_ring_header(std::uint8_t* out, const RingHeader& h) {
  const std::uint16_t magic = kRingMagic;
  std::memcpy(out, &magic, 2);
  out[2] = h.stream;
  out[3] = h.streams;
  std::memcpy(out + 4, &h.seq, 4);
  std::memcpy(out + 8, &h.attempt, 8);
}

Result<RingHeader> parse_ring_header(const std::uint8_t* in) {
  std::uint16_t magic = 0;
  std::memcpy(&magic, in, 2);
  if (magic != kRingMagic) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame with a bad magic number");
  RingHeader h;
  h.stream = in[2];
  h.streams = in[3];
  std::memcpy(&h.seq, in + 4, 4);
  std::memcpy(&h.attempt, in + 8, 8);
  if (h.streams == 0 || h.streams > kRingStreamsMax) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame announcing " + std::to_string(h.streams) +
                                                      " streams (1 to " + std::to_string(kRingStreamsMax) + ")");
  }
  if (h.stream >= h.streams) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame of stream " + std::to_string(h.stream) + " of " +
                                                      std::to_string(h.streams));
  }
  return h;
}

void tune_same_host(RingPlan& plan, bool previous_peer_on_this_host, bool next_peer_on_this_host) {
  const std::size_t bytes = plan.count * dtype_size(plan.dtype);
  if (plan.spin_us == 0 || bytes >= plan.sender_thread_bytes_min || bytes < kRingSameHostTuningBytesMin) return;
  if (next_peer_on_this_host) plan.tx_buffer_bytes = kRingSameHostSndBufBytes;
  if (previous_peer_on_this_host) {
    plan.rx_buffer_bytes = kRingSameHostRcvBufBytes;
    plan.rx_lowat_bytes = kRingRcvLowatBytes;
  }
}

Status run_ring(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats) {
  if (plan.quantization != LOCKSTEP_QUANT_NONE &&
      (plan.kind == RingKind::kBroadcast || plan.kind == RingKind::kAllGather)) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "broadcast and all-gather copy: they take no quantization");
  }
  if (plan.kind == RingKind::kAllGather && !plan.counts.empty()) {
    std::size_t total = 0;
    for (const std::size_t c : plan.counts) total += c;
    if (plan.counts.size() != plan.world || total != plan.count) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "all-gather counts do not match the world and the output");
    }
  }
  if (plan.kind == RingKind::kReduceScatter && plan.world > 0 && plan.count % plan.world != 0) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "reduce-scatter input is not world x n elements");
  }
  if (plan.kind == RingKind::kBroadcast && plan.root >= plan.world) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "broadcast root outside the world");
  }
  return Runner(plan, io, scratch, stats).run();
}

Result<CommitEnd> run_ring_commit(const RingPlan& plan, const RingIo& io, RingStats* stats) {
  if (plan.world <= 1) return CommitEnd::kCommitted;
  const std::size_t need = plan.world - 1;
  // Each direction sealed where its connection has a cipher (see Runner::seals).
  const bool seals = io.seal != nullptr;
  const bool opens = io.open != nullptr;
  const std::size_t frame = kRingHeaderBytes + (seals ? security::kTagBytes : 0);
  const std::size_t in_frame = kRingHeaderBytes + (opens ? security::kTagBytes : 0);
  // Tokens made (sealing advances the cipher: each is made once) and not yet sent.
  std::vector<std::uint8_t> out;
  std::size_t out_off = 0;
  std::size_t made = 0;
  const auto make = [&](std::size_t upto) {
    while (made < upto) {
      const std::size_t at = out.size();
      out.resize(at + frame);
      put_ring_header(out.data() + at, RingHeader{0, 1, kRingTokenSeq, plan.attempt});
      if (seals) {
        io.seal->seal(std::span<const std::uint8_t>(), std::span<const std::uint8_t>(out.data() + at, kRingHeaderBytes),
                      out.data() + at + kRingHeaderBytes);
      }
      ++made;
    }
  };
  std::uint8_t in[kRingHeaderBytes + security::kTagBytes];
  std::size_t in_len = 0;
  std::size_t received = 0;
  make(1);  // this peer holds the result
  auto last_move = std::chrono::steady_clock::now();
  for (;;) {
    if (io.abort_flag != nullptr && io.abort_flag->load()) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the attempt was aborted");
    }
    const bool settled = io.settled_flag != nullptr && io.settled_flag->load();
    if (settled) make(need);
    bool progress = false;
    while (out_off < out.size()) {
      const ssize_t sent = ::send(io.tx_fd, out.data() + out_off, out.size() - out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, std::string("sending a commit token: ") + std::strerror(errno));
      }
      out_off += static_cast<std::size_t>(sent);
      if (stats != nullptr) stats->bytes_sent += static_cast<std::uint64_t>(sent);
      progress = true;
    }
    if (out_off == out.size()) {
      out.clear();
      out_off = 0;
    }
    if (settled) {
      // The outcome is known: nothing more is waited for. Tokens that cannot leave at once
      // (a send buffer still full of data a cut link has not acknowledged), or one half
      // read, leave the connections out of step: the caller replaces them.
      if (out.empty() && in_len == 0) return CommitEnd::kSettled;
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the outcome came while commit tokens were on their way");
    }
    const bool reading = received < need;
    if (!reading && out.empty()) return CommitEnd::kCommitted;
    if (reading) {
      const ssize_t got = ::read(io.rx_fd, in + in_len, in_frame - in_len);
      if (got == 0) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the previous ring peer closed the connection");
      if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("receiving a commit token: ") + std::strerror(errno));
      }
      if (got > 0) {
        in_len += static_cast<std::size_t>(got);
        if (stats != nullptr) stats->bytes_received += static_cast<std::uint64_t>(got);
        progress = true;
      }
      if (in_len == in_frame) {
        auto h = parse_ring_header(in);
        if (!h.is_ok()) return h.status();
        const bool token = h.value().seq == kRingTokenSeq && h.value().stream == 0;
        // An earlier attempt's token that nothing has read yet (it settled by the master's
        // outcome, and this attempt's data phase read nothing from the previous peer: a
        // broadcast's root, say): opened (keeping the cipher in step) and dropped.
        const bool stale = token && h.value().attempt < plan.attempt;
        if (!token || (!stale && h.value().attempt != plan.attempt)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                        "a ring frame (attempt " + std::to_string(h.value().attempt) + ", stream " +
                            std::to_string(h.value().stream) + ", sequence " + std::to_string(h.value().seq) +
                            ") where a commit token of attempt " + std::to_string(plan.attempt) + " was due");
        }
        std::uint8_t none[1];
        if (opens && !io.open->open(std::span<const std::uint8_t>(in + kRingHeaderBytes, security::kTagBytes),
                                     std::span<const std::uint8_t>(in, kRingHeaderBytes), none)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "a commit token from the previous ring peer does not verify");
        }
        in_len = 0;
        if (!stale) {
          ++received;
          make(std::min(need, received + 1));
        }
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (progress) {
      last_move = now;
      continue;
    }
    int timeout_ms = -1;
    if (io.stall_timeout_ms > 0) {
      const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_move).count();
      if (idle_ms >= io.stall_timeout_ms) {
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "no commit token moved to or from the ring neighbours for " +
                                                                std::to_string(io.stall_timeout_ms) + " ms");
      }
      timeout_ms = static_cast<int>(io.stall_timeout_ms - idle_ms);
    }
    pollfd fds[3];
    nfds_t nfds = 0;
    if (!out.empty()) fds[nfds++] = pollfd{io.tx_fd, POLLOUT, 0};
    if (reading) fds[nfds++] = pollfd{io.rx_fd, POLLIN, 0};
    // Readable once the outcome (settled) or an abort came.
    const bool watch_abort = io.abort_fd >= 0;
    if (watch_abort) fds[nfds++] = pollfd{io.abort_fd, POLLIN, 0};
    if (::poll(fds, nfds, timeout_ms) < 0 && errno != EINTR) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
    if (watch_abort && fds[nfds - 1].revents != 0 && !(io.settled_flag != nullptr && io.settled_flag->load()) &&
        !(io.abort_flag != nullptr && io.abort_flag->load())) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the attempt was aborted");
    }
  }
}

void commit_residual(const RingPlan& plan, const RingScratch& scratch) {
  const std::size_t bytes = plan.count * dtype_size(plan.dtype);
  if (plan.residual != nullptr && scratch.residual_next.size() >= bytes) {
    std::memcpy(plan.residual, scratch.residual_next.data(), bytes);
  }
}

void restore(const RingPlan& plan, RingScratch& scratch) {
  const Layout l(plan);
  if (plan.world == 1) {
    if (!scratch.touched.empty() && scratch.touched[0] != 0) std::memcpy(plan.dst, scratch.backup.data(), plan.count * l.esize());
    scratch.touched.assign(scratch.touched.size(), 0);
    return;
  }
  for (std::size_t c = 0; c < l.chunks(); ++c) {
    for (std::size_t j = 0; j < l.nsub(c); ++j) {
      const std::size_t g = l.sub_index(c, j);
      if (g >= scratch.touched.size() || scratch.touched[g] == 0) continue;
      const std::size_t off = l.dst_offset(l.sub_start(c, j));
      std::memcpy(bytes_of(plan.dst) + off, scratch.backup.data() + off, l.sub_len(c, j) * l.esize());
      scratch.touched[g] = 0;
    }
  }
}

}  // namespace lockstep::coll
