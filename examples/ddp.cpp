// Data-parallel training with lockstep's C API from C++: the DDP loop of
// examples/python/ddp.py without any framework. The model is a softmax regression on a
// synthetic problem every peer generates identically (10 classes, 32 features, class
// centres plus noise); each peer trains on the shard given by its rank.
//
// Every step: admit pending peers (update topology), sync the shared state (weights,
// momentum, step: identical on every peer; a newcomer's first sync is receive-only),
// compute the gradient of a mini-batch of the shard, average it with an all-reduce
// (on a lost peer: the step again with the survivors), apply SGD with momentum.
//
//   ddp_example HOST PORT STEPS      (start a lockstep-master first)
#include <lockstep/lockstep.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t kClasses = 10;
constexpr std::size_t kFeatures = 32;
constexpr std::size_t kSamples = 4000;
constexpr std::size_t kBatch = 64;
constexpr float kLr = 0.5f;
constexpr float kMomentum = 0.9f;

struct Data {
  std::vector<float> x;  // kSamples x kFeatures
  std::vector<std::size_t> y;
};

Data make_data() {
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> centres(kClasses * kFeatures);
  for (auto& c : centres) c = noise(rng) * 0.3f;
  Data d;
  for (std::size_t i = 0; i < kSamples; ++i) {
    const std::size_t label = i % kClasses;
    d.y.push_back(label);
    for (std::size_t f = 0; f < kFeatures; ++f) d.x.push_back(centres[label * kFeatures + f] + noise(rng));
  }
  return d;
}

// Softmax-regression loss of rows [rows] and its gradient (weights: classes x (features + 1)).
float loss_and_gradient(const Data& d, const std::vector<std::size_t>& rows, const std::vector<float>& w,
                        std::vector<float>* grad) {
  const std::size_t stride = kFeatures + 1;
  const auto n = static_cast<float>(rows.size());
  if (grad != nullptr) grad->assign(w.size(), 0.0f);
  float loss = 0;
  for (const std::size_t r : rows) {
    float logits[kClasses];
    float top = -1e30f;
    for (std::size_t c = 0; c < kClasses; ++c) {
      float z = w[c * stride + kFeatures];
      for (std::size_t f = 0; f < kFeatures; ++f) z += w[c * stride + f] * d.x[r * kFeatures + f];
      logits[c] = z;
      top = std::max(top, z);
    }
    float sum = 0;
    for (float& z : logits) sum += (z = std::exp(z - top));
    loss -= std::log(logits[d.y[r]] / sum);
    if (grad == nullptr) continue;
    for (std::size_t c = 0; c < kClasses; ++c) {
      const float g = logits[c] / sum - (c == d.y[r] ? 1.0f : 0.0f);
      for (std::size_t f = 0; f < kFeatures; ++f) (*grad)[c * stride + f] += g * d.x[r * kFeatures + f] / n;
      (*grad)[c * stride + kFeatures] += g / n;
    }
  }
  return loss / n;
}

