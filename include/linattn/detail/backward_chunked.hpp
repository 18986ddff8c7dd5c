#pragma once
// Backward passes of the additive linear-attention read (linattn/gradients.hpp): the chunked
// causal backward (REFERENCES.md section 7) and the full one by associativity, for ordinary
// and log-scaled (random-feature) maps, every Normalization.
//
// One kernel for every normalization: the read is O' = [num, den] = A [V, 1] with A the masked
// scores (plus the carried state's part), and the output y = num * a(den) with a = 1 / divisor
// (1 when unnormalized). By the quotient rule the gradient of O' is
//   G_i = [a_i dy_i, b_i],  b_i = -(dy_i . num_i) a_i^2 = -(dy_i . y_i) a_i,
// with b_i = 0 where the divisor does not depend on den (unnormalized; clamped rows with
// den < eps, whose divisor is the constant eps). The rest is the backward of O' = A V', V' =
// [V, 1], where the column of ones is never stored: its share is b.
//
// Log-scaled maps: phi(x_t) = exp(l_t) f_t. The kernels work on f and on shifted gradients
// whose shifts are the forward's running maxima m_i (so every exponent below is <= 0, for every
// row it weighs, as in detail/log_domain.hpp): with true gradient G_i = exp(-lq_i - m_i) Ghat_i,
// the gradient of f(q_i) is exp(lq_i) dphi(q_i), that of f(k_j) is exp(lk_j) dphi(k_j), and
//   d f(q_i) = sum_{j <= i} (Ghat_i . v'_j) exp(lk_j - m_i) f(k_j) + exp(M_{c-1} - m_i) Ghat_i S'^T
//   d f(k_j) = sum_{i >= j} (Ghat_i . v'_j) exp(lk_j - m_i) f(q_i) + exp(lk_j - M_c) H v'_j
//   d v'_j   = sum_{i >= j} exp(lk_j - m_i) (f(q_i) . f(k_j)) Ghat_i + exp(lk_j - M_c) f(k_j)^T H
// where S' = [S, z] is the stored state before chunk c (log-scale M_{c-1}) and H the gradient
// of the stored state after chunk c (log-scale M_c). The running maxima and the feature maps'
// own shifts are constants: they only choose how the same true quantities are stored, so their
// derivatives cancel. Ordinary maps are the case l = 0, M = 0.
//
// Where the boundary states come from: dQ needs the state before each chunk, dK and dV only the
// gradient H after it. So a forward sweep (pass 1) rebuilds S chunk by chunk and computes dQ
// and each row's (a_i, b_i) as it goes, and a reverse sweep (pass 2) carries H from the end and
// computes dK, dV from the stored (a, b). No chunk-boundary state is stored: per token the
// backward keeps a_i, b_i (and m_i for log-scaled maps), 2 or 3 scalars.

#include <linattn/detail/chunked.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/log_domain.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/small_gemm.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>

