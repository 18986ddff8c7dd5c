#pragma once
// Backward pass of Delta and GatedDelta (linattn/rule_gradients.hpp).
//
// Delta and GatedDelta (delta_backward): the chunked WY / UT form (REFERENCES.md section 4,
// Yang et al. 2024) in reverse mode. Per chunk, with B_i = sum_{s<=i} log alpha_s from the
// chunk's start, gamma_i = exp(B_i), Gam_ij = exp(B_i - B_j) (j <= i, every one <= 1) and S the
// state before the chunk:
//   A = I + strictly_lower(diag(beta) (K K^T .* Gam)),  R = V - diag(gamma) K S,
//   U = A^-1 diag(beta) R  (the corrected values: S_i = gamma_i S + sum_{j<=i} Gam_ij k_j u_j^T),
//   O = diag(gamma) Q S + P U,  P = tril(Q K^T .* Gam),
//   S_after = gamma_n S + K^T diag(Gam_nj) U.
// Backwards, with dO and H (the gradient of S_after):
//   dU = diag(Gam_nj) K H + P^T dO;  dP = tril(dO U^T);  dQ = diag(gamma) dO S^T + (dP .* Gam) K
//   dW = A^-T dU;  dL = strictly_lower(-dW U^T);  dbeta_i = R_i . dW_i + sum_j dL_ij (k_i.k_j) Gam_ij
//   dR = diag(beta) dW;  dV = dR
//   dK = diag(Gam_nj) U H^T + (dP .* Gam)^T Q + N K + N^T K - diag(gamma) dR S^T,
//        N_ij = dL_ij beta_i Gam_ij
//   H_before = gamma_n H + Q^T diag(gamma) dO - K^T diag(gamma) dR
//   dL/dB_i collects every term's exp(B) factor (gamma_i, Gam_ij: + at i, - at j), and
//   d log alpha_s = sum_{i >= s in the chunk} dL/dB_i (the chunk's own; later chunks reach
//   earlier gates through H).
// The states at chunk boundaries are stored by a forward sweep (pass 1); the reverse sweep
// (pass 2) rebuilds each chunk's U from its boundary and runs the lines above. Per token about
// 9 r dv multiply-adds against the state (the forward: 3) plus O(C (r + dv)) in the chunk and two
// C x C unit-triangular solves of dv columns per chunk; memory ceil(T / C) r dv scalars for the
// boundaries plus O(C (C + r + dv) + r dv).

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace linattn::detail {

/// Buffers of the chunked delta backward, allocated once per call: the states before each
/// chunk (ceil(T / C) r x dv), per-chunk blocks (C rows) and two r x dv matrices.
template <class Scalar>
struct DeltaBackwardScratch {
  Index C = 0;
  RowMatrix<Scalar> boundary;                        // stacked r x dv states
  RowMatrix<Scalar> qf, kf, dqf, dkf, Hu;            // C x r
  RowMatrix<Scalar> Vc, KS, R, U, dU, dW;            // C x dv
  RowMatrix<Scalar> Gam, A, P, dP, KK;               // C x C
  ColVector<Scalar> log_cum, gam, dlg, beta;         // C
  RowMatrix<Scalar> H, H_next;                       // r x dv

  DeltaBackwardScratch(Index T, Index chunk, Index r, Index dv)
      : C(std::min(chunk, std::max<Index>(T, 1))), boundary((T + C - 1) / C * r, dv) {
    for (auto* m : {&qf, &kf, &dqf, &dkf, &Hu}) m->resize(C, r);
    for (auto* m : {&Vc, &KS, &R, &U, &dU, &dW}) m->resize(C, dv);
    for (auto* m : {&Gam, &A, &P, &dP, &KK}) m->setZero(C, C);
    for (auto* v : {&log_cum, &gam, &dlg, &beta}) v->resize(C);
    H.resize(r, dv);
    H_next.resize(r, dv);
  }

  /// Bytes the constructor allocates: (ceil(T / C) + 2) r dv + 5 C r + 6 C dv + 5 C^2 + 4 C
  /// scalars (C = min(chunk, T)).
  [[nodiscard]] static std::size_t bytes_for(Index T, Index chunk, Index r, Index dv) {
    const Index C = std::min(chunk, std::max<Index>(T, 1));
    return static_cast<std::size_t>(((T + C - 1) / C + 2) * r * dv + 5 * C * r + 6 * C * dv +
                                    5 * C * C + 4 * C) *
           sizeof(Scalar);
  }
};

/// The chunked delta-rule backward on the WY / UT form (see the file comment). `in`: bound beta
/// and (GatedDelta) log_alpha. Writes dQ, dK, dV, d_beta (length T), d_log_alpha (length T;
/// null for Delta) and dS0 (resized). dS_T null: 0.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void delta_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                    const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                    const RowMatrix<Scalar>* dS_T, Index chunk_size,
                    Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                    Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_beta, Scalar* d_log_alpha,
                    RowMatrix<Scalar>& dS0) {
  const Index T = Q.rows(), r = S0.rows(), dv = S0.cols();
  DeltaBackwardScratch<Scalar> w(T, chunk_size, r, dv);
  const Index C = w.C;
  const auto block = [](RowMatrix<Scalar>& m, Index n) { return m.topLeftCorner(n, n); };

  // The key side of rows [first, first + n) against the state S before the chunk: gates,
  // decays Gam_ij = exp(B_i - B_j) (j <= i), A = I + strictly_lower(diag(beta) (K K^T .* Gam)),
  // R = V - diag(gamma) K S, U = A^-1 diag(beta) R.
  const auto prepare = [&](const auto& S, Index first, Index n) {
    map_rows<Scalar>(phi, K, first, n, w.kf);
    w.Vc.topRows(n) = V.middleRows(first, n);
    Scalar sum = 0;
    for (Index i = 0; i < n; ++i) {
      w.beta(i) = in.beta(first + i);
      w.log_cum(i) = sum += in.log_alpha.empty() ? Scalar(0) : in.log_alpha(first + i);
      w.gam(i) = std::exp(w.log_cum(i));
    }
    for (Index i = 0; i < n; ++i)
      for (Index j = 0; j <= i; ++j) w.Gam(i, j) = std::exp(w.log_cum(i) - w.log_cum(j));
    auto KK = w.KK.topLeftCorner(n, n);
    KK.noalias() = w.kf.topRows(n) * w.kf.topRows(n).transpose();
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < i; ++j) w.A(i, j) = w.beta(i) * KK(i, j) * w.Gam(i, j);
      w.A(i, i) = 1;
    }
    w.KS.topRows(n).noalias() = w.kf.topRows(n) * S;
    w.R.topRows(n) = w.Vc.topRows(n) - w.gam.head(n).asDiagonal() * w.KS.topRows(n);
    auto U = w.U.topRows(n);
    U = w.beta.head(n).asDiagonal() * w.R.topRows(n);
    block(w.A, n).template triangularView<Eigen::UnitLower>().solveInPlace(U);
  };
  // S <- gamma_last S + K^T diag(Gam_{last, j}) U (into `next`, which may be S).
  const auto absorb = [&](const auto& S, auto&& next, Index n) {
    w.Hu.topRows(n) = w.Gam.row(n - 1).head(n).transpose().asDiagonal() * w.kf.topRows(n);
    next = w.gam(n - 1) * S;
    next.noalias() += w.Hu.topRows(n).transpose() * w.U.topRows(n);
  };
  const auto state = [&](Index c) { return w.boundary.middleRows(c * r, r); };

  // ---- pass 1: forward; the state before each chunk ----
  w.H = S0;  // the running state in this pass
  for (Index first = 0, c = 0; first < T; first += C, ++c) {
    const Index n = std::min(C, T - first);
    state(c) = w.H;
    prepare(w.H, first, n);
    absorb(w.H, w.H, n);
  }

  // ---- pass 2: reverse; H is the gradient of the state after the chunk ----
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero();
  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  for (Index first = last_first; first >= 0; first -= C) {
    const Index n = std::min(C, T - first), last = n - 1;
    const auto S = state(first / C);
    prepare(S, first, n);
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    const auto dO = dY.middleRows(first, n);
    auto P = block(w.P, n);
    P.noalias() = w.qf.topRows(n) * w.kf.topRows(n).transpose();
    P.array() *= block(w.Gam, n).array();  // Gam is 0 above the diagonal
    auto dqf = w.dqf.topRows(n);
    auto dkf = w.dkf.topRows(n);
    auto dU = w.dU.topRows(n);
    auto dlg = w.dlg.head(n);
    dlg.setZero();

    // The state after the chunk: S_n = gamma_n S + K^T diag(Gam_{n,j}) U.
    w.Hu.topRows(n).noalias() = w.U.topRows(n) * w.H.transpose();  // row j: (H u_j)^T
    for (Index j = 0; j < n; ++j) {
      const Scalar g = w.Gam(last, j);
      dkf.row(j) = g * w.Hu.row(j);
      const Scalar e = g * w.kf.row(j).dot(w.Hu.row(j));
      dlg(last) += e;
      dlg(j) -= e;
    }
    dlg(last) += w.gam(last) * (S.array() * w.H.array()).sum();
    dU.noalias() = w.kf.topRows(n) * w.H;
    dU = w.Gam.row(last).head(n).transpose().asDiagonal() * dU;
    w.H_next = w.gam(last) * w.H;

    // The outputs: O = diag(gamma) Q S + P U.
    dqf.noalias() = dO * S.transpose();
    // gamma_i's share through the read of S: gamma_i (q_i^T S) . dO_i = gamma_i q_i . (dO_i S^T)
    for (Index i = 0; i < n; ++i) dlg(i) += w.gam(i) * w.qf.row(i).dot(dqf.row(i));
    dqf = w.gam.head(n).asDiagonal() * dqf;
    w.dW.topRows(n) = w.gam.head(n).asDiagonal() * dO;
    w.H_next.noalias() += w.qf.topRows(n).transpose() * w.dW.topRows(n);
    dU.noalias() += P.transpose() * dO;
    auto dP = block(w.dP, n);
    dP.noalias() = dO * w.U.topRows(n).transpose();
    for (Index i = 0; i < n; ++i) {
      dP.row(i).tail(n - 1 - i).setZero();
      for (Index j = 0; j <= i; ++j) {
        const Scalar f = dP(i, j) * P(i, j);
        dlg(i) += f;
        dlg(j) -= f;
      }
    }
    dP.array() *= block(w.Gam, n).array();
    dqf.noalias() += dP * w.kf.topRows(n);
    dkf.noalias() += dP.transpose() * w.qf.topRows(n);

    // U = A^-1 W: dW = A^-T dU, dA = -dW U^T (strictly lower part).
    auto dW = w.dW.topRows(n);
    dW = dU;
    block(w.A, n).template triangularView<Eigen::UnitLower>().transpose().solveInPlace(dW);
    auto N = block(w.dP, n);  // reused: N_ij = dA_ij beta_i Gam_ij, i > j
    N.noalias() = -(dW * w.U.topRows(n).transpose());
    for (Index i = 0; i < n; ++i) {
      Scalar db = 0;
      for (Index j = 0; j < i; ++j) {
        const Scalar dA = N(i, j);
        db += dA * w.KK(i, j) * w.Gam(i, j);
        const Scalar f = dA * w.A(i, j);  // dL_ij L_ij: the decays' share
        dlg(i) += f;
        dlg(j) -= f;
        N(i, j) = dA * w.beta(i) * w.Gam(i, j);
      }
      N.row(i).tail(n - i).setZero();
      // W = diag(beta) R: dbeta_i = R_i . dW_i
      d_beta[first + i] = db + w.R.row(i).dot(dW.row(i));
    }
    dkf.noalias() += N * w.kf.topRows(n);
    dkf.noalias() += N.transpose() * w.kf.topRows(n);

    // R = V - diag(gamma) K S with dR = diag(beta) dW.
    dW = w.beta.head(n).asDiagonal() * dW;  // now dR
    dV.middleRows(first, n) = dW;
    for (Index i = 0; i < n; ++i) dlg(i) -= w.gam(i) * w.KS.row(i).dot(dW.row(i));
    dW = w.gam.head(n).asDiagonal() * dW;  // diag(gamma) dR
    dkf.noalias() -= dW * S.transpose();
    w.H_next.noalias() -= w.kf.topRows(n).transpose() * dW;

    // d log alpha_s = sum_{i >= s in the chunk} dL/dB_i.
    if (d_log_alpha != nullptr) {
      Scalar acc = 0;
      for (Index i = n - 1; i >= 0; --i) d_log_alpha[first + i] = acc += dlg(i);
    }
    w.H.swap(w.H_next);
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, n));
    phi.backward(Q.middleRows(first, n), w.qf.topRows(n), dqf, dq_rows);
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
    phi.backward(K.middleRows(first, n), w.kf.topRows(n), dkf, dk_rows);
  }
  dS0 = w.H;
}

}  // namespace linattn::detail
