#pragma once
// Independent double-precision references for the write rules, written from the formulas in
// write_rules.hpp (not from the library's kernels), with rounding-bound bookkeeping.

#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "test_support.hpp"

namespace linattn_test {

enum class Phi { elu_plus_one, identity, l2_normalize };

/// phi of one row in double.
template <class Row>
Eigen::RowVectorXd features(const Row& x, Phi phi) {
  Eigen::RowVectorXd f = x.template cast<double>();
  switch (phi) {
    case Phi::elu_plus_one:
      for (Index n = 0; n < f.size(); ++n) f(n) = elu_plus_one(f(n));
      break;
    case Phi::identity:
      break;
    case Phi::l2_normalize: {
      const double norm = f.norm();
      if (norm > 0) f /= norm;
      break;
    }
  }
  return f;
}

/// Reference output and, per element, the allowed error in units of u (the caller multiplies
/// by the unit roundoff of the precision under test).
struct RuleReference {
  MatrixXdR y;
  MatrixXdR allowed_units;
};

/// Decayed / gated attention by its quadratic definition: weight of key j <= i at row i is
///   w_ij = sum_n qf_in kf_jn exp(d_ijn),  d_ijn = sum_{j<s<=i} log_gate(s, n)
/// (log_gate is T x 1, the same for all channels, or T x r); y_i = sum_j w_ij v_j / sum_j w_ij
/// (or without the division).
///
/// Error allowance, first order in u, per weight: the dot product over r features (r u), sums
/// over at most T keys (T u), the feature map and division (4 u), a product of m = i - j gates
/// (2 m u, the recurrent path) or exponents summed over at most min(m, chunk) same-signed
/// log-gates (relative error min(m, chunk) u |d|, the chunked path): a_ij = r + T + 4 + 2 m +
/// min(m, chunk) max_n |d_ijn|. A weighted average N / D with positive weights errs by at most
/// sum_j a_ij u |w|_ij (|v_j| + |y_i|) / |D| (numerator and denominator errors); the
/// unnormalized read by sum_j a_ij u |w|_ij |v_j|. Here |w|_ij uses |qf_in kf_jn|.
/// One reference per chunk size in `chunks` (the outputs are the same; the allowances differ),
/// computed in one pass because the O(T^2 r) loop dominates a Debug + sanitizer test run.
template <class MQ, class MK, class MV, class MG>
std::vector<RuleReference> naive_gated(const MQ& Q, const MK& K, const MV& V, const MG& log_gate,
                                       Phi phi, bool normalize, const std::vector<Index>& chunks) {
  const Index T = Q.rows(), dv = V.cols(), nc = static_cast<Index>(chunks.size());
  std::vector<RuleReference> refs(chunks.size(),
                                  RuleReference{MatrixXdR::Zero(T, dv), MatrixXdR::Zero(T, dv)});
  if (T == 0) return refs;
  MatrixXdR qf(T, 0), kf(T, 0);
  for (Index t = 0; t < T; ++t) {
    const Eigen::RowVectorXd q = features(Q.row(t), phi), k = features(K.row(t), phi);
    if (t == 0) {
      qf.resize(T, q.size());
      kf.resize(T, k.size());
    }
    qf.row(t) = q;
    kf.row(t) = k;
  }
  const Index r = qf.cols();
  const MatrixXdR lg = log_gate.template cast<double>();
  Eigen::RowVectorXd d(r);
  for (Index i = 0; i < T; ++i) {
    double den = 0;
    Eigen::VectorXd w(i + 1), w_abs(i + 1);
    Eigen::MatrixXd a(i + 1, nc);
    d.setZero();  // sum over j < s <= i, built as j goes down
    for (Index j = i; j >= 0; --j) {
      if (j < i) d += (lg.cols() == 1 ? Eigen::RowVectorXd::Constant(r, lg(j + 1, 0))
                                      : Eigen::RowVectorXd(lg.row(j + 1)));
      const Index m = i - j;
      w(j) = w_abs(j) = 0;
      for (Index n = 0; n < r; ++n) {
        const double e = std::exp(d(n));
        w(j) += qf(i, n) * kf(j, n) * e;
        w_abs(j) += std::abs(qf(i, n) * kf(j, n)) * e;
      }
      const double span = d.cwiseAbs().maxCoeff();
      for (Index c = 0; c < nc; ++c)
        a(j, c) = double(r + T + 4 + 2 * m) + double(std::min(m, chunks[c])) * span;
      den += w(j);
    }
    Eigen::RowVectorXd y(dv);
    for (Index c = 0; c < dv; ++c) {
      double num = 0;
      for (Index j = 0; j <= i; ++j) num += w(j) * double(V(j, c));
      y(c) = normalize ? num / den : num;
    }
    for (Index k = 0; k < nc; ++k) {
      RuleReference& ref = refs[k];
      ref.y.row(i) = y;
      for (Index c = 0; c < dv; ++c) {
        double allow = 0;
        for (Index j = 0; j <= i; ++j)
          allow += a(j, k) * w_abs(j) *
                   (std::abs(double(V(j, c))) + (normalize ? std::abs(y(c)) : 0.0));
        ref.allowed_units(i, c) = normalize ? allow / std::abs(den) : allow;
      }
    }
  }
  return refs;
}

/// naive_gated for a single chunk size.
template <class MQ, class MK, class MV, class MG>
RuleReference naive_gated(const MQ& Q, const MK& K, const MV& V, const MG& log_gate, Phi phi,
                          bool normalize, Index chunk) {
  return naive_gated(Q, K, V, log_gate, phi, normalize, std::vector<Index>{chunk}).front();
}

/// (Gated) delta rule by its recurrence, literally: S_t = alpha_t (I - beta_t k k^T) S_{t-1} +
/// beta_t k v_t^T with k = phi(k_t), y_t = S_t^T phi(q_t). `log_alpha` empty means alpha = 1;
/// with r columns it holds per-channel gates (Kimi Delta Attention): S_t = (I - beta_t k k^T)
/// diag(alpha_t) S_{t-1} + beta_t k v_t^T.
///
/// Error allowance: with |k| = 1, alpha in (0, 1] and beta in [0, 2] the map S -> alpha (I -
/// beta k k^T) S (or (I - beta k k^T) diag(alpha) S) has 2-norm <= 1, so rounding errors made
/// at earlier steps are not amplified and add up. One step (recurrent: dot products over r
/// features; chunked: the same plus sums over at most `chunk` earlier tokens of the chunk in
/// the triangular solve and the read) perturbs S by at most about (r + chunk + 4) u
/// max(1, beta_t) (|S_{t-1}|_F + |v_t|) in Frobenius norm (its terms beta k k^T S and beta k v^T
/// grow with beta); we allow twice that, summed over the steps so far, times |phi(q_t)|.
/// Per-channel gates add, per term of the chunk's products, a product of at most `chunk` gates
/// per channel, each gate rounded by its exp and by a multiply: (2 chunk + 2) u relative,
/// allowed twice as well.
template <class MQ, class MK, class MV, class VB, class VA>
RuleReference naive_delta(const MQ& Q, const MK& K, const MV& V, const VB& beta,
                          const VA& log_alpha, Phi phi, Index chunk) {
  const Index T = Q.rows(), dv = V.cols();
  RuleReference ref{MatrixXdR::Zero(T, dv), MatrixXdR::Zero(T, dv)};
  if (T == 0) return ref;
  const Index r = features(K.row(0), phi).size();
  Eigen::MatrixXd S = Eigen::MatrixXd::Zero(r, dv);
  double budget = 0;
  const bool per_channel = log_alpha.size() > 0 && log_alpha.cols() > 1;
  const Index c = std::min(chunk, T);
  const double per_step = 2.0 * double(r + c + 4) + (per_channel ? 2.0 * double(2 * c + 2) : 0.0);
  for (Index t = 0; t < T; ++t) {
    const Eigen::VectorXd k = features(K.row(t), phi).transpose();
    const Eigen::VectorXd q = features(Q.row(t), phi).transpose();
    const Eigen::VectorXd v = V.row(t).template cast<double>().transpose();
    const double b = double(beta(t));
    budget += per_step * std::max(1.0, b) * (S.norm() + v.norm());
    const Eigen::MatrixXd A = Eigen::MatrixXd::Identity(r, r) - b * k * k.transpose();
    if (per_channel) {
      const Eigen::VectorXd alpha =
          log_alpha.row(t).template cast<double>().transpose().array().exp().matrix();
      S = A * (alpha.asDiagonal() * S) + b * k * v.transpose();
    } else {
      const double alpha = log_alpha.size() > 0 ? std::exp(double(log_alpha(t, 0))) : 1.0;
      S = alpha * (A * S) + b * k * v.transpose();
    }
    ref.y.row(t) = (S.transpose() * q).transpose();
    ref.allowed_units.row(t).setConstant(budget * q.norm());
  }
  return ref;
}

/// worst_ratio_of with the reference's own allowance.
template <class Scalar, class M>
double worst_ratio(const M& actual, const RuleReference& ref) {
  return worst_ratio_of<Scalar>(actual, ref.y, ref.allowed_units);
}

}  // namespace linattn_test
