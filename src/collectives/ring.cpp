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
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

namespace lockstep::coll {
namespace {

class Layout {
 public:
  explicit Layout(const RingPlan& p)
      : n_(p.world), i_(p.rank), count_(p.count), esize_(dtype_size(p.dtype)),
        sub_elems_(std::max<std::size_t>(1, p.subchunk_bytes / std::max<std::size_t>(1, dtype_size(p.dtype)))) {
    sub_offset_.resize(n_ + 1, 0);
    for (std::size_t c = 0; c < n_; ++c) sub_offset_[c + 1] = sub_offset_[c] + nsub(c);
  }
  std::size_t steps() const { return 2 * (n_ - 1); }
  std::size_t start(std::size_t c) const { return c * (count_ / n_) + std::min(c, count_ % n_); }
  std::size_t len(std::size_t c) const { return start(c + 1) - start(c); }
  std::size_t nsub(std::size_t c) const { return (len(c) + sub_elems_ - 1) / sub_elems_; }
  std::size_t send_chunk(std::size_t s) const { return (i_ + 2 * n_ - s) % n_; }
  std::size_t recv_chunk(std::size_t s) const { return (i_ + 2 * n_ - s - 1) % n_; }
  // Element offset and length of sub-chunk j of chunk c.
  std::size_t sub_start(std::size_t c, std::size_t j) const { return start(c) + j * sub_elems_; }
  std::size_t sub_len(std::size_t c, std::size_t j) const { return std::min(sub_elems_, len(c) - j * sub_elems_); }
  std::size_t sub_index(std::size_t c, std::size_t j) const { return sub_offset_[c] + j; }
  std::size_t total_subs() const { return sub_offset_[n_]; }
  std::size_t esize() const { return esize_; }
  std::size_t n() const { return n_; }
  // Bytes of sub-chunk j of chunk c on the wire.
  std::size_t wire_bytes(std::size_t c, std::size_t j, lockstep_quantization_t q) const {
    return q == LOCKSTEP_QUANT_NONE ? sub_len(c, j) * esize_ : quantized_bytes(sub_len(c, j), q);
  }
  // Where the encoded form of sub-chunk j of chunk c is kept during the all-gather.
  std::size_t encoded_offset(std::size_t c, std::size_t j) const {
    return (start(c) + j * sub_elems_) + sub_index(c, j) * kQuantHeaderBytes;
  }
  std::size_t encoded_total() const { return count_ + total_subs() * kQuantHeaderBytes; }

 private:
  std::size_t n_, i_, count_, esize_, sub_elems_;
  std::vector<std::size_t> sub_offset_;
};

// Position in the item sequence: step, sub-chunk, and bytes of the item done.
struct Cursor {
  std::size_t step = 0;
  std::size_t sub = 0;
  std::size_t item = 0;  // running item number (the frame's sequence number)
  std::size_t bytes = 0;
};

std::uint8_t* bytes_of(void* p) { return static_cast<std::uint8_t*>(p); }
const std::uint8_t* bytes_of(const void* p) { return static_cast<const std::uint8_t*>(p); }

void put_header(std::uint8_t* h, std::uint32_t seq, std::uint64_t attempt) {
  const std::uint32_t magic = kRingMagic;
  std::memcpy(h, &magic, 4);
  std::memcpy(h + 4, &seq, 4);
  std::memcpy(h + 8, &attempt, 8);
}

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

class Runner {
 public:
  Runner(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats)
      : p_(plan), io_(io), s_(scratch), stats_(stats), l_(plan) {}

