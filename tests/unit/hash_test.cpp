// The content hash: the digest does not depend on the thread count (on sizes around leaf
// boundaries and from an unaligned start), it equals the definition in hash.h recomputed
// here with the XXH3 API directly, and it changes with any one-bit flip and with the
// length. Sizes stay within a few tens of MiB so that the test is quick under sanitizers.
#include "state/hash.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using lockstep::state::Digest;
using lockstep::state::hash_bytes;
using lockstep::state::kHashLeafBytes;

// Non-constant content from a fixed generator (splitmix64), so that a leaf hashed at the
// wrong offset or with the wrong length gives a different digest.
std::vector<unsigned char> pattern(std::size_t bytes, std::uint64_t seed = 1) {
  std::vector<unsigned char> out(bytes);
  std::uint64_t state = seed;
  for (std::size_t i = 0; i < bytes; i += 8) {
    state += 0x9e3779b97f4a7c15u;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    z ^= z >> 31;
    for (std::size_t k = 0; k < 8 && i + k < bytes; ++k) out[i + k] = static_cast<unsigned char>(z >> (8 * k));
  }
  return out;
}

// The definition of hash.h, step by step, with a single thread and no shared code.
Digest reference(const unsigned char* data, std::size_t bytes) {
  std::vector<unsigned char> list;
  for (std::size_t offset = 0, index = 0; offset < bytes; offset += kHashLeafBytes, ++index) {
    const std::size_t length = std::min(kHashLeafBytes, bytes - offset);
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_withSeed(data + offset, length, XXH64_hash_t{index}));
    list.insert(list.end(), canonical.digest, canonical.digest + sizeof(canonical.digest));
  }
  const XXH128_hash_t root = XXH3_128bits_withSeed(list.data(), list.size(), XXH64_hash_t{bytes});
  return Digest{root.high64, root.low64};
}

TEST(Hash, SameDigestForEveryThreadCount) {
  constexpr std::size_t L = kHashLeafBytes;
  // 33 leaves: enough for 8 threads to start (4 leaves per extra thread).
  const std::vector<std::size_t> sizes = {0, 1, 7, L - 1, L, L + 1, 5 * L + 12345, 33 * L + 17};
  const auto buffer = pattern(33 * L + 17 + 3);
  for (const std::size_t size : sizes) {
    for (const std::size_t shift : {std::size_t{0}, std::size_t{3}}) {
      SCOPED_TRACE("size " + std::to_string(size) + " at offset " + std::to_string(shift));
      const unsigned char* data = buffer.data() + shift;
      const Digest expected = reference(data, size);
      for (const unsigned threads : {1u, 2u, 3u, 8u, 0u}) {
        EXPECT_EQ(hash_bytes(data, size, threads), expected) << threads << " threads";
      }
    }
  }
}

// The two steps that shared-state transfers use: the leaf list and the root over it give
// the digest of the definition, and each leaf alone is that leaf's d_i.
TEST(Hash, LeavesAndRootComposeTheDigest) {
  constexpr std::size_t L = kHashLeafBytes;
  const auto buffer = pattern(9 * L + 5);
  for (const std::size_t size : {std::size_t{0}, std::size_t{1}, L, L + 1, 9 * L + 5}) {
    SCOPED_TRACE("size " + std::to_string(size));
    const auto leaves = lockstep::state::leaf_digests(buffer.data(), size, 2);
    ASSERT_EQ(leaves.size(), lockstep::state::leaf_count(size));
    EXPECT_EQ(lockstep::state::root_digest(leaves, size), reference(buffer.data(), size));
    for (std::size_t i = 0; i < leaves.size(); ++i) {
      const std::size_t length = std::min(L, size - i * L);
      const XXH128_hash_t h = XXH3_128bits_withSeed(buffer.data() + i * L, length, XXH64_hash_t{i});
      EXPECT_EQ(leaves[i], (Digest{h.high64, h.low64})) << "leaf " << i;
      EXPECT_EQ(lockstep::state::leaf_digest(buffer.data(), size, i), leaves[i]) << "leaf " << i;
    }
  }
}

