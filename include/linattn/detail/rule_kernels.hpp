#pragma once
// Compute kernels behind RuleAttention: one recurrent token and one causal chunk for the
// decayed/gated rules and for the (gated) delta rule. They work on features already computed.
//
// Every exponential below has a non-positive argument (cumulative log-gates only decrease
// along a chunk and each difference is taken later-minus-earlier), so nothing overflows for any
// gate strength; an underflow to 0 stands for a weight below the smallest normal number.

#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace linattn::detail {

/// Rows per sub-chunk in the per-channel gated chunk (diagonal blocks use pairwise exps).
inline constexpr Index gate_subchunk = 16;

/// Scratch of a chunked call, sized once per call for chunk size C, features r, values dv.
template <class Scalar>
struct RuleScratch {
  RuleScratch(Index C, Index r, Index dv)
      : scores(C, C), system(C, C), pair(C, C), qs(C, r), kw(C, r), qb(C, r),
        qj(gate_subchunk, r), prefix(C, r), totals(C / gate_subchunk + 1, r), corrected(C, dv),
        den(C), weights(C), d(1, r), acc(1, r), scale(1, r) {}
  RowMatrix<Scalar> scores, system, pair, qs, kw, qb, qj, prefix, totals, corrected;
  ColVector<Scalar> den, weights;
  RowVector<Scalar> d, acc, scale;
};

/// pair(i, j) = exp(sum_{j<s<=i} log_gate(s)) for j <= i, 0 above: the decay from token j to
/// token i. Each exponent is summed over exactly the tokens in between (never as a difference
/// of two cumulative sums, which would cancel), so its rounding error is that of multiplying
/// those i - j gates one by one, as the recurrent path does. n^2 / 2 exps.
template <class LG, class P>
void pairwise_decay(const LG& log_gate, P&& pair) {
  using Scalar = typename std::decay_t<P>::Scalar;
  const Index n = pair.rows();
  for (Index j = 0; j < n; ++j) {
    Scalar d = 0;
    pair(j, j) = 1;
    for (Index i = j + 1; i < n; ++i) {
      d += static_cast<Scalar>(log_gate(i));
      pair(i, j) = std::exp(d);
    }
    for (Index i = 0; i < j; ++i) pair(i, j) = 0;
  }
}

/// prefix(i) = exp(sum_{s<=i} log_gate(s)) (decay of the incoming state at row i) and
/// suffix(j) = exp(sum_{j<s<n} log_gate(s)) (decay from row j to the chunk's end).
template <class LG, class Pre, class Suf>
void prefix_suffix_decay(const LG& log_gate, Pre&& prefix, Suf&& suffix) {
  using Scalar = typename std::decay_t<Pre>::Scalar;
  const Index n = prefix.size();
  Scalar acc = 0;
  for (Index i = 0; i < n; ++i) prefix(i) = std::exp(acc += static_cast<Scalar>(log_gate(i)));
  acc = 0;
  for (Index j = n - 1; j >= 0; --j) {
    suffix(j) = std::exp(acc);
    acc += static_cast<Scalar>(log_gate(j));
  }
}

/// One recurrent token of a decayed/gated rule on features:
///   S = diag(g) S + kf^T v, z = g .* z + kf^T, y = (qf S) / divisor(qf z).
/// `g` is a 1 x r row of gates in (0, 1]. The denominator is checked before S or z change,
/// so a throw leaves the state as it was. Cost: 5 r dv flops, one sweep over S.
template <class Scalar, class Qf, class Kf, class G, class V, class Y>
void gated_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                 const Qf& qf, const Kf& kf, const G& g, const V& v, Y&& y,
                 const Normalization& norm, Index row) {
  z_next = z.cwiseProduct(g.transpose()) + kf.transpose();
  const Scalar divisor = norm.divisor(static_cast<Scalar>(qf.dot(z_next.transpose())), row);
  y.setZero();
  for (Index i = 0; i < S.rows(); ++i) {
    auto Si = S.row(i);
    Si = g(i) * Si + kf(i) * v;
    y += qf(i) * Si;
  }
  z.swap(z_next);
  if (norm.divides()) y /= divisor;
}

/// One recurrent token of the (gated) delta rule on features, alpha = 1 for Delta:
///   u = beta (v - alpha kf S),  S = alpha S + kf^T u,  y = qf S  (S here is r x dv).
/// `prediction` is 1 x dv scratch. Cost: 6 r dv flops, two sweeps over S.
template <class Scalar, class Qf, class Kf, class V, class Y>
void delta_token(RowMatrix<Scalar>& S, RowVector<Scalar>& prediction, const Qf& qf, const Kf& kf,
                 const V& v, Scalar beta, Scalar alpha, Y&& y) {
  prediction.noalias() = kf * S;
  prediction = beta * (v - alpha * prediction);
  y.setZero();
  for (Index i = 0; i < S.rows(); ++i) {
    auto Si = S.row(i);
    Si = alpha * Si + kf(i) * prediction;
    y += qf(i) * Si;
  }
}