namespace linattn::detail {

/// Lanes of the register kernel for Scalar (1 where it does not apply): buffers that feed
/// small_gemm have their column counts rounded up to a multiple of it.
template <class Scalar>
constexpr Index kernel_lanes() {
  if constexpr (has_gemm_kernel<Scalar>)
    return GemmTile<Scalar>::lanes;
  else
    return 1;
}

/// C (m x n) = ((Accumulate ? C : 0) + A (m x depth) B (depth x n)) * diag(row_scale), all
/// row-major with leading dimensions: the register kernel where it applies (n a multiple of the
/// packet width), Eigen's product on Maps elsewhere. With Triangle::lower_result only the
/// entries j <= i are sure to be written. `prefetch` (null: none) is advanced by the register
/// kernel's tiles (SpreadPrefetch: the next chunk's rows stream in behind the products).
template <class Scalar, bool Accumulate>
void product(Index m, Index n, Index depth, const Scalar* A, Index lda, const Scalar* B,
             Index ldb, Scalar* C, Index ldc, Triangle triangle = Triangle::none,
             const Scalar* row_scale = nullptr, SpreadPrefetch* prefetch = nullptr) {
  if constexpr (has_gemm_kernel<Scalar>) {
    if (n % GemmTile<Scalar>::lanes == 0) {
      small_gemm<Scalar, Accumulate>(m, n, depth, A, lda, B, ldb, C, ldc, triangle, row_scale,
                                     prefetch);
      return;
    }
  }
  static_cast<void>(prefetch);
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const RowMatrix<Scalar>, 0, Stride> a(A, m, depth, Stride(lda));
  const Eigen::Map<const RowMatrix<Scalar>, 0, Stride> b(B, depth, n, Stride(ldb));
  Eigen::Map<RowMatrix<Scalar>, 0, Stride> c(C, m, n, Stride(ldc));
  product_into<Accumulate>(c, a, b);
  if (row_scale != nullptr)
    for (Index i = 0; i < m; ++i) c.row(i) *= row_scale[i];
}

/// dst (cols x rows) = src^T, row-major with leading dimensions; transpose_into where the
/// register kernel applies.
template <class Scalar>
void transpose_block(Index rows, Index cols, const Scalar* src, Index lds, Scalar* dst,
                     Index ldd) {
  if constexpr (has_gemm_kernel<Scalar>) {
    transpose_into(rows, cols, src, lds, dst, ldd);
  } else {
    using Stride = Eigen::OuterStride<>;
    Eigen::Map<RowMatrix<Scalar>, 0, Stride>(dst, cols, rows, Stride(ldd)) =
        Eigen::Map<const RowMatrix<Scalar>, 0, Stride>(src, rows, cols, Stride(lds)).transpose();
  }
}

/// C (n x cols) = (Accumulate ? C : 0) + M^T B for M (n x n) lower triangular, so M^T is
/// upper triangular. On the register kernel by reversing the order of rows: with
/// R(i, k) = M(n-1-k, n-1-i), lower triangular and built in `reversed` (row stride ld_r), row
/// n-1-i of M^T B is sum_k R(i, k) B(n-1-k), so R times B read from its last row up (negative
/// row stride) written to C from its last row up is M^T B, and the kernel skips R's zero upper
/// half (Triangle::lower_lhs). Eigen's product on Maps where the kernel does not apply.
/// `prefetch` as for product().
template <class Scalar, bool Accumulate>
void upper_product(Index n, Index cols, const Scalar* M, Index ld_m, const Scalar* B, Index ldb,
                   Scalar* C, Index ldc, Scalar* reversed, Index ld_r,
                   SpreadPrefetch* prefetch = nullptr) {
  if (n == 0) return;
  if constexpr (has_gemm_kernel<Scalar>) {
    if (cols % GemmTile<Scalar>::lanes == 0) {
      for (Index i = 0; i < n; ++i)
        for (Index k = 0; k < n; ++k)
          reversed[i * ld_r + k] = k <= i ? M[(n - 1 - k) * ld_m + (n - 1 - i)] : Scalar(0);
      small_gemm<Scalar, Accumulate>(n, cols, n, reversed, ld_r, B + (n - 1) * ldb, -ldb,
                                     C + (n - 1) * ldc, -ldc, Triangle::lower_lhs, nullptr,
                                     prefetch);
      return;
    }
  }
  static_cast<void>(prefetch);
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const RowMatrix<Scalar>, 0, Stride> m(M, n, n, Stride(ld_m));
  const Eigen::Map<const RowMatrix<Scalar>, 0, Stride> b(B, n, cols, Stride(ldb));
  Eigen::Map<RowMatrix<Scalar>, 0, Stride> c(C, n, cols, Stride(ldc));
  product_into<Accumulate>(c, m.transpose(), b);
}

/// One row's share of the quotient rule: G = [numerator * dy, denominator].
template <class Scalar>
struct ReadGradient {
  Scalar numerator;    // a = dy_out / d num (1 / divisor; 1 or exp(L) when unnormalized)
  Scalar denominator;  // b = dL / d den
};

/// (a, b) of a row with (scaled) denominator `den`, dy . num = `dy_num` and, for a log-scaled
/// map, L = `log_scale` (query log-scale plus running maximum). The forward's divisor, its
/// DenominatorError included: log_domain_reciprocal for log-scaled maps, Normalization::divisor
/// otherwise. Clamped rows whose den was replaced by eps (as written: den < eps) get b = 0.
template <class Scalar, bool LogScaled>
ReadGradient<Scalar> read_gradient(const Normalization& norm, Scalar den, Scalar dy_num,
                                   Scalar log_scale, Index row) {
  using Kind = Normalization::Kind;
  Scalar a = 1;
  bool through_den = norm.divides();
  if constexpr (LogScaled) {
    a = log_domain_reciprocal(norm, den, log_scale, row);
    if (norm.kind() == Kind::clamped) {
      // The test log_domain_reciprocal makes, on the same doubles.
      const double eps_scaled =
          std::exp(std::log(norm.epsilon()) - static_cast<double>(log_scale));
      through_den = !(static_cast<double>(den) < eps_scaled);
    }
  } else {
    if (!norm.divides()) return {Scalar(1), Scalar(0)};
    a = Scalar(1) / norm.divisor(den, row);
    if (norm.kind() == Kind::clamped)  // Normalization::divisor's test
      through_den = !(std::isfinite(den) && den < static_cast<Scalar>(norm.epsilon()));
  }
  return {a, through_den ? -(dy_num * a) * a : Scalar(0)};
}

/// Everything the causal backward allocates, once per call: per-chunk buffers (C rows, or
/// r x C transposes), the r x dv matrices of the sweeps, and per token (a, b) and, for
/// log-scaled maps, m. `padded` is C rounded up to the register kernel's packet width; padding
/// columns are zero-filled once and only ever hold finite values. `rebuilds_state`: the state
/// buffer of the recomputing backward (the backward from a saved forward reads the saved one).
template <class Scalar>
struct BackwardScratch {
  Index C = 0, padded = 0;
  RowMatrix<Scalar> qf, kf;                // C x r features (scaled ones for log-scaled maps)
  RowMatrix<Scalar> qf_t, kf_t, v_t, dy_t; // r x padded, r x padded, dv x padded, dv x padded
  RowMatrix<Scalar> rows_t;                // r x padded: X^T = S dY^T, then dk^T = H V^T
  RowMatrix<Scalar> scores, d_scores;      // C x padded: A and D-hat of the chunk
  RowMatrix<Scalar> scores_t, d_scores_t;  // their reversed transposes (upper_product)
  RowMatrix<Scalar> weights;               // C x C, exp(lk_j - m_i) (log-scaled maps only)
  RowMatrix<Scalar> rows_r, d_features;    // C x r: X or dk; dq
  RowMatrix<Scalar> rows_v, v_copy, dy_copy;  // C x dv: a dY; copies of rows that are not
                                              // row-major (0 rows when not needed)
  RowMatrix<Scalar> state, H;              // r x dv: S (0 x 0 unless rebuilds_state), H
  ColVector<Scalar> z, hz, lq, lk, scale;  // r, r, C, C, C
  ColVector<Scalar> a, b, m;               // T, T, T (m: log-scaled only)
  SpreadPrefetch prefetch;                 // the next chunk's input rows (prefetch_chunk_rows)

