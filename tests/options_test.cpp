// options.hpp: the machine-dependent defaults (chunk size and decode block from the L1 data
// cache and CPU vendor of the machine that runs) and the options no call could use.

#include <linattn/attention.hpp>
#include <linattn/options.hpp>

#include <catch2/catch.hpp>

#include <fstream>
#include <limits>
#include <string>

namespace options_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;

namespace {
// /proc/cpuinfo's vendor_id; empty when there is no such file or line.
std::string proc_vendor_id() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("vendor_id", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? std::string() : line.substr(start);
  }
  return {};
}
}  // namespace

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
  const bool defers = l1 >= 48 * 1024 && detail::cpu_vendor() == detail::CpuVendor::intel;
  CHECK(detail::resolve_decode_block(automatic, big, big, 4) == (defers ? 16 : 0));
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

TEST_CASE("kAuto defers decode steps only on the cores where that measured faster", "[options]") {
  // Intel with a 48 KiB L1 (Sapphire Rapids) defers once S outgrows L1; AMD cores with the same
  // L1 (Zen 5) and every core with 32 KiB (Zen 3, Zen 4) run fused steps.
  using detail::auto_decode_block;
  using detail::CpuVendor;
  constexpr Index kib = 1024;
  // 128 x 128 floats are 64 KiB: larger than 48 KiB; 64 x 64 floats (16 KiB) fit it.
  CHECK(auto_decode_block(128, 128, 4, 48 * kib, CpuVendor::intel) == 16);
  CHECK(auto_decode_block(64, 64, 4, 48 * kib, CpuVendor::intel) == 0);
  CHECK(auto_decode_block(128, 128, 4, 48 * kib, CpuVendor::amd) == 0);
  CHECK(auto_decode_block(128, 128, 4, 32 * kib, CpuVendor::intel) == 0);
  CHECK(auto_decode_block(128, 128, 4, 48 * kib, CpuVendor::other) == 0);
  // The boundary is the L1's size in scalars: 96 x 128 floats are exactly 48 KiB (fits).
  CHECK(auto_decode_block(96, 128, 4, 48 * kib, CpuVendor::intel) == 0);
  CHECK(auto_decode_block(97, 128, 4, 48 * kib, CpuVendor::intel) == 16);
  CHECK(auto_decode_block(64, 128, 8, 48 * kib, CpuVendor::intel) == 16);  // 64 KiB of doubles
}

TEST_CASE("the CPU vendor read by CPUID is the one Linux reports", "[options]") {
  // An independent reading: /proc/cpuinfo's vendor_id on x86 Linux. Off x86 there is no CPUID
  // and cpu_vendor() says other.
  const std::string id = proc_vendor_id();
  const detail::CpuVendor v = detail::cpu_vendor();
  INFO("CPUID: " << detail::vendor_name(v) << "; /proc/cpuinfo: " << id);
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
  REQUIRE_FALSE(id.empty());
  const detail::CpuVendor expected = id == "GenuineIntel"   ? detail::CpuVendor::intel
                                     : id == "AuthenticAMD" ? detail::CpuVendor::amd
                                                            : detail::CpuVendor::other;
  CHECK(v == expected);
#elif !defined(__x86_64__) && !defined(__i386__)
  CHECK(v == detail::CpuVendor::other);  // no CPUID to read
#endif
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

}  // namespace options_test
