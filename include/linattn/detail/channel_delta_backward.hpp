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
// Pass 1 runs the forward's chunk kernel (ChannelDeltaChunk, the same arithmetic as the
// chunked forward, so a saving forward keeps the same bits) and keeps the state at every
// chunk's start; pass 2 takes the chunks in reverse, recomputes the chunk's states token by
// token from the kept one (the chunk's C + 1 states, its p and u), then walks its tokens
// backwards. A backward from a saved forward (linattn/rule_saved_forward.hpp) is pass 2 alone.
// Per token about 5 r dv flops to recompute and 15 r dv in the reverse walk, in matrix-vector
// products and row-wise passes over r x dv matrices (Eigen's; fusing the walk into two sweeps
// over the rows of H measured no faster on a Zen 5 VM), plus the forward's for pass 1; memory:
// ceil(T / C) r dv scalars kept, plus (C + 2) r dv + O(C (r + dv)) scratch and pass 1's
// kernel. (Not the chunked WY form of the scalar-gated backward, delta_backward.hpp: the
// in-chunk products would need the per-channel decays inside every pairwise term, as the
// forward's ChannelDeltaChunk builds them.)

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/delta_kernels.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <optional>

namespace linattn::detail {

/// The buffers of channel_delta_backward, grown to the largest call and never shrunk (a
/// BackwardWorkspace keeps them between calls).
template <class Scalar>
struct ChannelDeltaBackwardScratch {
  std::optional<ChannelDeltaChunk<Scalar>> kernel;  // pass 1: the forward's chunk kernel
  RowMatrix<Scalar> states;           // a chunk's states: (C + 1) r x dv
  RowMatrix<Scalar> qf, kf, gates;    // C x r
  RowMatrix<Scalar> dqf, dkf;         // C x r
  RowMatrix<Scalar> p, u, v, dy;      // C x dv (v, dy: copies where V, dY rows are strided)
  RowMatrix<Scalar> H, running;       // r x dv: the state gradient; pass 1's running state
  RowVector<Scalar> du, dp;           // dv
  RowVector<Scalar> scaled_key;       // r: kf .* a

  /// Sized for chunks of C tokens, r features and dv values (pass 2's buffers and pass 1's
  /// running state; pass 1 makes its kernel).
  void fit(Index C, Index r, Index dv) {
    const auto grow = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.cols() != cols || m.rows() < rows) m.resize(rows, cols);
    };
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
    Index n = du.size() + dp.size() + scaled_key.size() + (kernel ? kernel->scalars() : 0);
    for (const auto* m : {&states, &qf, &kf, &gates, &dqf, &dkf, &p, &u, &v, &dy, &H, &running})
      n += m->size();
    return static_cast<std::size_t>(n) * sizeof(Scalar);
  }

  /// Bytes a call in chunks of C tokens holds here: pass 2's buffers, and with `pass1` the
  /// running state and the kernel made for chunks of `kernel_rows` (the forward's chunk).
  [[nodiscard]] static std::size_t bytes_for(Index C, Index r, Index dv, bool pass1,
                                             Index kernel_rows) {
    const Index pass2 = (C + 2) * r * dv + 5 * C * r + 4 * C * dv + 2 * dv + r;
    const Index first =
        pass1 ? r * dv + ChannelDeltaChunk<Scalar>::scalars_for(kernel_rows, r, dv) : 0;
    // The saved backward makes no kernel, but its running state is sized with the rest.
    return static_cast<std::size_t>(pass2 + (pass1 ? first : r * dv)) * sizeof(Scalar);
  }
};

/// Pass 1: the chunked forward's key side and state update (ChannelDeltaChunk made for chunks of
/// `chunk` rows, as the forward's) over K, V from S0, keeping the state before each chunk in
/// `saved` (fitted, no per-token rows): the saving forward's bits. No allocation once `w` and
/// `saved` fit the call.
template <class Scalar, class Phi, class DK, class DV>
void channel_delta_save_chunks(const Phi& phi, const DK& K, const DV& V,
                               const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                               Index chunk, DeltaSavedStates<Scalar>& saved,
                               ChannelDeltaBackwardScratch<Scalar>& w) {
  const Index T = K.rows(), r = S0.rows(), dv = S0.cols();
  const Index C = std::max<Index>(std::min(chunk, T), 1);
  saved.fit(T, C, r, dv, false);
  w.fit(C, r, dv);
  if (T == 0) return;
  ChannelDeltaChunk<Scalar>& kernel = chunk_scratch_in(w.kernel, false, chunk, r, dv);
  const SaveDeltaChunks<Scalar> save{saved};
  SpreadPrefetch next_rows;  // the next chunk's K, V rows behind this chunk's products
  kernel.prefetch = &next_rows;
  w.running = S0;
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    next_rows.add(K, first + C, C);
    next_rows.add(V, first + C, C);
    map_rows<Scalar>(phi, K, first, n, w.kf);
    const auto [v, ld_v] = row_major_rows(V, first, n, w.v);
    kernel.prepare(n, w.kf.data(), r, v, ld_v, values_from(in.beta, first),
                   TokenRows<Scalar>{in.log_alpha.data + first * in.log_alpha.row_stride,
                                     in.log_alpha.row_stride},
                   w.running);
    save(first, w.running, kernel);
    kernel.absorb(w.running);
    next_rows.finish();
  }
  stream_fence();
}