  BackwardScratch(Index T, Index chunk, Index r, Index dv, bool log_scaled, bool copy_v,
                  bool copy_dy, bool rebuilds_state = true) {
    const Index lanes = kernel_lanes<Scalar>();
    C = std::min(chunk, std::max<Index>(T, 1));
    padded = (C + lanes - 1) / lanes * lanes;
    qf.resize(C, r);
    kf.resize(C, r);
    for (auto* buffer : {&qf_t, &kf_t, &rows_t}) buffer->setZero(r, padded);
    for (auto* buffer : {&v_t, &dy_t}) buffer->setZero(dv, padded);
    for (auto* buffer : {&scores, &d_scores, &scores_t, &d_scores_t}) buffer->setZero(C, padded);
    weights.resize(log_scaled ? C : 0, log_scaled ? C : 0);
    rows_r.resize(C, r);
    d_features.resize(C, r);
    rows_v.resize(C, dv);
    v_copy.resize(copy_v ? C : 0, dv);
    dy_copy.resize(copy_dy ? C : 0, dv);
    state.resize(rebuilds_state ? r : 0, rebuilds_state ? dv : 0);
    H.resize(r, dv);
    z.resize(r);
    hz.resize(r);
    lq.resize(C);
    lk.resize(C);
    scale.resize(C);
    a.resize(T);
    b.resize(T);
    m.resize(log_scaled ? T : 0);
  }

  /// Whether this scratch serves a call with these arguments (the constructor's): the same
  /// per-chunk shapes, or a call of one chunk shorter than this scratch's C <= chunk (a short
  /// document after longer ones: its one chunk of T rows runs in the larger buffers with the
  /// same operations, which read n and its padded width only; the buffers' width is only their
  /// leading dimension). If so it is made to hold what a new one holds where that matters (the
  /// zero-initialised buffers zeroed again: the call's bits cannot depend on an earlier call,
  /// even one that read NaN) and its per-token buffers grown to T where shorter (never shrunk:
  /// a workspace over documents of many lengths keeps the longest's). O(C (r + dv + C)).
  [[nodiscard]] bool reuse(Index T, Index chunk, Index r, Index dv, bool log_scaled, bool copy_v,
                           bool copy_dy, bool rebuilds_state = true) {
    const Index needed = std::min(chunk, std::max<Index>(T, 1));
    const bool one_short_chunk = needed <= C && C <= chunk;
    if ((C != needed && !one_short_chunk) || qf.cols() != r || rows_v.cols() != dv ||
        (weights.size() > 0) != log_scaled || (v_copy.rows() > 0) != copy_v ||
        (dy_copy.rows() > 0) != copy_dy || (state.size() > 0) != rebuilds_state)
      return false;
    for (auto* buffer : {&qf_t, &kf_t, &rows_t, &v_t, &dy_t, &scores, &d_scores, &scores_t,
                         &d_scores_t})
      buffer->setZero();
    for (auto* per_token : {&a, &b})
      if (per_token->size() < T) per_token->resize(T);
    if (log_scaled && m.size() < T) m.resize(T);
    return true;
  }

