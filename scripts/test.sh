#!/usr/bin/env bash
# Builds linattn's tests and examples and runs every test through ctest.
#   bash scripts/test.sh              g++, Release (for AVX2 where the CPU has it), in build/test
#   bash scripts/test.sh --sanitize   clang, Debug with AddressSanitizer + UBSan, in build/asan
#                                     (CI runs both: every test under both compilers)
# The g++ build also builds the PyTorch component and runs its pytest suite (tests/torch),
# installing python3-torch, python3-pytest, libtorch-dev and pybind11-dev; LINATTN_TORCH=OFF
# skips it. The sanitizer build never builds it: an ASan-instrumented extension would need ASan
# preloaded into Debian's python3, which is not built for that.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
ensure_packages cmake make g++ libeigen3-dev catch2
(ensure_packages openmpi-bin libopenmpi-dev) || echo "linattn: no MPI: linattn::mpi's tests are skipped" >&2

if [ "${1:-}" = "--sanitize" ]; then
  ensure_packages clang libclang-rt-14-dev
  export CXX=clang++
  dir=build/asan
  # The examples, the headers-compile-alone check and the consumer builds are the g++ build's
  # (packaging, not code paths); here only the tests, to keep CI's time down (the sanitizers
  # are for the library's code, which the tests exercise).
  # Line tables instead of full debug info: the sanitizers' reports still name file and line,
  # and the build compiles about a sixth faster (clang 14, -O0, measured on one test file).
  flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-gline-tables-only
         -DLINATTN_SANITIZE=ON -DLINATTN_TORCH=OFF
         -DLINATTN_BUILD_EXAMPLES=OFF -DLINATTN_CHECK_PACKAGING=OFF)
  # LINATTN_FUZZ=ON also builds the libFuzzer targets here, in the same parallel build (CI
  # then runs them with LINATTN_FUZZ_DIR=build/asan bash scripts/fuzz.sh).
  if [ "${LINATTN_FUZZ:-OFF}" = "ON" ]; then flags+=(-DLINATTN_FUZZ=ON); fi
else
  dir=build/test
  # -O2, not CMake's Release default -O3: the same kernels and intrinsics run, and the build
  # compiles about 14% faster (g++ 12, the largest test file: 210 against 245 CPU seconds).
  flags=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG")
  # Every test at AVX2's packet width (x86-64-v3: 8 floats, FMA) where the CPU has it; the
  # sanitizer build runs them at the baseline's (SSE2, 4 floats) and native_tests at the host's
  # widest. Eigen starts its packets at a buffer's first aligned element, 32 bytes here against
  # the 16 that malloc guarantees the tests' buffers, so this build is where a result that
  # followed a buffer's address would show (tests/placement_test.cpp and the bit-for-bit
  # comparisons). LINATTN_TEST_ARCH=<-march value> picks another; =baseline, none.
  arch=${LINATTN_TEST_ARCH:-}
  if [ -z "$arch" ] && grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo; then
    arch=x86-64-v3
  fi
  if [ -n "$arch" ] && [ "$arch" != baseline ]; then
    flags+=("-DCMAKE_CXX_FLAGS=-march=$arch")
    echo "linattn: tests built with -march=$arch" >&2
  else
    flags+=("-DCMAKE_CXX_FLAGS=")
  fi
  if [ "${LINATTN_TORCH:-ON}" = "OFF" ]; then
    flags+=(-DLINATTN_TORCH=OFF)
  else
    ensure_packages python3-dev python3-torch python3-pytest libtorch-dev pybind11-dev
    flags+=(-DLINATTN_TORCH=ON)
  fi
fi
jobs=$(nproc)
cmake -S . -B "$dir" "${flags[@]}"
cmake --build "$dir" -j"$jobs"
ctest --test-dir "$dir" --output-on-failure -j"$jobs"
