#pragma once
// Backward pass of Decay and Gated (linattn/rule_gradients.hpp).
//
// Decay and Gated (gated_backward): the chunked form of REFERENCES.md section 3 run in reverse
// mode. With the normalizer as an extra value column (V' = [V, 1], S' = [S, z]; the read is
// O'_i = S'_i^T q_i and the quotient rule gives its gradient G_i = [a_i dy_i, b_i] as in
// backward_chunked.hpp), per chunk with local cumulative log-gates B_i = sum_{s<=i} log g_s
// (one per channel, or one broadcast to all), state S'_0 before the chunk, H after it:
//   O'_i   = (q_i .* exp(B_i))^T S'_0 + sum_{j<=i} A_ij v'_j,
//   A_ij   = sum_n q_in k_jn exp(B_in - B_jn)                       (j <= i, every factor <= 1)
//   dA_ij  = G_i . v'_j
//   dq_i   = exp(B_i) .* (S'_0 G_i) + sum_{j<=i} dA_ij k_j .* exp(B_i - B_j)
//   dk_j   = exp(B_last - B_j) .* (H v'_j) + sum_{i>=j} dA_ij q_i .* exp(B_i - B_j)
//   dv'_j  = (k_j .* exp(B_last - B_j))^T H + sum_{i>=j} A_ij G_i
//   H     <- diag(exp(B_last)) H + sum_i (q_i .* exp(B_i)) G_i^T        (moving to the chunk before)
// Every exponent is <= 0 (log-gates are <= 0), so nothing overflows however small the gates.
// Gate gradients: the outputs and the final state depend on the global cumulative log-gates
// B_t only through q_t .* exp(B_t), k_t .* exp(-B_t) and exp(B_T) in the final state, so
//   dL/dB_t = q_t .* dq_t - k_t .* dk_t (+ rowsum(S'_T .* H_T) for t = T, the last token)
// with dq, dk the gradients of the features, and d log g_s = sum_{t>=s} dL/dB_t (a reverse
// cumulative sum; summed over the channels for one gate per token). Pass 1 (forward) rebuilds
// S' chunk by chunk, writes dQ, each row's (a, b) and q .* dq into the gate gradient; pass 2
// (reverse) carries H, writes dK, dV, subtracts k .* dk; the end adds the final-state term and
// sums from the end. Memory: 2 scalars per token plus O(C (C + r + dv) + r dv) per call.

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace linattn::detail {

/// Buffers of the gated backward, allocated once per call. `gate_cols` is 1 (Decay, one gate
/// per token) or r (per-channel gates); D = dv + 1 (values with the normalizer's column).
template <class Scalar>
struct GatedBackwardScratch {
  Index C = 0, r = 0, dv = 0, D = 0;
  RowMatrix<Scalar> qf, kf, qhat, khat, dqf, dkf;  // C x r
  RowMatrix<Scalar> log_cum, gates, to_end;        // C x gate_cols: B_i, g_i, exp(B_last - B_i)
  RowMatrix<Scalar> vx, G, rows_d;                 // C x D
  RowMatrix<Scalar> A, dA, W;                      // C x C
  RowMatrix<Scalar> Sx, H;                         // r x D
  RowVector<Scalar> decay_end, running, final_term;  // gate_cols, r, r
  ColVector<Scalar> a, b;                          // T

  GatedBackwardScratch(Index T, Index chunk, Index r_, Index dv_, Index gate_cols)
      : C(std::min(chunk, std::max<Index>(T, 1))), r(r_), dv(dv_), D(dv_ + 1) {
    for (auto* m : {&qf, &kf, &qhat, &khat, &dqf, &dkf}) m->resize(C, r);
    for (auto* m : {&log_cum, &gates, &to_end}) m->resize(C, gate_cols);
    for (auto* m : {&vx, &G, &rows_d}) m->resize(C, D);
    for (auto* m : {&A, &dA, &W}) m->resize(C, C);
    Sx.resize(r, D);
    H.resize(r, D);
    decay_end.resize(gate_cols);
    running.resize(r);
    final_term.resize(r);
    a.resize(T);
    b.resize(T);
  }

  /// Bytes the constructor allocates: 2 T + 6 C r + 3 C g + 3 C D + 3 C^2 + 2 r D + g + 2 r
  /// scalars (g = gate_cols, D = dv + 1, C = min(chunk, T)).
  [[nodiscard]] static std::size_t bytes_for(Index T, Index chunk, Index r, Index dv,
                                             Index gate_cols) {
    const Index C = std::min(chunk, std::max<Index>(T, 1)), D = dv + 1;
    return static_cast<std::size_t>(2 * T + 6 * C * r + 3 * C * gate_cols + 3 * C * D +
                                    3 * C * C + 2 * r * D + gate_cols + 2 * r) *
           sizeof(Scalar);
  }
};

/// The gated backward over one call (see the file comment). `in`: Gated's bound log-gates (T x 1
/// or T x r) or, when empty, Decay's constant log-gate. S0, z0: the initial state (z0 of length
/// r). dS_T, dz_T: gradient of the final state (null: 0). Writes dQ, dK, dV (may be strided
/// views), d_gate (T x gate_cols, contiguous, null: not wanted) and dS0, dz0 (resized).
/// DenominatorError as the forward read would throw it.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void gated_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                    const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                    const ColVector<Scalar>& z0, const RowMatrix<Scalar>* dS_T,
                    const ColVector<Scalar>* dz_T, Index chunk_size, const Normalization& norm,
                    Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                    Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_gate, RowMatrix<Scalar>& dS0,
                    ColVector<Scalar>& dz0) {
  const Index T = Q.rows(), r = S0.rows(), dv = S0.cols();
  const bool per_channel = in.log_gate.cols > 1;
  const Index gc = per_channel ? r : 1;
  GatedBackwardScratch<Scalar> w(T, chunk_size, r, dv, gc);
  const Index C = w.C;
  const auto log_gate = [&](Index t, Index c) {
    return in.log_gate.empty() ? in.constant_log_gate : in.log_gate(t, per_channel ? c : 0);
  };

  // Features, extended values, cumulative log-gates and the decays of rows [first, first + n).
  const auto prepare = [&](Index first, Index n) {
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    map_rows<Scalar>(phi, K, first, n, w.kf);
    w.vx.topLeftCorner(n, dv) = V.middleRows(first, n);
    w.vx.col(dv).head(n).setOnes();
    for (Index c = 0; c < gc; ++c) {
      Scalar sum = 0;
      for (Index i = 0; i < n; ++i) w.log_cum(i, c) = sum += log_gate(first + i, c);
    }
    w.decay_end = w.log_cum.row(n - 1).array().exp();
    for (Index i = 0; i < n; ++i) {
      w.to_end.row(i) = (w.log_cum.row(n - 1) - w.log_cum.row(i)).array().exp();
      if (per_channel) {
        w.qhat.row(i) = w.qf.row(i).cwiseProduct(w.log_cum.row(i).array().exp().matrix());
        w.khat.row(i) = w.kf.row(i).cwiseProduct(w.to_end.row(i));
        w.gates.row(i) = Eigen::Map<const RowVector<Scalar>>(&in.log_gate.data[(first + i) *
                                                                 in.log_gate.row_stride], r)
                             .array()
                             .exp();
      } else {
        w.qhat.row(i) = w.qf.row(i) * std::exp(w.log_cum(i, 0));
        w.khat.row(i) = w.kf.row(i) * w.to_end(i, 0);
      }
    }
    if (!per_channel) {  // W_ij = exp(B_i - B_j) for j <= i
      for (Index i = 0; i < n; ++i)
        for (Index j = 0; j < n; ++j)
          w.W(i, j) = j <= i ? std::exp(w.log_cum(i, 0) - w.log_cum(j, 0)) : Scalar(0);
    }
  };
  // The chunk's scores A (lower triangle, zero above); for per-channel gates, with
  // `d_keys` also dk_j += sum_{i>=j} dA_ij q_i .* exp(B_i - B_j) in the same loop.
  const auto scores = [&](Index n, bool d_keys) {
    auto A = w.A.topLeftCorner(n, n);
    if (!per_channel) {
      A.noalias() = w.qf.topRows(n) * w.kf.topRows(n).transpose();
      A.array() *= w.W.topLeftCorner(n, n).array();
      if (d_keys) {
        w.dA.topLeftCorner(n, n).array() *= w.W.topLeftCorner(n, n).array();
        w.dkf.topRows(n).noalias() +=
            w.dA.topLeftCorner(n, n).transpose() * w.qf.topRows(n);
      }
      return;
    }
    A.setZero();
    for (Index i = 0; i < n; ++i) {
      w.running.setOnes();  // prod_{s=j+1..i} g_s, by channel
      for (Index j = i; j >= 0; --j) {
        const auto qw = w.qf.row(i).cwiseProduct(w.running);
        A(i, j) = qw.dot(w.kf.row(j));
        if (d_keys) w.dkf.row(j) += w.dA(i, j) * qw;
        w.running.array() *= w.gates.row(j).array();
      }
    }
  };
  // G_i from the stored (a, b): [a_i dy_i, b_i]; dA = tril(G V'^T).
  const auto read_grads = [&](Index first, Index n) {
    for (Index i = 0; i < n; ++i) {
      w.G.row(i).head(dv) = w.a(first + i) * dY.row(first + i);
      w.G(i, dv) = w.b(first + i);
    }
    w.dA.topLeftCorner(n, n).noalias() = w.G.topRows(n) * w.vx.topRows(n).transpose();
    for (Index i = 0; i + 1 < n; ++i) w.dA.row(i).segment(i + 1, n - i - 1).setZero();
  };
  // The gate gradient's per-token terms dL/dB (q .* dq in pass 1, minus k .* dk in pass 2).
  const auto add_gate_terms = [&](Index first, Index n, const RowMatrix<Scalar>& f,
                                  const RowMatrix<Scalar>& df, Scalar sign) {
    if (d_gate == nullptr) return;
    for (Index i = 0; i < n; ++i) {
      Scalar* row = d_gate + (first + i) * gc;
      if (per_channel)
        Eigen::Map<RowVector<Scalar>>(row, r) += sign * f.row(i).cwiseProduct(df.row(i));
      else
        row[0] += sign * f.row(i).dot(df.row(i));
    }
  };

  // ---- pass 1: forward; S' before each chunk, dQ, (a, b), q .* dq ----
  w.Sx.leftCols(dv) = S0;
  w.Sx.col(dv) = z0;
  if (d_gate != nullptr) std::fill(d_gate, d_gate + T * gc, Scalar(0));
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    prepare(first, n);
    scores(n, false);
    // X = dY S^T serves both the read's (num . dy, den) and dq's state part, so the state is
    // read once: num_i . dy_i = q-hat_i . X_i + (A V)_i . dy_i, den_i = q-hat_i . z + (A 1)_i.
    auto X = w.dqf.topRows(n);
    X.noalias() = dY.middleRows(first, n) * w.Sx.leftCols(dv).transpose();
    auto AV = w.rows_d.topRows(n);
    AV.noalias() = w.A.topLeftCorner(n, n) * w.vx.topRows(n);
    for (Index i = 0; i < n; ++i) {
      const Scalar den = w.qhat.row(i).dot(w.Sx.col(dv).transpose()) + AV(i, dv);
      const Scalar dy_num =
          w.qhat.row(i).dot(X.row(i)) + dY.row(first + i).dot(AV.row(i).head(dv));
      const ReadGradient<Scalar> g =
          read_gradient<Scalar, false>(norm, den, dy_num, Scalar(0), first + i);
      w.a(first + i) = g.numerator;
      w.b(first + i) = g.denominator;
    }
    read_grads(first, n);
    // dq = exp(B) .* (S' G) + (dA .* exp(B_i - B_j)) k, S' G_i = a_i X_i + b_i z
    for (Index i = 0; i < n; ++i) {
      X.row(i) = w.a(first + i) * X.row(i) + w.b(first + i) * w.Sx.col(dv).transpose();
      if (per_channel)
        X.row(i).array() *= w.log_cum.row(i).array().exp();
      else
        X.row(i) *= std::exp(w.log_cum(i, 0));
    }
    if (!per_channel) {
      w.dA.topLeftCorner(n, n).array() *= w.W.topLeftCorner(n, n).array();
      w.dqf.topRows(n).noalias() += w.dA.topLeftCorner(n, n) * w.kf.topRows(n);
    } else {
      for (Index i = 0; i < n; ++i) {
        w.running.setOnes();
        for (Index j = i; j >= 0; --j) {
          w.dqf.row(i) += w.dA(i, j) * w.kf.row(j).cwiseProduct(w.running);
          w.running.array() *= w.gates.row(j).array();
        }
      }
    }
    add_gate_terms(first, n, w.qf, w.dqf, Scalar(1));
    {
      Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, n));
      phi.backward(Q.middleRows(first, n), w.qf.topRows(n), w.dqf.topRows(n), dq_rows);
    }
    // S' <- diag(exp(B_last)) S' + K-hat^T V'
    if (per_channel)
      w.Sx = w.decay_end.transpose().asDiagonal() * w.Sx;
    else
      w.Sx *= w.decay_end(0);
    w.Sx.noalias() += w.khat.topRows(n).transpose() * w.vx.topRows(n);
  }

  // ---- pass 2: reverse; H, dK, dV, minus k .* dk ----
  if (dS_T != nullptr)
    w.H.leftCols(dv) = *dS_T;
  else
    w.H.leftCols(dv).setZero();
  if (dz_T != nullptr)
    w.H.col(dv) = *dz_T;
  else
    w.H.col(dv).setZero();
  // The final state's share of dL/dB_T: rowsum(S'_T .* H_T) (w.Sx holds S'_T now).
  w.final_term = (w.Sx.array() * w.H.array()).rowwise().sum().transpose();
  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  for (Index first = last_first; first >= 0; first -= C) {
    const Index n = std::min(C, T - first);
    prepare(first, n);
    read_grads(first, n);
    // dk = exp(B_last - B_j) .* (V' H^T) + intra
    w.dkf.topRows(n).noalias() = w.vx.topRows(n) * w.H.transpose();
    for (Index j = 0; j < n; ++j) {
      if (per_channel)
        w.dkf.row(j).array() *= w.to_end.row(j).array();
      else
        w.dkf.row(j) *= w.to_end(j, 0);
    }
    scores(n, true);
    // dV' = K-hat H + A^T G
    auto dvx = w.rows_d.topRows(n);
    dvx.noalias() = w.khat.topRows(n) * w.H;
    dvx.noalias() += w.A.topLeftCorner(n, n).transpose() * w.G.topRows(n);
    dV.middleRows(first, n) = dvx.leftCols(dv);
    add_gate_terms(first, n, w.kf, w.dkf, Scalar(-1));
    {
      Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
      phi.backward(K.middleRows(first, n), w.kf.topRows(n), w.dkf.topRows(n), dk_rows);
    }
    // H before the chunk = diag(exp(B_last)) H + Q-hat^T G
    if (per_channel)
      w.H = w.decay_end.transpose().asDiagonal() * w.H;
    else
      w.H *= w.decay_end(0);
    w.H.noalias() += w.qhat.topRows(n).transpose() * w.G.topRows(n);
  }
  dS0 = w.H.leftCols(dv);
  dz0 = w.H.col(dv);

  // d log g_s = sum_{t >= s} dL/dB_t, the final state's term on the last token.
  if (d_gate != nullptr && T > 0) {
    Scalar* last = d_gate + (T - 1) * gc;
    if (per_channel)
      Eigen::Map<RowVector<Scalar>>(last, r) += w.final_term;
    else
      last[0] += w.final_term.sum();
    for (Index t = T - 2; t >= 0; --t)
      Eigen::Map<RowVector<Scalar>>(d_gate + t * gc, gc) +=
          Eigen::Map<const RowVector<Scalar>>(d_gate + (t + 1) * gc, gc);
  }
}

}  // namespace linattn::detail
