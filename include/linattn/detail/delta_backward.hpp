#pragma once
// Backward pass of Delta and GatedDelta (linattn/rule_gradients.hpp).
//
// Delta and GatedDelta (delta_backward): the chunked WY / UT form (REFERENCES.md section 4,
// Yang et al. 2024) in reverse mode. Per chunk, with B_i = sum_{s<=i} log alpha_s from the
// chunk's start, gamma_i = exp(B_i), Gam_ij = exp(B_i - B_j) (j <= i, every one <= 1) and S the
// state before the chunk:
//   A = I + strictly_lower(diag(beta) (K K^T .* Gam)),  G = diag(gamma) K S,  R = V - G,
//   U = A^-1 diag(beta) R  (the corrected values: S_i = gamma_i S + sum_{j<=i} Gam_ij k_j u_j^T),
//   O = diag(gamma) Q S + P U,  P = tril(Q K^T .* Gam),
//   S_after = gamma_n S + K^T diag(Gam_nj) U.
// Backwards, with dO and H (the gradient of S_after):
//   dU = diag(Gam_nj) K H + P^T dO;  dP = tril(dO U^T);  dQ = diag(gamma) dO S^T + (dP .* Gam) K
//   dW = A^-T dU;  dL = strictly_lower(-dW U^T);  dbeta_i = R_i . dW_i + sum_j dL_ij (k_i.k_j) Gam_ij
//   dR = diag(beta) dW;  dV = dR
//   dK = diag(Gam_nj) U H^T + (dP .* Gam)^T Q + M K - diag(gamma) dR S^T,
//        M = N + N^T, N_ij = dL_ij beta_i Gam_ij
//   H_before = gamma_n H + Q^T diag(gamma) dO - K^T diag(gamma) dR
//   dL/dB_i collects every term's exp(B) factor (gamma_i, Gam_ij: + at i, - at j), and
//   d log alpha_s = sum_{i >= s in the chunk} dL/dB_i (the chunk's own; later chunks reach
//   earlier gates through H).
//
// Layout: pass 1 runs the forward's own chunk kernel (DeltaChunk, delta_kernels.hpp) and keeps,
// per chunk, the state before it and, per token, U and G (DeltaSavedStates: the saving forward
// keeps the same, bit for bit, so delta_backward_saved starts from there and skips pass 1).
// Pass 2 runs the chunks in reverse with every product on the register kernel
// (small_gemm.hpp): the feature gradients are built transposed (r x C, whose rows are long),
// so that each product against an r x dv matrix takes S or H as its row-major left operand and
// C x dv blocks transposed on the right. The state's four products per chunk are
//   dU  = diag(Gam_nj) K H                              (C x r x dv)
//   dK^T += H (diag(Gam_nj) U)^T                         (r x dv x C)
//   [dQ^T | dK^T] += S [diag(gamma) dO | -diag(gamma) dR]^T   (r x dv x 2C)
//   H  = gamma_n H + [Q^T | K^T] [diag(gamma) dO ; -diag(gamma) dR]   (r x 2C x dv)
// Per token 12 r dv flops against the state in pass 2 and 4 in pass 1 (the forward: 6), plus
// about C (5 r + 5 dv) in the chunk's C x C blocks and the transposed triangular solve.
// Memory: the saved data (ceil(T / C) r dv + 2 T dv scalars) plus O(C (C + r + dv) + r dv).

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_kernels.hpp>
#include <linattn/detail/huge_pages.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/saved_backward.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/detail/stream_store.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>

namespace linattn::detail {

// ---- what the backward keeps of a forward -----------------------------------------------------

/// The chunked forward's data the delta backward reads, chunk c of
/// `chunk_size` rows: the state before it (rows [c r, (c + 1) r) of `states`, r x dv each) and,
/// per token, the corrected values u_t and the decayed state reads g_t = D(t, -1) kf_t S of
/// DeltaChunk (rows of `corrected` and `reads`, T x dv). Per-channel GatedDelta keeps the
/// states only (`per_token` false: its backward recomputes each chunk's tokens from the state
/// before it, detail/channel_delta_backward.hpp). Filled by SaveDeltaChunks (then
/// stream_fence() before another thread reads it).
template <class Scalar>
struct DeltaSavedStates {
  RowMatrix<Scalar> states, corrected, reads;
  Index chunk_size = 0;
  bool per_token = true;  // whether the rows of corrected and reads belong to the data

