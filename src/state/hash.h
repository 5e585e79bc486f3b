// Content hash of shared state: a deterministic, parallel 128-bit digest of a byte
// buffer, used to check that peers hold the same bytes. The digest depends only on the
// bytes and their length, never on the number of threads that computed it, and is
// defined so that another implementation (a GPU kernel, another language) can produce
// the same value from the XXH3 specification alone.
//
// Definition. Let B be the buffer and n its length in bytes; L = kHashLeafBytes.
//  1. Leaves: B is split into m = ceil(n / L) leaves; leaf i (0 <= i < m) is the bytes
//     [i*L, min((i+1)*L, n)). All leaves hold L bytes except possibly the last, which
//     holds the rest (1..L bytes). An empty buffer has m = 0 leaves.
//  2. Leaf digests: d_i = XXH3_128bits_withSeed(leaf i, its length, seed = i), with the
//     leaf index as the 64-bit seed.
//  3. Leaf list: each d_i written as 16 bytes in XXH128_canonical_t form, i.e.
//     XXH128_canonicalFromHash: high64 big-endian, then low64 big-endian; the m
//     records concatenated in leaf order give a string C of 16*m bytes.
//  4. Root: r = XXH3_128bits_withSeed(C, 16*m, seed = n), with the total byte length
//     as the 64-bit seed. Digest{hi = r.high64, lo = r.low64}.
// There is no special case: a buffer of at most one leaf, and the empty buffer (C empty,
// seed 0), go through the root step as well. Seeding the leaves with their index ties
// each leaf to its position (swapping two leaves changes the digest), and seeding the
// root with n binds the total length into the digest on top of the leaf lengths.
//
// xxHash is version 0.8 (XXH3's output is stable since 0.8.0).
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::state {

struct Digest {
  std::uint64_t hi = 0;
  std::uint64_t lo = 0;
  bool operator==(const Digest&) const = default;
  auto operator<=>(const Digest&) const = default;
  std::string to_hex() const;  // 32 lowercase hex digits, hi first
};

// Leaf size of the hash tree: part of the digest's definition, never change it.
inline constexpr std::size_t kHashLeafBytes = std::size_t{1} << 20;

// The digest of `bytes` bytes at `data` (data may be null when bytes == 0), computed with
// up to `threads` threads (0 = std::thread::hardware_concurrency()); the digest is the
// same for every thread count. The calling thread takes part; a buffer of fewer than
// about 4 leaves per extra thread uses fewer threads, and one that fails to start a
// thread carries on with those it has. The buffer must not change during the call.
Digest hash_bytes(const void* data, std::size_t bytes, unsigned threads = 0);

// The same digest in its two steps, for callers that keep the leaves (a shared-state
// transfer compares them to find what differs, and digests what it receives leaf by
// leaf as it arrives): leaf_digests() gives d_0 .. d_{m-1} (threads as for hash_bytes),
// leaf_digest() one d_i of a buffer of `bytes` bytes (reading leaf i only), and
// root_digest() the digest of a `bytes`-byte buffer from its whole leaf list, so that
// root_digest(leaf_digests(p, n), n) == hash_bytes(p, n).
std::size_t leaf_count(std::size_t bytes);
std::vector<Digest> leaf_digests(const void* data, std::size_t bytes, unsigned threads = 0);
Digest leaf_digest(const void* data, std::size_t bytes, std::size_t i);
Digest root_digest(const std::vector<Digest>& leaves, std::size_t bytes);

// Delta transfers: a range [offset, offset + bytes) of a tensor cut at every multiple of
// kHashLeafBytes (the content hash's leaves, counted from the tensor's start). Segment k
// starts at segment_start(offset, k) and lies in leaf offset / kHashLeafBytes + k; its
// digest is that whole leaf's digest d_i (above), which both ends already hold from
// the digest of the tensor they voted with. (A segment cut by the range's ends compares
// its whole leaf: equal leaves have equal parts.)
constexpr std::uint64_t segment_count(std::uint64_t offset, std::uint64_t bytes) {
  return bytes == 0 ? 0 : (offset + bytes - 1) / kHashLeafBytes - offset / kHashLeafBytes + 1;
}
constexpr std::uint64_t segment_start(std::uint64_t offset, std::uint64_t k) {
  return k == 0 ? offset : (offset / kHashLeafBytes + k) * kHashLeafBytes;
}

}  // namespace lockstep::state