  /// Bytes the constructor allocates for these arguments, without allocating them:
  /// per token 2 scalars (3 when log_scaled); per call 2 C r + 3 r P + 2 dv P + 4 C P
  /// (+ C^2 when log_scaled) + 2 C r + C dv (+ C dv per copy) + r dv (+ r dv when
  /// rebuilds_state) + 2 r + 3 C, with C = min(chunk, T) and P = C rounded up to the packet
  /// width.
  [[nodiscard]] static std::size_t bytes_for(Index T, Index chunk, Index r, Index dv,
                                             bool log_scaled, bool copy_v, bool copy_dy,
                                             bool rebuilds_state = true) {
    const Index lanes = kernel_lanes<Scalar>();
    const Index C = std::min(chunk, std::max<Index>(T, 1));
    const Index P = (C + lanes - 1) / lanes * lanes;
    const Index per_call = 2 * C * r + 3 * r * P + 2 * dv * P + 4 * C * P +
                           (log_scaled ? C * C : 0) + 2 * C * r + C * dv +
                           (copy_v ? C * dv : 0) + (copy_dy ? C * dv : 0) +
                           (rebuilds_state ? 2 : 1) * r * dv + 2 * r + 3 * C;
    const Index per_token = log_scaled ? 3 : 2;
    return static_cast<std::size_t>(per_call + per_token * T) * sizeof(Scalar);
  }

