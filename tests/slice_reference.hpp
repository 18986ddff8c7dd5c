#pragma once
// Rounding bounds for a causal prefill split into contiguous slices (sequence parallelism,
// detail/slice_runner.hpp and linattn/mpi.hpp) against the same prefill in one piece, from
// double-precision recurrences written from the formulas (not from the library's kernels).
// Both results err from the exact one; the bound on their difference is the sum of the two
// allowances, each derived as in rule_reference.hpp.

#include <linattn/attention.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "rule_reference.hpp"
#include "test_support.hpp"

namespace linattn_test {

/// Features of every row of X in double (T x r).
template <class M>
MatrixXdR feature_rows(const M& X, Phi phi) {
  MatrixXdR F;
  for (Index t = 0; t < X.rows(); ++t) {
    const Eigen::RowVectorXd f = features(X.row(t), phi);
    if (t == 0) F.resize(X.rows(), f.size());
    F.row(t) = f;
  }
  return F;
}

/// Decayed and gated rules (Additive: log-gates 0; Decay: log(gamma) everywhere; Gated: the
/// T x 1 or T x r log-gates), split into `slices` slices, against one piece; in units of u.
///
/// One piece errs by at most sum_j a_ij |w|_ij (|v_j| + |y_i|) / |D_i| per output element
/// (rule_reference.hpp: a_ij = r + T + 4 + 2 m + min(m, C) max_n |d_ijn|, m = i - j). Split,
/// a key j of an earlier slice reaches row i through the carried state: its term is summed
/// into that slice's summary (the same chunked kernel, within a_ij), then into at most P
/// summaries in turn (P additions), decayed by at most P slice decays exp(sum log g) taken in
/// double and rounded (P multiplications, P roundings), and read with the query scaled by its
/// decay (one rounding), one more addition to the slice's own numerator, z rounded once and the
/// denominator rounded once: a_ij + 3 P + 6. The bound is sum_j (2 a_ij + 3 P + 6) |w|_ij ...
/// (numerator and denominator errors of a weighted average of positive weights; without
/// normalization the |y_i| term and the division drop out).
template <class MQ, class MK, class MV>
MatrixXdR split_gated_output_bound(const MQ& Q, const MK& K, const MV& V, const MatrixXdR& lg,
                                   Phi phi, bool normalize, Index chunk, Index slices) {
  const Index T = Q.rows(), dv = V.cols();
  MatrixXdR bound = MatrixXdR::Zero(T, dv);
  if (T == 0) return bound;
  const MatrixXdR qf = feature_rows(Q, phi), kf = feature_rows(K, phi);
  const Index r = qf.cols();
  const double extra = 3.0 * double(slices) + 6.0;
  Eigen::RowVectorXd d(r);
  for (Index i = 0; i < T; ++i) {
    Eigen::VectorXd w(i + 1), w_abs(i + 1), a(i + 1);
    d.setZero();
    double den = 0;
    for (Index j = i; j >= 0; --j) {
      if (j < i)
        d += lg.cols() == 1 ? Eigen::RowVectorXd::Constant(r, lg(j + 1, 0))
                            : Eigen::RowVectorXd(lg.row(j + 1));
      const Index m = i - j;
      w(j) = w_abs(j) = 0;
      for (Index n = 0; n < r; ++n) {
        const double e = std::exp(d(n));
        w(j) += qf(i, n) * kf(j, n) * e;
        w_abs(j) += std::abs(qf(i, n) * kf(j, n)) * e;
      }
      a(j) = double(r + T + 4 + 2 * m) + double(std::min(m, chunk)) * d.cwiseAbs().maxCoeff();
      den += w(j);
    }
    for (Index c = 0; c < dv; ++c) {
      double num = 0;
      for (Index j = 0; j <= i; ++j) num += w(j) * double(V(j, c));
      const double y = normalize ? num / den : num;
      double allow = 0;
      for (Index j = 0; j <= i; ++j)
        allow += (2 * a(j) + extra) * w_abs(j) *
                 (std::abs(double(V(j, c))) + (normalize ? std::abs(y) : 0.0));
      bound(i, c) = normalize ? allow / std::abs(den) : allow;
    }
  }
  return bound;
}

/// The state after the first `prefix` tokens (r x dv), split into `slices` slices against one
/// piece, in units of u: S = sum_j e_j .* kf_j v_j^T with e_j the decay from j to the end; per
/// element sum_j (2 a_j + 3 P + 6) e_jn |kf_jn| |v_jc|, a_j as above with m = prefix - 1 - j.
template <class MK, class MV>
MatrixXdR split_gated_state_bound(const MK& K, const MV& V, const MatrixXdR& lg, Phi phi,
                                  Index prefix, Index chunk, Index slices) {
  const MatrixXdR kf = feature_rows(K.topRows(prefix), phi);
  const Index r = kf.cols() > 0 ? kf.cols() : K.cols(), dv = V.cols();
  MatrixXdR bound = MatrixXdR::Zero(r, dv);
  Eigen::RowVectorXd d = Eigen::RowVectorXd::Zero(r);
  for (Index j = prefix - 1; j >= 0; --j) {
    if (j < prefix - 1)
      d += lg.cols() == 1 ? Eigen::RowVectorXd::Constant(r, lg(j + 1, 0))
                          : Eigen::RowVectorXd(lg.row(j + 1));
    const Index m = prefix - 1 - j;
    const double a = double(r + prefix + 4 + 2 * m) +
                     double(std::min(m, chunk)) * d.cwiseAbs().maxCoeff();
    for (Index n = 0; n < r; ++n)
      for (Index c = 0; c < dv; ++c)
        bound(n, c) += (2 * a + 3.0 * double(slices) + 6.0) * std::exp(d(n)) *
                       std::abs(kf(j, n) * double(V(j, c)));
  }
  return bound;
}

/// The (gated) delta rules, split at `lengths` (in order, summing to T), against one piece, in
/// units of u. With |k| = 1, alpha in (0, 1] and beta in [0, 2] no step amplifies, so errors
/// add up without growing (rule_reference.hpp): one piece's S_t errs by at most
/// E(t) = sum_{s<=t} 2 (r + C + 4) max(1, beta_s) (|S_{s-1}|_F + |v_s|) in Frobenius norm. Split, slice p
/// runs [A | B] (r x (r + dv)) from [I | 0] with values [0 | v]: the same allowance on that
/// state, |[A | B]| <= |A|_F |C_p|_F + |B|_F against the carry C_p, then S_t = A_t C_p + B_t adds
/// (r + 2) (|A_t|_F |C_p|_F + |B_t|_F), and the carry's own error passes through A_t unchanged
/// (|A_t|_2 <= 1). A row's output differs by at most |qf_t| (E(t) + E_split(t)). Per-channel
/// log_alpha (T x r: S_t = (I - beta k k^T) diag(alpha_t) S_{t-1} + beta k v^T) adds
/// 2 (2 C + 2) per step, the chunk's gate products (rule_reference.hpp's naive_delta).
struct DeltaSplitBound {
  Eigen::VectorXd outputs;            // per row, for every element of the row
  std::vector<double> states;         // per slice: the state after it (Frobenius norm)
};

template <class MQ, class MK, class MV, class MB, class MA>
DeltaSplitBound split_delta_bound(const MQ& Q, const MK& K, const MV& V, const MB& beta,
                                  const MA& log_alpha, Phi phi, Index chunk,
                                  const std::vector<Index>& lengths) {
  const Index T = Q.rows(), dv = V.cols();
  DeltaSplitBound out{Eigen::VectorXd::Zero(T), {}};
  const MatrixXdR qf = feature_rows(Q, phi), kf = feature_rows(K, phi);
  const Index r = kf.cols() > 0 ? kf.cols() : K.cols();
  const bool per_channel = log_alpha.size() > 0 && log_alpha.cols() > 1;
  const Index c = std::min(chunk, std::max<Index>(T, 1));
  const double step_units =
      2.0 * double(r + c + 4) + (per_channel ? 2.0 * double(2 * c + 2) : 0.0);
  const auto factor = [&](Index t) {
    const Eigen::VectorXd k = kf.row(t).transpose();
    const Eigen::MatrixXd I_bkk =
        Eigen::MatrixXd::Identity(r, r) - double(beta(t)) * k * k.transpose();
    if (per_channel)
      return Eigen::MatrixXd(
          I_bkk * log_alpha.row(t).transpose().array().exp().matrix().asDiagonal());
    const double alpha = log_alpha.size() > 0 ? std::exp(double(log_alpha(t, 0))) : 1.0;
    return Eigen::MatrixXd(alpha * I_bkk);
  };
  // One piece.
  Eigen::MatrixXd S = Eigen::MatrixXd::Zero(r, dv);
  Eigen::VectorXd single(T);
  std::vector<Eigen::MatrixXd> carries;  // the exact state before each slice
  double budget = 0;
  Index next_slice = 0, slice_start = 0;
  for (Index t = 0; t <= T; ++t) {
    while (next_slice < Index(lengths.size()) && slice_start == t) {
      carries.push_back(S);
      slice_start += lengths[std::size_t(next_slice++)];
    }
    if (t == T) break;
    const Eigen::VectorXd v = V.row(t).template cast<double>().transpose();
    budget += step_units * std::max(1.0, double(beta(t))) * (S.norm() + v.norm());
    S = factor(t) * S + double(beta(t)) * kf.row(t).transpose() * v.transpose();
    single(t) = budget;
  }
  // Split.
  double carry_error = 0;
  Index first = 0;
  for (std::size_t p = 0; p < lengths.size(); ++p) {
    const double c_norm = carries[p].norm();
    Eigen::MatrixXd A = Eigen::MatrixXd::Identity(r, r), B = Eigen::MatrixXd::Zero(r, dv);
    double split = 0;
    for (Index t = first; t < first + lengths[p]; ++t) {
      const Eigen::VectorXd v = V.row(t).template cast<double>().transpose();
      split += step_units * std::max(1.0, double(beta(t))) * (A.norm() * c_norm + B.norm() + v.norm());
      const Eigen::MatrixXd F = factor(t);
      A = F * A;
      B = F * B + double(beta(t)) * kf.row(t).transpose() * v.transpose();
      const double compose = double(r + 2) * (A.norm() * c_norm + B.norm());
      out.outputs(t) = qf.row(t).norm() * (single(t) + carry_error + split + compose);
    }
    carry_error += split + double(r + 2) * (A.norm() * c_norm + B.norm());
    const Index last = first + lengths[p] - 1;
    out.states.push_back((last >= 0 ? single(last) : 0.0) + carry_error);
    first += lengths[p];
  }
  return out;
}

}  // namespace linattn_test

