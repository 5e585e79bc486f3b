// lockstep._torch: the `torch.distributed` backend "lockstep" (docs/torch.md).
//
// A ProcessGroupLockstep runs torch's collectives over a lockstep communicator that the
// Python side (lockstep/torch.py) created, connected and keeps alive. The communicator
// belongs to the thread that created it; this process group launches and awaits every
// collective on a thread of its own, the one other thread the C API allows, so that a
// Work completes (and its future's callbacks run) whichever thread waits for it. Ops are
// launched in the order torch issues them (the same on every rank: torch's rule), each
// with the next tag of this process group, and awaited oldest first.
//
// Ranks: torch's rank r is the lockstep view's rank view_rank[r] (a fixed-size job keeps
// the ranks its launcher gave; lockstep orders its ring by itself). Results are put in
// torch's rank order. A process group belongs to the membership view it was made in:
// once the view changed (update or optimize topology), every call raises VIEW_CHANGED.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/lockstep.h"

namespace py = pybind11;

namespace {

// A failed call with lockstep's status; the translator below raises the lockstep
// package's exception class for it (lockstep.PeerConnectionLostError, ...).
struct StatusError : std::runtime_error {
  StatusError(int s, const std::string& message) : std::runtime_error(message), status(s) {}
  int status;
};

[[noreturn]] void fail(int status, const std::string& why) {
  throw StatusError(status, std::string(lockstep_status_name(static_cast<lockstep_status_t>(status))) + ": " + why);
}

// Tags of this backend's collectives: the top bit set, so that they never meet the tags an
// application gives its own collectives on the same communicator (docs/torch.md).
constexpr std::uint64_t kTagBase = std::uint64_t{1} << 63;

bool to_dtype(at::ScalarType t, lockstep_dtype_t* out) {
  switch (t) {
    case at::kByte: *out = LOCKSTEP_U8; return true;
    case at::kChar: *out = LOCKSTEP_I8; return true;
    case at::kShort: *out = LOCKSTEP_I16; return true;
    case at::kInt: *out = LOCKSTEP_I32; return true;
    case at::kLong: *out = LOCKSTEP_I64; return true;
    case at::kHalf: *out = LOCKSTEP_F16; return true;
    case at::kBFloat16: *out = LOCKSTEP_BF16; return true;
    case at::kFloat: *out = LOCKSTEP_F32; return true;
    case at::kDouble: *out = LOCKSTEP_F64; return true;
    default: return false;
  }
}

bool to_op(const c10d::ReduceOp& op, lockstep_reduce_op_t* out) {
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM: *out = LOCKSTEP_SUM; return true;
    case c10d::ReduceOp::AVG: *out = LOCKSTEP_AVG; return true;
    case c10d::ReduceOp::PRODUCT: *out = LOCKSTEP_PROD; return true;
    case c10d::ReduceOp::MIN: *out = LOCKSTEP_MIN; return true;
    case c10d::ReduceOp::MAX: *out = LOCKSTEP_MAX; return true;
    default: return false;
  }
}

// The checks every tensor argument gets; an empty string when it is usable.
std::string unusable(const at::Tensor& t, const char* what) {
  lockstep_dtype_t d;
  if (!t.defined()) return std::string(what) + " is undefined";
  if (!t.device().is_cpu()) return std::string(what) + " is on " + t.device().str() + ": lockstep reduces CPU tensors";
  if (t.is_sparse()) return std::string(what) + " is sparse";
  if (!t.is_contiguous()) return std::string(what) + " is not contiguous (call .contiguous() first)";
  if (t.requires_grad()) return std::string(what) + " requires grad (use tensor.detach() or torch.no_grad())";
  if (!to_dtype(t.scalar_type(), &d)) {
    return std::string(what) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
           ", which lockstep does not reduce (uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)";
  }
  return std::string();
}