  /// Bytes held by the buffers above (bytes_for() of the constructor's arguments; of the
  /// longest T since, where reused).
  [[nodiscard]] std::size_t bytes() const {
    const Index scalars = qf.size() + kf.size() + qf_t.size() + kf_t.size() + v_t.size() +
                          dy_t.size() + rows_t.size() + scores.size() + d_scores.size() +
                          scores_t.size() + d_scores_t.size() + weights.size() +
                          rows_r.size() + d_features.size() + rows_v.size() + v_copy.size() +
                          dy_copy.size() + state.size() + H.size() + z.size() + hz.size() +
                          lq.size() + lk.size() + scale.size() + a.size() + b.size() +
                          m.size();
    return static_cast<std::size_t>(scalars) * sizeof(Scalar);
  }
};

/// The scratch `slot` holds, made ready for a call with the constructor arguments `args`: kept
/// where its reuse(args...) accepts it, otherwise a new one (the old one freed first). A
/// backward that keeps its slot between calls (BackwardWorkspace) allocates its scratch once
/// per shape instead of once per call.
template <class Scratch, class... Args>
Scratch& scratch_in(std::optional<Scratch>& slot, const Args&... args) {
  if (!slot || !slot->reuse(args...)) slot.emplace(args...);
  return *slot;
}

/// scratch_in for a call that may be one chunk shorter than the kept scratch's (`one_chunk`: the
/// call is a single chunk, so Scratch::reuse(args..., one_chunk) may accept buffers for more
/// rows); a new one is made for `args`.
template <class Scratch, class... Args>
Scratch& chunk_scratch_in(std::optional<Scratch>& slot, bool one_chunk, const Args&... args) {
  if (!slot || !slot->reuse(args..., one_chunk)) slot.emplace(args...);
  return *slot;
}

/// Issues what `queue` still holds, then queues rows [first, first + n) of Q, K, V and dY
/// (clipped to their rows; nothing where n <= 0 or first < 0), in the order load_chunk reads
/// them: called at the start of a chunk with the rows of the chunk that follows it in the
/// sweep (the one before it in a reverse sweep), which then stream in behind this chunk's
/// products instead of being fetched a line at a time when the next chunk's feature map and
/// transposes reach them (most of those two steps' time, from memory). Returns whether rows
/// were queued, so that a caller can queue its own rows of that chunk after them (gates, saved
/// states). Every backward uses it. Hints only: no result changes.
template <class DQ, class DK, class DV, class DY>
bool prefetch_chunk_rows(SpreadPrefetch& queue, const DQ& Q, const DK& K, const DV& V,
                         const DY& dY, Index first, Index n) noexcept {
  queue.finish();
  if (n <= 0 || first < 0) return false;
  queue.add(Q, first, n);
  queue.add(K, first, n);
  queue.add(V, first, n);
  queue.add(dY, first, n);
  return true;
}

/// Features of rows [first, first + n) of X into the top n rows of `out` (and, for a
/// log-scaled map, their log-scales into `log_scale`).
template <class Scalar, bool LogScaled, class Phi, class DX>
void chunk_features(const Phi& phi, const DX& X, Index first, Index n, RowMatrix<Scalar>& out,
                    ColVector<Scalar>& log_scale) {
  Eigen::Ref<RowMatrix<Scalar>> f(out.topRows(n));
  if constexpr (LogScaled)
    phi.apply_scaled(X.middleRows(first, n), f, Eigen::Ref<ColVector<Scalar>>(log_scale.head(n)));
  else
    phi.apply(X.middleRows(first, n), f);
}

/// The chunk's score block A = tril(f(Q) f(K)^T), weighted by exp(lk_j - m_i) for log-scaled
/// maps, and the raw D = tril(dY V^T) in d_scores; kf_t, v_t and dy_t get the transposes.
/// `m` holds the chunk's running maxima (log-scaled only).
template <class Scalar, bool LogScaled>
void chunk_scores(BackwardScratch<Scalar>& w, Index n, Index r, Index dv, const Scalar* v,
                  Index ld_v, const Scalar* dy, Index ld_dy, const Scalar* m) {
  const Index lanes = kernel_lanes<Scalar>();
  const Index n_padded = (n + lanes - 1) / lanes * lanes;
  transpose_block(n, r, w.kf.data(), r, w.kf_t.data(), w.padded);
  transpose_block(n, dv, v, ld_v, w.v_t.data(), w.padded);
  transpose_block(n, dv, dy, ld_dy, w.dy_t.data(), w.padded);
  product<Scalar, false>(n, n_padded, r, w.qf.data(), r, w.kf_t.data(), w.padded,
                         w.scores.data(), w.padded, Triangle::lower_result, nullptr, &w.prefetch);
  product<Scalar, false>(n, n_padded, dv, dy, ld_dy, w.v_t.data(), w.padded, w.d_scores.data(),
                         w.padded, Triangle::lower_result, nullptr, &w.prefetch);
  for (Index i = 0; i + 1 < n; ++i) {
    w.scores.row(i).segment(i + 1, n - i - 1).setZero();
    w.d_scores.row(i).segment(i + 1, n - i - 1).setZero();
  }
  if constexpr (LogScaled) {
    for (Index i = 0; i < n; ++i)
      for (Index j = 0; j <= i; ++j) w.weights(i, j) = rescale_factor(w.lk(j), m[i]);
    for (Index i = 0; i < n; ++i)
      w.scores.row(i).head(i + 1).array() *= w.weights.row(i).head(i + 1).array();
  }
}

/// D-hat_ij = (a_i D_ij + b_i) exp(lk_j - m_i) for j <= i, in place in d_scores.
template <class Scalar, bool LogScaled>
void weight_score_gradients(BackwardScratch<Scalar>& w, Index n, const Scalar* a,
                            const Scalar* b) {
  for (Index i = 0; i < n; ++i) {
    auto row = w.d_scores.row(i).head(i + 1).array();
    row = a[i] * row + b[i];
    if constexpr (LogScaled) row *= w.weights.row(i).head(i + 1).array();
  }
}

/// Rows of one chunk as the pieces below read them: the first row, the count, and V and dY as
/// row-major pointers with their row strides (the inputs' own storage or the scratch copies).
template <class Scalar>
struct ChunkRows {
  Index first, n;
  const Scalar* v;
  Index ld_v;
  const Scalar* dy;
  Index ld_dy;
};

/// Loads one chunk: the features of its queries and keys (and log-scales), for log-scaled maps
/// its running maxima m[i] = max(M_before, lk_0..lk_i) into `m` (when `fill_m`; else m holds
/// them already), and the score blocks A and D (chunk_scores).
template <class Scalar, bool LogScaled, class Phi, class DQ, class DK, class DV, class DY>
ChunkRows<Scalar> load_chunk(BackwardScratch<Scalar>& w, const Phi& phi, const DQ& Q,
                             const DK& K, const DV& V, const DY& dY, Index first, Index n,
                             Index r, Index dv, Scalar M_before, Scalar* m, bool fill_m) {
  chunk_features<Scalar, LogScaled>(phi, Q, first, n, w.qf, w.lq);
  chunk_features<Scalar, LogScaled>(phi, K, first, n, w.kf, w.lk);
  if constexpr (LogScaled) {
    if (fill_m) {
      Scalar running = M_before;
      for (Index i = 0; i < n; ++i) m[i] = running = running_max(running, w.lk(i));
    }
  } else {
    static_cast<void>(M_before);
    static_cast<void>(fill_m);
  }
  const auto [v, ld_v] = row_major_rows(V, first, n, w.v_copy);
  const auto [dy, ld_dy] = row_major_rows(dY, first, n, w.dy_copy);
  chunk_scores<Scalar, LogScaled>(w, n, r, dv, v, ld_v, dy, ld_dy, m);
  return {first, n, v, ld_v, dy, ld_dy};
}

/// The read's share of one chunk, given the stored state before it (S, r x dv row-major at
/// `state`; z in w.z; log-scale M_before): each row's (a, b) by the quotient rule into a[i],
/// b[i], D-hat in place of D, and dq = D-hat f(K) + s (a X + b z^T) with X = dY S^T, through
/// the map into the chunk's rows of dQ. X is formed as X^T = S dY^T (S read in place as the
/// kernel's left operand, one transpose of C x r back): the sums are X's, term by term in the
/// same order, and no r x dv transpose is made. 2 r dv flops per token in X, about C r in
/// D-hat f(K).
template <class Scalar, bool LogScaled, class Phi, class DQ>
void chunk_query_gradients(BackwardScratch<Scalar>& w, const Phi& phi, const DQ& Q,
                           const ChunkRows<Scalar>& c, Index r, Index dv, const Scalar* state,
                           Scalar M_before, const Scalar* m, const Normalization& norm,
                           Scalar* a, Scalar* b, Eigen::Ref<RowMatrix<Scalar>>& dQ) {
  const Index n = c.n;
  const Index lanes = kernel_lanes<Scalar>();
  const Index n_padded = (n + lanes - 1) / lanes * lanes;
  if constexpr (LogScaled)
    for (Index i = 0; i < n; ++i) w.scale(i) = rescale_factor(M_before, m[i]);  // state's weight
  else
    static_cast<void>(M_before);
  // X = dY S^T: the state's share of dy . num, and of dq.
  product<Scalar, false>(r, n_padded, dv, state, dv, w.dy_t.data(), w.padded, w.rows_t.data(),
                         w.padded, Triangle::none, nullptr, &w.prefetch);
  transpose_block(r, n, w.rows_t.data(), w.padded, w.rows_r.data(), r);
  for (Index i = 0; i < n; ++i) {
    const Scalar s = LogScaled ? w.scale(i) : Scalar(1);
    const auto A_i = w.scores.row(i).head(i + 1);
    const Scalar den = s * w.qf.row(i).dot(w.z.transpose()) + A_i.sum();
    const Scalar dy_num =
        s * w.qf.row(i).dot(w.rows_r.row(i)) + A_i.dot(w.d_scores.row(i).head(i + 1));
    const Scalar L = LogScaled ? Scalar(w.lq(i) + m[i]) : Scalar(0);
    const ReadGradient<Scalar> g =
        read_gradient<Scalar, LogScaled>(norm, den, dy_num, L, c.first + i);
    a[i] = g.numerator;
    b[i] = g.denominator;
  }
  weight_score_gradients<Scalar, LogScaled>(w, n, a, b);
  // dq = D-hat f(K) + s (a X + b z^T)
  for (Index i = 0; i < n; ++i) {
    const Scalar s = LogScaled ? w.scale(i) : Scalar(1);
    w.d_features.row(i) = (s * a[i]) * w.rows_r.row(i) + (s * b[i]) * w.z.transpose();
  }
  product<Scalar, true>(n, r, n, w.d_scores.data(), w.padded, w.kf.data(), r,
                        w.d_features.data(), r, Triangle::lower_lhs, nullptr, &w.prefetch);
  Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(c.first, n));
  phi.backward(Q.middleRows(c.first, n), w.qf.topRows(n), w.d_features.topRows(n), dq_rows);
}

