// Shared-state blocks (state/blocks.h): the header's bounds, compression round trips,
// frames that lie about their size or are not frames (refused, the destination
// untouched), and the sender's policy: compress while the link is unknown or slow, not
// where compressing takes longer than the bytes it saves, probes while it does not, and
// tries each new range.
#include "state/blocks.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace {

using namespace lockstep;
using state::BlockHeader;

std::vector<std::uint8_t> compressible(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  std::mt19937 rng(4);
  // f32 values of 16 kinds, as a coarsely quantized or mostly constant tensor holds.
  for (std::size_t i = 0; i + 4 <= n; i += 4) {
    const float f = static_cast<float>(rng() % 16) / 16.0f;
    std::memcpy(v.data() + i, &f, 4);
  }
  return v;
}

std::vector<std::uint8_t> random_bytes(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  std::mt19937_64 rng(5);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

TEST(StateBlocks, HeaderRoundTripAndBounds) {
  std::uint8_t h[state::kBlockHeaderBytes];
  state::put_block_header(h, BlockHeader{1000, 300, true});
  auto parsed = state::parse_block_header(h, 5000);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed.value().raw, 1000u);
  EXPECT_EQ(parsed.value().wire, 300u);
  EXPECT_TRUE(parsed.value().compressed);

  const auto refused = [&](BlockHeader b, std::uint64_t remaining) {
    state::put_block_header(h, b);
    auto r = state::parse_block_header(h, remaining);
    return !r.is_ok() && r.status().code() == LOCKSTEP_STATUS_PROTOCOL_ERROR;
  };
  EXPECT_TRUE(refused({0, 0, false}, 10));                               // an empty block
  EXPECT_TRUE(refused({11, 11, false}, 10));                             // more than the range has left
  EXPECT_TRUE(refused({state::kBlockBytes + 1, 1, true}, ~0ull));        // above the block size
  EXPECT_TRUE(refused({10, 9, false}, 10));                              // a raw block is its own length
  EXPECT_TRUE(refused({10, 0, true}, 10));                               // an empty frame
  EXPECT_TRUE(refused({10, static_cast<std::uint32_t>(state::compress_bound(10) + 1), true}, 10));
  EXPECT_FALSE(refused({10, static_cast<std::uint32_t>(state::compress_bound(10)), true}, 10));
  EXPECT_FALSE(refused({state::kBlockBytes, state::kBlockBytes, false}, ~0ull));
}

TEST(StateBlocks, CompressesAndDecompressesExactly) {
  state::BlockCompressor c;
  state::BlockDecompressor d;
  for (const std::size_t n : {std::size_t{1}, std::size_t{4096}, state::kBlockBytes}) {
    const auto raw = compressible(n < 4 ? 4 : n);
    for (const int level : {1, 3}) {
      const std::size_t wire = c.compress(raw.data(), n, level);
      if (n < 64) {
        EXPECT_EQ(wire, 0u) << "a tiny block cannot save 3 %";
        continue;
      }
      ASSERT_GT(wire, 0u);
      EXPECT_LT(wire, n / 2) << "16 kinds of values compress to less than half";
      std::vector<std::uint8_t> out(n, 0xee);
      ASSERT_TRUE(d.decompress(c.data(), wire, out.data(), n).is_ok());
      EXPECT_EQ(0, std::memcmp(out.data(), raw.data(), n));
    }
  }
  // Random bytes do not shrink: the block goes raw.
  const auto noise = random_bytes(1 << 20);
  EXPECT_EQ(c.compress(noise.data(), noise.size(), 1), 0u);
}

