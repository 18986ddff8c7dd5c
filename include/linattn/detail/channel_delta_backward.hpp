#pragma once
// Backward pass of GatedDelta with per-channel gates (Kimi Delta Attention;
// linattn/rule_gradients.hpp). Per token t, with features kf = phi(k_t), qf = phi(q_t), the
// gates a = exp(log_alpha_t) (length r) and S (r x dv) the state before the token:
//   S' = diag(a) S,   p = S'^T kf,   u = beta (v - p),   S_t = S' + kf u^T,   y = S_t^T qf.
// Backwards, with H = dLoss/dS_t from the later tokens (dS_T at the end) and dy:
//   dqf = S_t dy,  H += qf dy^T,
//   dkf = H u,     du = H^T kf,     d beta = du . (v - p),  dv = beta du,  dp = -beta du,
//   dkf += S' dp,  H += kf dp^T     (now dLoss/dS'),
//   d log_alpha_m = sum_c S'_mc H_mc  (a_m dLoss/da_m),   H <- diag(a) H  (dLoss/dS).
// A token-by-token reverse sweep: pass 1 runs the recurrence and keeps the state at every
// chunk's start; pass 2 takes the chunks in reverse, recomputes the chunk's states from the
// kept one (the chunk's C + 1 states, its p and u), then walks its tokens backwards.
// Per token about 6 r dv flops in pass 1, 6 r dv to recompute and 16 r dv in the reverse walk,
// each a matrix-vector product on S (Eigen's); memory: ceil(T / C) r dv scalars kept, plus
// (C + 2) r dv + O(C (r + dv)) scratch. (Not the chunked WY form of the scalar-gated backward,
// delta_backward.hpp: the in-chunk products would need the per-channel decays inside every
// pairwise term, as the forward's ChannelDeltaChunk builds them.)

#include <linattn/detail/chunked.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>

namespace linattn::detail {

/// The buffers of channel_delta_backward, grown to the largest call and never shrunk (a
/// BackwardWorkspace keeps them between calls).
template <class Scalar>
struct ChannelDeltaBackwardScratch {
  RowMatrix<Scalar> kept;             // the state at each chunk's start (chunks r x dv)
  RowMatrix<Scalar> states;           // a chunk's states: (C + 1) r x dv
  RowMatrix<Scalar> qf, kf, gates;    // C x r
  RowMatrix<Scalar> dqf, dkf;         // C x r
  RowMatrix<Scalar> p, u, v, dy;      // C x dv
  RowMatrix<Scalar> H, decayed;       // r x dv
  RowVector<Scalar> du, dp;           // dv

  /// Sized for T tokens in chunks of C, r features and dv values.
  void fit(Index T, Index C, Index r, Index dv) {
    const auto grow = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.cols() != cols)
        m.resize(rows, cols);
      else if (m.rows() < rows)
        m.resize(rows, cols);
    };
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    grow(kept, chunks * r, dv);
    grow(states, (C + 1) * r, dv);
    for (auto* m : {&qf, &kf, &gates, &dqf, &dkf}) grow(*m, C, r);
    for (auto* m : {&p, &u, &v, &dy}) grow(*m, C, dv);
    for (auto* m : {&H, &decayed}) grow(*m, r, dv);
    du.resize(dv);
    dp.resize(dv);
  }

  /// Bytes held.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = static_cast<std::size_t>(du.size() + dp.size());
    for (const auto* m : {&kept, &states, &qf, &kf, &gates, &dqf, &dkf, &p, &u, &v, &dy, &H,
                          &decayed})
      n += static_cast<std::size_t>(m->size());
    return n * sizeof(Scalar);
  }

  /// Bytes channel_delta_backward needs for T tokens in chunks of C.
  [[nodiscard]] static std::size_t bytes_for(Index T, Index C, Index r, Index dv) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    return static_cast<std::size_t>(chunks * r * dv + (C + 3) * r * dv + 5 * C * r +
                                    4 * C * dv + 2 * dv) *
           sizeof(Scalar);
  }
};

