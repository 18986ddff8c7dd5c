#pragma once
// The data-cache sizes of the machine that runs, read once at run time, for the defaults that
// depend on them (Options' chunk size and decode block). Linux reports them through sysconf
// (glibc) or sysfs; elsewhere, or when neither answers, the fallback is a typical x86 core
// (32 KiB L1d, 1 MiB L2).

#include <linattn/types.hpp>

#include <cstdio>

#if defined(__linux__)
#include <unistd.h>
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

}  // namespace linattn::detail