  /// Sized for T tokens in chunks of C, r features and dv values, with the per-token rows or
  /// without (allocates when the size changes, asking for huge pages on a new block:
  /// detail/huge_pages.hpp).
  void resize(Index T, Index C, Index r, Index dv, bool with_tokens = true) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    resize_with_huge_pages(states, chunks * r, dv);
    resize_with_huge_pages(corrected, with_tokens ? T : 0, dv);
    resize_with_huge_pages(reads, with_tokens ? T : 0, dv);
    chunk_size = C;
    per_token = with_tokens;
  }

  /// Sized for at least T tokens (resize, but kept where it already holds as many or more rows
  /// for the same C, r and dv): a workspace over documents of many lengths allocates the
  /// longest's once. The readers use only the first T tokens' rows. A call of one chunk (T <=
  /// C) also keeps data of a longer chunk: its one state lies first either way. Without
  /// `with_tokens`, per-token rows already held are kept (unused).
  void fit(Index T, Index C, Index r, Index dv, bool with_tokens = true) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    const Index token_rows = with_tokens ? T : 0;
    if ((chunk_size == C || (T <= C && T <= chunk_size)) && states.cols() == dv &&
        corrected.cols() == dv && states.rows() >= chunks * r &&
        corrected.rows() >= token_rows && reads.rows() >= token_rows) {
      per_token = with_tokens;
      return;
    }
    resize(T, C, r, dv, with_tokens);
  }

  /// Scalars kept for T tokens: ceil(T / C) r dv + 2 T dv (without the per-token rows:
  /// ceil(T / C) r dv).
  [[nodiscard]] static std::size_t bytes_for(Index T, Index C, Index r, Index dv,
                                             bool with_tokens = true) {
    const Index chunks = T == 0 ? 0 : (T + C - 1) / C;
    return static_cast<std::size_t>(chunks * r * dv + (with_tokens ? 2 * T * dv : 0)) *
           sizeof(Scalar);
  }
};

/// The chunked delta forward's observer (rule_chunked) that copies each chunk's state, corrected
/// values and state reads into a DeltaSavedStates sized for the call (chunk_size the forward's
/// chunk); of per-channel GatedDelta's chunk (ChannelDeltaChunk), the state only. Called as
/// (first, S, chunk) after chunk.prepare(), before the state absorbs it.
/// Non-temporal stores (stream_copy): the data is read back only by
/// the backward, after the whole forward, and should not evict the forward's working set.
template <class Scalar>
struct SaveDeltaChunks {
  DeltaSavedStates<Scalar>& out;

  void operator()(Index first, const RowMatrix<Scalar>& S, const DeltaChunk<Scalar>& chunk) const {
    const Index r = S.rows(), dv = S.cols(), n = chunk.rows();
    stream_copy(S.data(), r * dv, out.states.data() + first / out.chunk_size * r * dv);
    stream_copy(chunk.corrected(), n * dv, out.corrected.data() + first * dv);
    stream_copy(chunk.state_reads(), n * dv, out.reads.data() + first * dv);
  }
  void operator()(Index first, const RowMatrix<Scalar>& S,
                  const ChannelDeltaChunk<Scalar>&) const {
    const Index r = S.rows(), dv = S.cols();
    stream_copy(S.data(), r * dv, out.states.data() + first / out.chunk_size * r * dv);
  }
};