  Status run() {
    prepare();
    if (p_.world == 1) return single();
    // Tunings: where the kernel refuses one, the ring runs as it would without it.
    if (p_.tx_buffer_bytes > 0) {
      (void)::setsockopt(io_.tx_fd, SOL_SOCKET, SO_SNDBUF, &p_.tx_buffer_bytes, sizeof p_.tx_buffer_bytes);
    }
    if (p_.rx_buffer_bytes > 0) {
      (void)::setsockopt(io_.rx_fd, SOL_SOCKET, SO_RCVBUF, &p_.rx_buffer_bytes, sizeof p_.rx_buffer_bytes);
    }
    skip_empty(send_, true);
    skip_empty(recv_, false);
    if (p_.count * l_.esize() >= p_.sender_thread_bytes_min && start_sender()) return run_receiver();
    // The clock is read only while nothing moves.
    bool idle = false;
    std::chrono::steady_clock::time_point idle_since{};
    while (send_.step < l_.steps() || recv_.step < l_.steps()) {
      if (io_.abort_flag != nullptr && io_.abort_flag->load(std::memory_order_relaxed)) return aborted();
      bool progress = false;
      Status st = pump_send(&progress);
      if (!st.is_ok()) return fail(st);
      st = pump_recv(&progress);
      if (!st.is_ok()) return fail(st);
      if (progress) {
        idle = false;
        continue;
      }
      int timeout_ms = -1;
      if (io_.stall_timeout_ms > 0) {
        const auto now = std::chrono::steady_clock::now();
        if (!idle) idle_since = now;
        idle = true;
        const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - idle_since).count();
        if (idle_ms >= io_.stall_timeout_ms) {
          return fail(Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                             "no data moved to or from the ring neighbours for " +
                                 std::to_string(io_.stall_timeout_ms) + " ms (a cut link?)"));
        }
        timeout_ms = static_cast<int>(io_.stall_timeout_ms - idle_ms);
      }
      set_lowat(wanted_lowat());
      pollfd fds[3];
      nfds_t nfds = 0;
      if (send_ready()) fds[nfds++] = pollfd{io_.tx_fd, POLLOUT, 0};
      if (recv_.step < l_.steps()) fds[nfds++] = pollfd{io_.rx_fd, POLLIN, 0};
      fds[nfds++] = pollfd{io_.abort_fd, POLLIN, 0};
      if (poll_spinning(fds, nfds, timeout_ms, p_.spin_us) < 0 && errno != EINTR) {
        return fail(Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll"));
      }
      if (fds[nfds - 1].revents != 0) return aborted();
    }
    set_lowat(1);
    return Status::ok();
  }

  // The receive low-water mark for the next poll: RingPlan::rx_lowat_bytes, but never
  // more than the bytes of the current sub-chunk still due (beyond them the previous
  // peer may send nothing until this one has sent it more). 1: none.
  std::size_t wanted_lowat() const {
    if (p_.rx_lowat_bytes == 0 || recv_.step >= l_.steps()) return 1;
    const std::size_t c = l_.recv_chunk(recv_.step);
    const std::size_t due = kRingHeaderBytes + on_wire(l_.wire_bytes(c, recv_.sub, p_.quantization)) - recv_.bytes;
    return std::max<std::size_t>(1, std::min(p_.rx_lowat_bytes, due));
  }
  void set_lowat(std::size_t bytes) {
    if (bytes == lowat_) return;
    const int value = static_cast<int>(bytes);
    if (::setsockopt(io_.rx_fd, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof value) == 0) lowat_ = bytes;
  }

  // ---------------------------------------------------------------- two threads
  // A second thread runs pump_send while this one runs pump_recv: on a machine where
  // the peers share few cores, a peer then holds a fair share of the CPU while its
  // neighbours compete for it, and sending goes on while a sub-chunk is reduced. The
  // sender learns how far the receiver got from recv_pos_ (release/acquire orders the
  // reduced bytes before the send that reads them); wake_fd_ stops whichever side is
  // still waiting when the other fails. The destination is restored only after the
  // sender has been joined.

  static std::uint64_t pack(std::size_t step, std::size_t sub) {
    return (static_cast<std::uint64_t>(step) << 32) | static_cast<std::uint64_t>(sub);
  }
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
    recv_pos_.fetch_or(std::uint64_t{1} << 63, std::memory_order_acq_rel);  // a waiting sender wakes
    recv_pos_.notify_all();
    const std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }

