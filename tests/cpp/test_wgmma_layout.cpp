// The 128-byte-swizzled shared-memory layout of the Hopper attention kernels (gpu/swizzle.h, gpu/wgmma.h,
// attention_forward_sm90.h, attention_backward_sm90.h): host arithmetic, no GPU needed. Checks that
// swizzled_offset places every 16-byte chunk of a tile exactly once, as the wgmma descriptors read it (chunk
// c of line r of an 8-line atom at chunk position c ^ (r % 8)), and that the kernels' shared-memory writes
// are free of bank conflicts: the cp.async staging (16 bytes per lane) and the backward's dX^T stores
// (4 bytes per lane, two queries of one key line).
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "hipdlrm/gpu/swizzle.h"

using hipdlrm::gpu::wgmma::swizzled_offset;

namespace {

constexpr int kLineBytes = 128;  // one line: 64 16-bit elements

// A tile of `lines` rows and 8 * `chunks` columns (the kernels' head dims 128 and 64: 16 or 8 16-byte chunks
// per row), one or two 64-column blocks of `lines` lines each.
void check_bijection(int lines, int chunks) {
  std::set<int> seen;
  for (int r = 0; r < lines; ++r) {
    for (int c = 0; c < chunks; ++c) {
      const int off = swizzled_offset(r, c, lines);
      EXPECT_EQ(off % 16, 0);
      EXPECT_GE(off, 0);
      EXPECT_LT(off, lines * (chunks / 8) * kLineBytes);
      EXPECT_TRUE(seen.insert(off).second) << "line " << r << " chunk " << c << " collides";
      // 64-column block c / 8, line r inside it, and the atom's swizzle inside the line.
      EXPECT_EQ(off / (lines * kLineBytes), c / 8);
      EXPECT_EQ(off % (lines * kLineBytes) / kLineBytes, r);
      EXPECT_EQ(off % kLineBytes / 16, (c % 8) ^ (r % 8));
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), lines * chunks);
}

// Shared memory has 32 four-byte banks; a warp's accesses conflict when two lanes hit the same bank at
// different addresses. 16-byte accesses are served a quarter-warp (8 lanes) at a time.
int max_bank_ways(const std::vector<int>& byte_addresses, int access_bytes) {
  const int lanes_per_phase = access_bytes == 16 ? 8 : access_bytes == 8 ? 16 : 32;
  int worst = 0;
  for (std::size_t p = 0; p < byte_addresses.size(); p += lanes_per_phase) {
    std::vector<std::set<int>> words_per_bank(32);
    for (int l = 0; l < lanes_per_phase; ++l) {
      const int a = byte_addresses[p + l];
      for (int w = 0; w < access_bytes / 4; ++w) words_per_bank[(a / 4 + w) % 32].insert(a / 4 + w);
    }
    for (const auto& s : words_per_bank) worst = std::max(worst, static_cast<int>(s.size()));
  }
  return worst;
}

}  // namespace

TEST(WgmmaLayout, SwizzleIsABijectionWithTheAtomPattern) {
  for (int chunks : {16, 8}) {
    for (int lines : {64, 128}) check_bijection(lines, chunks);  // q / dO tiles, k / v tiles
  }
}

TEST(WgmmaLayout, StagingWritesAreConflictFree) {
  // stage_swizzled<kRows, kThreads, kD>: thread c writes chunk c % (kD / 8) of line c / (kD / 8) (16 bytes);
  // consecutive threads form a warp.
  for (int chunks : {16, 8}) {
    for (int lines : {64, 128}) {
      for (int warp0 = 0; warp0 < lines * chunks; warp0 += 32) {
        std::vector<int> addr;
        for (int lane = 0; lane < 32; ++lane) {
          const int c = warp0 + lane;
          addr.push_back(swizzled_offset(c / chunks, c % chunks, lines));
        }
        EXPECT_EQ(max_bank_ways(addr, 16), 1) << "head dim " << 8 * chunks << " lines " << lines << " warp at " << warp0;
      }
    }
  }
}

