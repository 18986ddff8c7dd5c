#pragma once
/// \file errors.hpp
/// The two exception types of linattn: shape misuse and numerical domain errors.
///
/// Three error channels are kept apart: concepts and static_assert reject type misuse at
/// compile time, ShapeError (a std::invalid_argument) rejects inconsistent shapes, and the
/// normalization policy decides what a bad denominator does (by default: DenominatorError,
/// a std::domain_error).

#include <Eigen/Core>

#include <sstream>
#include <stdexcept>
#include <string>

namespace linattn {

/// Thrown when operand shapes do not fit together; the message names the shapes.
class ShapeError : public std::invalid_argument {
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

namespace detail {

/// "3x4" for an Eigen object, used in shape messages.
template <class Derived>
std::string shape_of(const Eigen::EigenBase<Derived>& x) {
  return std::to_string(x.rows()) + "x" + std::to_string(x.cols());
}

template <class... Parts>
[[noreturn]] void throw_shape_error(const Parts&... parts) {
  std::ostringstream os;
  os << "linattn: ";
  (os << ... << parts);
  throw ShapeError(os.str());
}

}  // namespace detail
}  // namespace linattn
