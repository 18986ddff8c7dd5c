#pragma once
/// \file feature_maps.hpp
/// Feature-map policies phi: R^d -> R^r and the FeatureMap concept that checks them.
///
/// A feature map is a small value type. Linear attention scores a query q against a key k by
/// phi(q)^T phi(k); the map defines that kernel, and results are exact for that kernel only.
///
/// To write your own, provide (see examples/custom_feature_map.cpp):
///   static constexpr bool strictly_positive;           // every feature > 0 for finite input?
///   Index feature_dim(Index d) const;                  // r for input dimension d
///   template <class In, class Out>
///   void apply(const In& x, Out& out) const;           // out (T x r) = phi of each row of x (T x d)
/// `In` is any Eigen expression with T rows; `out` is already sized T x r (an Eigen::Ref to
/// row-major storage), so apply must not resize it.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <concepts>
#include <type_traits>

namespace linattn {

/// A feature-map policy usable with LinearAttention<Phi, Scalar>.
template <class Phi, class Scalar = float>
concept FeatureMap =
    std::copy_constructible<Phi> &&
    requires(const Phi& phi, Index d, const RowMatrix<Scalar>& x,
             Eigen::Ref<RowMatrix<Scalar>> out) {
      { std::bool_constant<Phi::strictly_positive>::value } -> std::convertible_to<bool>;
      { phi.feature_dim(d) } -> std::convertible_to<Index>;
      phi.apply(x, out);
    };

/// phi(x) = x. The plain dot-product kernel q^T k; features can be negative or cancel, so the
/// normalized read can meet a zero or negative denominator (which is then an error).
/// Cost: one copy, T*d.
struct Identity {
  static constexpr bool strictly_positive = false;
  static constexpr const char* name = "identity";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    out = x;
  }
};

namespace detail {
/// True for a row-major (or row-vector) expression with storage and unit inner stride.
template <class X>
constexpr bool has_contiguous_rows() {
  if constexpr ((X::Flags & Eigen::DirectAccessBit) != 0)
    return X::IsRowMajor && X::InnerStrideAtCompileTime == 1;
  else
    return false;
}
}  // namespace detail

/// phi(x) = ELU(x) + 1, elementwise: x + 1 for x > 0, exp(x) for x <= 0 (Katharopoulos et al.
/// 2020, section 3.2). Positive for finite input, so the denominator is positive in exact
/// arithmetic; exp(x) underflows to 0 below about -87 (float) or -708 (double).
/// Cost: T*d exponentials, vectorized.
struct EluPlusOne {
  static constexpr bool strictly_positive = true;
  static constexpr const char* name = "elu_plus_one";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    // max(x, 0) + exp(min(x, 0)) is x + 1 for x > 0 (exp(0) = 1 exactly) and exp(x) otherwise,
    // the definition without a branch: every operation has a SIMD packet form (Eigen's select()
    // has none, which made this map one scalar expf call per element, the main cost of a
    // token). exp(m) is taken as exp(m / 2)^2 because Eigen's vectorized exp clamps its input
    // (at about -88 in float, -708 in double) and so never returns 0 or a subnormal: halving
    // keeps the input in range down to twice that, and the square then underflows to the
    // subnormal or 0 that std::exp would give. Cost: one extra multiply; error about 2 ulp
    // (exp's ~1 ulp, doubled by the square, plus one rounding). NaN propagates (Eigen's max and
    // min return the NaN operand, as std::max does).
    // Eigen takes the SIMD exp where it can load packets and the scalar std::exp elsewhere, and
    // the two differ in the last bit. Which elements take which path depends only on the
    // destination when the input rows are contiguous, so other inputs (column-major, strided
    // rows, expressions) are first copied into `out` and transformed there: the result is the
    // same whatever the caller's layout.
    using Scalar = typename Out::Scalar;
    const auto f = [](const auto& v) {
      return v.max(Scalar(0)) + (v.min(Scalar(0)) * Scalar(0.5)).exp().square();
    };
    if constexpr (detail::has_contiguous_rows<In>()) {
      out = f(x.array()).matrix();
    } else {
      out = x;
      out.array() = f(out.array());
    }
  }
};

namespace detail {

/// The feature map's name if it declares one, for messages and serialized state.
template <class Phi>
constexpr const char* feature_map_name() {
  if constexpr (requires { Phi::name; }) {
    return Phi::name;
  } else {
    return "user";
  }
}

}  // namespace detail
}  // namespace linattn
