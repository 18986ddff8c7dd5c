#pragma once
/// \file options.hpp
/// Options: the run-time settings of an attention (normalization, chunk size, decode block),
/// and how their machine-dependent defaults are chosen.

#include <linattn/detail/cache_info.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <stdexcept>

namespace linattn {

/// The default of Options::chunk_size and Options::decode_block: chosen for the machine that
/// runs, from its L1 data cache (and for the decode block its CPU's vendor; see there).
inline constexpr Index kAuto = -1;

/// Run-time options of an attention.
struct Options {
  /// What the read divides by; strict (throwing) by default. The delta rules, which keep no
  /// normalizer, read unnormalized whatever is set here.
  Normalization normalization{};
  /// Tokens per chunk in the chunked causal paths (>= 1, or kAuto). Per token the chunked path
  /// costs about 4 r dv + C (r + dv) flops: smaller chunks spend less on the within-chunk score
  /// block, larger ones give the products more rows. kAuto takes 32 where the state S
  /// (r x dv) fits the L1 data cache and 16 where it does not (docs/performance.md has the
  /// chunk-size sweep behind this).
  Index chunk_size = kAuto;
  /// Tokens a state made by this attention collects in step() before folding them into S
  /// (0 or 1 folds every token in one fused pass over S; additive rule only). With B > 1 each
  /// step reads S instead of rewriting it, and one rank-B product per B tokens updates it:
  /// same flops, half the state traffic, plus about 2 B (r + dv) flops per token. It can pay
  /// only when S does not fit L1, and the size of L1 does not decide it: measured with heads
  /// taking turns at r = dv = 128, it ran 1.2 x the fused step on an Intel Sapphire Rapids
  /// core (48 KiB L1), 0.7 to 0.8 x on AMD Zen 3 and Zen 4 (32 KiB) and 0.8 x on Zen 5
  /// (48 KiB), but 1.05 to 1.18 x on another Zen 3 VM on another day (docs/performance.md, "The
  /// decode block on AMD cores"). kAuto takes B = 16 where S is larger than the L1 data cache on
  /// an Intel core whose L1 holds at least 48 KiB, and 0 otherwise, where a wrong choice costs
  /// less (detail::auto_decode_block); the main command
  /// (scripts/bench.sh) times both in the same iterations and judges the default by their
  /// ratio. Costs B (2 r + dv + 1) scalars per state.
  Index decode_block = kAuto;
};

namespace detail {

/// Whether r x dv scalars fit in `capacity` scalars (by division: r dv may not fit an Index).
inline bool state_fits(Index r, Index dv, Index capacity) {
  return r <= 0 || dv <= 0 || r <= capacity / dv;
}

/// Options::chunk_size resolved for feature dim r and value dim dv.
inline Index resolve_chunk_size(const Options& options, Index r, Index dv, Index scalar_bytes) {
  if (options.chunk_size != kAuto) return options.chunk_size;
  return state_fits(r, dv, cache_sizes().l1d / scalar_bytes) ? 32 : 16;
}

/// The decode block kAuto takes for an r x dv state of `scalar_bytes`-byte scalars on a core
/// with an L1 data cache of `l1d` bytes made by `vendor` (Options::decode_block has the
/// measurements): 16 on Intel cores with at least 48 KiB of L1 when S does not fit it, else 0.
inline Index auto_decode_block(Index r, Index dv, Index scalar_bytes, Index l1d,
                               CpuVendor vendor) {
  constexpr Index large_l1 = 48 * 1024;
  return vendor == CpuVendor::intel && l1d >= large_l1 && !state_fits(r, dv, l1d / scalar_bytes)
             ? 16
             : 0;
}

/// Options::decode_block resolved for feature dim r and value dim dv on the machine that runs.
inline Index resolve_decode_block(const Options& options, Index r, Index dv, Index scalar_bytes) {
  if (options.decode_block != kAuto) return options.decode_block;
  return auto_decode_block(r, dv, scalar_bytes, cache_sizes().l1d, cpu_vendor());
}

/// Throws std::invalid_argument for option values no call could use.
inline void check_options(const Options& options) {
  if (options.chunk_size < 1 && options.chunk_size != kAuto)
    throw std::invalid_argument("linattn: Options::chunk_size must be >= 1 or kAuto");
  if (options.chunk_size > (Index{1} << 20))
    throw std::invalid_argument("linattn: Options::chunk_size must be at most 2^20");
  if (options.decode_block < 0 && options.decode_block != kAuto)
    throw std::invalid_argument("linattn: Options::decode_block must be >= 0 or kAuto");
  if (options.decode_block > 4096)
    throw std::invalid_argument("linattn: Options::decode_block must be at most 4096");
}

}  // namespace detail
}  // namespace linattn