  // False (and one thread does it all) when no thread or descriptor can be had.
  bool start_sender() {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return false;
    threaded_ = true;
    recv_pos_.store(pack(recv_.step, recv_.sub), std::memory_order_release);
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
    return Status::ok();
  }

  Status send_loop() {
    while (send_.step < l_.steps()) {
      if (stop_.load(std::memory_order_acquire)) return Status::ok();  // the receiver's status counts
      if (abort_requested()) return abort_status();
      const std::uint64_t seen = recv_pos_.load(std::memory_order_acquire);
      if (!send_ready()) {
        recv_pos_.wait(seen, std::memory_order_acquire);
        continue;
      }
      bool progress = false;
      Status st = pump_send(&progress);
      if (!st.is_ok()) return st;
      if (progress) {
        last_move_ns_.store(now_ns(), std::memory_order_relaxed);
        continue;
      }
      if (!send_ready()) continue;
      const int timeout_ms = stall_left_ms();
      if (timeout_ms == 0) return stalled();
      pollfd fds[3] = {{io_.tx_fd, POLLOUT, 0}, {io_.abort_fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      if (::poll(fds, 3, timeout_ms) < 0 && errno != EINTR) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
      if (fds[1].revents != 0) return abort_status();
    }
    return Status::ok();
  }

  Status recv_loop() {
    while (recv_.step < l_.steps()) {
      if (stop_.load(std::memory_order_acquire)) return Status::ok();  // the sender's status counts
      if (abort_requested()) return abort_status();
      bool progress = false;
      Status st = pump_recv(&progress);
      if (!st.is_ok()) return st;
      if (progress) {
        last_move_ns_.store(now_ns(), std::memory_order_relaxed);
        continue;
      }
      const int timeout_ms = stall_left_ms();
      if (timeout_ms == 0) return stalled();
      pollfd fds[3] = {{io_.rx_fd, POLLIN, 0}, {io_.abort_fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      if (::poll(fds, 3, timeout_ms) < 0 && errno != EINTR) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
      if (fds[1].revents != 0) return abort_status();
    }
    return Status::ok();
  }

 private:
  void prepare() {
    const std::size_t total = p_.count * l_.esize();
    if (s_.backup.size() < total) s_.backup.resize(total);
    s_.touched.assign(l_.total_subs() + 1, 0);
    const std::size_t staging =
        std::min(total, std::max<std::size_t>(p_.subchunk_bytes, l_.esize())) + kQuantHeaderBytes;
    if (s_.staging.size() < staging) s_.staging.resize(staging);
    if (quantized()) {
      if (s_.encoded_send.size() < staging) s_.encoded_send.resize(staging);
      if (s_.encoded_gather.size() < l_.encoded_total()) s_.encoded_gather.resize(l_.encoded_total());
    }
    if (encrypted()) {
      if (s_.sealed_send.size() < staging + security::kTagBytes) s_.sealed_send.resize(staging + security::kTagBytes);
      if (s_.sealed_recv.size() < staging + security::kTagBytes) s_.sealed_recv.resize(staging + security::kTagBytes);
    }
  }

  // Backs up destination elements [start, start+len) of sub-chunk g before the first write.
  void touch(std::size_t g, std::size_t start, std::size_t len) {
    if (s_.touched[g] != 0) return;
    s_.touched[g] = 1;
    std::memcpy(s_.backup.data() + start * l_.esize(), bytes_of(p_.dst) + start * l_.esize(), len * l_.esize());
  }

  Status single() {
    if (p_.src != p_.dst) {
      touch(0, 0, p_.count);
      std::memcpy(p_.dst, p_.src, p_.count * l_.esize());
    }
    return Status::ok();  // a world of one: sum, max, ... and avg over one peer are the input
  }

  bool quantized() const { return p_.quantization != LOCKSTEP_QUANT_NONE; }
  bool encrypted() const { return io_.seal != nullptr && io_.open != nullptr; }
  // Bytes after the header: the payload, and its tag when encrypted.
  std::size_t on_wire(std::size_t payload) const { return payload + (encrypted() ? security::kTagBytes : 0); }

  // The bytes of a send item. Quantized: reduce-scatter encodes the partial sum; the
  // first all-gather step encodes this peer's final chunk and replaces its own copy
  // with the decoded form; later steps forward what was received, unchanged.
  const std::uint8_t* send_data(std::size_t c, std::size_t start) {
    const std::uint8_t* raw = (send_.step == 0 ? bytes_of(p_.src) : bytes_of(p_.dst)) + start * l_.esize();
    if (!quantized()) return raw;
    const std::size_t elems = l_.sub_len(c, send_.sub);
    if (send_.step + 1 < l_.n()) {
      quantize(raw, elems, p_.dtype, p_.quantization, s_.encoded_send.data());
      return s_.encoded_send.data();
    }
    std::uint8_t* kept = s_.encoded_gather.data() + l_.encoded_offset(c, send_.sub);
    if (send_.step + 1 == l_.n()) {
      quantize(raw, elems, p_.dtype, p_.quantization, kept);
      touch(l_.sub_index(c, send_.sub), start, elems);
      dequantize(kept, elems, p_.dtype, p_.quantization, bytes_of(p_.dst) + start * l_.esize());
    }
    return kept;
  }

  void skip_empty(Cursor& c, bool sending) {
    while (c.step < l_.steps() && c.sub >= l_.nsub(sending ? l_.send_chunk(c.step) : l_.recv_chunk(c.step))) {
      ++c.step;
      c.sub = 0;
    }
  }

  void advance(Cursor& c, bool sending) {
    ++c.sub;
    ++c.item;
    c.bytes = 0;
    skip_empty(c, sending);
  }

  bool send_ready() const {
    if (send_.step >= l_.steps()) return false;
    if (send_.step == 0) return true;
    // The receive of this sub-chunk at the previous step must be complete.
    if (threaded_) {
      const std::uint64_t received = recv_pos_.load(std::memory_order_acquire);
      return received >> 63 == 0 && received > pack(send_.step - 1, send_.sub);  // bit 63: stopped
    }
    return recv_.step > send_.step - 1 || (recv_.step == send_.step - 1 && recv_.sub > send_.sub);
  }

  Status pump_send(bool* progress) {
    while (send_ready()) {
      const std::size_t c = l_.send_chunk(send_.step);
      const std::size_t start = l_.sub_start(c, send_.sub);
      const std::size_t plain = l_.wire_bytes(c, send_.sub, p_.quantization);
      const std::size_t payload = on_wire(plain);
      // Step 0 sends this peer's own input; later steps send what was reduced or received.
      if (send_.bytes == 0) {
        put_header(send_header_, static_cast<std::uint32_t>(send_.item), p_.attempt);
        send_source_ = send_data(c, start);
        if (encrypted()) {
          io_.seal->seal(std::span<const std::uint8_t>(send_source_, plain),
                         std::span<const std::uint8_t>(send_header_, kRingHeaderBytes), s_.sealed_send.data());
          send_source_ = s_.sealed_send.data();
        }
      }
      const std::uint8_t* data = send_source_;
      iovec iov[2];
      int n = 0;
      if (send_.bytes < kRingHeaderBytes) {
        iov[n++] = iovec{send_header_ + send_.bytes, kRingHeaderBytes - send_.bytes};
        iov[n++] = iovec{const_cast<std::uint8_t*>(data), payload};
      } else {
        const std::size_t off = send_.bytes - kRingHeaderBytes;
        iov[n++] = iovec{const_cast<std::uint8_t*>(data) + off, payload - off};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t sent = ::sendmsg(io_.tx_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::ok();
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("sending to the next ring peer: ") + std::strerror(errno));
      }
      *progress = true;
      send_.bytes += static_cast<std::size_t>(sent);
      if (stats_ != nullptr) stats_->bytes_sent += static_cast<std::uint64_t>(sent);
      if (send_.bytes == kRingHeaderBytes + payload) advance(send_, true);
    }
    return Status::ok();
  }

  Status pump_recv(bool* progress) {
    while (recv_.step < l_.steps()) {
      const std::size_t c = l_.recv_chunk(recv_.step);
      const std::size_t start = l_.sub_start(c, recv_.sub);
      const std::size_t elems = l_.sub_len(c, recv_.sub);
      const std::size_t plain = l_.wire_bytes(c, recv_.sub, p_.quantization);
      const std::size_t payload = on_wire(plain);
      const bool reducing = recv_.step < l_.n() - 1;
      const std::size_t g = l_.sub_index(c, recv_.sub);
      // All-gather writes straight into the destination: back it up first.
      if (!reducing && recv_.bytes == 0) touch(g, start, elems);
      std::uint8_t* target = reducing ? s_.staging.data() : bytes_of(p_.dst) + start * l_.esize();
      if (quantized() && !reducing) target = s_.encoded_gather.data() + l_.encoded_offset(c, recv_.sub);
      // Encrypted: the sealed bytes wait in scratch until they verify.
      std::uint8_t* landing = encrypted() ? s_.sealed_recv.data() : target;
      iovec iov[2];
      int n = 0;
      if (recv_.bytes < kRingHeaderBytes) {
        iov[n++] = iovec{recv_header_ + recv_.bytes, kRingHeaderBytes - recv_.bytes};
        // Read no further than the header until it is checked.
      } else {
        const std::size_t off = recv_.bytes - kRingHeaderBytes;
        iov[n++] = iovec{landing + off, payload - off};
      }
      const ssize_t got = ::readv(io_.rx_fd, iov, n);
      if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Status::ok();
        return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                      std::string("receiving from the previous ring peer: ") + std::strerror(errno));
      }
      if (got == 0) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the previous ring peer closed the connection");
      *progress = true;
      const std::size_t before = recv_.bytes;
      recv_.bytes += static_cast<std::size_t>(got);
      if (stats_ != nullptr) stats_->bytes_received += static_cast<std::uint64_t>(got);
      if (before < kRingHeaderBytes && recv_.bytes == kRingHeaderBytes) {
        Status h = check_header();
        if (!h.is_ok()) return h;
      }
      if (recv_.bytes == kRingHeaderBytes + payload) {
        if (encrypted() && !io_.open->open(std::span<const std::uint8_t>(landing, payload),
                                           std::span<const std::uint8_t>(recv_header_, kRingHeaderBytes), target)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                        "ring sub-chunk " + std::to_string(recv_.item) +
                            " from the previous peer does not verify (altered on the way, or sent with another key)");
        }
        if (quantized() && !quantized_header_valid(target, p_.dtype, p_.quantization)) {
          return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "quantized sub-chunk with an impossible header");
        }
        if (!reducing && quantized()) {
          dequantize(target, elems, p_.dtype, p_.quantization, bytes_of(p_.dst) + start * l_.esize());
        }
        if (reducing) {
          std::uint8_t* dst = bytes_of(p_.dst) + start * l_.esize();
          const std::uint8_t* src = bytes_of(p_.src) + start * l_.esize();
          if (quantized()) {
            touch(g, start, elems);
            if (src != dst) std::memcpy(dst, src, elems * l_.esize());
            dequantize_reduce(dst, s_.staging.data(), elems, p_.dtype, p_.quantization, p_.op);
          } else if (s_.touched[g] == 0) {
            // The reduce takes the backup itself, reading the destination once.
            s_.touched[g] = 1;
            reduce3_saving(dst, s_.backup.data() + start * l_.esize(), src, s_.staging.data(), elems, p_.dtype,
                           p_.op);
          } else {
            touch(g, start, elems);
            reduce3(dst, src, s_.staging.data(), elems, p_.dtype, p_.op);
          }
          // The last reduce-scatter step completes this peer's chunk: finish it here,
          // once, so that the all-gather hands every peer the same bytes.
          if (recv_.step == l_.n() - 2) finalize(dst, elems, p_.dtype, p_.op, static_cast<std::uint32_t>(p_.world));
        }
        advance(recv_, false);
        if (threaded_) {
          recv_pos_.store(pack(recv_.step, recv_.sub), std::memory_order_release);
          recv_pos_.notify_one();
        }
      }
    }
    return Status::ok();
  }

