// The content hash (see hash.h for the definition): leaf digests computed by a small
// pool of std::threads that take leaf indices from an atomic counter, each writing only
// its own slot of the leaf list; the root is hashed by the calling thread after joining
// them, so the digest cannot depend on which thread hashed which leaf.
#include "state/hash.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace lockstep::state {
namespace {

// Below this many leaves per extra thread, starting one costs more than it saves.
constexpr std::size_t kLeavesPerExtraThread = 4;

static_assert(sizeof(XXH128_canonical_t) == 16, "the leaf list holds 16-byte records");

unsigned thread_count(unsigned requested, std::size_t leaves) {
  unsigned n = requested == 0 ? std::thread::hardware_concurrency() : requested;
  n = std::max(n, 1u);
  const std::size_t extra = std::min<std::size_t>(n - 1, leaves / kLeavesPerExtraThread);
  return static_cast<unsigned>(extra) + 1;
}

}  // namespace

std::string Digest::to_hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (std::size_t i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(hi >> (4 * i)) & 0xfu];
    out[31 - i] = kDigits[(lo >> (4 * i)) & 0xfu];
  }
  return out;
}

std::size_t leaf_count(std::size_t bytes) {
  // Written without rounding up first, which could overflow near SIZE_MAX.
  return bytes / kHashLeafBytes + (bytes % kHashLeafBytes != 0 ? 1 : 0);
}

Digest leaf_digest(const void* data, std::size_t bytes, std::size_t i) {
  const std::size_t offset = i * kHashLeafBytes;
  const std::size_t length = std::min(kHashLeafBytes, bytes - offset);
  const XXH128_hash_t h =
      XXH3_128bits_withSeed(static_cast<const unsigned char*>(data) + offset, length, XXH64_hash_t{i});
  return Digest{h.high64, h.low64};
}

std::vector<Digest> leaf_digests(const void* data, std::size_t bytes, unsigned threads) {
  const std::size_t leaves = leaf_count(bytes);
  std::vector<Digest> list(leaves);
  // Relaxed is enough: the counter only hands out distinct indices; each thread writes
  // only the slots it drew, published to the calling thread by join().
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < leaves;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      list[i] = leaf_digest(data, bytes, i);
    }
  };
  const unsigned n = thread_count(threads, leaves);
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (unsigned t = 1; t < n; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // out of threads: the ones started and this one finish the job
    }
  }
  work();
  for (auto& thread : pool) thread.join();
  return list;
}

Digest root_digest(const std::vector<Digest>& leaves, std::size_t bytes) {
  std::vector<XXH128_canonical_t> list(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    XXH128_canonicalFromHash(&list[i], XXH128_hash_t{leaves[i].lo, leaves[i].hi});
  }
  const XXH128_hash_t root =
      XXH3_128bits_withSeed(list.data(), list.size() * sizeof(XXH128_canonical_t), XXH64_hash_t{bytes});
  return Digest{root.high64, root.low64};
}

Digest hash_bytes(const void* data, std::size_t bytes, unsigned threads) {
  return root_digest(leaf_digests(data, bytes, threads), bytes);
}

}  // namespace lockstep::state
