#pragma once
// Kernels behind LinearAttention for a LogScaledFeatureMap: the same recurrent token, chunked
// causal form and full read as detail/recurrent_sweep.hpp and detail/chunked.hpp, on features
// phi(x) = exp(l) f with f of order one, keeping the state as exp(M) (S, z) with M the
// running maximum of key log-scales.
//
// Why a running maximum and not the maximum over the chunk or the sequence: a key shift cancels
// in the ratio only if every key that shares a sum gets the same shift, so the shift has to be
// the state's M. Row i of the output must use M_i = max(M_in, l_k(j) for j <= i), exactly what
// the recurrent path has after token i; a shift that also saw later keys would scale row i's
// weights down by exp(M_i - M_later), which underflows to zero when later keys are much larger
// (outputs that depend on the future, or a 0/0). Query log-scales cancel in the ratio: they only
// enter through the Normalization policy (absolute eps, or the unnormalized read).

#include <linattn/detail/chunk_observer.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/errors.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace linattn::detail {

/// exp(from - to) for to >= from, with exp(-inf - x) = 0 (an empty state contributes nothing).
template <class Scalar>
Scalar rescale_factor(Scalar from, Scalar to) {
  if (from == -std::numeric_limits<Scalar>::infinity()) return Scalar(0);
  return std::exp(from - to);
}

/// max(m, l) that propagates a NaN in l (std::max would drop it and hide a NaN input).
template <class Scalar>
Scalar running_max(Scalar m, Scalar l) {
  return l <= m ? m : l;
}

/// How a scaled numerator becomes the output row. The true numerator and denominator are
/// num exp(L) and den exp(L), L = log-scale of the query plus M, so:
///   strict        y = num / den                 (den must be > 0 and finite; the shift cancels)
///   clamped(eps)  y = num / max(den, eps exp(-L))
///   shifted(eps)  y = num / (den + eps exp(-L))
///   unnormalized  y = num * exp(L)              (the true phi(q)^T S; may overflow to Inf)
/// The output is divided, never multiplied by a reciprocal: a tiny or subnormal den whose
/// reciprocal would overflow gives the finite quotient, as on every other path. A divisor
/// outside Scalar's range (eps exp(-L) in float) is applied in double.
template <class Scalar>
struct LogDomainRead {
  double divisor = 1;
  Scalar multiplier = 1;
  bool divides = true;

  template <class Row>
  void apply(Row&& y) const {
    if (!divides) {
      y *= multiplier;
      return;
    }
    const auto narrow = static_cast<Scalar>(divisor);
    if (std::isfinite(narrow) && narrow > 0 && static_cast<double>(narrow) == divisor)
      y /= narrow;
    else
      for (Index c = 0; c < y.size(); ++c) y(c) = static_cast<Scalar>(static_cast<double>(y(c)) / divisor);
  }
};

/// The read of a row with scaled denominator `den` and log-scale L = `log_scale`; throws
/// DenominatorError as the policy would for the true denominator.
template <class Scalar>
LogDomainRead<Scalar> log_domain_read(const Normalization& norm, Scalar den, Scalar log_scale,
                                      Index row) {
  using Kind = Normalization::Kind;
  LogDomainRead<Scalar> read;
  switch (norm.kind()) {
    case Kind::unnormalized:
      read.divides = false;
      read.multiplier = std::exp(log_scale);
      return read;
    case Kind::strict:
      read.divisor = static_cast<double>(norm.divisor(den, row));
      return read;
    case Kind::clamped:
    case Kind::shifted:
      break;
  }
  if (!std::isfinite(den)) static_cast<void>(norm.divisor(den, row));  // throws for NaN/Inf
  const double eps_scaled = std::exp(std::log(norm.epsilon()) - static_cast<double>(log_scale));
  const double d = static_cast<double>(den);
  const double divisor = norm.kind() == Kind::clamped ? (d < eps_scaled ? eps_scaled : d)
                                                      : d + eps_scaled;
  if (!(divisor > 0) || std::isnan(divisor)) {
    std::ostringstream os;
    os << "linattn: denominator phi(q)^T z = " << d << " * exp(" << log_scale
       << ") at query row " << row << " plus epsilon is not strictly positive";
    throw DenominatorError(os.str(), row, d * std::exp(static_cast<double>(log_scale)));
  }
  read.divisor = divisor;  // Inf (true den << eps) gives 0
  return read;
}

/// The factor by which a row's read scales its numerator, d y / d num: 1 / divisor, or exp(L)
/// unnormalized (the backward's quotient rule; throws as log_domain_read).
template <class Scalar>
Scalar log_domain_reciprocal(const Normalization& norm, Scalar den, Scalar log_scale, Index row) {
  const auto read = log_domain_read(norm, den, log_scale, row);
  return read.divides ? static_cast<Scalar>(1.0 / read.divisor) : read.multiplier;
}

