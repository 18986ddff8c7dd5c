#pragma once
// Little-endian byte encoding and the FNV-1a 64-bit checksum used by serialize.hpp.
// Integers and IEEE-754 scalars are written byte by byte with shifts, so the format is the
// same on any host byte order.

#include <linattn/types.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// FNV-1a, 64-bit (offset basis 14695981039346656037, prime 1099511628211), over `bytes`.
/// Catches every single-byte change and, with high probability, any other corruption; it is
/// a checksum, not a defence against deliberate tampering.
inline std::uint64_t fnv1a64(std::span<const std::byte> bytes) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint64_t>(b);
    h *= 1099511628211ull;
  }
  return h;
}

/// Appends little-endian values to a byte vector.
class ByteWriter {
 public:
  explicit ByteWriter(std::vector<std::byte>& out) : out_(out) {}

  template <class U>
    requires std::is_unsigned_v<U>
  void put_uint(U value) {
    for (std::size_t i = 0; i < sizeof(U); ++i)
      out_.push_back(static_cast<std::byte>((value >> (8 * i)) & 0xffu));
  }
  void put_u32(std::uint32_t v) { put_uint(v); }
  void put_u64(std::uint64_t v) { put_uint(v); }
  void put_scalar(float v) { put_uint(std::bit_cast<std::uint32_t>(v)); }
  void put_scalar(double v) { put_uint(std::bit_cast<std::uint64_t>(v)); }
  void put_bytes(std::string_view s) {
    for (char c : s) out_.push_back(static_cast<std::byte>(c));
  }
  /// Overwrites 8 bytes at `offset` with v (used for the total size, known at the end).
  void patch_u64(std::size_t offset, std::uint64_t v) {
    for (std::size_t i = 0; i < 8; ++i)
      out_[offset + i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
  }
  [[nodiscard]] std::size_t size() const noexcept { return out_.size(); }

 private:
  std::vector<std::byte>& out_;
};

/// Reads little-endian values from a byte span; the caller checks remaining() first, and a
/// read past the end returns false instead of touching memory outside the span.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> in) : in_(in) {}

  [[nodiscard]] std::size_t remaining() const noexcept { return in_.size() - pos_; }
  [[nodiscard]] std::size_t position() const noexcept { return pos_; }

  template <class U>
    requires std::is_unsigned_v<U>
  [[nodiscard]] bool get_uint(U& value) noexcept {
    if (remaining() < sizeof(U)) return false;
    U v = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i)
      v |= static_cast<U>(static_cast<U>(in_[pos_ + i]) << (8 * i));
    pos_ += sizeof(U);
    value = v;
    return true;
  }
  [[nodiscard]] bool get_scalar(float& v) noexcept {
    std::uint32_t bits = 0;
    if (!get_uint(bits)) return false;
    v = std::bit_cast<float>(bits);
    return true;
  }
  [[nodiscard]] bool get_scalar(double& v) noexcept {
    std::uint64_t bits = 0;
    if (!get_uint(bits)) return false;
    v = std::bit_cast<double>(bits);
    return true;
  }
  [[nodiscard]] bool get_bytes(std::size_t n, std::string& out) {
    if (remaining() < n) return false;
    out.assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }

 private:
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

}  // namespace linattn::detail
