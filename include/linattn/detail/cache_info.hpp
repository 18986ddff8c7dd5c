#pragma once
// What the machine that runs is, read once at run time, for the defaults that depend on it
// (Options' chunk size and decode block): its data-cache sizes and its CPU's vendor. Linux
// reports the sizes through sysconf (glibc) or sysfs; elsewhere, or when neither answers, the
// fallback is a typical x86 core (32 KiB L1d, 1 MiB L2). The vendor comes from CPUID on x86
// (GCC and clang); elsewhere it is CpuVendor::other.

#include <linattn/types.hpp>

#include <cstdio>
#include <cstring>

#if defined(__linux__)
#include <unistd.h>
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace linattn::detail {

/// Per-core data-cache sizes in bytes.
struct CacheSizes {
  Index l1d = 32 * 1024;
  Index l2 = 1024 * 1024;
};

/// Parses sysfs's "48K" or "2048K" (or a plain byte count); 0 when unreadable.
inline Index read_cache_size_file(const char* path) {
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  long long value = 0;
  char unit = 0;
  const int fields = std::fscanf(f, "%lld%c", &value, &unit);
  std::fclose(f);
  if (fields < 1 || value <= 0) return 0;
  if (unit == 'K') value *= 1024;
  if (unit == 'M') value *= 1024 * 1024;
  return static_cast<Index>(value);
}

/// The sizes of cpu0's caches (sysconf, then sysfs, then the fallback); computed once.
inline const CacheSizes& cache_sizes() {
  static const CacheSizes sizes = [] {
    CacheSizes s;
#if defined(__linux__)
    Index l1 = 0, l2 = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    l1 = static_cast<Index>(sysconf(_SC_LEVEL1_DCACHE_SIZE));
    l2 = static_cast<Index>(sysconf(_SC_LEVEL2_CACHE_SIZE));
#endif
    // index0 is the L1 data cache and index2 the L2 on x86 and most ARM cores.
    if (l1 <= 0) l1 = read_cache_size_file("/sys/devices/system/cpu/cpu0/cache/index0/size");
    if (l2 <= 0) l2 = read_cache_size_file("/sys/devices/system/cpu/cpu0/cache/index2/size");
    if (l1 > 0) s.l1d = l1;
    if (l2 > 0) s.l2 = l2;
#endif
    return s;
  }();
  return sizes;
}

/// Who made the CPU: the cores measured so far differ by vendor where cache sizes do not
/// (Options::decode_block).
enum class CpuVendor { other, intel, amd };

/// The vendor of the CPU that runs (CPUID leaf 0); computed once.
inline CpuVendor cpu_vendor() {
  static const CpuVendor vendor = [] {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    unsigned int max_leaf = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &max_leaf, &ebx, &ecx, &edx) != 0) {
      char name[13] = {};
      std::memcpy(name, &ebx, 4);
      std::memcpy(name + 4, &edx, 4);
      std::memcpy(name + 8, &ecx, 4);
      if (std::strcmp(name, "GenuineIntel") == 0) return CpuVendor::intel;
      if (std::strcmp(name, "AuthenticAMD") == 0) return CpuVendor::amd;
    }
#endif
    return CpuVendor::other;
  }();
  return vendor;
}

/// "Intel", "AMD" or "other": for reports.
inline const char* vendor_name(CpuVendor vendor) noexcept {
  switch (vendor) {
    case CpuVendor::intel: return "Intel";
    case CpuVendor::amd: return "AMD";
    default: return "other";
  }
}

}  // namespace linattn::detail