/// Buffers of the delta backward's reverse sweep, allocated once per call (L = C rounded up
/// to whole packets): per-chunk features and their gradients (C x r), the transposed features
/// [qf^T | kf^T] and gradients [dqf^T | dkf^T] (r x 2L), the right-hand blocks
/// [gamma dO ; -gamma dR] (2L x dv) and their transpose, C x dv and C x L blocks, and H (r x dv).
/// Zero-initialised: padding rows and columns stay zero (finite), so the padded products add
/// nothing to the wanted entries.
template <class Scalar>
struct DeltaBackwardScratch {
  Index C = 0, L = 0;
  RowMatrix<Scalar> qf, kf, dqf, dkf;            // C x r
  RowMatrix<Scalar> qk_t, grads_t;               // r x 2L
  RowMatrix<Scalar> rhs, rhs_t;                  // 2L x dv, dv x 2L
  RowMatrix<Scalar> dU, dW, v_copy, dy_copy;     // C x dv
  RowMatrix<Scalar> u_t, ug_t;                   // dv x L
  RowMatrix<Scalar> Gam, P, PT, KG, dPT, NAT, N, F;  // C x L
  RowMatrix<Scalar> blocks;                      // 2L x L: [dP .* Gam ; N + N^T]
  ColVector<Scalar> log_cum, gam, dlg;           // C
  RowMatrix<Scalar> H;                           // r x dv
  SpreadPrefetch prefetch;                       // the next chunk's rows (reverse sweep)

  DeltaBackwardScratch(Index chunk, Index r, Index dv, bool copy_v, bool copy_dy)
      : C(chunk), L(padded_columns<Scalar>(chunk)) {
    allocate(r, dv, copy_v, copy_dy);
  }

  /// Whether this scratch serves a call with these (the constructor's) arguments, or with a
  /// smaller chunk when the call is one chunk of that many rows (`one_chunk`: a short document
  /// after longer ones); if so it is zeroed again as a new one is (BackwardScratch::reuse). A
  /// chunk of n rows reads n and its padded width np; the wider padding L only adds zero
  /// columns to the transposed blocks [qf^T | kf^T] and zero rows to [gamma dO ; -gamma dR],
  /// which the register kernel's in-order sums (one accumulator per entry) pass through
  /// unchanged, and every row starts on a packet boundary either way. O(C (r + dv + L)).
  [[nodiscard]] bool reuse(Index chunk, Index r, Index dv, bool copy_v, bool copy_dy,
                           bool one_chunk = false) {
    if (!(chunk == C || (one_chunk && chunk < C)) || qf.cols() != r || H.cols() != dv ||
        (v_copy.rows() > 0) != copy_v || (dy_copy.rows() > 0) != copy_dy)
      return false;
    allocate(r, dv, copy_v, copy_dy);  // the same sizes: zero-fills, allocates nothing
    return true;
  }

  /// Scalars held (scalars_for(), plus the copies of V and dY where made).
  [[nodiscard]] Index scalars() const noexcept {
    Index n = 0;
    for (const auto* m : {&qf, &kf, &dqf, &dkf, &qk_t, &grads_t, &rhs, &rhs_t, &dU, &dW, &v_copy,
                          &dy_copy, &u_t, &ug_t, &Gam, &P, &PT, &KG, &dPT, &NAT, &N, &F, &blocks,
                          &H})
      n += m->size();
    return n + log_cum.size() + gam.size() + dlg.size();
  }

 private:
  void allocate(Index r, Index dv, bool copy_v, bool copy_dy) {
    for (auto* m : {&qf, &kf, &dqf, &dkf}) m->setZero(C, r);
    for (auto* m : {&qk_t, &grads_t}) m->setZero(r, 2 * L);
    rhs.setZero(2 * L, dv);
    rhs_t.setZero(dv, 2 * L);
    for (auto* m : {&dU, &dW}) m->setZero(C, dv);
    v_copy.resize(copy_v ? C : 0, dv);
    dy_copy.resize(copy_dy ? C : 0, dv);
    for (auto* m : {&u_t, &ug_t}) m->setZero(dv, L);
    for (auto* m : {&Gam, &P, &PT, &KG, &dPT, &NAT, &N, &F}) m->setZero(C, L);
    blocks.setZero(2 * L, L);
    for (auto* v : {&log_cum, &gam, &dlg}) v->setZero(C);
    H.resize(r, dv);
  }