TEST(WgmmaLayout, BackwardDsStoresAreConflictFree) {
  // attention_backward_sm90.h: lane 4 g + t of warp w in warpgroup wg stores, for register (kk, r), the pair
  // of queries 16 kk + 8 (r >> 1) + 2 t, + 1 of key line 64 wg + 16 w + g + 8 (r & 1) into the [128 keys][64
  // queries] tile: chunk 2 kk + (r >> 1), byte 4 t of it.
  constexpr int kKeyLines = 128;
  std::set<int> written;
  for (int wg = 0; wg < 2; ++wg) {
    for (int w = 0; w < 4; ++w) {
      for (int kk = 0; kk < 4; ++kk) {
        for (int r = 0; r < 4; ++r) {
          std::vector<int> addr;
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane & 3;
            const int line = 64 * wg + 16 * w + g + 8 * (r & 1);
            addr.push_back(swizzled_offset(line, 2 * kk + (r >> 1), kKeyLines) + 4 * t);
          }
          EXPECT_EQ(max_bank_ways(addr, 4), 1) << "wg " << wg << " warp " << w << " kk " << kk << " r " << r;
          written.insert(addr.begin(), addr.end());
        }
      }
    }
  }
  // Every 4-byte word of the 16 KB tile is written exactly once per step.
  EXPECT_EQ(static_cast<int>(written.size()), kKeyLines * 64 * 2 / 4);
}

TEST(WgmmaLayout, BankCounterSeesConflicts) {
  // The checker itself: eight lanes writing 16 bytes into the same chunk column of eight unswizzled
  // 128-byte lines hit the same four banks (8-way).
  std::vector<int> addr;
  for (int lane = 0; lane < 32; ++lane) addr.push_back((lane % 8) * kLineBytes);
  EXPECT_EQ(max_bank_ways(addr, 16), 8);
}

// The descriptor fields as the PTX ISA lays them out, and desc_add's shortcut (one add to the start-address
// field, which the Hopper kernels use for each k16 slice of an operand) equal to encoding the moved address, for
// every 16-byte aligned address of the 228 KiB of shared memory and the offsets the kernels add.
TEST(WgmmaLayout, DescriptorFieldsAndOffsets) {
  using hipdlrm::gpu::wgmma::desc_add;
  using hipdlrm::gpu::wgmma::desc_encode;
  const std::uint64_t d = desc_encode(0x12340, 8192, 1024);
  EXPECT_EQ(d & 0x3FFF, 0x12340u >> 4);
  EXPECT_EQ((d >> 16) & 0x3FFF, 8192u >> 4);
  EXPECT_EQ((d >> 32) & 0x3FFF, 1024u >> 4);
  EXPECT_EQ(d >> 62, 1u);
  EXPECT_EQ(d & ((std::uint64_t{0x3} << 14) | (std::uint64_t{0x3} << 30) | (std::uint64_t{0xFFFF} << 46)), 0u);
  constexpr std::uint32_t kSmem = 228 * 1024;
  // k16 slices: 32-byte steps inside a 128-byte line, 1024- to 32768-byte steps between blocks and stages.
  const int offsets[] = {0, 32, 64, 96, 2048, 4096, 6144, 8192, 8192 + 96, 16384, 32768, 65536};
  for (int lbo : {16, 8192, 16384, 32768}) {
    for (std::uint32_t a = 0; a < kSmem; a += 16) {
      const std::uint64_t base = desc_encode(a, lbo, 1024);
      for (int off : offsets) {
        if (a + static_cast<std::uint32_t>(off) >= kSmem) continue;
        ASSERT_EQ(desc_add(base, off), desc_encode(a + off, lbo, 1024)) << "address " << a << " + " << off;
      }
    }
  }
}
