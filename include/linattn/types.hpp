#pragma once
/// \file types.hpp
/// The vocabulary types of linattn: matrix aliases, views of rows, and the attention mask.
/// Outputs and states are row-major: one row per token (outputs) or per key feature (state S),
/// so a row is contiguous.

#include <Eigen/Core>

#include <concepts>
#include <cstddef>

namespace linattn {

using Index = Eigen::Index;

/// Alignment of a recurrent state object, in bytes: two x86 cache lines (the pair an x86 core
/// prefetches together), so that states written by different threads never share one.
inline constexpr std::size_t kStateAlignment = 128;

/// Row-major dynamic matrix, the layout of every output and of the state S.
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Dynamic row vector (one token's output, one row of features).
template <class Scalar>
using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

/// Dynamic column vector (the normalizer z).
template <class Scalar>
using ColVector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// A read-only view of rows that lie `outerStride()` elements apart, each contiguous: one
/// head of a [T, H d] buffer, a block of a row-major matrix, or a whole matrix. The grouped
/// calls take a span of these, one per query head (TensorView::head_matrix returns one).
template <class Scalar>
using ConstRowsView = Eigen::Map<const RowMatrix<Scalar>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// A writable view of rows, as ConstRowsView (the outputs of a grouped call).
template <class Scalar>
using RowsView = Eigen::Map<RowMatrix<Scalar>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Causal or full (non-causal) attention.
///
/// `Mask::none` and `Mask::causal` are constants of distinct types that convert to a run-time
/// Mask, so a call that has both forms takes either (or a Mask chosen at run time), while a
/// call with only the causal form (a write rule other than Additive) accepts `Mask::causal`
/// alone and rejects the rest at compile time. Being of two types, they do not mix in `?:`;
/// a mask chosen at run time is `Mask::causal_if(flag)`.
class Mask {
 public:
  enum class Kind : unsigned char { none, causal };

  /// The type of Mask::none and Mask::causal.
  template <Kind K>
  struct Constant {
    static constexpr Kind kind = K;
    constexpr operator Mask() const noexcept { return Mask(K); }  // NOLINT(google-explicit-constructor)
  };

  /// Every query reads every key (Tq may differ from Tk).
  static constexpr Constant<Kind::none> none{};
  /// Query i reads keys j <= i.
  static constexpr Constant<Kind::causal> causal{};

  constexpr Mask(Kind kind) noexcept : kind_(kind) {}  // NOLINT(google-explicit-constructor)
  /// Mask::causal when `causal`, else Mask::none, as a run-time Mask.
  [[nodiscard]] static constexpr Mask causal_if(bool causal) noexcept {
    return Mask(causal ? Kind::causal : Kind::none);
  }

  [[nodiscard]] constexpr Kind kind() const noexcept { return kind_; }
  [[nodiscard]] constexpr bool is_causal() const noexcept { return kind_ == Kind::causal; }
  friend constexpr bool operator==(Mask, Mask) noexcept = default;

 private:
  Kind kind_;
};

/// The type of Mask::causal: what the causal-only calls take.
using CausalMask = Mask::Constant<Mask::Kind::causal>;

/// The scalar types linattn computes in.
template <class Scalar>
concept SupportedScalar = std::same_as<Scalar, float> || std::same_as<Scalar, double>;

}  // namespace linattn