/// Causal chunk of n tokens with one scalar log-gate per token (Decay and scalar Gated), then
/// the state absorbs the chunk. With D(i, j) = exp(sum_{j<s<=i} log g_s) (pairwise_decay):
///   out_i = D(i, -1) qf_i S + sum_{j<=i} D(i, j) (qf_i . kf_j) v_j   (den likewise with z and
///   1 for v), S = D(n-1, -1) S + sum_j D(n-1, j) kf_j^T v_j, z likewise.
/// `log_gate` has n entries. Rows are normalized before the state changes.
/// Cost: 2 n^2 (r + dv) + 4 n r dv flops and n^2 / 2 + 2 n exps.
template <class Scalar, class Qf, class Kf, class V, class LG, class Out>
void scalar_gated_chunk(RowMatrix<Scalar>& S, ColVector<Scalar>& z, const Qf& qf, const Kf& kf,
                        const V& v, const LG& log_gate, Out&& out, RuleScratch<Scalar>& scratch,
                        const Normalization& norm, Index first_row) {
  const Index n = qf.rows();
  if (n == 0) return;
  auto s = scratch.scores.topLeftCorner(n, n);
  auto pair = scratch.pair.topLeftCorner(n, n);
  pairwise_decay(log_gate, pair);
  s.noalias() = qf * kf.transpose();
  s.array() *= pair.array();
  auto eb = scratch.den.head(n);
  auto w = scratch.weights.head(n);
  prefix_suffix_decay(log_gate, eb, w);
  out.noalias() = qf * S;
  out.array().colwise() *= eb.array();
  out.noalias() += s * v;
  if (norm.divides()) {
    for (Index i = 0; i < n; ++i) {
      const Scalar d = eb(i) * qf.row(i).dot(z.transpose()) + s.row(i).sum();
      out.row(i) /= norm.divisor(d, first_row + i);
    }
  }
  auto kw = scratch.kw.topRows(n);
  kw = w.asDiagonal() * kf;
  const Scalar total = eb(n - 1);
  S *= total;
  S.noalias() += kw.transpose() * v;
  z = total * z + kw.colwise().sum().transpose();
}

/// Causal chunk of n tokens with one log-gate per feature channel (n x r), then the state
/// absorbs it. The weight of token j at row i is sum_m qf_im kf_jm exp(sum_{j<s<=i} lg_sm).
/// Computed in sub-chunks of gate_subchunk rows: rows of block I against an earlier block J
/// factor through the end of J and the start of I,
///   (qf_i .* exp(lg summed over I up to i) .* exp(lg summed over the blocks between))
///     . (kf_j .* exp(lg summed over J after j)),
/// every factor <= 1 and every exponent a direct sum over the tokens it spans (no differences
/// of cumulative sums); diagonal blocks use the pairwise exps. Nothing overflows for any gates.
/// Cost: 2 n^2 (r + dv) + 4 n r dv flops, about n (gate_subchunk / 2 + n / gate_subchunk + 3) r
/// exps.
template <class Scalar, class Qf, class Kf, class V, class LG, class Out>
void channel_gated_chunk(RowMatrix<Scalar>& S, ColVector<Scalar>& z, const Qf& qf,
                         const Kf& kf, const V& v, const LG& lg, Out&& out,
                         RuleScratch<Scalar>& scratch, const Normalization& norm,
                         Index first_row) {
  const Index n = qf.rows(), r = qf.cols();
  if (n == 0) return;
  // Incoming state, decayed to each row: (qf_i .* exp(P_i)) S with P_i = sum_{s<=i} lg_s.
  auto P = scratch.prefix.topRows(n);
  P.row(0) = lg.row(0);
  for (Index i = 1; i < n; ++i) P.row(i) = P.row(i - 1) + lg.row(i);
  auto qs = scratch.qs.topRows(n);
  qs = (qf.array() * P.array().exp()).matrix();
  out.noalias() = qs * S;
  auto den = scratch.den.head(n);
  const bool divides = norm.divides();
  if (divides) den.noalias() = qs * z;

  // Keys decayed to the end of their own sub-chunk, and each sub-chunk's total log-gate.
  const Index c = gate_subchunk;
  auto kt = scratch.kw.topRows(n);
  auto& acc = scratch.acc;
  for (Index j0 = 0, J = 0; j0 < n; j0 += c, ++J) {
    const Index len = std::min(c, n - j0);
    acc.setZero();
    for (Index j = j0 + len - 1; j >= j0; --j) {
      kt.row(j) = (kf.row(j).array() * acc.array().exp()).matrix();
      acc += lg.row(j);
    }
    scratch.totals.row(J) = acc;
  }
  auto s = scratch.scores.topLeftCorner(n, n);
  s.setZero();
  auto& d = scratch.d;
  auto& scale = scratch.scale;
  for (Index i0 = 0, I = 0; i0 < n; i0 += c, ++I) {
    const Index len_i = std::min(c, n - i0);
    for (Index j = i0; j < i0 + len_i; ++j) {
      d.setZero();
      s(j, j) = qf.row(j).dot(kf.row(j));
      for (Index i = j + 1; i < i0 + len_i; ++i) {
        d += lg.row(i);
        s(i, j) = (qf.row(i).array() * kf.row(j).array() * d.array().exp()).sum();
      }
    }
    if (I == 0) continue;
    auto qb = scratch.qb.middleRows(i0, len_i);
    acc.setZero();
    for (Index i = 0; i < len_i; ++i) {
      acc += lg.row(i0 + i);
      qb.row(i) = (qf.row(i0 + i).array() * acc.array().exp()).matrix();
    }
    auto qj = scratch.qj.topRows(len_i);
    d.setZero();  // the log-gates of the whole blocks strictly between J and I
    for (Index J = I - 1; J >= 0; --J) {
      const Index j0 = J * c;
      scale = d.array().exp().matrix();
      qj = (qb.array().rowwise() * scale.array()).matrix();
      s.block(i0, j0, len_i, c).noalias() = qj * kt.middleRows(j0, c).transpose();
      d += scratch.totals.row(J);
    }
  }
  out.noalias() += s * v;
  if (divides) {
    den += s.rowwise().sum();
    for (Index i = 0; i < n; ++i) out.row(i) /= norm.divisor(den(i), first_row + i);
  }

  // State: S = diag(exp(P_last)) S + sum_j (kf_j .* exp(sum_{j<s<n} lg_s))^T v_j.
  acc.setZero();
  for (Index j = n - 1; j >= 0; --j) {
    kt.row(j) = (kf.row(j).array() * acc.array().exp()).matrix();
    acc += lg.row(j);
  }
  scale = P.row(n - 1).array().exp().matrix();
  for (Index m = 0; m < r; ++m) S.row(m) *= scale(m);
  S.noalias() += kt.transpose() * v;
  z = z.cwiseProduct(scale.transpose()) + kt.colwise().sum().transpose();
}