bool check(lockstep_status_t s, lockstep_comm_t* comm, const char* what) {
  if (s == LOCKSTEP_OK) return true;
  std::fprintf(stderr, "%s: %s (%s)\n", what, lockstep_status_string(s), comm ? lockstep_comm_last_error(comm) : "");
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MASTER_HOST MASTER_PORT STEPS\n", argv[0]);
    return 2;
  }
  const Data data = make_data();
  std::vector<float> weights(kClasses * (kFeatures + 1), 0.0f);
  std::vector<float> velocity(weights.size(), 0.0f);
  std::uint64_t step[1] = {0};
  const std::uint64_t steps = std::strtoull(argv[3], nullptr, 10);

  lockstep_comm_config_t config;
  lockstep_comm_config_init(&config);
  config.master_host = argv[1];
  config.master_port = static_cast<uint16_t>(std::atoi(argv[2]));
  config.base_port = 0;
  lockstep_comm_t* comm = nullptr;
  if (!check(lockstep_comm_create(&config, &comm), nullptr, "create") ||
      !check(lockstep_comm_connect(comm), comm, "connect")) {
    return 1;
  }
  const lockstep_tensor_t tensors[] = {
      {"weights", weights.data(), weights.size(), LOCKSTEP_F32, LOCKSTEP_DEVICE_CPU, 0},
      {"velocity", velocity.data(), velocity.size(), LOCKSTEP_F32, LOCKSTEP_DEVICE_CPU, 0},
      {"step", step, 1, LOCKSTEP_U64, LOCKSTEP_DEVICE_CPU, 0},
  };
  lockstep_shared_state_t state = {0, tensors, 3};
  int64_t world = 0;
  lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
  bool joining = world > 1;  // a newcomer goes straight to its first (receive-only) sync
  std::vector<float> grad;
  while (step[0] < steps) {
    if (!joining) {
      for (;;) {  // admit pending peers; alone, wait for some
        int pending = 0;
        if (!check(lockstep_comm_are_peers_pending(comm, &pending), comm, "are_peers_pending")) return 1;
        if (pending) {
          lockstep_status_t s;
          while ((s = lockstep_comm_update_topology(comm)) == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) {
          }
          if (!check(s, comm, "update_topology")) return 1;
          break;
        }
        lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
        if (world >= 2) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      state.revision += 1;
    }
    lockstep_status_t s;
    while ((s = lockstep_comm_sync_shared_state(comm, &state,
                                                joining ? LOCKSTEP_SYNC_RECEIVE_ONLY : LOCKSTEP_SYNC_ENFORCE_POPULAR,
                                                nullptr)) == LOCKSTEP_STATUS_PEER_CONNECTION_LOST ||
           s == LOCKSTEP_STATUS_HASH_MISMATCH) {
    }
    if (!check(s, comm, "sync_shared_state")) return 1;
    joining = false;
    uint32_t rank = 0;
    lockstep_comm_get_rank(comm, &rank);
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
    std::vector<std::size_t> rows;  // this peer's shard, a different window every step
    const auto peers = static_cast<std::size_t>(world);
    for (std::size_t i = 0; i < kBatch; ++i) {
      const std::size_t k = (static_cast<std::size_t>(step[0]) * kBatch + i) % (kSamples / peers);
      rows.push_back(rank + k * peers);
    }
    const float loss = loss_and_gradient(data, rows, weights, &grad);
    lockstep_reduce_desc_t d{};  // zeroed: fields of later versions keep their defaults
    d.src = grad.data();
    d.dst = grad.data();
    d.count = grad.size();
    d.dtype = LOCKSTEP_F32;
    d.op = LOCKSTEP_AVG;
    d.tag = step[0];
    s = lockstep_comm_all_reduce(comm, &d, nullptr);
    if (s == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) continue;  // the step again, with the survivors
    if (!check(s, comm, "all_reduce")) return 1;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      velocity[i] = kMomentum * velocity[i] + grad[i];
      weights[i] -= kLr * velocity[i];
    }
    step[0] += 1;
    if (step[0] % 20 == 0 || step[0] == steps) {
      std::vector<std::size_t> all(kSamples);
      for (std::size_t i = 0; i < kSamples; ++i) all[i] = i;
      char hex[33];
      lockstep_hash(weights.data(), weights.size() * sizeof(float), hex);
      std::printf("{\"step\":%llu,\"world\":%lld,\"rank\":%u,\"batch_loss\":%.4f,\"loss\":%.4f,\"weights\":\"%s\"}\n",
                  static_cast<unsigned long long>(step[0]), static_cast<long long>(world), rank, static_cast<double>(loss),
                  static_cast<double>(loss_and_gradient(data, all, weights, nullptr)), hex);
      std::fflush(stdout);
    }
  }
  lockstep_comm_destroy(comm);
  return 0;
}
