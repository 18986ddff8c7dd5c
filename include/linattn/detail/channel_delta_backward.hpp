#pragma once
// Backward pass of GatedDelta with per-channel gates (Kimi Delta Attention;
// linattn/rule_gradients.hpp), in the chunked WY form of delta_backward.hpp with the decays
// per channel. Per token t: features kf = phi(k_t), qf = phi(q_t), gates a_t = exp(log_alpha_t)
// (length r), S' = diag(a_t) S, u_t = beta_t (v_t - kf S'), S_t = S' + kf^T u_t, y_t = qf S_t.
//
// In a block of n tokens (rows i, j) from state S, with the products of the block's gates
//   gam_i = a_0 .* ... .* a_i,  e_j = a_{j+1} .* ... .* a_{n-1},  E_ij = a_{j+1} .* ... .* a_i
// (j <= i; every factor <= 1, products of gates multiplied one by one: nothing overflows),
//   W_ij = sum_m kf_im kf_jm E_ijm (j < i),   P_ij = sum_m qf_im kf_jm E_ijm (j <= i),
//   R = V - (K .* gam) S,  (I + strictly_lower(diag(beta) W)) U = diag(beta) R,
//   O = (Q .* gam) S + P U,   S_after = diag(gam_{n-1}) S + (K .* e)^T U.
// Backwards, with dO and H (the gradient of S_after):
//   dU = (K .* e) H + P^T dO,   dX = (I + strictly_lower(diag(beta) W))^-T dU,
//   d beta_i = R_i . dX_i - sum_{j<i} W_ij (dX_i . u_j),   dW_ij = -beta_i (dX_i . u_j),
//   dR = diag(beta) dX = dV,   dP_ij = dO_i . u_j,
//   dqf_i = gam_i .* (S dO_i) + sum_{j<=i} dP_ij kf_j .* E_ij,
//   dkf_i = gam_i .* (-S dR_i) + e_i .* (H u_i) + sum_{i'>=i} dP_i'i qf_i' .* E_i'i
//           + sum_{j<i} dW_ij kf_j .* E_ij + sum_{i'>i} dW_i'i kf_i' .* E_i'i,
//   H <- diag(gam_{n-1}) H + (Q .* gam)^T dO - (K .* gam)^T dR.
// Gate gradients: everything depends on the block's cumulative log-gates b_i only through
// exp(+b_i) at row i and exp(-b_j) at row j, so dL/db_i = qf_i .* dqf_i + kf_i .* (the terms
// of dkf_i with exp(+b_i)) - kf_i .* (those with exp(-b_i)), and the last row also takes
// sum_j kf_j .* e_j .* (H u_j) + gam_{n-1} .* rowsum(S .* H); d log_alpha_s = sum_{i>=s} dL/db_i
// over the block (the later blocks' share arrives through H).
//
// Layout: pass 1 runs the forward's chunk kernel (ChannelDeltaChunk: the saving forward's bits)
// and keeps the state before each chunk; pass 2 (the backward from a saved forward is pass 2
// alone) takes the chunks in reverse: from the kept state it rebuilds the state before each
// block of channel_delta_block rows and the block's R and U, then walks the blocks backwards.
// The products against S and H (r x dv) are matrix products over the block's rows: per token
// 4 r dv flops to rebuild (R, the state update) and 12 r dv in the walk ((K .* e) H, U H^T,
// [dO; -dR] S^T and H's update), plus about 9 r n in the pairwise terms (18 flops per pair and
// channel: P, W and their gradients, on row kernels that hold the running row in registers) and
// n dv in the triangular solves; pass 1 costs the forward's. Memory: ceil(T / C) r dv scalars
// kept, plus ceil(C / n) r dv + O(C (r + dv + n) + n (r + dv)) scratch and pass 1's kernel.

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

/// Rows per block of the per-channel delta backward's reverse walk (see the file comment):
/// the products against S and H run over 2 x 16 rows, while the pairwise terms cost about
/// 9 r x 16 flops per token, under a fifth of the 16 r dv of the products at r = dv >= 64
/// (measured on Zen 5 at r = dv = 64 and 128: 32-row blocks were no faster).
inline constexpr Index channel_delta_block = 16;

