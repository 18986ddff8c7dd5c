#pragma once
/// \file errors.hpp
/// The exceptions of linattn.
///
/// Three error channels are kept apart: concepts and static_assert reject type misuse at
/// compile time; ShapeError and StateMismatchError (std::invalid_argument) reject arguments
/// that do not fit together; the normalization policy decides what a bad denominator does
/// (by default DenominatorError, a std::domain_error). StateFormatError (std::runtime_error)
/// rejects saved bytes that are not a state the caller can restore.
/// docs/input_contract.md lists which input throws what.

#include <Eigen/Core>

#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace linattn {

/// Thrown when operand shapes do not fit together (or a size does not fit an Index); the
/// message names the shapes.
class ShapeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown when a state is used with an attention other than the kind that made it: another
/// feature map (or another draw of a random one), another write rule or rule parameter.
class StateMismatchError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown when a normalized read meets a denominator phi(q)^T z that is <= 0, NaN or Inf.
/// row() is the query row (within the call) and value() the offending denominator.
class DenominatorError : public std::domain_error {
 public:
  DenominatorError(const std::string& what, Eigen::Index row, double value)
      : std::domain_error(what), row_(row), value_(value) {}
  [[nodiscard]] Eigen::Index row() const noexcept { return row_; }
  [[nodiscard]] double value() const noexcept { return value_; }

 private:
  Eigen::Index row_;
  double value_;
};

/// Thrown when a byte blob is not a state that can be restored here; what() says why and
/// reason() classifies it. A std::runtime_error: the blob is external data.
class StateFormatError : public std::runtime_error {
 public:
  enum class Reason {
    truncated,             ///< fewer bytes than the header or the stored size says
    bad_magic,             ///< not a linattn state blob
    unsupported_version,   ///< a format version this build does not read
    size_mismatch,         ///< bytes after the stored size, or a size that does not add up
    checksum_mismatch,     ///< the bytes were changed after writing
    scalar_type_mismatch,  ///< float state into a double state or the reverse
    feature_map_mismatch,  ///< saved with another feature map (name or fingerprint)
    rule_mismatch,         ///< saved with another write rule or rule parameter
    shape_mismatch,        ///< heads or dims differ from the restoring state
    bad_value              ///< a stored value no state can hold (NaN in S, a huge count)
  };

  StateFormatError(Reason reason, const std::string& what)
      : std::runtime_error("linattn: cannot restore state: " + what), reason_(reason) {}
  [[nodiscard]] Reason reason() const noexcept { return reason_; }

 private:
  Reason reason_;
};

namespace detail {

/// "3x4" for an Eigen object, used in shape messages.
template <class Derived>
std::string shape_of(const Eigen::EigenBase<Derived>& x) {
  return std::to_string(x.rows()) + "x" + std::to_string(x.cols());
}

template <class Exception = ShapeError, class... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  std::ostringstream os;
  os << "linattn: ";
  (os << ... << parts);
  throw Exception(os.str());
}

template <class... Parts>
[[noreturn]] void throw_shape_error(const Parts&... parts) {
  throw_error<ShapeError>(parts...);
}

/// a * b, or ShapeError naming `what` when the product of two non-negative sizes does not fit
/// an Index (sizes computed from user dimensions are checked before anything is allocated).
inline Eigen::Index checked_product(Eigen::Index a, Eigen::Index b, const char* what) {
  if (a < 0 || b < 0 || (a != 0 && b > std::numeric_limits<Eigen::Index>::max() / a))
    throw_shape_error(what, " = ", a, " x ", b, " does not fit an Index");
  return a * b;
}

/// a + b for non-negative sizes, or ShapeError naming `what`.
inline Eigen::Index checked_sum(Eigen::Index a, Eigen::Index b, const char* what) {
  if (a < 0 || b < 0 || b > std::numeric_limits<Eigen::Index>::max() - a)
    throw_shape_error(what, " = ", a, " + ", b, " does not fit an Index");
  return a + b;
}

}  // namespace detail
}  // namespace linattn