TEST(StateBlocks, AFrameThatLiesAboutItsSizeNeverReachesTheDestination) {
  state::BlockCompressor c;
  state::BlockDecompressor d;
  const auto raw = compressible(1 << 16);
  const std::size_t wire = c.compress(raw.data(), raw.size(), 1);
  ASSERT_GT(wire, 0u);
  std::vector<std::uint8_t> frame(c.data(), c.data() + wire);
  std::vector<std::uint8_t> dst(raw.size() + 16, 0xee);
  const auto untouched = [&] {
    for (const auto b : dst) {
      if (b != 0xee) return false;
    }
    return true;
  };
  // Announced smaller or larger than it decompresses to.
  for (const std::size_t announced : {raw.size() - 1, raw.size() + 1, std::size_t{1}}) {
    auto s = d.decompress(frame.data(), frame.size(), dst.data(), announced);
    EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << announced;
    EXPECT_TRUE(untouched());
  }
  // Cut, altered, or not a frame at all.
  auto cut = d.decompress(frame.data(), frame.size() / 2, dst.data(), raw.size());
  EXPECT_EQ(cut.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
  auto altered = frame;
  altered[0] ^= 0xff;  // the frame's magic number
  EXPECT_EQ(d.decompress(altered.data(), altered.size(), dst.data(), raw.size()).code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
  const auto noise = random_bytes(4096);
  EXPECT_EQ(d.decompress(noise.data(), noise.size(), dst.data(), raw.size()).code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
  EXPECT_EQ(d.decompress(frame.data(), frame.size(), dst.data(), state::kBlockBytes + 1).code(),
            LOCKSTEP_STATUS_PROTOCOL_ERROR);
  EXPECT_TRUE(untouched());
  // And the true size works.
  ASSERT_TRUE(d.decompress(frame.data(), frame.size(), dst.data(), raw.size()).is_ok());
  EXPECT_EQ(0, std::memcmp(dst.data(), raw.data(), raw.size()));
}

// A slow link behind a socket that takes 4 MiB at once: the send calls return at once
// until the buffer fills, and later each waits only for room. The policy's link speed is
// what left the socket over the time its queue held bytes: the link's, not the
// buffer's.
TEST(StateBlocks, PolicyMeasuresTheLinkByWhatLeftTheSocket) {
  constexpr double kLink = 6.25e6;  // 50 Mbit/s
  constexpr double kBuffer = 4.0 * (1 << 20);
  constexpr double kBlockWire = 900e3;  // a compressed 4 MiB block
  constexpr double kCompressSeconds = 0.02;
  state::CompressionPolicy policy;
  double now = 0.0;
  double queued = 0.0;  // in the socket at `now`
  double last_end = -1.0;
  const auto drain = [&](double until) {
    queued = std::max(0.0, queued - (until - now) * kLink);
    now = until;
  };
  for (int block = 0; block < 40; ++block) {
    drain(now + kCompressSeconds);
    const double before = queued;
    const double start = now;
    // The call returns once the block fits in the buffer.
    const double wait = std::max(0.0, queued + kBlockWire - kBuffer) / kLink;
    drain(now + wait);
    queued += kBlockWire;
    policy.on_sent(static_cast<std::size_t>(kBlockWire), now - start, static_cast<std::uint64_t>(before),
                   static_cast<std::uint64_t>(queued), last_end < 0 ? -1.0 : now - last_end);
    last_end = now;
  }
  EXPECT_NEAR(policy.link_bytes_per_second(), kLink, 0.1 * kLink);
}

TEST(StateBlocks, PolicyCompressesWhereItPaysOnly) {
  constexpr std::size_t kBlock = state::kBlockBytes;
  // Unknown link: the first block is tried, and a compressible one keeps being compressed.
  state::CompressionPolicy slow;
  EXPECT_TRUE(slow.compress_next());
  slow.on_compressed(kBlock, kBlock / 3, 0.01);  // 400 MB/s, to a third
  EXPECT_TRUE(slow.compress_next());
  EXPECT_EQ(slow.link_bytes_per_second(), 0.0);
  // A 25 MB/s link (200 Mbit/s): 2/3 x 400 MB/s > 25 MB/s, so it pays, at level 3 below 25 MB/s.
  for (int i = 0; i < 8; ++i) slow.on_sent(kBlock / 3 + 8, static_cast<double>(kBlock / 3) / 20e6);
  EXPECT_NEAR(slow.link_bytes_per_second(), 20e6, 1e5);
  EXPECT_TRUE(slow.compress_next());
  EXPECT_EQ(slow.level(), 3);

  // A 2 GB/s link (loopback): compressing at 400 MB/s would slow it down.
  state::CompressionPolicy fast;
  fast.on_compressed(kBlock, kBlock / 3, 0.01);
  for (int i = 0; i < 8; ++i) fast.on_sent(kBlock, static_cast<double>(kBlock) / 2e9);
  EXPECT_FALSE(fast.compress_next());
  EXPECT_EQ(fast.level(), 1);
  // It still tries one block in 8 (then 16, ...) in case the data or the link changed.
  std::size_t tries = 0;
  for (int block = 0; block < 64; ++block) {
    if (fast.compress_next()) {
      ++tries;
      fast.on_compressed(kBlock, kBlock / 3, 0.01);
    } else {
      fast.on_skipped();
    }
  }
  EXPECT_EQ(tries, 3u);  // after 8, 16 and 32 blocks sent raw

  // A new range on the fast link: not even tried (compressing is slower than the link).
  fast.on_new_range();
  EXPECT_FALSE(fast.compress_next());

  // Incompressible data on a slow link: raw, with the same probes; the next range (a
  // tensor that may compress) is tried again at once.
  state::CompressionPolicy noise;
  noise.on_compressed(kBlock, kBlock, 0.004);
  EXPECT_FALSE(noise.compress_next());
  for (int i = 0; i < 8; ++i) noise.on_sent(kBlock + 8, static_cast<double>(kBlock) / 20e6);
  EXPECT_FALSE(noise.compress_next());
  noise.on_new_range();
  EXPECT_TRUE(noise.compress_next());
}

}  // namespace
