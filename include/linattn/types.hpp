#pragma once
/// \file types.hpp
/// Matrix aliases used across linattn. Outputs and states are row-major: one row per token
/// (outputs) or per key feature (state S), so a row is contiguous.

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

/// Causal or full (non-causal) attention.
enum class Mask { none, causal };

/// The scalar types linattn computes in.
template <class Scalar>
concept SupportedScalar = std::same_as<Scalar, float> || std::same_as<Scalar, double>;

}  // namespace linattn