 public:
  /// Scalars the constructor allocates (copies of V and dY counted): 4 C r + 4 r L + 4 L dv +
  /// 4 C dv + 2 dv L + 8 C L + 2 L^2 + 3 C + r dv.
  [[nodiscard]] static std::size_t scalars_for(Index C, Index r, Index dv) {
    const Index L = padded_columns<Scalar>(C);
    return static_cast<std::size_t>(4 * C * r + 4 * r * L + 4 * L * dv + 4 * C * dv +
                                    2 * dv * L + 8 * C * L + 2 * L * L + 3 * C + r * dv);
  }

  /// Bytes delta_backward allocates for T tokens (chunk, r, dv): the saved data, pass 1's
  /// kernel and this scratch.
  [[nodiscard]] static std::size_t bytes_for(Index T, Index chunk, Index r, Index dv) {
    const Index C = std::min(chunk, std::max<Index>(T, 1)), L = padded_columns<Scalar>(C);
    // DeltaChunk (2 r L + 3 C L + 2 C dv + 3 C), the running state, features and a V copy.
    const std::size_t pass1 = static_cast<std::size_t>(2 * r * L + 3 * C * L + 3 * C * dv +
                                                       3 * C + C * r + r * dv);
    return DeltaSavedStates<Scalar>::bytes_for(T, C, r, dv) +
           (scalars_for(C, r, dv) + pass1) * sizeof(Scalar);
  }
};