TEST(Hash, EmptyAndTinyBuffersFollowTheDefinition) {
  // Written out for the small cases: the root hashes the canonical leaf digests, seeded
  // with the total length; the empty buffer hashes an empty leaf list with seed 0.
  const XXH128_hash_t empty_root = XXH3_128bits_withSeed(nullptr, 0, 0);
  const Digest empty = hash_bytes(nullptr, 0);
  EXPECT_EQ(empty, (Digest{empty_root.high64, empty_root.low64}));

  const auto bytes = pattern(15, 7);
  auto one_leaf = [&](std::size_t n) {
    XXH128_canonical_t leaf;
    XXH128_canonicalFromHash(&leaf, XXH3_128bits_withSeed(bytes.data(), n, 0));
    const XXH128_hash_t root = XXH3_128bits_withSeed(leaf.digest, sizeof(leaf.digest), n);
    return Digest{root.high64, root.low64};
  };
  const Digest d1 = hash_bytes(bytes.data(), 1);
  const Digest d15 = hash_bytes(bytes.data(), 15);
  EXPECT_EQ(d1, one_leaf(1));
  EXPECT_EQ(d15, one_leaf(15));
  // Stable: the same input gives the same digest again, from a copy elsewhere in memory.
  const std::vector<unsigned char> copy(bytes);
  EXPECT_EQ(hash_bytes(copy.data(), 15), d15);
  EXPECT_EQ(hash_bytes(copy.data(), 1), d1);
  // Distinct.
  EXPECT_NE(empty, d1);
  EXPECT_NE(empty, d15);
  EXPECT_NE(d1, d15);
  // A null pointer with zero bytes is the empty buffer, whatever the thread count.
  EXPECT_EQ(hash_bytes(bytes.data(), 0, 4), empty);
}

TEST(Hash, CanonicalLeafRecordsAreBigEndian) {
  // The leaf list's byte order is part of the definition: high64 then low64, each
  // big-endian. Checked against a record built by hand from the numeric digest.
  const auto bytes = pattern(100, 3);
  const XXH128_hash_t leaf = XXH3_128bits_withSeed(bytes.data(), bytes.size(), 0);
  unsigned char record[16];
  for (int i = 0; i < 8; ++i) {
    record[i] = static_cast<unsigned char>(leaf.high64 >> (56 - 8 * i));
    record[8 + i] = static_cast<unsigned char>(leaf.low64 >> (56 - 8 * i));
  }
  const XXH128_hash_t root = XXH3_128bits_withSeed(record, sizeof(record), bytes.size());
  EXPECT_EQ(hash_bytes(bytes.data(), bytes.size()), (Digest{root.high64, root.low64}));
}

TEST(Hash, OneBitFlipChangesTheDigest) {
  const std::size_t size = 3 * kHashLeafBytes + 1000;
  auto buffer = pattern(size, 11);
  const Digest original = hash_bytes(buffer.data(), size, 2);
  for (const std::size_t at : {std::size_t{0}, size / 2, kHashLeafBytes - 1, kHashLeafBytes, size - 1}) {
    for (const int bit : {0, 7}) {
      SCOPED_TRACE("byte " + std::to_string(at) + " bit " + std::to_string(bit));
      buffer[at] = static_cast<unsigned char>(buffer[at] ^ (1u << bit));
      EXPECT_NE(hash_bytes(buffer.data(), size, 2), original);
      buffer[at] = static_cast<unsigned char>(buffer[at] ^ (1u << bit));
    }
  }
  EXPECT_EQ(hash_bytes(buffer.data(), size, 2), original);
}

TEST(Hash, SwappedLeavesChangeTheDigest) {
  // Leaf seeds are the leaf indices, so the same leaves in another order differ.
  auto buffer = pattern(2 * kHashLeafBytes, 5);
  const Digest original = hash_bytes(buffer.data(), buffer.size());
  std::swap_ranges(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(kHashLeafBytes),
                   buffer.begin() + static_cast<std::ptrdiff_t>(kHashLeafBytes));
  EXPECT_NE(hash_bytes(buffer.data(), buffer.size()), original);
}

TEST(Hash, TrailingZeroByteChangesTheDigest) {
  for (const std::size_t size : {std::size_t{0}, std::size_t{15}, kHashLeafBytes - 1, kHashLeafBytes,
                                 2 * kHashLeafBytes + 5}) {
    SCOPED_TRACE("size " + std::to_string(size));
    auto buffer = pattern(size, 9);
    const Digest shorter = hash_bytes(buffer.data(), buffer.size());
    buffer.push_back(0);
    EXPECT_NE(hash_bytes(buffer.data(), buffer.size()), shorter);
  }
}

TEST(Hash, ToHex) {
  EXPECT_EQ((Digest{}).to_hex(), std::string(32, '0'));
  EXPECT_EQ((Digest{0x0123456789abcdefu, 0xfedcba9876543210u}).to_hex(), "0123456789abcdeffedcba9876543210");
  EXPECT_EQ((Digest{1, 0}).to_hex(), "00000000000000010000000000000000");
  EXPECT_EQ((Digest{0, 0xau}).to_hex(), "0000000000000000000000000000000a");
  const std::string hex = hash_bytes("lockstep", 8).to_hex();
  EXPECT_EQ(hex.size(), 32u);
  EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
}

TEST(Hash, DigestOrdersHiFirst) {
  EXPECT_LT((Digest{0, ~std::uint64_t{0}}), (Digest{1, 0}));
  EXPECT_LT((Digest{1, 0}), (Digest{1, 1}));
}

}  // namespace