/// Pass 2, the reverse sweep, from the states kept before each chunk of saved.chunk_size rows
/// (per-channel GatedDelta's saved forward, or pass 1). `in`: bound beta (T x 1) and log_alpha
/// (T x r). Writes dQ, dK, dV, d_beta (length T), d_log_alpha (T x r, row-major, contiguous)
/// and dS0 (resized); dS_T null: 0. No allocation once `w` fits the call.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void channel_delta_backward_saved(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                                  const DY& dY, const TokenInputs<Scalar>& in,
                                  const DeltaSavedStates<Scalar>& saved,
                                  const RowMatrix<Scalar>* dS_T, Eigen::Ref<RowMatrix<Scalar>> dQ,
                                  Eigen::Ref<RowMatrix<Scalar>> dK,
                                  Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_beta,
                                  Scalar* d_log_alpha, RowMatrix<Scalar>& dS0,
                                  ChannelDeltaBackwardScratch<Scalar>& w) {
  const Index T = Q.rows(), r = phi.feature_dim(K.cols()), dv = V.cols();
  const Index C = std::max<Index>(saved.chunk_size, 1);
  w.fit(std::min(C, std::max<Index>(T, 1)), r, dv);
  using Row = Eigen::Map<RowVector<Scalar>>;
  using ConstRow = Eigen::Map<const RowVector<Scalar>>;
  using State = Eigen::Map<RowMatrix<Scalar>>;
  using ConstState = Eigen::Map<const RowMatrix<Scalar>>;
  const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero(r, dv);
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index first = c * C, n = std::min(C, T - first);
    // The chunk's keys, gates and values, its queries and dy.
    map_rows<Scalar>(phi, K, first, n, w.kf);
    for (Index i = 0; i < n; ++i)
      gates_from_logs(&in.log_alpha.data[(first + i) * in.log_alpha.row_stride], 1,
                      w.gates.row(i).data(), r);
    const auto [v, ld_v] = row_major_rows(V, first, n, w.v);
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    const auto [dy_rows, ld_dy] = row_major_rows(dY, first, n, w.dy);
    // The chunk's states from the kept one: token i takes state i to state i + 1 with
    // p = (kf .* a) S, u = beta (v - p), S' = diag(a) S + kf u^T (row by row).
    State(w.states.data(), r, dv) = ConstState(saved.states.data() + c * r * dv, r, dv);
    for (Index i = 0; i < n; ++i) {
      const Scalar* from = w.states.data() + i * r * dv;
      Scalar* to = w.states.data() + (i + 1) * r * dv;
      w.scaled_key = w.kf.row(i).cwiseProduct(w.gates.row(i));
      Row p(w.p.row(i).data(), dv), u(w.u.row(i).data(), dv);
      p.noalias() = w.scaled_key * ConstState(from, r, dv);
      u = in.beta(first + i) * (ConstRow(v + i * ld_v, dv) - p);
      const Scalar* a = w.gates.row(i).data();
      const Scalar* kf = w.kf.row(i).data();
      for (Index m = 0; m < r; ++m)
        Row(to + m * dv, dv) = a[m] * ConstRow(from + m * dv, dv) + kf[m] * u;
    }
    for (Index i = n - 1; i >= 0; --i) {
      const Index t = first + i;
      // S_t and S_{t-1}, the token's features, gates, dy and u.
      const ConstState St(w.states.data() + (i + 1) * r * dv, r, dv),
          Sb(w.states.data() + i * r * dv, r, dv);
      const auto q = w.qf.row(i), k = w.kf.row(i), ga = w.gates.row(i);
      const ConstRow dy(dy_rows + i * ld_dy, dv), u(w.u.row(i).data(), dv);
      auto dq = w.dqf.row(i);
      auto dk = w.dkf.row(i);
      const Scalar beta = in.beta(t);
      dq.noalias() = dy * St.transpose();
      w.H.noalias() += q.transpose() * dy;
      dk.noalias() = u * w.H.transpose();
      w.du.noalias() = k * w.H;
      d_beta[t] = w.du.dot(ConstRow(v + i * ld_v, dv) - w.p.row(i));
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

/// The backward of per-channel GatedDelta from the state S0 (see the file comment): pass 1 into
/// `saved` (the forward's chunks of `chunk` rows), then pass 2. Outputs as
/// channel_delta_backward_saved. No allocation once `w` and `saved` fit the call.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void channel_delta_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                            const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                            const RowMatrix<Scalar>* dS_T, Index chunk,
                            Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                            Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_beta, Scalar* d_log_alpha,
                            RowMatrix<Scalar>& dS0, DeltaSavedStates<Scalar>& saved,
                            ChannelDeltaBackwardScratch<Scalar>& w) {
  channel_delta_save_chunks(phi, K, V, in, S0, chunk, saved, w);
  channel_delta_backward_saved(phi, Q, K, V, dY, in, saved, dS_T, dQ, dK, dV, d_beta,
                               d_log_alpha, dS0, w);
}

}  // namespace linattn::detail