  Status check_header() const {
    std::uint32_t magic = 0;
    std::uint32_t seq = 0;
    std::uint64_t attempt = 0;
    std::memcpy(&magic, recv_header_, 4);
    std::memcpy(&seq, recv_header_ + 4, 4);
    std::memcpy(&attempt, recv_header_ + 8, 8);
    if (magic != kRingMagic) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame with a bad magic number");
    if (attempt != p_.attempt) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame of attempt " + std::to_string(attempt) +
                                                        " during attempt " + std::to_string(p_.attempt));
    }
    if (seq != static_cast<std::uint32_t>(recv_.item)) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "ring frame out of sequence");
    }
    return Status::ok();
  }

  Status fail(Status st) {
    set_lowat(1);
    restore(p_, s_);
    return st;
  }
  Status aborted() { return fail(Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "the attempt was aborted")); }

  const RingPlan& p_;
  const RingIo& io_;
  RingScratch& s_;
  RingStats* stats_;
  Layout l_;
  Cursor send_;
  Cursor recv_;
  const std::uint8_t* send_source_ = nullptr;
  std::size_t lowat_ = 1;  // the receive socket's low-water mark, as this attempt set it
  // Two threads (see start_sender).
  bool threaded_ = false;
  int wake_fd_ = -1;
  std::thread sender_;
  Status send_status_ = Status::ok();
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> recv_pos_{0};  // pack(recv_.step, recv_.sub), published by the receiver
  std::atomic<std::int64_t> last_move_ns_{0};
  std::uint8_t send_header_[kRingHeaderBytes] = {};
  std::uint8_t recv_header_[kRingHeaderBytes] = {};
};

}  // namespace