/// The state gradient's share of one chunk, given H (w.H, w.hz: the gradient of the stored
/// state after the chunk, at log-scale M_after = m[n-1]), D-hat in d_scores and (a, b):
///   dk = diag(scale) (V H^T + 1 hz^T) + D-hat^T f(Q)      through the map into dK
///   dv = diag(scale) f(K) H + A^T diag(a) dY              into dV
///   H  = exp(M_before - M_after) H + f(Q)^T diag(exp(M_before - m)) [a dY, b]
/// with scale_j = exp(lk_j - M_after) (1 for ordinary maps). V H^T is formed as H V^T from the
/// chunk's v_t (no r x dv transpose of H). 6 r dv flops per token against H, about C (r + dv)
/// in the two transposed-triangle products.
template <class Scalar, bool LogScaled, class Phi, class DK>
void chunk_key_value_gradients(BackwardScratch<Scalar>& w, const Phi& phi, const DK& K,
                               const ChunkRows<Scalar>& c, Index r, Index dv, Scalar M_before,
                               const Scalar* m, const Scalar* a, const Scalar* b,
                               Eigen::Ref<RowMatrix<Scalar>>& dK,
                               Eigen::Ref<RowMatrix<Scalar>>& dV) {
  const Index n = c.n, first = c.first;
  Scalar M_after = 0;
  if constexpr (LogScaled) {
    M_after = m[n - 1];
    for (Index j = 0; j < n; ++j) w.scale(j) = rescale_factor(w.lk(j), M_after);
  } else {
    static_cast<void>(m);
  }
  const Scalar* key_scale = LogScaled ? w.scale.data() : nullptr;

  const Index lanes = kernel_lanes<Scalar>();
  const Index n_padded = (n + lanes - 1) / lanes * lanes;
  product<Scalar, false>(r, n_padded, dv, w.H.data(), dv, w.v_t.data(), w.padded,
                         w.rows_t.data(), w.padded, Triangle::none, nullptr, &w.prefetch);
  transpose_block(r, n, w.rows_t.data(), w.padded, w.rows_r.data(), r);
  for (Index j = 0; j < n; ++j) {
    w.rows_r.row(j) += w.hz.transpose();
    if constexpr (LogScaled) w.rows_r.row(j) *= w.scale(j);
  }
  upper_product<Scalar, true>(n, r, w.d_scores.data(), w.padded, w.qf.data(), r,
                              w.rows_r.data(), r, w.d_scores_t.data(), w.padded, &w.prefetch);
  {
    Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first, n));
    phi.backward(K.middleRows(first, n), w.kf.topRows(n), w.rows_r.topRows(n), dk_rows);
  }

  Scalar* dv_rows = dV.data() + first * dV.outerStride();
  product<Scalar, false>(n, dv, r, w.kf.data(), r, w.H.data(), dv, dv_rows, dV.outerStride(),
                         Triangle::none, key_scale, &w.prefetch);
  for (Index i = 0; i < n; ++i)
    w.rows_v.row(i) = a[i] * Eigen::Map<const RowVector<Scalar>>(c.dy + i * c.ld_dy, dv);
  upper_product<Scalar, true>(n, dv, w.scores.data(), w.padded, w.rows_v.data(), dv, dv_rows,
                              dV.outerStride(), w.scores_t.data(), w.padded, &w.prefetch);

  if constexpr (LogScaled) {
    const Scalar decay = rescale_factor(M_before, M_after);
    w.H *= decay;
    w.hz *= decay;
    for (Index i = 0; i < n; ++i) {
      w.scale(i) = rescale_factor(M_before, m[i]);
      w.rows_v.row(i) *= w.scale(i);
    }
  } else {
    static_cast<void>(M_before);
  }
  transpose_block(n, r, w.qf.data(), r, w.qf_t.data(), w.padded);
  product<Scalar, true>(r, dv, n, w.qf_t.data(), w.padded, w.rows_v.data(), dv, w.H.data(), dv,
                        Triangle::none, nullptr, &w.prefetch);
  for (Index i = 0; i < n; ++i)
    w.hz += (LogScaled ? Scalar(b[i] * w.scale(i)) : b[i]) * w.qf.row(i).transpose();
}