/// Causal chunk of n tokens of the (gated) delta rule by the WY / UT form (Yang et al. 2024),
/// then the state absorbs it. With D(i, j) = exp(sum_{j<s<=i} log alpha_s) (1 for Delta) and
/// D(i, -1) the decay of the incoming state, the corrected values
/// u_i = beta_i (v_i - alpha_i S_{i-1}^T kf_i) solve the unit lower triangular system
///   u_i + beta_i sum_{j<i} D(i, j) (kf_i . kf_j) u_j = beta_i (v_i - D(i, -1) S^T kf_i),
/// (that is U = T (V - D K S) with T = (I + strictly_lower(diag(beta) D .* K K^T))^-1 diag(beta)),
/// then out_i = D(i, -1) qf_i S + sum_{j<=i} D(i, j) (qf_i . kf_j) u_j and
/// S = D(n-1, -1) S + sum_j D(n-1, j) kf_j^T u_j. `log_alpha` is empty for Delta.
/// Cost: 2 n^2 (r + dv) + n^2 dv (the solve) + 6 n r dv flops.
template <class Scalar, class Qf, class Kf, class V, class Beta, class LA, class Out>
void delta_chunk(RowMatrix<Scalar>& S, const Qf& qf, const Kf& kf, const V& v, const Beta& beta,
                 const LA& log_alpha, Out&& out, RuleScratch<Scalar>& scratch) {
  const Index n = qf.rows();
  if (n == 0) return;
  const bool gated = log_alpha.size() > 0;
  auto pair = scratch.pair.topLeftCorner(n, n);
  auto eb = scratch.den.head(n);
  auto w = scratch.weights.head(n);
  if (gated) {
    pairwise_decay(log_alpha, pair);
    prefix_suffix_decay(log_alpha, eb, w);
  }

  // Right-hand side beta_i (v_i - D(i, -1) kf_i S) and the system's strictly lower part.
  auto U = scratch.corrected.topRows(n);
  U.noalias() = kf * S;
  if (gated) U.array().colwise() *= eb.array();
  U = v - U;
  U.array().colwise() *= beta.array();
  auto A = scratch.system.topLeftCorner(n, n);
  A.noalias() = kf * kf.transpose();
  if (gated) A.array() *= pair.array();
  A.array().colwise() *= beta.array();
  A.template triangularView<Eigen::UnitLower>().solveInPlace(U);

  auto s = scratch.scores.topLeftCorner(n, n);
  s.noalias() = qf * kf.transpose();
  if (gated)
    s.array() *= pair.array();
  else
    s.template triangularView<Eigen::StrictlyUpper>().setZero();
  out.noalias() = qf * S;
  if (gated) out.array().colwise() *= eb.array();
  out.noalias() += s * U;

  if (gated) {
    auto kw = scratch.kw.topRows(n);
    kw = w.asDiagonal() * kf;
    S *= eb(n - 1);
    S.noalias() += kw.transpose() * U;
  } else {
    S.noalias() += kf.transpose() * U;
  }
}

}  // namespace linattn::detail