/// The buffers of channel_delta_backward, grown to the largest call and never shrunk (a
/// BackwardWorkspace keeps them between calls).
template <class Scalar>
struct ChannelDeltaBackwardScratch {
  std::optional<ChannelDeltaChunk<Scalar>> kernel;  // pass 1: the forward's chunk kernel
  RowMatrix<Scalar> states;                      // before each block: ceil(C / n) r x dv
  RowMatrix<Scalar> qf, kf, gates, dqf, dkf;     // C x r
  RowMatrix<Scalar> R, U, v, dy;                 // C x dv (v, dy: copies of strided rows)
  RowMatrix<Scalar> W;                           // C x n: each block's decayed key products
  RowMatrix<Scalar> H, running;                  // r x dv: the state gradient; pass 1's state
  RowMatrix<Scalar> gam, decay_end, kend, dkp, dkm;  // n x r: one block's
  RowMatrix<Scalar> lhs, D;                      // 2n x r: [kf .* gam; qf .* gam], [-S dR; S dO]^T
  RowMatrix<Scalar> rhs, dU, dX;                 // 2n x dv ([-dR; dO]), n x dv, n x dv
  RowMatrix<Scalar> P, dP, dW;                   // n x n
  // Transposes for the register kernel (n and 2n rounded up to whole packets, Pn and P2n):
  RowMatrix<Scalar> lhs_t, D_t, kend_t, dkm_t;   // r x P2n, r x P2n, r x Pn, r x Pn
  RowMatrix<Scalar> rhs_t, U_t;                  // dv x P2n, dv x Pn
  RowVector<Scalar> decay, end_terms;            // r
  RowVector<Scalar> coef;                        // n: one row's solve coefficients

