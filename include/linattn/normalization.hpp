#pragma once
/// \file normalization.hpp
/// The normalization policy: how a read turns the numerator phi(q)^T S and the denominator
/// phi(q)^T z into an output row.
///
///   strict()        y = num / den; den <= 0, NaN or Inf throws DenominatorError (default).
///                   Linear attention's weighted average (Katharopoulos et al. 2020); nothing
///                   is clamped.
///   clamped(eps)    y = num / max(den, eps). Changes the result wherever den < eps: a row whose
///                   weights nearly cancel is scaled down instead of blowing up. NaN/Inf still throw.
///   shifted(eps)    y = num / (den + eps), the convention of fast-transformers (eps = 1e-6 added
///                   after the dot product). Biases every row by a relative eps/den; a result
///                   den + eps <= 0, NaN or Inf still throws.
///   unnormalized()  y = num, the read of gated/delta modules that apply their own norm later.
///                   z is still maintained so the state stays interchangeable.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <cmath>
#include <limits>
#include <sstream>

namespace linattn {

/// Value-type policy for the denominator of a normalized read. Cheap to copy.
class Normalization {
 public:
  enum class Kind { strict, clamped, shifted, unnormalized };

  /// The default: a strictly positive, finite denominator or DenominatorError.
  constexpr Normalization() = default;

  [[nodiscard]] static constexpr Normalization strict() { return {}; }
  /// Opt-in clamp: divide by max(den, eps); eps must be positive and finite.
  [[nodiscard]] static Normalization clamped(double eps) { return {Kind::clamped, checked(eps)}; }
  /// Opt-in shift: divide by den + eps; eps must be positive and finite.
  [[nodiscard]] static Normalization shifted(double eps) { return {Kind::shifted, checked(eps)}; }
  /// No division: y = phi(q)^T S.
  [[nodiscard]] static constexpr Normalization unnormalized() {
    return {Kind::unnormalized, 0.0};
  }

  [[nodiscard]] constexpr Kind kind() const noexcept { return kind_; }
  [[nodiscard]] constexpr double epsilon() const noexcept { return eps_; }
  [[nodiscard]] constexpr bool divides() const noexcept { return kind_ != Kind::unnormalized; }

  /// The divisor to use for a raw denominator `den` of query `row`; throws DenominatorError
  /// when the policy does not accept it. O(1).
  template <class Scalar>
  [[nodiscard]] Scalar divisor(Scalar den, Index row) const {
    Scalar out = den;
    switch (kind_) {
      case Kind::strict:
        break;
      case Kind::clamped:
        if (std::isfinite(den) && den < static_cast<Scalar>(eps_)) out = static_cast<Scalar>(eps_);
        break;
      case Kind::shifted:
        out = den + static_cast<Scalar>(eps_);
        break;
      case Kind::unnormalized:
        return Scalar(1);
    }
    if (!(out > 0) || !std::isfinite(out)) raise(static_cast<double>(den), row);
    return out;
  }

 private:
  constexpr Normalization(Kind kind, double eps) : kind_(kind), eps_(eps) {}

  static double checked(double eps) {
    if (!(eps > 0) || !std::isfinite(eps)) {
      std::ostringstream os;
      os << "linattn: normalization epsilon must be positive and finite, got " << eps;
      throw std::invalid_argument(os.str());
    }
    return eps;
  }

  [[noreturn]] void raise(double den, Index row) const {
    std::ostringstream os;
    os.precision(std::numeric_limits<double>::max_digits10);
    os << "linattn: denominator phi(q)^T z = " << den << " at query row " << row
       << " is not strictly positive and finite";
    if (kind_ == Kind::strict)
      os << "; the weighted average is undefined there (use a positive feature map such as "
            "EluPlusOne, or opt in to Normalization::clamped(eps) or ::unnormalized())";
    throw DenominatorError(os.str(), row, den);
  }

  Kind kind_ = Kind::strict;
  double eps_ = 0.0;
};

}  // namespace linattn