/// The reverse sweep of the delta backward (see the file comment) from the forward's saved data
/// (`saved`, chunks of saved.chunk_size rows). `in`: bound beta and (GatedDelta) log_alpha.
/// Writes dQ, dK, dV, d_beta (length T), d_log_alpha (length T; null for Delta) and dS0
/// (resized). dS_T null: 0. Same outputs as delta_backward from the same initial state, bit for
/// bit when `saved` holds the forward's data (the forward and pass 1 run one kernel). `saved`
/// must be sized for these T, r, dv (unchecked; an assertion in debug builds).
/// Per token about 12 r dv + C (5 r + 5 dv) flops; scratch O(C (C + r + dv) + r dv).
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void delta_backward_saved(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                          const TokenInputs<Scalar>& in, const DeltaSavedStates<Scalar>& saved,
                          const RowMatrix<Scalar>* dS_T, Eigen::Ref<RowMatrix<Scalar>> dQ,
                          Eigen::Ref<RowMatrix<Scalar>> dK, Eigen::Ref<RowMatrix<Scalar>> dV,
                          Scalar* d_beta, Scalar* d_log_alpha, RowMatrix<Scalar>& dS0,
                          std::optional<DeltaBackwardScratch<Scalar>>& scratch) {
  const Index T = Q.rows(), dv = V.cols(), r = phi.feature_dim(K.cols());
  const Index C = std::max<Index>(saved.chunk_size, 1);
  // The caller checks the shapes (the public saved forward names them); here only in debug.
  // A workspace's saved data may hold more tokens than this call's (DeltaSavedStates::fit).
  eigen_assert(saved.corrected.rows() >= T && saved.reads.rows() >= T &&
               saved.states.rows() >= (T + C - 1) / C * r && saved.states.cols() == dv);
  DeltaBackwardScratch<Scalar>& w =
      chunk_scratch_in(scratch, T <= C, std::min(C, std::max<Index>(T, 1)), r, dv,
                       !has_row_major_storage<DV>(), !has_row_major_storage<DY>());
  const Index L = w.L, L2 = 2 * L;
  const bool gated = !in.log_alpha.empty();
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero();
  Scalar* qk_t = w.qk_t.data();
  Scalar* grads_t = w.grads_t.data();
  Scalar* dPG = w.blocks.data();        // rows [0, L): dP .* Gam
  Scalar* M = w.blocks.data() + L * L;  // rows [L, 2L): N + N^T

  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  for (Index first = last_first; first >= 0; first -= C) {
    const Index n = std::min(C, T - first), last = n - 1, np = padded_columns<Scalar>(n);
    const Scalar* S = saved.states.data() + first / C * r * dv;
    const Scalar* U = saved.corrected.data() + first * dv;
    const Scalar* G = saved.reads.data() + first * dv;
    // The chunk before this one: its input rows and saved data, behind this chunk's products.
    if (prefetch_chunk_rows(w.prefetch, Q, K, V, dY, first - C, first > 0 ? C : 0)) {
      for (const auto* rows : {&saved.corrected, &saved.reads}) w.prefetch.add(*rows, first - C, C);
      w.prefetch.add(saved.states, (first / C - 1) * r, r);
    }
    map_rows<Scalar>(phi, Q, first, n, w.qf);
    map_rows<Scalar>(phi, K, first, n, w.kf);
    transpose_into(n, r, w.qf.data(), r, qk_t, L2);
    transpose_into(n, r, w.kf.data(), r, qk_t + L, L2);
    transpose_into(n, dv, U, dv, w.u_t.data(), L);
    if (n < w.C)  // the short last chunk (the first here): padding columns of the features 0
      for (Index m = 0; m < r; ++m) {
        std::fill(qk_t + m * L2 + n, qk_t + m * L2 + L, Scalar(0));
        std::fill(qk_t + m * L2 + L + n, qk_t + (m + 1) * L2, Scalar(0));
      }
    const auto [v, ld_v] = row_major_rows(V, first, n, w.v_copy);
    const auto [dO, ld_dO] = row_major_rows(dY, first, n, w.dy_copy);
    using Row = Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>>;
    using MutableRow = Eigen::Map<Eigen::Array<Scalar, 1, Eigen::Dynamic>>;

    // Decays: Gam_ij = exp(B_i - B_j) <= 1 for j <= i (1 for Delta).
    if (gated) {
      Scalar sum = 0;
      for (Index i = 0; i < n; ++i) w.log_cum(i) = sum += in.log_alpha(first + i);
      for (Index i = 0; i < n; ++i) {
        w.gam(i) = std::exp(w.log_cum(i));
        w.Gam.row(i).head(i + 1).array() =
            (w.log_cum(i) - w.log_cum.head(i + 1).array().transpose()).exp();
      }
    }
    const Scalar* g = gated ? w.Gam.row(last).data() : nullptr;  // Gam_nj (null: all 1)
    auto dlg = w.dlg.head(n);
    dlg.setZero();

    // dU = diag(Gam_nj) K H; its share of dL/dB: e_j = Gam_nj k_j H u_j^T = dU_j . u_j.
    rule_gemm<Scalar, false>(n, dv, r, w.kf.data(), r, w.H.data(), dv, w.dU.data(), dv,
                             Triangle::none, g, &w.prefetch);
    if (gated) {
      for (Index j = 0; j < n; ++j) {
        const Scalar e = w.dU.row(j).dot(Eigen::Map<const RowVector<Scalar>>(U + j * dv, dv));
        dlg(last) += e;
        dlg(j) -= e;
      }
      dlg(last) += w.gam(last) * (Eigen::Map<const RowMatrix<Scalar>>(S, r, dv).array() *
                                  w.H.array()).sum();
    }

    // P = tril(Q K^T) .* Gam and KG = tril(K K^T) .* Gam; dU += P^T dO.
    rule_gemm<Scalar, false>(n, np, r, w.qf.data(), r, qk_t + L, L2, w.P.data(), L,
                             Triangle::lower_result, nullptr, &w.prefetch);
    rule_gemm<Scalar, false>(n, np, r, w.kf.data(), r, qk_t + L, L2, w.KG.data(), L,
                             Triangle::lower_result, nullptr, &w.prefetch);
    for (Index i = 0; i < n; ++i) {
      if (gated) {
        w.P.row(i).head(i + 1).array() *= w.Gam.row(i).head(i + 1).array();
        w.KG.row(i).head(i).array() *= w.Gam.row(i).head(i).array();
      }
      w.P.row(i).segment(i + 1, np - i - 1).setZero();
    }
    transpose_into(n, n, w.P.data(), L, w.PT.data(), L);
    rule_gemm<Scalar, true>(n, dv, n, w.PT.data(), L, dO, ld_dO, w.dU.data(), dv, Triangle::none,
                            nullptr, &w.prefetch);

    // dP = tril(dO U^T): its share of dL/dB, then dP .* Gam.
    rule_gemm<Scalar, false>(n, np, dv, dO, ld_dO, w.u_t.data(), L, dPG, L, Triangle::lower_result,
                             nullptr, &w.prefetch);
    // F_ij collects the in-chunk terms f_ij that go to dL/dB_i with + and to dL/dB_j with -.
    auto F = w.F.topLeftCorner(n, n);
    for (Index i = 0; i < n; ++i) {
      MutableRow row(dPG + i * L, i + 1);
      if (gated) {
        F.row(i).head(i + 1) = (row * w.P.row(i).head(i + 1).array()).matrix();
        F.row(i).tail(n - i - 1).setZero();
        row *= w.Gam.row(i).head(i + 1).array();
      }
      std::fill(dPG + i * L + i + 1, dPG + (i + 1) * L, Scalar(0));
    }

    // dW = A^-T dU, A_ij = beta_i KG_ij (i > j): backward substitution on NAT = -A^T, by blocks
    // of delta_solve_block rows (the rows of a block against every later row on the register
    // kernel, inside the block row by row from the last).
    for (Index k = 1; k < n; ++k) w.N.row(k).head(k) = -in.beta(first + k) * w.KG.row(k).head(k);
    transpose_into(n, n, w.N.data(), L, w.NAT.data(), L);  // read above the diagonal only
    auto dW = w.dW.topRows(n);
    dW = w.dU.topRows(n);
    for (Index b0 = last / delta_solve_block * delta_solve_block; b0 >= 0;
         b0 -= delta_solve_block) {
      const Index end = std::min(n, b0 + delta_solve_block);
      if (end < n)
        rule_gemm<Scalar, true>(end - b0, dv, n - end, w.NAT.data() + b0 * L + end, L,
                                w.dW.data() + end * dv, dv, w.dW.data() + b0 * dv, dv,
                                Triangle::none, nullptr, &w.prefetch);
      for (Index i = end - 2; i >= b0; --i)
        accumulate_rows(w.dW.data() + i * dv, &w.NAT(i, i + 1), w.dW.data() + (i + 1) * dv, dv,
                        end - i - 1, dv);
    }

    // dL = strictly_lower(-dW U^T): d beta, the decays' share, N_ij = dL_ij beta_i Gam_ij and
    // M = N + N^T; W = diag(beta) R with R = V - G: d beta_i also gets R_i . dW_i.
    rule_gemm<Scalar, false>(n, np, dv, w.dW.data(), dv, w.u_t.data(), L, w.PT.data(), L,
                             Triangle::lower_result, nullptr, &w.prefetch);  // PT reused: dW U^T
    for (Index i = 0; i < n; ++i) {
      const Scalar b = in.beta(first + i);
      auto dL = w.N.row(i).head(i).array();
      dL = -w.PT.row(i).head(i).array();
      const auto dL_KG = dL * w.KG.row(i).head(i).array();
      if (gated) F.row(i).head(i) += (b * dL_KG).matrix();  // dL_ij A_ij: the decays' share
      d_beta[first + i] = dL_KG.sum() + (Row(v + i * ld_v, dv) - Row(G + i * dv, dv))
                                            .matrix()
                                            .dot(dW.row(i));
      dL *= b;
      if (gated) dL *= w.Gam.row(i).head(i).array();  // now N_ij
      w.N.row(i).segment(i, n - i).setZero();
    }
    transpose_into(n, n, w.N.data(), L, w.dPT.data(), L);  // dPT reused: N^T
    for (Index i = 0; i < n; ++i)
      MutableRow(M + i * L, n) = w.N.row(i).head(n).array() + w.dPT.row(i).head(n).array();
    if (gated) dlg += F.rowwise().sum() - F.colwise().sum().transpose();

    // dR = diag(beta) dW = dV; its share of dL/dB: -gamma_i k_i S . dR_i = -G_i . dR_i. The
    // right-hand blocks: [diag(gamma) dO ; -diag(gamma) dR].
    for (Index i = 0; i < n; ++i) {
      const Scalar b = in.beta(first + i), gi = gated ? w.gam(i) : Scalar(1);
      dW.row(i) *= b;
      if (gated) dlg(i) -= Row(G + i * dv, dv).matrix().dot(dW.row(i));
      MutableRow(w.rhs.data() + i * dv, dv) = gi * Row(dO + i * ld_dO, dv);
      MutableRow(w.rhs.data() + (L + i) * dv, dv) = -gi * dW.row(i).array();
    }
    dV.middleRows(first, n) = dW;
    transpose_into(n, dv, w.rhs.data(), dv, w.rhs_t.data(), L2);
    transpose_into(n, dv, w.rhs.data() + L * dv, dv, w.rhs_t.data() + L, L2);

    // [dQ^T | dK^T] = S [gamma dO | -gamma dR]^T; gamma_i's share through the read of S:
    // gamma_i (q_i S) . dO_i = q_i . (column i of S (gamma dO)^T).
    rule_gemm<Scalar, false>(r, L2, dv, S, dv, w.rhs_t.data(), L2, grads_t, L2, Triangle::none,
                             nullptr, &w.prefetch);
    if (gated)
      dlg += (w.qk_t.leftCols(n).array() * w.grads_t.leftCols(n).array())
                 .colwise()
                 .sum()
                 .matrix()
                 .transpose();
    // dK^T += H (diag(Gam_nj) U)^T + [Q^T | K^T] [dP .* Gam ; M];  dQ^T += K^T (dP .* Gam)^T.
    const Scalar* ug_t = w.u_t.data();
    if (gated) {
      w.ug_t.leftCols(n) = w.u_t.leftCols(n) * w.Gam.row(last).head(n).asDiagonal();
      ug_t = w.ug_t.data();
    }
    rule_gemm<Scalar, true>(r, L, dv, w.H.data(), dv, ug_t, L, grads_t + L, L2, Triangle::none,
                            nullptr, &w.prefetch);
    rule_gemm<Scalar, true>(r, L, L2, qk_t, L2, w.blocks.data(), L, grads_t + L, L2, Triangle::none,
                            nullptr, &w.prefetch);
    transpose_into(n, n, dPG, L, w.dPT.data(), L);
    rule_gemm<Scalar, true>(r, L, n, qk_t + L, L2, w.dPT.data(), L, grads_t, L2, Triangle::none,
                            nullptr, &w.prefetch);

    // H_before = gamma_n H + [Q^T | K^T] [gamma dO ; -gamma dR].
    if (gated) w.H *= w.gam(last);
    rule_gemm<Scalar, true>(r, dv, L2, qk_t, L2, w.rhs.data(), dv, w.H.data(), dv, Triangle::none,
                            nullptr, &w.prefetch);

    // d log alpha_s = sum_{i >= s in the chunk} dL/dB_i.
    if (d_log_alpha != nullptr) {
      Scalar acc = 0;
      for (Index i = n - 1; i >= 0; --i) d_log_alpha[first + i] = acc += dlg(i);
    }
    transpose_into(r, n, grads_t, L2, w.dqf.data(), r);
    transpose_into(r, n, grads_t + L, L2, w.dkf.data(), r);
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first, n));
    phi.backward(Q.middleRows(first, n), w.qf.topRows(n), w.dqf.topRows(n), dq_rows);
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
    phi.backward(K.middleRows(first, n), w.kf.topRows(n), w.dkf.topRows(n), dk_rows);
  }
  dS0 = w.H;
}