  /// Sized for chunks of C tokens, r features and dv values (pass 2's buffers and pass 1's
  /// running state; pass 1 makes its kernel).
  void fit(Index C, Index r, Index dv) {
    const Index n = block_rows(C), blocks = (C + n - 1) / n;
    const auto grow = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.cols() != cols || m.rows() < rows) m.resize(rows, cols);
    };
    grow(states, blocks * r, dv);
    for (auto* m : {&qf, &kf, &gates, &dqf, &dkf}) grow(*m, C, r);
    for (auto* m : {&R, &U, &v, &dy}) grow(*m, C, dv);
    // The block's width n is smaller for a call shorter than the chunks before it: kept wider.
    const auto grow_wide = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.cols() < cols || m.rows() < rows) m.resize(std::max(rows, m.rows()), std::max(cols, m.cols()));
    };
    grow_wide(W, C, n);
    for (auto* m : {&H, &running}) grow(*m, r, dv);
    for (auto* m : {&gam, &decay_end, &kend, &dkp, &dkm}) grow(*m, n, r);
    for (auto* m : {&lhs, &D}) grow(*m, 2 * n, r);
    grow(rhs, 2 * n, dv);
    for (auto* m : {&dU, &dX}) grow(*m, n, dv);
    for (auto* m : {&P, &dP, &dW}) grow_wide(*m, n, n);
    const Index pn = padded(n), p2n = padded(2 * n);
    // Zeroed when made: columns past a block's rows are read by the kernel, never used.
    const auto grow_zero = [](RowMatrix<Scalar>& m, Index rows, Index cols) {
      if (m.cols() < cols || m.rows() != rows) m.setZero(rows, std::max(cols, m.cols()));
    };
    for (auto* m : {&lhs_t, &D_t}) grow_zero(*m, r, p2n);
    for (auto* m : {&kend_t, &dkm_t}) grow_zero(*m, r, pn);
    grow_zero(rhs_t, dv, p2n);
    grow_zero(U_t, dv, pn);
    decay.resize(r);
    end_terms.resize(r);
    if (coef.size() < n) coef.resize(n);
  }

  /// n rounded up to the register kernel's packet width.
  [[nodiscard]] static constexpr Index padded(Index n) noexcept {
    const Index lanes = kernel_lanes<Scalar>();
    return (n + lanes - 1) / lanes * lanes;
  }

  /// Rows of a block for chunks of C rows.
  [[nodiscard]] static Index block_rows(Index C) noexcept {
    return std::max<Index>(std::min(C, channel_delta_block), 1);
  }

  /// Bytes held.
  [[nodiscard]] std::size_t bytes() const noexcept {
    Index n = decay.size() + end_terms.size() + coef.size() + (kernel ? kernel->scalars() : 0);
    for (const auto* m : {&states, &qf, &kf, &gates, &dqf, &dkf, &R, &U, &v, &dy, &W, &H,
                          &running, &gam, &decay_end, &kend, &dkp, &dkm, &lhs, &D, &rhs, &dU,
                          &dX, &P, &dP, &dW, &lhs_t, &D_t, &kend_t, &dkm_t, &rhs_t, &U_t})
      n += m->size();
    return static_cast<std::size_t>(n) * sizeof(Scalar);
  }

  /// Bytes a call in chunks of C tokens holds here: pass 2's buffers, and with `pass1` the
  /// kernel made for chunks of `kernel_rows` (the forward's chunk).
  [[nodiscard]] static std::size_t bytes_for(Index C, Index r, Index dv, bool pass1,
                                             Index kernel_rows) {
    const Index n = block_rows(C), blocks = (C + n - 1) / n;
    const Index pass2 = (blocks + 2) * r * dv + 5 * C * r + 4 * C * dv + C * n + 5 * n * r +
                        4 * n * r + 2 * n * dv + 2 * n * dv + 3 * n * n + 2 * r + n +
                        (2 * r + dv) * (padded(2 * n) + padded(n));
    const Index first = pass1 ? ChannelDeltaChunk<Scalar>::scalars_for(kernel_rows, r, dv) : 0;
    return static_cast<std::size_t>(pass2 + first) * sizeof(Scalar);
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
  const Index chunk_rows = std::min(C, std::max<Index>(T, 1));
  w.fit(chunk_rows, r, dv);
  const Index L = ChannelDeltaBackwardScratch<Scalar>::block_rows(chunk_rows);
  using Stride = Eigen::OuterStride<>;
  using ConstBlock = Eigen::Map<const RowMatrix<Scalar>, 0, Stride>;
  using State = Eigen::Map<RowMatrix<Scalar>>;
  using ConstState = Eigen::Map<const RowMatrix<Scalar>>;
  using Vec = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  using ConstVec = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
  const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero(r, dv);
  const auto row = [r](RowMatrix<Scalar>& m, Index i) { return Vec(m.data() + i * r, r); };
  const auto crow = [r](const RowMatrix<Scalar>& m, Index i) {
    return ConstVec(m.data() + i * r, r);
  };
  // One block's gate products (rows i0 ... i0 + n - 1 of the chunk): gam, e (decay_end), the
  // stacked [kf .* gam; qf .* gam] in lhs and kf .* e in kend.
  const auto block_decays = [&](Index i0, Index n) {
    for (Index i = 0; i < n; ++i) {
      if (i == 0)
        row(w.gam, 0) = crow(w.gates, i0);
      else
        row(w.gam, i) = crow(w.gam, i - 1) * crow(w.gates, i0 + i);
    }
    row(w.decay_end, n - 1).setOnes();
    for (Index j = n - 2; j >= 0; --j)
      row(w.decay_end, j) = crow(w.decay_end, j + 1) * crow(w.gates, i0 + j + 1);
    for (Index i = 0; i < n; ++i) {
      row(w.lhs, i) = crow(w.kf, i0 + i) * crow(w.gam, i);
      row(w.lhs, n + i) = crow(w.qf, i0 + i) * crow(w.gam, i);
      row(w.kend, i) = crow(w.kf, i0 + i) * crow(w.decay_end, i);
    }
  };
  // The block's decayed pairwise products: W (j < i) into rows i0 ... of w.W (the rebuild;
  // its diagonal entry is written too and never read) or, with `queries`, P (j <= i) into w.P
  // (the walk). decayed_row_scores decays the row once per earlier key, held in registers.
  const auto pairwise = [&](Index i0, Index n, bool queries) {
    const Scalar* gates = w.gates.data() + i0 * r;
    const Scalar* keys = w.kf.data() + i0 * r;
    for (Index i = 0; i < n; ++i) {
      const Scalar* x = (queries ? w.qf : w.kf).data() + (i0 + i) * r;
      Scalar* out = queries ? &w.P(i, 0) : &w.W(i0 + i, 0);
      decayed_row_scores(x, gates, r, keys, r, r, Index(0), i, out, w.decay.data());
    }
  };
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index first = c * C, nc = std::min(C, T - first), blocks = (nc + L - 1) / L;
    // The chunk's features, gates, values and dy.
    map_rows<Scalar>(phi, K, first, nc, w.kf);
    map_rows<Scalar>(phi, Q, first, nc, w.qf);
    for (Index i = 0; i < nc; ++i)
      gates_from_logs(&in.log_alpha.data[(first + i) * in.log_alpha.row_stride], 1,
                      w.gates.row(i).data(), r);
    const auto [v, ld_v] = row_major_rows(V, first, nc, w.v);
    const auto [dy_rows, ld_dy] = row_major_rows(dY, first, nc, w.dy);
    // Forwards over the blocks from the kept state: each block's R, U and the next state.
    State(w.states.data(), r, dv) = ConstState(saved.states.data() + c * r * dv, r, dv);
    for (Index b = 0; b < blocks; ++b) {
      const Index i0 = b * L, n = std::min(L, nc - i0);
      const ConstState S(w.states.data() + b * r * dv, r, dv);
      block_decays(i0, n);
      pairwise(i0, n, false);
      auto R = w.R.middleRows(i0, n);
      auto U = w.U.middleRows(i0, n);
      // R = V - (kf .* gam) S, the product on the register kernel (S in place).
      product<Scalar, false>(n, dv, r, w.lhs.data(), r, S.data(), dv, R.data(), dv);
      R = ConstBlock(v + i0 * ld_v, n, dv, Stride(ld_v)) - R;
      // The forward substitution, u_i = beta_i r_i - sum_{j<i} beta_i W_ij u_j (accumulate_rows:
      // u_i held in registers across the earlier rows).
      for (Index i = 0; i < n; ++i) {
        const Scalar beta = in.beta(first + i0 + i);
        U.row(i) = beta * R.row(i);
        for (Index j = 0; j < i; ++j) w.coef(j) = -beta * w.W(i0 + i, j);
        accumulate_rows(U.row(i).data(), w.coef.data(), U.data(), dv, i, dv);
      }
      if (b + 1 < blocks) {
        State next(w.states.data() + (b + 1) * r * dv, r, dv);
        const ConstVec total = crow(w.gam, n - 1);
        for (Index m = 0; m < r; ++m) next.row(m) = total(m) * S.row(m);
        transpose_block(n, r, w.kend.data(), r, w.kend_t.data(), w.kend_t.cols());
        product<Scalar, true>(r, dv, n, w.kend_t.data(), w.kend_t.cols(), U.data(), dv,
                              next.data(), dv);
      }
    }
    // Backwards over the blocks.
    for (Index b = blocks - 1; b >= 0; --b) {
      const Index i0 = b * L, n = std::min(L, nc - i0), t0 = first + i0;
      const ConstState S(w.states.data() + b * r * dv, r, dv);
      block_decays(i0, n);
      pairwise(i0, n, true);
      const ConstBlock dO(dy_rows + i0 * ld_dy, n, dv, Stride(ld_dy));
      const auto R = w.R.middleRows(i0, n);
      const auto U = w.U.middleRows(i0, n);
      const auto P = w.P.topLeftCorner(n, n).template triangularView<Eigen::Lower>();
      auto dU = w.dU.topRows(n);
      auto dX = w.dX.topRows(n);
      // The products against S and H take them in place as the left operand or the right one,
      // (n x r) H and, transposed, H U^T and S [-dR; dO]^T (r x dv times dv x n or 2n).
      const Index pn = w.padded(n), p2n = w.padded(2 * n);
      product<Scalar, false>(n, dv, r, w.kend.data(), r, w.H.data(), dv, dU.data(), dv);
      dU.noalias() += P.transpose() * dO;
      // H's shares before H moves to the block's start: e .* (H u_i) and the state's decay.
      transpose_block(n, dv, U.data(), dv, w.U_t.data(), w.U_t.cols());
      product<Scalar, false>(r, pn, dv, w.H.data(), dv, w.U_t.data(), w.U_t.cols(),
                             w.dkm_t.data(), w.dkm_t.cols());
      transpose_block(r, n, w.dkm_t.data(), w.dkm_t.cols(), w.dkm.data(), r);
      auto dkm = w.dkm.topRows(n);
      dkm.array() *= w.decay_end.topRows(n).array();
      const ConstVec total = crow(w.gam, n - 1);
      Vec end_terms(w.end_terms.data(), r);
      end_terms = (S.array() * w.H.array()).rowwise().sum().transpose() * total;
      for (Index j = 0; j < n; ++j) end_terms += crow(w.kf, i0 + j) * crow(w.dkm, j);
      // The transposed solve, beta and W's gradients.
      for (Index j = n - 1; j >= 0; --j) {
        dX.row(j) = dU.row(j);
        for (Index i = j + 1; i < n; ++i) w.coef(i - j - 1) = -in.beta(t0 + i) * w.W(i0 + i, j);
        accumulate_rows(dX.row(j).data(), w.coef.data(), dX.data() + (j + 1) * dv, dv, n - j - 1,
                        dv);
      }
      for (Index i = 0; i < n; ++i) {
        const Scalar beta = in.beta(t0 + i);
        Scalar db = R.row(i).dot(dX.row(i));
        for (Index j = 0; j < i; ++j) {
          const Scalar xu = dX.row(i).dot(U.row(j));
          db -= w.W(i0 + i, j) * xu;
          w.dW(i, j) = -beta * xu;
        }
        w.dW(i, i) = Scalar(0);
        d_beta[t0 + i] = db;
        // [-dR; dO] for the products against S and H.
        w.rhs.row(i) = -beta * dX.row(i);
        w.rhs.row(n + i) = dO.row(i);
        dV.row(t0 + i) = beta * dX.row(i);
      }
      w.dP.topLeftCorner(n, n).noalias() = dO * U.transpose();
      // [-S dR_i ; S dO_i] as rows, then the decays: dqf = gam .* S dO, the + part of dkf.
      transpose_block(2 * n, dv, w.rhs.data(), dv, w.rhs_t.data(), w.rhs_t.cols());
      product<Scalar, false>(r, p2n, dv, S.data(), dv, w.rhs_t.data(), w.rhs_t.cols(),
                             w.D_t.data(), w.D_t.cols());
      transpose_block(r, 2 * n, w.D_t.data(), w.D_t.cols(), w.D.data(), r);
      for (Index i = 0; i < n; ++i) {
        row(w.dqf, i0 + i) = crow(w.D, n + i) * crow(w.gam, i);
        row(w.dkp, i) = crow(w.D, i) * crow(w.gam, i);
      }
      // The pairwise terms by Horner's rule (gated_horner, the sum held in registers): row i's
      // dqf and + part over j = 0 ... i, then column j's - part over i = n - 1 ... j, each
      // term decayed by E_ij = a_{j+1} .* ... .* a_i. dW's diagonal is 0 (W has none).
      {
        const Scalar* gates = w.gates.data() + i0 * r;
        const Scalar* keys = w.kf.data() + i0 * r;
        for (Index i = 0; i < n; ++i) {
          const Scalar* next_gates = gates + std::min<Index>(i, 1) * r;  // unread when i = 0
          gated_horner(w.dqf.data() + (i0 + i) * r, &w.dP(i, 0), Index(1), keys, r, next_gates,
                       r, i + 1, r);
          gated_horner(w.dkp.data() + i * r, &w.dW(i, 0), Index(1), keys, r, next_gates, r,
                       i + 1, r);
        }
        const Index ld_p = w.dP.cols(), ld_w = w.dW.cols();
        const Scalar* last_gates = gates + (n - 1) * r;
        for (Index j = 0; j < n; ++j) {
          Scalar* out = w.dkm.data() + j * r;
          gated_horner(out, &w.dP(n - 1, j), -ld_p, w.qf.data() + (i0 + n - 1) * r, -r,
                       last_gates, -r, n - j, r);
          gated_horner(out, &w.dW(n - 1, j), -ld_w, keys + (n - 1) * r, -r, last_gates, -r,
                       n - j, r);
        }
      }
      // Gate gradients: dL/db_i, then the sums over the block's later rows.
      Vec acc(w.decay.data(), r);
      acc = end_terms;
      for (Index i = n - 1; i >= 0; --i) {
        const ConstVec ki = crow(w.kf, i0 + i);
        acc += crow(w.qf, i0 + i) * crow(w.dqf, i0 + i) + ki * (crow(w.dkp, i) - crow(w.dkm, i));
        Vec(d_log_alpha + (t0 + i) * r, r) = acc;
        row(w.dkf, i0 + i) = crow(w.dkp, i) + crow(w.dkm, i);
      }
      // H moves to the block's start: diag(gam_{n-1}) H + [kf .* gam; qf .* gam]^T [-dR; dO].
      for (Index m = 0; m < r; ++m) w.H.row(m) *= total(m);
      transpose_block(2 * n, r, w.lhs.data(), r, w.lhs_t.data(), w.lhs_t.cols());
      product<Scalar, true>(r, dv, 2 * n, w.lhs_t.data(), w.lhs_t.cols(), w.rhs.data(), dv,
                            w.H.data(), dv);
    }
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, nc));
    phi.backward(Q.middleRows(first, nc), w.qf.topRows(nc), w.dqf.topRows(nc), dq_rows);
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, nc));
    phi.backward(K.middleRows(first, nc), w.kf.topRows(nc), w.dkf.topRows(nc), dk_rows);
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