namespace linattn_test {

/// Calls f(name, attention, phi, log_gates, beta, log_alpha, inputs...) for every write rule:
/// Additive, Decay(0.95), Gated with scalar and with per-channel log-gates, Delta and
/// GatedDelta (one log_alpha per token, and per channel: Kimi Delta Attention), with their
/// per-token inputs for T tokens (Scalar, T x 1 or T x r) and the same
/// in double for the bounds (log_gates: the log-gates the kernels use, 0 for Additive; beta and
/// log_alpha empty where the rule has none). Feature dims r = dk. The delta rules use
/// L2Normalize (unit keys: every step a contraction), the others EluPlusOne.
template <class Scalar, class F>
void for_each_rule(Index T, Index dk, std::uint64_t seed, F&& f) {
  using namespace linattn;
  const MatrixXdR none;
  const auto as_double = [](const RowMatrix<Scalar>& m) { return MatrixXdR(m.template cast<double>()); };
  {
    const LinearAttention<EluPlusOne, Scalar> attention;
    f("additive", attention, Phi::elu_plus_one, MatrixXdR(MatrixXdR::Zero(T, 1)), none, none);
  }
  {
    const RuleAttention<EluPlusOne, Decay, Scalar> attention(EluPlusOne{}, Decay(0.95));
    const double lg = static_cast<double>(static_cast<Scalar>(std::log(0.95)));
    f("decay", attention, Phi::elu_plus_one, MatrixXdR(MatrixXdR::Constant(T, 1, lg)), none, none);
  }
  {
    const RuleAttention<EluPlusOne, Gated, Scalar> attention;
    const RowMatrix<Scalar> lg = uniform_matrix<Scalar>(T, 1, seed + 10, -0.2, 0.0);
    f("gated (scalar gates)", attention, Phi::elu_plus_one, as_double(lg), none, none, lg);
  }
  {
    const RuleAttention<EluPlusOne, Gated, Scalar> attention;
    const RowMatrix<Scalar> lg = uniform_matrix<Scalar>(T, dk, seed + 11, -0.2, 0.0);
    f("gated (per-channel gates)", attention, Phi::elu_plus_one, as_double(lg), none, none, lg);
  }
  {
    const RuleAttention<L2Normalize, Delta, Scalar> attention;
    const RowMatrix<Scalar> beta = uniform_matrix<Scalar>(T, 1, seed + 12, 0.0, 1.0);
    f("delta", attention, Phi::l2_normalize, none, as_double(beta), none, beta);
  }
  {
    const RuleAttention<L2Normalize, GatedDelta, Scalar> attention;
    const RowMatrix<Scalar> beta = uniform_matrix<Scalar>(T, 1, seed + 13, 0.0, 1.0);
    const RowMatrix<Scalar> log_alpha = uniform_matrix<Scalar>(T, 1, seed + 14, -0.1, 0.0);
    f("gated_delta", attention, Phi::l2_normalize, none, as_double(beta), as_double(log_alpha),
      beta, log_alpha);
  }
  {
    const RuleAttention<L2Normalize, GatedDelta, Scalar> attention;
    const RowMatrix<Scalar> beta = uniform_matrix<Scalar>(T, 1, seed + 15, 0.0, 1.0);
    const RowMatrix<Scalar> log_alpha = uniform_matrix<Scalar>(T, dk, seed + 16, -0.1, 0.0);
    f("gated_delta (per-channel log_alpha)", attention, Phi::l2_normalize, none, as_double(beta),
      as_double(log_alpha), beta, log_alpha);
  }
}

/// Slice lengths of T tokens over P slices with different shapes: even, uneven (a ramp),
/// one empty slice in the middle, the first empty, the last empty. Each sums to T.
inline std::vector<std::vector<Index>> slicings(Index T, Index P) {
  std::vector<std::vector<Index>> all;
  std::vector<Index> even(std::size_t(P), T / P);
  even.back() += T - (T / P) * P;
  all.push_back(even);
  if (P == 1) return all;
  std::vector<Index> ramp(static_cast<std::size_t>(P));
  Index weights = P * (P + 1) / 2, given = 0;
  for (Index p = 0; p + 1 < P; ++p) given += ramp[std::size_t(p)] = T * (p + 1) / weights;
  ramp.back() = T - given;
  all.push_back(ramp);
  for (Index empty : {Index{1}, Index{0}, P - 1}) {
    std::vector<Index> lengths(std::size_t(P), 0);
    Index left = T, shares = P - 1;
    for (Index p = 0; p < P; ++p) {
      if (p == empty) continue;
      lengths[std::size_t(p)] = left / shares;
      left -= lengths[std::size_t(p)];
      --shares;
    }
    lengths[std::size_t(empty == P - 1 ? P - 2 : P - 1)] += left;
    all.push_back(lengths);
  }
  return all;
}

/// The slicings a test runs: all of slicings(T, P), or under the sanitizers (-O0,
/// kSanitizedBuild) the even one and the one where rank 1 holds nothing, whose reference bounds
/// (O(T^2 r) double loops each) dominate those builds' time.
inline std::vector<std::vector<Index>> slicings_to_test(Index T, Index P) {
  auto all = slicings(T, P);
  if (kSanitizedBuild && all.size() > 2) all = {all[0], all[2]};
  return all;
}

}  // namespace linattn_test
