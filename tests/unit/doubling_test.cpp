// The plan of an all-reduce by doubling (collectives/doubling.h), run on numbers: every
// rank starts with its own bit, each pair all-reduce adds the pair's values, a
// broadcast copies the root's. Every world from 2 to 64 must end with every rank holding
// every bit exactly once (a bit added twice would carry into another), without a
// deadlock, with the division of avg on every rank that sums and on no other.
#include "collectives/doubling.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

namespace lockstep::coll {
namespace {

using Kind = DoublingStage::Kind;

TEST(Doubling, EveryWorldEndsWithEveryContributionOnceOnEveryRank) {
  for (std::size_t world = 2; world <= 64; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<std::vector<DoublingStage>> plans;
    for (std::size_t r = 0; r < world; ++r) plans.push_back(doubling_stages(world, r));
    std::vector<std::uint64_t> value(world);
    for (std::size_t r = 0; r < world; ++r) value[r] = std::uint64_t{1} << r;
    const std::uint64_t all = world == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << world) - 1;
    std::vector<std::size_t> next(world, 0);
    std::vector<int> finalized(world, 0);
    // Runs every stage whose partner is at the matching stage, until none is left.
    for (bool progress = true; progress;) {
      progress = false;
      for (std::size_t a = 0; a < world; ++a) {
        if (next[a] == plans[a].size()) continue;
        const DoublingStage& sa = plans[a][next[a]];
        const std::size_t b = sa.partner;
        ASSERT_LT(b, world);
        ASSERT_NE(b, a);
        if (next[b] == plans[b].size()) continue;
        const DoublingStage& sb = plans[b][next[b]];
        if (sb.partner != a) continue;  // b is busy with another partner first
        ASSERT_EQ(sa.kind, sb.kind) << a << " and " << b;
        ASSERT_EQ(sa.role + sb.role, 1u) << "a pair needs a rank 0 and a rank 1";
        if (sa.kind == Kind::kAllReduce) {
          value[a] = value[b] = value[a] + value[b];
        } else {
          value[sa.role == 0 ? b : a] = value[sa.role == 0 ? a : b];
        }
        for (const auto& [r, s] : {std::pair{a, sa}, std::pair{b, sb}}) {
          if (s.finalize_after) {
            EXPECT_EQ(value[r], all) << "rank " << r << " divides before it holds the whole sum";
            ++finalized[r];
          }
        }
        ++next[a];
        ++next[b];
        progress = true;
      }
    }
    const std::size_t p = std::bit_floor(world);
    for (std::size_t r = 0; r < world; ++r) {
      EXPECT_EQ(next[r], plans[r].size()) << "rank " << r << " waits for ever";
      EXPECT_EQ(value[r], all) << "rank " << r;
      EXPECT_EQ(finalized[r], r < p ? 1 : 0) << "rank " << r;
      EXPECT_LE(plans[r].size(), static_cast<std::size_t>(std::bit_width(p) - 1) + 2);
    }
  }
}

TEST(Doubling, TheRuleChoosesByKindSizeWorldAndOverride) {
  proto::CollectiveDescriptor d;
  d.count = 16 * 1024;  // 64 KiB of f32
  d.dtype = LOCKSTEP_F32;
  d.op = LOCKSTEP_SUM;
  EXPECT_TRUE(runs_by_doubling(d, kDoublingWorldMin));
  EXPECT_FALSE(runs_by_doubling(d, kDoublingWorldMin - 1));
  d.count = kDoublingBytesMax / 4 + 1;
  EXPECT_FALSE(runs_by_doubling(d, 32));
  d.algorithm = proto::Algorithm::kDoubling;
  EXPECT_TRUE(runs_by_doubling(d, 2));
  EXPECT_FALSE(runs_by_doubling(d, 1));
  d.quantization = LOCKSTEP_QUANT_MINMAX_U8;  // quantized rings keep their error feedback
  EXPECT_FALSE(runs_by_doubling(d, 32));
  d.quantization = LOCKSTEP_QUANT_NONE;
  d.kind = proto::CollectiveKind::kBroadcast;
  EXPECT_FALSE(runs_by_doubling(d, 32));
  d.kind = proto::CollectiveKind::kAllReduce;
  d.count = 16;
  d.algorithm = proto::Algorithm::kRing;
  EXPECT_FALSE(runs_by_doubling(d, 32));
}

}  // namespace
}  // namespace lockstep::coll