/// Starts H at the final state's gradient (dS_T, dz_T), zero where null.
template <class Scalar>
void start_state_gradient(BackwardScratch<Scalar>& w, const RowMatrix<Scalar>* dS_T,
                          const ColVector<Scalar>* dz_T) {
  if (dS_T != nullptr)
    w.H = *dS_T;
  else
    w.H.setZero();
  if (dz_T != nullptr)
    w.hz = *dz_T;
  else
    w.hz.setZero();
}

/// Gradients of the causal read continuing the stored state (S0, z0) at log-scale M0 (0 for
/// ordinary maps), in chunks of `chunk_size` rows, given the output gradient dY and the
/// gradient (dS_T, dz_T) of the stored final state (null: zero). Writes dQ, dK, dV (T x dk,
/// T x dk, T x dv; may be strided views) and the gradient of the stored initial state into
/// (dS0, dz0). Pass 1 (forward) rebuilds S and writes dQ and (a, b); pass 2 (reverse) carries H
/// and writes dK, dV. Per token about 10 r dv + C (4 r + 3 dv) flops (4 r dv in pass 1's
/// products against the state, 6 r dv in pass 2) plus the feature maps twice and their
/// derivatives once; memory: BackwardScratch, O(C (r + C + dv) + r dv) plus 2 or 3 scalars per
/// token, in `scratch` (kept there for the next call: scratch_in). DenominatorError as the
/// forward read would throw it (nothing then is meaningful).
/// The state is rebuilt with the arithmetic of the register forward (detail::causal_chunked:
/// the same product sums in the same order, z a running sum row by row), so where both run on
/// the register kernel the rebuilt states are the forward's bits, and this backward equals
/// saved_causal_backward's from a saved forward bit for bit.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void causal_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                     const RowMatrix<Scalar>& S0, const ColVector<Scalar>& z0, Scalar M0,
                     const RowMatrix<Scalar>* dS_T, const ColVector<Scalar>* dz_T,
                     Index chunk_size, const Normalization& norm,
                     Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                     Eigen::Ref<RowMatrix<Scalar>> dV, RowMatrix<Scalar>& dS0,
                     ColVector<Scalar>& dz0, std::optional<BackwardScratch<Scalar>>& scratch) {
  constexpr bool LogScaled = LogScaledFeatureMap<Phi, Scalar>;
  const Index T = Q.rows(), r = S0.rows(), dv = S0.cols();
  BackwardScratch<Scalar>& w =
      scratch_in(scratch, T, chunk_size, r, dv, LogScaled, !has_row_major_storage<DV>(),
                 !has_row_major_storage<DY>(), true);
  const Index C = w.C;

  // ---- pass 1: forward over the chunks, S in w.state, z, M; dQ and (a, b) per row ----
  w.state = S0;
  w.z = z0;
  Scalar M = M0;
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    prefetch_chunk_rows(w.prefetch, Q, K, V, dY, first + C, std::min(C, T - first - C));
    Scalar* m = LogScaled ? w.m.data() + first : nullptr;
    const ChunkRows<Scalar> c =
        load_chunk<Scalar, LogScaled>(w, phi, Q, K, V, dY, first, n, r, dv, M, m, true);
    chunk_query_gradients<Scalar, LogScaled>(w, phi, Q, c, r, dv, w.state.data(), M, m, norm,
                                             w.a.data() + first, w.b.data() + first, dQ);
    // The state absorbs the chunk (as detail::log_domain_causal_chunk for log-scaled maps).
    if constexpr (LogScaled) {
      const Scalar M_new = m[n - 1];
      const Scalar alpha = rescale_factor(M, M_new);
      if (alpha != Scalar(1)) {
        w.state *= alpha;
        w.z *= alpha;
      }
      for (Index j = 0; j < n; ++j) w.kf.row(j) *= rescale_factor(w.lk(j), M_new);
      transpose_block(n, r, w.kf.data(), r, w.kf_t.data(), w.padded);
      M = M_new;
    }
    // S += f(K)^T V as the register forward does it (detail::causal_chunked: the same operands
    // in the same order), so the rebuilt states are the forward's bits.
    product<Scalar, true>(r, dv, n, w.kf_t.data(), w.padded, c.v, c.ld_v, w.state.data(), dv,
                          Triangle::none, nullptr, &w.prefetch);
    for (Index j = 0; j < n; ++j) w.z += w.kf.row(j).transpose();  // the forward's running z
  }

  // ---- pass 2: reverse over the chunks, H (gradient of the stored state after the chunk) ----
  start_state_gradient(w, dS_T, dz_T);
  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  for (Index first = last_first; first >= 0; first -= C) {
    const Index n = std::min(C, T - first);
    Scalar* m = LogScaled ? w.m.data() + first : nullptr;
    const Scalar M_before = LogScaled ? (first == 0 ? M0 : w.m(first - 1)) : Scalar(0);
    prefetch_chunk_rows(w.prefetch, Q, K, V, dY, first - C, first > 0 ? C : 0);
    const ChunkRows<Scalar> c =
        load_chunk<Scalar, LogScaled>(w, phi, Q, K, V, dY, first, n, r, dv, M_before, m, false);
    const Scalar* a = w.a.data() + first;
    const Scalar* b = w.b.data() + first;
    weight_score_gradients<Scalar, LogScaled>(w, n, a, b);
    chunk_key_value_gradients<Scalar, LogScaled>(w, phi, K, c, r, dv, M_before, m, a, b, dK, dV);
  }
  dS0 = w.H;
  dz0 = w.hz;
}

