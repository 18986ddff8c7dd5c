// options.hpp: the machine-dependent defaults (chunk size and decode block from the L1 data
// cache of the machine that runs) and the options no call could use.

#include <linattn/attention.hpp>
#include <linattn/options.hpp>

#include <catch2/catch.hpp>

#include <limits>

using namespace linattn;

TEST_CASE("the cache sizes are read from the machine, with a plausible fallback", "[options]") {
  const auto& c = detail::cache_sizes();
  INFO("L1d " << c.l1d << " bytes, L2 " << c.l2 << " bytes");
  CHECK(c.l1d >= 4 * 1024);
  CHECK(c.l1d <= 4 * 1024 * 1024);
  CHECK(c.l2 >= c.l1d);
  CHECK(&detail::cache_sizes() == &c);  // read once
}

TEST_CASE("kAuto resolves the chunk size and decode block from the size of S against L1",
          "[options]") {
  const Index l1 = detail::cache_sizes().l1d;
  const Options automatic;
  // S of r x dv floats: 32 where it fits L1, 16 where it does not.
  const Index fits = 16;  // 16 x 16 floats = 1 KiB fits any L1
  CHECK(detail::resolve_chunk_size(automatic, fits, fits, 4) == 32);
  const Index big = 1024;  // 4 MiB: no L1
  CHECK(detail::resolve_chunk_size(automatic, big, big, 4) == 16);
  CHECK(detail::resolve_decode_block(automatic, fits, fits, 4) == 0);
  CHECK(detail::resolve_decode_block(automatic, big, big, 4) == (l1 >= 48 * 1024 ? 16 : 0));
  // Explicit values pass through; the attention resolves them the same way.
  Options explicit_options;
  explicit_options.chunk_size = 7;
  explicit_options.decode_block = 3;
  CHECK(detail::resolve_chunk_size(explicit_options, big, big, 4) == 7);
  CHECK(detail::resolve_decode_block(explicit_options, big, big, 4) == 3);
  const LinearAttention<EluPlusOne> attn;
  CHECK(attn.chunk_size(fits, fits) == 32);
  CHECK(attn.make_state(big, big).decode_block() == detail::resolve_decode_block(automatic, big, big, 4));
  // No overflow for absurd dimensions: the comparison divides.
  const Index huge = std::numeric_limits<Index>::max() / 2;
  CHECK(detail::resolve_chunk_size(automatic, huge, huge, 8) == 16);
}

TEST_CASE("options no call could use are refused when the attention is made", "[options]") {
  const auto refused = [](Index chunk, Index block) {
    Options o;
    o.chunk_size = chunk;
    o.decode_block = block;
    try {
      LinearAttention<EluPlusOne> attn(EluPlusOne{}, o);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  CHECK(refused(0, kAuto));
  CHECK(refused(-2, kAuto));
  CHECK(refused(Index{1} << 21, kAuto));
  CHECK(refused(kAuto, -2));
  CHECK(refused(kAuto, 5000));
  CHECK_FALSE(refused(1, 0));
  CHECK_FALSE(refused(kAuto, 4096));
  // A dividing normalization for a rule without a normalizer.
  CHECK_THROWS_AS((RuleAttention<L2Normalize, Delta>(L2Normalize{}, Options{})), std::invalid_argument);
}