void tune_same_host(RingPlan& plan, bool previous_peer_on_this_host, bool next_peer_on_this_host) {
  const std::size_t bytes = plan.count * dtype_size(plan.dtype);
  if (plan.spin_us == 0 || bytes >= plan.sender_thread_bytes_min || bytes < kRingSameHostTuningBytesMin) return;
  if (next_peer_on_this_host) plan.tx_buffer_bytes = kRingSameHostSndBufBytes;
  if (previous_peer_on_this_host) {
    plan.rx_buffer_bytes = kRingSameHostRcvBufBytes;
    plan.rx_lowat_bytes = kRingRcvLowatBytes;
  }
}

Status run_ring_all_reduce(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats) {
  return Runner(plan, io, scratch, stats).run();
}

void restore(const RingPlan& plan, RingScratch& scratch) {
  const Layout l(plan);
  if (plan.world == 1) {
    if (!scratch.touched.empty() && scratch.touched[0] != 0) std::memcpy(plan.dst, scratch.backup.data(), plan.count * l.esize());
    scratch.touched.assign(scratch.touched.size(), 0);
    return;
  }
  for (std::size_t c = 0; c < plan.world; ++c) {
    for (std::size_t j = 0; j < l.nsub(c); ++j) {
      const std::size_t g = l.sub_index(c, j);
      if (g >= scratch.touched.size() || scratch.touched[g] == 0) continue;
      const std::size_t off = l.sub_start(c, j) * l.esize();
      std::memcpy(bytes_of(plan.dst) + off, scratch.backup.data() + off, l.sub_len(c, j) * l.esize());
      scratch.touched[g] = 0;
    }
  }
}

}  // namespace lockstep::coll