/// Pass 1's buffers (delta_save_chunks), kept by a caller between calls (BackwardWorkspace):
/// the forward's chunk kernel, the running state, a chunk's key features and a copy of its
/// values (strided V).
template <class Scalar>
struct DeltaForwardScratch {
  std::optional<DeltaChunk<Scalar>> kernel;
  RowMatrix<Scalar> S, kf, v_copy;

  /// Scalars held.
  [[nodiscard]] Index scalars() const noexcept {
    return (kernel ? kernel->scalars() : 0) + S.size() + kf.size() + v_copy.size();
  }
};

/// Pass 1 of the delta backward: the forward's chunk kernel over K, V from S0, keeping what the
/// reverse sweep reads in `saved` (fitted for chunks of `chunk` rows: DeltaSavedStates::fit).
/// The same arithmetic as the chunked forward with SaveDeltaChunks, so `saved` gets the saving
/// forward's bits. Its kernel and buffers are `scratch`'s (made where they do not fit this
/// call; a call of one chunk takes a kernel for more rows).
template <class Scalar, class Phi, class DK, class DV>
void delta_save_chunks(const Phi& phi, const DK& K, const DV& V, const TokenInputs<Scalar>& in,
                       const RowMatrix<Scalar>& S0, Index chunk, DeltaSavedStates<Scalar>& saved,
                       DeltaForwardScratch<Scalar>& scratch) {
  const Index T = K.rows(), r = S0.rows(), dv = S0.cols();
  const Index C = std::min(chunk, std::max<Index>(T, 1));
  saved.fit(T, C, r, dv);
  if (T == 0) return;
  DeltaChunk<Scalar>& kernel = chunk_scratch_in(scratch.kernel, T <= C, C, r, dv);
  RowMatrix<Scalar>& S = scratch.S;
  RowMatrix<Scalar>& kf = scratch.kf;
  RowMatrix<Scalar>& v_copy = scratch.v_copy;
  S = S0;
  // kf and v_copy: at least C rows (a kept kernel's chunk may hold more; rows [0, n) are read).
  if (kf.rows() < C || kf.cols() != r) kf.resize(std::max(C, kernel.chunk_rows()), r);
  if (!has_row_major_storage<DV>() && (v_copy.rows() < C || v_copy.cols() != dv))
    v_copy.resize(std::max(C, kernel.chunk_rows()), dv);
  const SaveDeltaChunks<Scalar> save{saved};
  SpreadPrefetch next_rows;  // the next chunk's K, V rows behind this chunk's products
  kernel.prefetch = &next_rows;
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    next_rows.add(K, first + C, C);
    next_rows.add(V, first + C, C);
    map_rows<Scalar>(phi, K, first, n, kf);
    const auto [v, ld_v] = row_major_rows(V, first, n, v_copy);
    kernel.prepare(n, kf.data(), r, v, ld_v, values_from(in.beta, first),
                   values_from(in.log_alpha, first), S);
    save(first, S, kernel);
    kernel.absorb(S);
  }
  stream_fence();
}

/// The chunked delta-rule backward on the WY / UT form (see the file comment): pass 1
/// (delta_save_chunks) from S0 into `saved` with `forward`'s buffers (fitted; a caller that
/// keeps them and `scratch` between calls allocates them once per shape), then the reverse
/// sweep (delta_backward_saved).
/// `in`: bound beta
/// and (GatedDelta) log_alpha. Writes dQ, dK, dV, d_beta (length T), d_log_alpha (length T;
/// null for Delta) and dS0 (resized). dS_T null: 0. Memory: DeltaBackwardScratch::bytes_for.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void delta_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                    const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                    const RowMatrix<Scalar>* dS_T, Index chunk_size,
                    Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                    Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_beta, Scalar* d_log_alpha,
                    RowMatrix<Scalar>& dS0, DeltaSavedStates<Scalar>& saved,
                    DeltaForwardScratch<Scalar>& forward,
                    std::optional<DeltaBackwardScratch<Scalar>>& scratch) {
  delta_save_chunks(phi, K, V, in, S0, chunk_size, saved, forward);
  delta_backward_saved(phi, Q, K, V, dY, in, saved, dS_T, dQ, dK, dV, d_beta, d_log_alpha, dS0,
                       scratch);
}

}  // namespace linattn::detail