/// Gradients of the full (non-causal) read by associativity, O((Tq + Tk) r dv): with
/// Shat = f(K)^T diag(e) V and zhat = f(K)^T e (e_j = exp(lk_j - M), M = max lk; e = 1 for
/// ordinary maps), X = dY Shat^T gives dy . num = f(q_i) . X_i and
///   d f(Q) = diag(a) X + b zhat^T,  H = f(Q)^T diag(a) dY,  h = f(Q)^T b,
///   d f(K) = diag(e) (V H^T + 1 h^T),  dV = diag(e) f(K) H.
/// Allocates the features of all rows (as the forward's full read does) and O(r dv).
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void full_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                   const Normalization& norm, Eigen::Ref<RowMatrix<Scalar>> dQ,
                   Eigen::Ref<RowMatrix<Scalar>> dK, Eigen::Ref<RowMatrix<Scalar>> dV) {
  constexpr bool LogScaled = LogScaledFeatureMap<Phi, Scalar>;
  const Index Tq = Q.rows(), Tk = K.rows(), r = phi.feature_dim(K.cols());
  RowMatrix<Scalar> qf(Tq, r), kf(Tk, r);
  ColVector<Scalar> lq(Tq), lk(Tk), e = ColVector<Scalar>::Ones(Tk);
  chunk_features<Scalar, LogScaled>(phi, Q, 0, Tq, qf, lq);
  chunk_features<Scalar, LogScaled>(phi, K, 0, Tk, kf, lk);
  Scalar M = 0;
  if constexpr (LogScaled) {
    M = -std::numeric_limits<Scalar>::infinity();
    for (Index j = 0; j < Tk; ++j) M = running_max(M, lk(j));
    for (Index j = 0; j < Tk; ++j) e(j) = rescale_factor(lk(j), M);
  }
  const RowMatrix<Scalar> kf_scaled = e.asDiagonal() * kf;
  const RowMatrix<Scalar> S = kf_scaled.transpose() * V;
  const ColVector<Scalar> z = kf_scaled.colwise().sum().transpose();
  RowMatrix<Scalar> X = dY * S.transpose();
  ColVector<Scalar> a(Tq), b(Tq);
  for (Index i = 0; i < Tq; ++i) {
    const Scalar L = LogScaled ? Scalar(lq(i) + M) : Scalar(0);
    const ReadGradient<Scalar> g = read_gradient<Scalar, LogScaled>(
        norm, qf.row(i).dot(z.transpose()), qf.row(i).dot(X.row(i)), L, i);
    a(i) = g.numerator;
    b(i) = g.denominator;
  }
  X = a.asDiagonal() * X;
  X.noalias() += b * z.transpose();
  phi.backward(Q, qf, X, dQ);
  const RowMatrix<Scalar> H = qf.transpose() * (a.asDiagonal() * dY);
  const ColVector<Scalar> h = qf.transpose() * b;
  RowMatrix<Scalar> dkf = V * H.transpose();
  dkf.rowwise() += h.transpose();
  dkf = e.asDiagonal() * dkf;
  phi.backward(K, kf, dkf, dK);
  product_into<false>(dV, kf_scaled, H);
}

}  // namespace linattn::detail