/// One recurrent token on scaled features: qf, kf are 1 x r with log-scales lq, lk.
///   M' = max(M, lk),  S = exp(M - M') S + exp(lk - M') kf^T v,  z likewise,
///   y = log_domain_read(qf z, lq + M') applied to qf S.
/// The denominator is checked before S, z or M change (a throw leaves the state as it was).
/// Cost: as the plain recurrent token (detail::recurrent_token_fused) plus r dv multiplies when M grows, and two exp.
template <class Scalar, class Qf, class Kf, class V, class Y>
void log_domain_token(RowMatrix<Scalar>& S, ColVector<Scalar>& z, ColVector<Scalar>& z_next,
                      Scalar& M, const Qf& qf, Scalar lq, const Kf& kf, Scalar lk, const V& v,
                      Y&& y, const Normalization& norm, Index row) {
  const Scalar M_new = running_max(M, lk);
  const Scalar alpha = rescale_factor(M, M_new);
  const Scalar beta = rescale_factor(lk, M_new);
  z_next = alpha * z + beta * kf.transpose();
  const auto read = log_domain_read(norm, static_cast<Scalar>(qf.dot(z_next.transpose())),
                                    lq + M_new, row);
  y.setZero();
  if (alpha == Scalar(1)) {
    for (Index i = 0; i < S.rows(); ++i) {
      auto Si = S.row(i);
      Si += (beta * kf(i)) * v;
      y += qf(i) * Si;
    }
  } else {
    for (Index i = 0; i < S.rows(); ++i) {
      auto Si = S.row(i);
      Si = alpha * Si + (beta * kf(i)) * v;
      y += qf(i) * Si;
    }
  }
  z.swap(z_next);
  M = M_new;
  read.apply(y);
}

/// Causal attention of one chunk of n scaled tokens against the incoming state (S, z, M), then
/// the state absorbs the chunk. With m_i = max(M, lk_0..lk_i) (the recurrent path's M after
/// token i):
///   out_i = exp(M - m_i) qf_i S + sum_{j <= i} exp(lk_j - m_i) (qf_i . kf_j) v_j,
///   den_i likewise with z and 1, output row = log_domain_read(den_i, lq_i + m_i) applied to out_i;
///   then M' = m_{n-1}, S = exp(M - M') S + kf^T diag(exp(lk - M')) v, z likewise.
/// exp(lk_j - m_i) is applied as exp(lk_j - m_j) (per column, <= 1) times exp(m_j - m_i) (only
/// where the running maximum grew between j and i, usually a few entries per chunk).
/// `kf` is scaled in place; `scores`, `den`, `run_max` are scratch of at least n x n, n, n.
/// Rows are normalized before the state is touched. Cost: as a plain chunk (detail/chunked.hpp) plus
/// n exp per chunk and one exp per score whose running maximum grew inside the chunk.
template <class Scalar, class Qf, class LQ, class Kf, class LK, class V, class Out>
void log_domain_causal_chunk(RowMatrix<Scalar>& S, ColVector<Scalar>& z, Scalar& M,
                             const Qf& qf, const LQ& lq, Kf&& kf, const LK& lk, const V& v,
                             Out&& out, RowMatrix<Scalar>& scores, ColVector<Scalar>& den,
                             ColVector<Scalar>& run_max, const Normalization& norm,
                             Index first_row) {
  const Index n = qf.rows();
  auto m = run_max.head(n);
  Scalar running = M;
  for (Index i = 0; i < n; ++i) m(i) = running = running_max(running, lk(i));

  auto s = scores.topLeftCorner(n, n);
  s.noalias() = qf * kf.transpose();
  s.template triangularView<Eigen::StrictlyUpper>().setZero();
  for (Index j = 0; j < n; ++j) s.col(j) *= rescale_factor(lk(j), m(j));
  Index run_start = 0;  // first index of the current run of equal running maxima
  for (Index i = 1; i < n; ++i) {
    if (m(i) != m(i - 1)) run_start = i;
    if (run_start > 0)
      s.row(i).head(run_start).array() *=
          (m.head(run_start).transpose().array() - m(i)).exp();
  }

  product_into<false>(out, qf, S);
  const bool empty = M == -std::numeric_limits<Scalar>::infinity();
  for (Index i = 0; i < n; ++i) out.row(i) *= empty ? Scalar(0) : std::exp(M - m(i));
  product_into<true>(out, s, v);
  auto d = den.head(n);
  d.noalias() = qf * z;
  for (Index i = 0; i < n; ++i) {
    d(i) = (empty ? Scalar(0) : std::exp(M - m(i)) * d(i)) + s.row(i).sum();
    log_domain_read(norm, d(i), lq(i) + m(i), first_row + i).apply(out.row(i));
  }

  const Scalar M_new = m(n - 1);
  const Scalar alpha = rescale_factor(M, M_new);
  if (alpha != Scalar(1)) {
    S *= alpha;
    z *= alpha;
  }
  for (Index j = 0; j < n; ++j) kf.row(j) *= rescale_factor(lk(j), M_new);
  S.noalias() += kf.transpose() * v;
  z += kf.colwise().sum().transpose();
  M = M_new;
}

