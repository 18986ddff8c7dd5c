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
// Per token about 5 r dv flops in pass 1, 5 r dv to recompute and 15 r dv in the reverse walk,
// in matrix-vector products and row-wise passes over r x dv matrices (Eigen's; fusing the walk
// into two sweeps over the rows of H measured no faster on a Zen 5 VM); memory: ceil(T / C) r dv
// scalars kept, plus (C + 3) r dv + O(C (r + dv)) scratch. (Not the chunked WY form of the scalar-gated backward,
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
  RowMatrix<Scalar> H, running;       // r x dv: the state gradient; pass 1's running state
  RowVector<Scalar> du, dp;           // dv
  RowVector<Scalar> scaled_key;       // r: kf .* a

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
    for (auto* m : {&H, &running}) grow(*m, r, dv);
    du.resize(dv);
    dp.resize(dv);
    scaled_key.resize(r);
  }

  /// Bytes held.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = static_cast<std::size_t>(du.size() + dp.size() + scaled_key.size());
    for (const auto* m : {&kept, &states, &qf, &kf, &gates, &dqf, &dkf, &p, &u, &v, &dy, &H,
                          &running})
      n += static_cast<std::size_t>(m->size());
    return n * sizeof(Scalar);
  }

  /// Bytes channel_delta_backward needs for T tokens in chunks of C.
  [[nodiscard]] static std::size_t bytes_for(Index T, Index C, Index r, Index dv) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    return static_cast<std::size_t>(chunks * r * dv + (C + 3) * r * dv + 5 * C * r +
                                    4 * C * dv + 2 * dv + r) *
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
  // Token i from state `from` into `to` (the same matrix in pass 1): p = (kf .* a) from,
  // u = beta (v - p), to = diag(a) from + kf^T u, row by row (one read sweep, one write sweep).
  const auto token = [&](Index t, Index i, const Scalar* from, Scalar* to) {
    w.scaled_key = w.kf.row(i).cwiseProduct(w.gates.row(i));
    Row p(w.p.row(i).data(), dv), u(w.u.row(i).data(), dv);
    p.noalias() = w.scaled_key * Eigen::Map<const RowMatrix<Scalar>>(from, r, dv);
    u = in.beta(t) * (w.v.row(i) - p);
    const Scalar* a = w.gates.row(i).data();
    const Scalar* kf = w.kf.row(i).data();
    for (Index m = 0; m < r; ++m)
      Row(to + m * dv, dv) = a[m] * ConstRow(from + m * dv, dv) + kf[m] * u;
  };
  // The chunk's tokens from S (pass 1: in place) or from state(0) into state(1..n) (pass 2).
  const auto run = [&](Index first, Index n, Scalar* S, bool keep) {
    for (Index i = 0; i < n; ++i) {
      if (keep)
        token(first + i, i, w.states.data() + i * r * dv, w.states.data() + (i + 1) * r * dv);
      else
        token(first + i, i, S, S);
    }
  };

  // Pass 1: the state at each chunk's start.
  const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
  w.running = S0;
  for (Index c = 0; c < chunks; ++c) {
    const Index first = c * C, n = std::min(C, T - first);
    kept(c) = w.running;
    key_side(first, n);
    run(first, n, w.running.data(), false);
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
    run(first, n, nullptr, true);
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    for (Index i = 0; i < n; ++i) w.dy.row(i) = dY.row(first + i).template cast<Scalar>();
    for (Index i = n - 1; i >= 0; --i) {
      const Index t = first + i;
      // S_t and S_{t-1}, the token's features, gates, dy and u.
      const Eigen::Map<const RowMatrix<Scalar>> St(w.states.data() + (i + 1) * r * dv, r, dv),
          Sb(w.states.data() + i * r * dv, r, dv);
      const auto q = w.qf.row(i), k = w.kf.row(i), ga = w.gates.row(i);
      const ConstRow dy(w.dy.row(i).data(), dv), u(w.u.row(i).data(), dv);
      auto dq = w.dqf.row(i);
      auto dk = w.dkf.row(i);
      const Scalar beta = in.beta(t);
      dq.noalias() = dy * St.transpose();
      w.H.noalias() += q.transpose() * dy;
      dk.noalias() = u * w.H.transpose();
      w.du.noalias() = k * w.H;
      d_beta[t] = w.du.dot(w.v.row(i) - w.p.row(i));
      dV.row(t) = beta * w.du;
      w.dp = -beta * w.du;
      // S' = diag(a) S_{t-1}: dkf += S' dp, H += kf dp^T (the gradient of S'),
      // d log a_m = S'_m . H_m, H <- diag(a) H.
      w.scaled_key.noalias() = w.dp * Sb.transpose();
      dk += w.scaled_key.cwiseProduct(ga);
      w.H.noalias() += k.transpose() * w.dp;
      Row(d_log_alpha + t * r, r) =
          ((Sb.array() * w.H.array()).rowwise().sum().transpose() * ga.array()).matrix();
      w.H.array().colwise() *= ga.transpose().array();
    }
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, n));
    phi.backward(Q.middleRows(first, n), w.qf.topRows(n), w.dqf.topRows(n), dq_rows);
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
    phi.backward(K.middleRows(first, n), w.kf.topRows(n), w.dkf.topRows(n), dk_rows);
  }
  dS0 = w.H;
}

}  // namespace linattn::detail
