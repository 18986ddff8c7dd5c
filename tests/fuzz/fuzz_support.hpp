#pragma once
// Shared by the fuzz targets: a reader of the fuzzer's bytes, and the contract every target
// checks (an exception from the documented set, never anything else).

#include <linattn/linattn.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <limits>

namespace linattn_fuzz {

/// Takes bytes from the front of the input; past the end it returns zeros.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  /// A value of every kind the contract names: ordinary, zero, subnormal, huge, NaN, Inf.
  template <class Scalar>
  Scalar special() {
    using L = std::numeric_limits<Scalar>;
    const std::uint8_t kind = u8();
    const auto mantissa = static_cast<Scalar>(static_cast<int>(u8()) - 128) / Scalar(32);
    switch (kind % 16) {
      case 0: return Scalar(0);
      case 1: return L::denorm_min() * static_cast<Scalar>(1 + u8());
      case 2: return L::max() / static_cast<Scalar>(1 + u8());
      case 3: return -L::max();
      case 4: return L::quiet_NaN();
      case 5: return L::infinity();
      case 6: return -L::infinity();
      case 7: return mantissa * Scalar(1e6);
      case 8: return mantissa * Scalar(-200);  // exp underflows for ELU+1 and random features
      default: return mantissa;
    }
  }
  [[nodiscard]] std::size_t left() const noexcept { return size_ - pos_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// Reports a broken contract and aborts, so the fuzzer keeps the input.
[[noreturn]] inline void broken(const char* what) {
  std::fprintf(stderr, "linattn fuzz: contract broken: %s\n", what);
  std::abort();
}

/// Runs f; returns 0 if it returned, 1 for a DenominatorError, 2 for a ShapeError or another
/// std::invalid_argument, 3 for a StateFormatError. Anything else breaks the contract.
template <class F>
int outcome(F&& f) {
  try {
    f();
    return 0;
  } catch (const linattn::DenominatorError&) {
    return 1;
  } catch (const std::invalid_argument&) {
    return 2;
  } catch (const linattn::StateFormatError&) {
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    broken("an exception outside the documented set");
  }
}

}  // namespace linattn_fuzz