/// Non-causal read of all keys: M = max_j lk_j (every query sees every key, so the global
/// maximum is the right shift), S = kf^T diag(exp(lk - M)) V, z likewise, then rows as above.
/// `kf` is scaled in place. Cost: as the plain full read plus Tk + Tq exp.
template <class Scalar, class Qf, class LQ, class Kf, class LK, class V, class Out>
void log_domain_full(const Qf& qf, const LQ& lq, Kf&& kf, const LK& lk, const V& v, Out&& out,
                     const Normalization& norm) {
  Scalar M = -std::numeric_limits<Scalar>::infinity();
  for (Index j = 0; j < lk.size(); ++j) M = running_max(M, lk(j));
  for (Index j = 0; j < kf.rows(); ++j) kf.row(j) *= rescale_factor(lk(j), M);
  const RowMatrix<Scalar> S = kf.transpose() * v;
  const ColVector<Scalar> z = kf.colwise().sum().transpose();
  product_into<false>(out, qf, S);
  const ColVector<Scalar> den = qf * z;
  for (Index i = 0; i < out.rows(); ++i)
    log_domain_read(norm, den(i), lq(i) + M, i).apply(out.row(i));
}

/// Full (non-causal) attention through a LogScaledFeatureMap: features and log-scales of all
/// rows, then log_domain_full. Allocates the feature matrices once per call.
template <class Scalar, class Phi, class DQ, class DK, class DV, class Out>
void log_domain_full_read(const Phi& phi, const DQ& Q, const DK& K, const DV& V, Out&& out,
                          const Normalization& norm) {
  const Index r = phi.feature_dim(K.cols());
  RowMatrix<Scalar> qf(Q.rows(), r), kf(K.rows(), r);
  ColVector<Scalar> lq(Q.rows()), lk(K.rows());
  {
    Eigen::Ref<RowMatrix<Scalar>> q_ref(qf), k_ref(kf);
    phi.apply_scaled(Q, q_ref, Eigen::Ref<ColVector<Scalar>>(lq));
    phi.apply_scaled(K, k_ref, Eigen::Ref<ColVector<Scalar>>(lk));
  }
  log_domain_full<Scalar>(qf, lq, kf, lk, V, out, norm);
}

/// Causal attention in chunks of C rows through a LogScaledFeatureMap, continuing from the
/// state (S, z, M); `tokens` counts the absorbed rows. Scratch is allocated once per call.
/// `before_chunk(first, S, z, M)` sees the state before each chunk (see NoChunkObserver).
template <class Scalar, class Phi, class DQ, class DK, class DV, class Out,
          class BeforeChunk = NoChunkObserver>
void log_domain_causal(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                       RowMatrix<Scalar>& S, ColVector<Scalar>& z, Scalar& M, Index& tokens,
                       Index chunk_size, Out&& out, const Normalization& norm,
                       const BeforeChunk& before_chunk = {}) {
  const Index T = Q.rows();
  const Index r = S.rows();
  const Index C = std::min(chunk_size, std::max<Index>(T, 1));
  RowMatrix<Scalar> qf(C, r), kf(C, r), scores(C, C);
  ColVector<Scalar> lq(C), lk(C), den(C), run_max(C);
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    before_chunk(first, S, z, M);
    Eigen::Ref<RowMatrix<Scalar>> q_ref(qf.topRows(n)), k_ref(kf.topRows(n));
    phi.apply_scaled(Q.middleRows(first, n), q_ref, Eigen::Ref<ColVector<Scalar>>(lq.head(n)));
    phi.apply_scaled(K.middleRows(first, n), k_ref, Eigen::Ref<ColVector<Scalar>>(lk.head(n)));
    log_domain_causal_chunk<Scalar>(S, z, M, qf.topRows(n), lq.head(n), kf.topRows(n),
                                    lk.head(n), V.middleRows(first, n),
                                    out.middleRows(first, n), scores, den, run_max, norm, first);
    tokens += n;
  }
}

/// One token through a LogScaledFeatureMap: q, k, v are 1 x d rows, qf, kf 1 x r scratch rows.
template <class Scalar, class Phi, class Rq, class Rk, class Rv, class Y>
void log_domain_step(const Phi& phi, const Rq& q, const Rk& k, const Rv& v,
                     RowMatrix<Scalar>& qf, RowMatrix<Scalar>& kf, RowMatrix<Scalar>& S,
                     ColVector<Scalar>& z, ColVector<Scalar>& z_next, Scalar& M, Y&& y,
                     const Normalization& norm, Index row) {
  Scalar lq = 0, lk = 0;
  {
    Eigen::Ref<RowMatrix<Scalar>> q_ref(qf), k_ref(kf);
    phi.apply_scaled(q, q_ref, Eigen::Map<ColVector<Scalar>>(&lq, 1));
    phi.apply_scaled(k, k_ref, Eigen::Map<ColVector<Scalar>>(&lk, 1));
  }
  log_domain_token<Scalar>(S, z, z_next, M, qf.row(0), lq, kf.row(0), lk, v, y, norm, row);
}

}  // namespace linattn::detail