class WorkLockstep : public c10d::Work {
 public:
  WorkLockstep(c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(-1, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // Called once, on the process group's thread.
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) future_->setError(error);
    else future_->markCompleted(c10::IValue(outputs_));
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// One collective as the process group's thread runs it: `launch` starts it (with the
// tag given) and `after` moves its result into torch's order once it succeeded.
struct Op {
  std::function<lockstep_status_t(std::uint64_t tag, lockstep_async_t** handle)> launch;
  std::function<void()> after;
  c10::intrusive_ptr<WorkLockstep> work;
  std::string invalid;               // a local argument error: the peers are told by a mismatched vote
  bool whole_group = false;          // an all-reduce: the survivors of a lost peer finish it without it
  std::vector<at::Tensor> keepalive;  // every buffer the C call reads or writes
};

class ProcessGroupLockstep : public c10d::ProcessGroup {
 public:
  // comm: a connected, accepted communicator, owned elsewhere and alive until shutdown();
  // view_rank: for each torch rank, its rank in the lockstep view; view_ids: the view's
  // member ids in rank order (hex), to tell when it changed.
  ProcessGroupLockstep(std::uintptr_t comm, int rank, int size, std::vector<int> view_rank,
                       std::vector<std::string> view_ids)
      : c10d::ProcessGroup(rank, size),
        comm_(reinterpret_cast<lockstep_comm_t*>(comm)),
        view_rank_(std::move(view_rank)),
        view_ids_(std::move(view_ids)) {
    if (comm_ == nullptr) fail(LOCKSTEP_STATUS_INVALID_ARGUMENT, "null communicator");
    if (size < 1 || static_cast<int>(view_rank_.size()) != size || static_cast<int>(view_ids_.size()) != size) {
      fail(LOCKSTEP_STATUS_INVALID_ARGUMENT, "the rank map must have one entry per rank");
    }
    torch_rank_.assign(static_cast<std::size_t>(size), -1);
    for (int r = 0; r < size; ++r) {
      const int v = view_of(r);
      if (v < 0 || v >= size || torch_of(v) != -1) fail(LOCKSTEP_STATUS_INVALID_ARGUMENT, "the rank map is not a permutation");
      torch_rank_[static_cast<std::size_t>(v)] = r;
    }
    identity_ = true;
    for (int r = 0; r < size; ++r) identity_ = identity_ && view_of(r) == r;
    thread_ = std::thread([this] { run(); });
  }

  ~ProcessGroupLockstep() override { shutdown(); }

  const std::string getBackendName() const override { return "lockstep"; }

  // Ends the thread after the ops already queued; later calls fail. Idempotent.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  std::uint64_t ops_started() const { return next_seq_.load(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto op = make_op(c10d::OpType::ALLREDUCE, tensors);
    lockstep_reduce_op_t rop = LOCKSTEP_SUM;
    if (op->invalid.empty() && tensors.size() != 1) op->invalid = "lockstep takes one tensor per call (got " + std::to_string(tensors.size()) + ")";
    if (op->invalid.empty()) op->invalid = unusable(tensors[0], "the tensor");
    if (op->invalid.empty() && !to_op(opts.reduceOp, &rop)) op->invalid = "reduce op not supported (SUM, AVG, PRODUCT, MIN, MAX are)";
    if (op->invalid.empty()) {
      at::Tensor t = tensors[0];
      lockstep_dtype_t dt;
      to_dtype(t.scalar_type(), &dt);
      op->whole_group = true;
      op->launch = [this, t, dt, rop](std::uint64_t tag, lockstep_async_t** h) {
        lockstep_reduce_desc_t d;
        std::memset(&d, 0, sizeof d);
        d.src = t.data_ptr();
        d.dst = t.data_ptr();
        d.count = static_cast<std::uint64_t>(t.numel());
        d.dtype = dt;
        d.op = rop;
        d.quantization = LOCKSTEP_QUANT_NONE;
        d.tag = tag;
        return lockstep_comm_all_reduce_async(comm_, &d, h);
      };
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto op = make_op(c10d::OpType::BROADCAST, tensors);
    if (tensors.size() != 1) op->invalid = "lockstep takes one tensor per call (got " + std::to_string(tensors.size()) + ")";
    if (op->invalid.empty()) op->invalid = unusable(tensors[0], "the tensor");
    if (op->invalid.empty() && (opts.rootRank < 0 || opts.rootRank >= size_)) op->invalid = "root rank " + std::to_string(opts.rootRank) + " is outside the group";
    if (op->invalid.empty()) {
      at::Tensor t = tensors[0];
      lockstep_dtype_t dt;
      to_dtype(t.scalar_type(), &dt);
      const std::uint32_t root = static_cast<std::uint32_t>(view_of(static_cast<int>(opts.rootRank)));
      op->launch = [this, t, dt, root](std::uint64_t tag, lockstep_async_t** h) {
        lockstep_broadcast_desc_t d;
        std::memset(&d, 0, sizeof d);
        d.buf = t.data_ptr();
        d.count = static_cast<std::uint64_t>(t.numel());
        d.dtype = dt;
        d.root = root;
        d.tag = tag;
        return lockstep_comm_broadcast_async(comm_, &d, h);
      };
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override {
    std::vector<at::Tensor> outs = outputs.size() == 1 ? outputs[0] : std::vector<at::Tensor>{};
    auto op = make_op(c10d::OpType::ALLGATHER, outs);
    if (inputs.size() != 1 || outputs.size() != 1) op->invalid = "lockstep takes one input tensor and one output list per call";
    if (op->invalid.empty()) op->invalid = unusable(inputs[0], "the input");
    if (op->invalid.empty() && static_cast<int>(outs.size()) != size_) op->invalid = "the output list needs one tensor per rank (" + std::to_string(size_) + ")";
    for (std::size_t i = 0; op->invalid.empty() && i < outs.size(); ++i) {
      op->invalid = unusable(outs[i], "an output");
      if (op->invalid.empty() && (outs[i].numel() != inputs[0].numel() || outs[i].scalar_type() != inputs[0].scalar_type())) {
        op->invalid = "output " + std::to_string(i) + " differs from the input in size or dtype";
      }
    }
    if (op->invalid.empty()) {
      at::Tensor in = inputs[0];
      at::Tensor flat = at::empty({static_cast<std::int64_t>(size_) * in.numel()}, in.options());
      gather_into(op.get(), in, flat);
      op->after = [this, flat, outs] {
        const std::int64_t n = outs.empty() ? 0 : outs[0].numel();
        for (int r = 0; r < size_; ++r) outs[static_cast<std::size_t>(r)].view({-1}).copy_(flat.narrow(0, view_of(r) * n, n));
      };
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    auto op = make_op(c10d::OpType::_ALLGATHER_BASE, {output});
    op->invalid = unusable(input, "the input");
    if (op->invalid.empty()) op->invalid = unusable(output, "the output");
    if (op->invalid.empty() && (output.numel() != size_ * input.numel() || output.scalar_type() != input.scalar_type())) {
      op->invalid = "the output must hold world size x the input's elements, of the input's dtype";
    }
    if (op->invalid.empty()) {
      at::Tensor in = input, out = output;
      if (identity_) {
        gather_into(op.get(), in, out.view({-1}));
      } else {
        at::Tensor flat = at::empty_like(out.view({-1}));
        gather_into(op.get(), in, flat);
        op->after = [this, flat, out, in] {
          const std::int64_t n = in.numel();
          auto o = out.view({-1});
          for (int r = 0; r < size_; ++r) o.narrow(0, r * n, n).copy_(flat.narrow(0, view_of(r) * n, n));
        };
      }
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto op = make_op(c10d::OpType::REDUCE_SCATTER, outputs);
    lockstep_reduce_op_t rop = LOCKSTEP_SUM;
    if (outputs.size() != 1 || inputs.size() != 1) op->invalid = "lockstep takes one output tensor and one input list per call";
    if (op->invalid.empty()) op->invalid = unusable(outputs[0], "the output");
    if (op->invalid.empty() && static_cast<int>(inputs[0].size()) != size_) op->invalid = "the input list needs one tensor per rank (" + std::to_string(size_) + ")";
    for (std::size_t i = 0; op->invalid.empty() && i < inputs[0].size(); ++i) {
      op->invalid = unusable(inputs[0][i], "an input");
      if (op->invalid.empty() && (inputs[0][i].numel() != outputs[0].numel() || inputs[0][i].scalar_type() != outputs[0].scalar_type())) {
        op->invalid = "input " + std::to_string(i) + " differs from the output in size or dtype";
      }
    }
    if (op->invalid.empty() && !to_op(opts.reduceOp, &rop)) op->invalid = "reduce op not supported (SUM, AVG, PRODUCT, MIN, MAX are)";
    if (op->invalid.empty()) {
      at::Tensor out = outputs[0];
      const std::int64_t n = out.numel();
      at::Tensor flat = at::empty({static_cast<std::int64_t>(size_) * n}, out.options());
      // Rank v of the view reduces the v-th block: the block meant for torch rank torch_rank_[v].
      for (int v = 0; v < size_; ++v) flat.narrow(0, v * n, n).copy_(inputs[0][static_cast<std::size_t>(torch_of(v))].view({-1}));
      scatter_from(op.get(), flat, out, rop);
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto op = make_op(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
    lockstep_reduce_op_t rop = LOCKSTEP_SUM;
    op->invalid = unusable(input, "the input");
    if (op->invalid.empty()) op->invalid = unusable(output, "the output");
    if (op->invalid.empty() && (input.numel() != size_ * output.numel() || output.scalar_type() != input.scalar_type())) {
      op->invalid = "the input must hold world size x the output's elements, of the output's dtype";
    }
    if (op->invalid.empty() && !to_op(opts.reduceOp, &rop)) op->invalid = "reduce op not supported (SUM, AVG, PRODUCT, MIN, MAX are)";
    if (op->invalid.empty()) {
      at::Tensor src = input.view({-1});
      if (!identity_) {
        const std::int64_t n = output.numel();
        at::Tensor flat = at::empty_like(src);
        for (int v = 0; v < size_; ++v) flat.narrow(0, v * n, n).copy_(src.narrow(0, torch_of(v) * n, n));
        src = flat;
      }
      scatter_from(op.get(), src, output, rop);
    }
    return enqueue(std::move(op));
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    auto op = make_op(c10d::OpType::BARRIER, {});
    op->launch = [this](std::uint64_t tag, lockstep_async_t** h) { return lockstep_comm_barrier_async(comm_, tag, h); };
    return enqueue(std::move(op));
  }

 private:
  int view_of(int torch_rank) const { return view_rank_[static_cast<std::size_t>(torch_rank)]; }
  int torch_of(int view_rank) const { return torch_rank_[static_cast<std::size_t>(view_rank)]; }

  std::unique_ptr<Op> make_op(c10d::OpType type, std::vector<at::Tensor> outputs) {
    auto op = std::make_unique<Op>();
    op->keepalive = outputs;
    op->work = c10::make_intrusive<WorkLockstep>(type, std::move(outputs));
    return op;
  }

  void gather_into(Op* op, const at::Tensor& in, const at::Tensor& flat) {
    lockstep_dtype_t dt;
    to_dtype(in.scalar_type(), &dt);
    op->keepalive.push_back(in);
    op->keepalive.push_back(flat);
    op->launch = [this, in, flat, dt](std::uint64_t tag, lockstep_async_t** h) {
      lockstep_all_gather_desc_t d;
      std::memset(&d, 0, sizeof d);
      d.src = in.data_ptr();
      d.count = static_cast<std::uint64_t>(in.numel());
      d.dst = flat.data_ptr();
      d.dst_capacity = static_cast<std::uint64_t>(flat.numel());
      d.dtype = dt;
      d.tag = tag;
      return lockstep_comm_all_gather_async(comm_, &d, h);
    };
  }

  void scatter_from(Op* op, const at::Tensor& flat, const at::Tensor& out, lockstep_reduce_op_t rop) {
    lockstep_dtype_t dt;
    to_dtype(out.scalar_type(), &dt);
    op->keepalive.push_back(flat);
    op->keepalive.push_back(out);
    op->launch = [this, flat, out, dt, rop](std::uint64_t tag, lockstep_async_t** h) {
      lockstep_reduce_scatter_desc_t d;
      std::memset(&d, 0, sizeof d);
      d.src = flat.data_ptr();
      d.dst = out.data_ptr();
      d.count_per_rank = static_cast<std::uint64_t>(out.numel());
      d.dtype = dt;
      d.op = rop;
      d.quantization = LOCKSTEP_QUANT_NONE;
      d.tag = tag;
      return lockstep_comm_reduce_scatter_async(comm_, &d, h);
    };
  }

  c10::intrusive_ptr<c10d::Work> enqueue(std::unique_ptr<Op> op) {
    auto work = op->work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) {
        work->complete(std::make_exception_ptr(StatusError(LOCKSTEP_STATUS_INVALID_USAGE,
                                                           "INVALID_USAGE: this process group was shut down")));
        return work;
      }
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
    return work;
  }

  // The view this group was made in, compared with the communicator's (member ids in
  // rank order); an empty string while it is the same.
  std::string view_changed() {
    std::vector<lockstep_member_t> members(view_ids_.size() + 8);
    std::size_t count = 0;
    lockstep_status_t s = lockstep_comm_get_membership(comm_, members.data(), members.size(), &count);
    if (s != LOCKSTEP_OK) return std::string();  // too many members: changed; other errors surface from the call
    bool same = count == view_ids_.size();
    static const char* hex = "0123456789abcdef";
    for (std::size_t i = 0; same && i < count; ++i) {
      std::string id;
      for (std::uint8_t b : members[i].id) {
        id.push_back(hex[b >> 4]);
        id.push_back(hex[b & 15]);
      }
      same = id == view_ids_[i];
    }
    if (same) return std::string();
    return "the membership view changed after this process group was made (" + std::to_string(view_ids_.size()) +
           " ranks, now " + std::to_string(count) + "): call lockstep.torch.reconfigure() for the new group";
  }

  void start(std::unique_ptr<Op> op, std::deque<std::pair<std::unique_ptr<Op>, lockstep_async_t*>>* in_flight) {
    const std::uint64_t tag = kTagBase | next_seq_++;
    std::string changed = view_changed();
    if (!changed.empty()) {
      op->work->complete(std::make_exception_ptr(StatusError(LOCKSTEP_STATUS_VIEW_CHANGED, "VIEW_CHANGED: " + changed)));
      return;
    }
    lockstep_async_t* handle = nullptr;
    lockstep_status_t s;
    if (!op->invalid.empty()) {
      // This rank cannot take part: it enters a barrier of the same tag, so that every
      // peer's vote sees a mismatched operation and fails at once (OPERATION_MISMATCH)
      // instead of waiting for this rank.
      s = lockstep_comm_barrier_async(comm_, tag, &handle);
    } else {
      s = op->launch(tag, &handle);
    }
    if (s != LOCKSTEP_OK) {
      op->work->complete(std::make_exception_ptr(StatusError(s, status_message(s))));
      return;
    }
    in_flight->emplace_back(std::move(op), handle);
  }

  void finish(std::unique_ptr<Op> op, lockstep_async_t* handle) {
    lockstep_reduce_info_t info;
    const lockstep_status_t s = lockstep_async_wait(handle, &info);
    std::exception_ptr error;
    if (!op->invalid.empty()) {
      error = std::make_exception_ptr(StatusError(LOCKSTEP_STATUS_INVALID_ARGUMENT, "INVALID_ARGUMENT: " + op->invalid));
    } else if (s != LOCKSTEP_OK) {
      error = std::make_exception_ptr(StatusError(s, status_message(s)));
    } else if (op->whole_group && static_cast<int>(info.world_size) != size_) {
      // lockstep's all-reduce goes on with the survivors of a lost peer; a torch group is
      // fixed, so the call fails on every survivor (each sees the same count).
      error = std::make_exception_ptr(StatusError(
          LOCKSTEP_STATUS_VIEW_CHANGED, "VIEW_CHANGED: " + std::to_string(info.world_size) + " of the group's " +
                                            std::to_string(size_) +
                                            " ranks took part (a peer left): the tensor holds their reduction; update "
                                            "the topology and call lockstep.torch.reconfigure()"));
    } else if (op->after) {
      try {
        op->after();
      } catch (...) {
        error = std::current_exception();
      }
    }
    op->work->complete(error);
  }

  std::string status_message(lockstep_status_t s) {
    std::string detail = lockstep_comm_last_error(comm_);
    return std::string(lockstep_status_name(s)) + ": " + (detail.empty() ? lockstep_status_string(s) : detail);
  }

  void run() {
    std::deque<std::pair<std::unique_ptr<Op>, lockstep_async_t*>> in_flight;
    for (;;) {
      std::deque<std::unique_ptr<Op>> fresh;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopped_ || !queue_.empty() || !in_flight.empty(); });
        fresh.swap(queue_);
        if (stopped_ && fresh.empty() && in_flight.empty()) return;
      }
      for (auto& op : fresh) start(std::move(op), &in_flight);
      if (!in_flight.empty()) {
        auto [op, handle] = std::move(in_flight.front());
        in_flight.pop_front();
        finish(std::move(op), handle);
      }
    }
  }

  lockstep_comm_t* comm_;
  std::vector<int> view_rank_;   // torch rank -> view rank
  std::vector<int> torch_rank_;  // view rank -> torch rank
  std::vector<std::string> view_ids_;
  bool identity_ = false;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool stopped_ = false;
  std::atomic<std::uint64_t> next_seq_{0};  // the next op's sequence number (in its tag)
  std::thread thread_;
};

}  // namespace

PYBIND11_MODULE(_torch, m) {
  m.doc() = "The torch.distributed backend 'lockstep'; use lockstep.torch instead.";
  py::module::import("torch.distributed");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = py::module::import("lockstep._errors").attr("error_for_status")(e.status, e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<ProcessGroupLockstep, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupLockstep>>(m, "ProcessGroupLockstep")
      .def(py::init<std::uintptr_t, int, int, std::vector<int>, std::vector<std::string>>(), py::arg("comm"),
           py::arg("rank"), py::arg("size"), py::arg("view_rank"), py::arg("view_ids"))
      .def("_shutdown", &ProcessGroupLockstep::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("_ops_started", &ProcessGroupLockstep::ops_started);
}