/// The backward of per-channel GatedDelta from the state S0 (see the file comment), in chunks
/// of `chunk` tokens. `in`: bound beta (T x 1) and log_alpha (T x r). Writes dQ, dK, dV,
/// d_beta (length T), d_log_alpha (T x r, row-major, contiguous) and dS0 (resized); dS_T null:
/// 0. No allocation once `w` fits the call.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void channel_delta_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                            const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                            const RowMatrix<Scalar>* dS_T, Index chunk,
                            Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                            Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_beta, Scalar* d_log_alpha,
                            RowMatrix<Scalar>& dS0, ChannelDeltaBackwardScratch<Scalar>& w) {
  const Index T = Q.rows(), r = S0.rows(), dv = S0.cols();
  const Index C = std::max<Index>(std::min(chunk, T), 1);
  w.fit(T, C, r, dv);
  using Row = Eigen::Map<RowVector<Scalar>>;
  using ConstRow = Eigen::Map<const RowVector<Scalar>>;
  using State = Eigen::Map<RowMatrix<Scalar>>;
  const auto state = [&](Index i) { return State(w.states.data() + i * r * dv, r, dv); };
  const auto kept = [&](Index c) { return State(w.kept.data() + c * r * dv, r, dv); };
  const auto column = [](const RowMatrix<Scalar>& m, Index i) {
    return ConstRow(m.data() + i * m.cols(), m.cols());
  };
  // One chunk's keys, gates and values; then the recurrence over it from `S`, which it leaves
  // at the chunk's end, keeping each token's p and u (and, with `keep`, every state).
  const auto key_side = [&](Index first, Index n) {
    map_rows<Scalar>(phi, K, first, n, w.kf);
    for (Index i = 0; i < n; ++i) {
      gates_from_logs(&in.log_alpha.data[(first + i) * in.log_alpha.row_stride], 1,
                      w.gates.row(i).data(), r);
      w.v.row(i) = V.row(first + i).template cast<Scalar>();
    }
  };
  const auto run = [&](Index first, Index n, State S, bool keep) {
    for (Index i = 0; i < n; ++i) {
      S.array().colwise() *= w.gates.row(i).transpose().array();
      Row p(w.p.row(i).data(), dv), u(w.u.row(i).data(), dv);
      p.noalias() = w.kf.row(i) * S;
      u = in.beta(first + i) * (w.v.row(i) - p);
      S.noalias() += w.kf.row(i).transpose() * u;
      if (keep) state(i + 1) = S;
    }
  };

  // Pass 1: the state at each chunk's start.
  const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
  w.decayed = S0;
  for (Index c = 0; c < chunks; ++c) {
    const Index first = c * C, n = std::min(C, T - first);
    kept(c) = w.decayed;
    key_side(first, n);
    run(first, n, State(w.decayed.data(), r, dv), false);
  }

  // Pass 2: the chunks in reverse, each token backwards.
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero(r, dv);
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index first = c * C, n = std::min(C, T - first);
    key_side(first, n);
    state(0) = kept(c);
    w.decayed = kept(c);
    run(first, n, State(w.decayed.data(), r, dv), true);
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    for (Index i = 0; i < n; ++i) w.dy.row(i) = dY.row(first + i).template cast<Scalar>();
    for (Index i = n - 1; i >= 0; --i) {
      const Index t = first + i;
      const auto qf = w.qf.row(i);
      const auto kf = w.kf.row(i);
      const auto dy = w.dy.row(i);
      const auto a = column(w.gates, i);
      const Scalar beta = in.beta(t);
      w.dqf.row(i).noalias() = dy * state(i + 1).transpose();
      w.H.noalias() += qf.transpose() * dy;
      w.dkf.row(i).noalias() = w.u.row(i) * w.H.transpose();
      w.du.noalias() = kf * w.H;
      d_beta[t] = w.du.dot(w.v.row(i) - w.p.row(i));
      dV.row(t) = beta * w.du;
      w.dp = -beta * w.du;
      // S' = diag(a) S_{t-1}, recomputed from the kept state before the token.
      w.decayed = state(i);
      w.decayed.array().colwise() *= a.transpose().array();
      w.dkf.row(i).noalias() += w.dp * w.decayed.transpose();
      w.H.noalias() += kf.transpose() * w.dp;
      Row(d_log_alpha + t * r, r) =
          (w.decayed.array() * w.H.array()).rowwise().sum().transpose();
      w.H.array().colwise() *= a.transpose().array();
    }
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, n));
    phi.backward(Q.middleRows(first, n), w.qf.topRows(n), w.dqf.topRows(n), dq_rows);
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
    phi.backward(K.middleRows(first, n), w.kf.topRows(n), w.dkf.topRows(n), dk_rows);
  }
  dS0 = w.H;
}

}  // namespace linattn::detail
