#pragma once
// Backward pass of Decay and Gated (linattn/rule_gradients.hpp, linattn/rule_saved_forward.hpp).
//
// The chunked form of REFERENCES.md section 3 run in reverse mode. With the normalizer as an
// extra value column (V' = [V, 1], S' = [S, z]; the read is O'_i = S'_i^T q_i and the quotient
// rule gives its gradient G_i = [a_i dy_i, b_i] as in backward_chunked.hpp), per chunk with
// local cumulative log-gates B_i = sum_{s<=i} log g_s (one per channel, or one broadcast to
// all), state S'_0 before the chunk, H after it:
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
// cumulative sum; summed over the channels for one gate per token).
//
// The products run on the register kernel (small_gemm.hpp) as in the additive backward
// (backward_chunked.hpp): z's column is never part of a product (its share is b_i and the
// vector hz), the products against S and H read them in place (X^T = S dY^T, H V^T), and the
// transposed triangles go through upper_product. One gate per token: A = tril(Q K^T) .* W with
// W_ij = exp(B_i - B_j) and dA .* W on the same kernel. Per-channel gates, in sub-chunks of
// c = gate_subchunk rows as the forward: for i in sub-chunk I (first row i0) and j < i0 the
// weight factors through the reference point B_{i0-1}:
//   A_ij = (q_i .* exp(B_i - B_{i0-1})) . (k_j .* exp(B_{i0-1} - B_j))    (both exponents <= 0)
// one register-kernel product per sub-chunk row I (and one each for dq and dk); the diagonal
// c x c blocks use the products of the gates between j and i (the forward's in-chunk decays;
// dq and dk by Horner's rule, c r / 2 multiply-adds per token each).
//
// The backward's chunk B is a multiple of the forward's C (backward_chunk_size: 32 rows under
// the automatic chunk). Where the chunk-boundary states come from: gated_backward (pass 1,
// forward) rebuilds them with the forward's own chunk kernel (ScalarGatedChunk /
// ChannelGatedChunk::absorb over the forward's chunks: the forward's bits), writing dQ, each
// row's (a, b) and q .* dq into the gate gradient; pass 2 (reverse) carries H, writes dK, dV
// and subtracts k .* dk. From a saved forward (rule_saved_forward.hpp) gated_backward_from
// reads them and does both passes' work on each chunk in one reverse sweep. Both run the same
// chunk code on the same states, so they agree bit for bit.
// Per token (r features, dv values), against the forward's 4 r dv + C (r + dv):
//   recomputing  10 r dv + about B (5 r + 3 dv) (+ 2 c r for per-channel gates, c = 16)
//   from saved    8 r dv + about B (3 r + 2 dv) (+ 2 c r)

#include <linattn/detail/backward_chunked.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/gated_kernels.hpp>
#include <linattn/detail/prefetch.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/saved_backward.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>

namespace linattn::detail {

/// The per-chunk work of the gated backward and its buffers, allocated once per call. `gc`
/// (gate columns) is 1 (one gate per token) or r (per channel). Use: load() a chunk, then
/// query() with the state before it (or weight_gradients() with stored (a, b)), then
/// key_value() with H after it.
template <class Scalar>
class GatedBackwardChunk {
 public:
  GatedBackwardChunk(Index C, Index r, Index dv, bool per_channel, bool copy_v, bool copy_dy)
      : C_(C), P_(padded(C)), r_(r), dv_(dv), gc_(per_channel ? r : 1),
        per_channel_(per_channel), blocks_((C + sub - 1) / sub) {
    qf_.resize(C, r);
    kf_.resize(C, r);
    qhat_.resize(C, r);
    rows_r_.resize(C, r);
    d_features_.resize(C, r);
    for (auto* m : {&kf_t_, &qhat_t_, &rows_t_}) m->setZero(r, P_);
    for (auto* m : {&v_t_, &dy_t_}) m->setZero(dv, P_);
    for (auto* m : {&scores_, &d_scores_, &scores_t_, &d_scores_t_}) m->setZero(C, P_);
    rows_v_.resize(C, dv);
    dv_rows_.resize(C, dv);
    v_copy_.resize(copy_v ? C : 0, dv);
    dy_copy_.resize(copy_dy ? C : 0, dv);
    for (auto* m : {&log_cum_, &qscale_, &kscale_}) m->resize(C, gc_);
    decay_end_.resize(gc_);
    acc_.resize(r);
    if (per_channel) {
      // Rows of the sub-chunk blocks: I sub rows for I = 1 ... b - 1 (kw_offset).
      const Index off = blocks_ > 1 ? kw_offset(blocks_, r) / r : 0;
      for (auto* m : {&gates_, &khat_, &qt_, &qt_scale_, &tmp_}) m->resize(C, r);
      kw_.resize(off, r);
      kw_scale_.resize(off, r);
      kw_t_.setZero(std::max<Index>(blocks_ - 1, 0) * r, P_);
      block_t_.setZero(C, P_);
    } else {
      weights_.resize(C, C);
    }
  }

  /// Whether this chunk's buffers serve a call with these (the constructor's) arguments, or
  /// with a smaller C when the call is one chunk of C rows (`one_chunk`: a short document after
  /// longer ones); if so they are made to hold what new ones hold where that matters (the
  /// zero-initialised ones zeroed again), as BackwardScratch::reuse. A chunk of n rows reads n
  /// and its padded width only: the buffers' width is a leading dimension, and what depends on
  /// where a value lies (Eigen's packet exp against its scalar tail) is laid out by n (the
  /// weights, n x n) or by the sub-chunk (the per-channel blocks), so the bits are those of
  /// new buffers for C rows. O(C (r + dv + C)).
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool per_channel, bool copy_v,
                           bool copy_dy, bool one_chunk = false) {
    if (!(C == C_ || (one_chunk && C < C_)) || r != r_ || dv != dv_ ||
        per_channel != per_channel_ ||
        (v_copy_.rows() > 0) != copy_v || (dy_copy_.rows() > 0) != copy_dy)
      return false;
    for (auto* m : {&kf_t_, &qhat_t_, &rows_t_, &v_t_, &dy_t_, &scores_, &d_scores_, &scores_t_,
                    &d_scores_t_, &kw_t_, &block_t_})
      m->setZero();
    return true;
  }

  /// Scalars held by the buffers (scalars_for() of the constructor's arguments).
  [[nodiscard]] Index scalars() const noexcept {
    Index n = 0;
    for (const auto* m : {&qf_, &kf_, &qhat_, &rows_r_, &d_features_, &kf_t_, &qhat_t_, &rows_t_,
                          &v_t_, &dy_t_, &scores_, &d_scores_, &scores_t_, &d_scores_t_, &rows_v_,
                          &dv_rows_, &v_copy_, &dy_copy_, &log_cum_, &qscale_, &kscale_,
                          &weights_, &gates_, &khat_, &qt_, &qt_scale_, &tmp_, &kw_, &kw_scale_,
                          &kw_t_, &block_t_})
      n += m->size();
    return n + decay_end_.size() + acc_.size();
  }

  /// Scalars the constructor allocates (see its body): 5 C r + 3 r P + 2 dv P + 4 C P +
  /// C dv (2 + copies) + 3 C g + g + r, plus C^2 (one gate per token) or 5 C r + (b - 1) b c r
  /// + (b - 1) r P + C P (per channel; b = ceil(C / c) sub-chunks of c rows), P = C rounded up
  /// to the register kernel's packet width, g = gate columns.
  [[nodiscard]] static Index scalars_for(Index C, Index r, Index dv, bool per_channel,
                                         bool copy_v, bool copy_dy) {
    const Index P = padded(C), g = per_channel ? r : 1, b1 = std::max<Index>((C + sub - 1) / sub - 1, 0);
    const Index blocks = b1 * (b1 + 1) * sub * r;  // kw_ and kw_scale_: 2 kw_offset(b1 + 1, r)
    Index n = 5 * C * r + 3 * r * P + 2 * dv * P + 4 * C * P +
              C * dv * (2 + (copy_v ? 1 : 0) + (copy_dy ? 1 : 0)) + 3 * C * g + g + r;
    n += per_channel ? 5 * C * r + blocks + b1 * r * P + C * P : C * C;
    return n;
  }

  /// prefetch_chunk_rows (backward_chunked.hpp) with the per-channel log-gates' rows after
  /// Q, K, V and dY: the chunk the sweep loads next. Hints only: no result changes.
  template <class DQ, class DK, class DV, class DY>
  void prefetch_chunk(const DQ& Q, const DK& K, const DV& V, const DY& dY,
                      const TokenInputs<Scalar>& in, Index first, Index n) noexcept {
    if (!prefetch_chunk_rows(prefetch_, Q, K, V, dY, first, n)) return;
    if (per_channel_ && in.log_gate.col_stride == 1) {
      using Stride = Eigen::OuterStride<>;
      prefetch_.add(Eigen::Map<const RowMatrix<Scalar>, 0, Stride>(
                        in.log_gate.data, in.log_gate.rows, in.log_gate.cols,
                        Stride(in.log_gate.row_stride)),
                    first, n);
    }
  }

  /// Queues rows [first, first + n) of a row-major matrix after what prefetch_chunk queued.
  template <class M>
  void prefetch_more(const M& m, Index first, Index n) noexcept {
    prefetch_.add(m, first, n);
  }

  [[nodiscard]] const Scalar* key_features() const noexcept { return kf_.data(); }
  [[nodiscard]] const Scalar* values() const noexcept { return v_; }
  [[nodiscard]] Index values_stride() const noexcept { return ld_v_; }

  /// Loads rows [first, first + n): features, cumulative log-gates and their exponentials, the
  /// transposes the products read, the decayed scores A (lower triangle, zero above) and the
  /// raw D = tril(dY V^T).
  template <class Phi, class DQ, class DK, class DV, class DY>
  void load(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
            const TokenInputs<Scalar>& in, Index first, Index n) {
    first_ = first;
    n_ = n;
    map_rows<Scalar>(phi, Q, first, n, qf_);
    map_rows<Scalar>(phi, K, first, n, kf_);
    const auto vr = row_major_rows(V, first, n, v_copy_);
    v_ = vr.first;
    ld_v_ = vr.second;
    const auto dr = row_major_rows(dY, first, n, dy_copy_);
    dy_ = dr.first;
    ld_dy_ = dr.second;
    // B row by row (each channel's sum in token order), then the exponentials over whole
    // contiguous blocks, so that every one takes Eigen's packet exp.
    if (in.log_gate.empty()) {
      Scalar sum = 0;
      for (Index i = 0; i < n; ++i) log_cum_(i, 0) = sum += in.constant_log_gate;
    } else if (per_channel_) {
      using GateRow = Eigen::Map<const RowVector<Scalar>>;
      const auto gate_row = [&](Index i) {
        return GateRow(in.log_gate.data + (first + i) * in.log_gate.row_stride, r_);
      };
      log_cum_.row(0) = gate_row(0);
      for (Index i = 1; i < n; ++i) log_cum_.row(i) = log_cum_.row(i - 1) + gate_row(i);
    } else {
      Scalar sum = 0;
      for (Index i = 0; i < n; ++i) log_cum_(i, 0) = sum += in.log_gate(first + i, 0);
    }
    const auto last = log_cum_.row(n - 1);
    for (Index i = 0; i < n; ++i) kscale_.row(i) = last - log_cum_.row(i);
    exp_in_place(kscale_.data(), n * gc_);
    qscale_.topRows(n) = log_cum_.topRows(n);
    exp_in_place(qscale_.data(), n * gc_);
    decay_end_ = qscale_.row(n - 1);
    if (per_channel_) {
      qhat_.topRows(n) = qf_.topRows(n).cwiseProduct(qscale_.topRows(n));
      khat_.topRows(n) = kf_.topRows(n).cwiseProduct(kscale_.topRows(n));
      for (Index i = 0; i < n; ++i)
        gates_from_logs(&in.log_gate.data[(first + i) * in.log_gate.row_stride], 1,
                        gates_.row(i).data(), r_);
    } else {
      // W_ij = exp(B_i - B_j) for j <= i (the rest of each row, exp(0), is never read), n x n
      // with row stride n (weight_row).
      for (Index i = 0; i < n; ++i) {
        qhat_.row(i) = qf_.row(i) * qscale_(i, 0);
        Scalar* w = weights_.data() + i * n;
        for (Index j = 0; j < n; ++j) w[j] = j <= i ? log_cum_(i, 0) - log_cum_(j, 0) : Scalar(0);
      }
      exp_in_place(weights_.data(), n * n);
    }
    const Index np = padded(n);
    transpose_block(n, dv_, v_, ld_v_, v_t_.data(), P_);
    transpose_block(n, dv_, dy_, ld_dy_, dy_t_.data(), P_);
    transpose_block(n, r_, qhat_.data(), r_, qhat_t_.data(), P_);
    if (per_channel_) {
      channel_scores();
    } else {
      transpose_block(n, r_, kf_.data(), r_, kf_t_.data(), P_);
      product<Scalar, false>(n, np, r_, qf_.data(), r_, kf_t_.data(), P_, scores_.data(), P_,
                             Triangle::lower_result, nullptr, &prefetch_);
      for (Index i = 0; i < n; ++i)
        scores_.row(i).head(i + 1).array() *= weight_row(i);
    }
    product<Scalar, false>(n, np, dv_, dy_, ld_dy_, v_t_.data(), P_, d_scores_.data(), P_,
                           Triangle::lower_result, nullptr, &prefetch_);
    for (Index i = 0; i + 1 < n; ++i) {
      scores_.row(i).segment(i + 1, n - i - 1).setZero();
      d_scores_.row(i).segment(i + 1, n - i - 1).setZero();
    }
  }

  /// dA in place of D: a_i D_ij + b_i for j <= i, times W_ij for one gate per token (then it is
  /// the gradient of the undecayed score q_i . k_j).
  void weight_gradients(const Scalar* a, const Scalar* b) {
    for (Index i = 0; i < n_; ++i) {
      auto row = d_scores_.row(i).head(i + 1).array();
      row = a[i] * row + b[i];
      if (!per_channel_) row *= weight_row(i);
    }
  }

  /// The read's share, given the state before the chunk (S r x dv and z, contiguous): each
  /// row's (a, b) into a[i], b[i] (DenominatorError as the forward), dA, and
  ///   dq = exp(B) .* (a X + b z) + in-chunk terms,   X = dY S^T (as X^T = S dY^T)
  /// through the map into dQ's rows; q .* dq added into the gate gradient rows (if wanted).
  template <class Phi, class DQ>
  void query(const Phi& phi, const DQ& Q, const Scalar* S, const Scalar* z,
             const Normalization& norm, Scalar* a, Scalar* b, Eigen::Ref<RowMatrix<Scalar>>& dQ,
             Scalar* d_gate) {
    const Index n = n_;
    const Eigen::Map<const RowVector<Scalar>> zr(z, r_);
    product<Scalar, false>(r_, padded(n), dv_, S, dv_, dy_t_.data(), P_, rows_t_.data(), P_,
                           Triangle::none, nullptr, &prefetch_);
    transpose_block(r_, n, rows_t_.data(), P_, rows_r_.data(), r_);
    for (Index i = 0; i < n; ++i) {
      const auto A_i = scores_.row(i).head(i + 1);
      const Scalar den = qhat_.row(i).dot(zr) + A_i.sum();
      const Scalar dy_num = qhat_.row(i).dot(rows_r_.row(i)) + A_i.dot(d_scores_.row(i).head(i + 1));
      const ReadGradient<Scalar> g =
          read_gradient<Scalar, false>(norm, den, dy_num, Scalar(0), first_ + i);
      a[i] = g.numerator;
      b[i] = g.denominator;
    }
    weight_gradients(a, b);
    for (Index i = 0; i < n; ++i) d_features_.row(i) = a[i] * rows_r_.row(i) + b[i] * zr;
    scale_rows(d_features_, qscale_, n);
    if (per_channel_)
      channel_query_terms();
    else
      product<Scalar, true>(n, r_, n, d_scores_.data(), P_, kf_.data(), r_, d_features_.data(),
                            r_, Triangle::lower_lhs, nullptr, &prefetch_);
    add_gate_terms(d_gate, qf_, d_features_, Scalar(1));
    Eigen::Ref<RowMatrix<Scalar>> dq_rows(dQ.middleRows(first_, n));
    phi.backward(Q.middleRows(first_, n), qf_.topRows(n), d_features_.topRows(n), dq_rows);
  }

  /// The state gradient's share, given H, hz (the gradient of S', z after the chunk), dA in
  /// d_scores and (a, b):
  ///   dk = exp(B_last - B) .* (V H^T + 1 hz^T) + in-chunk terms    through the map into dK
  ///   dv = (k .* exp(B_last - B)) H + A^T diag(a) dY                into dV
  ///   H  = diag(exp(B_last)) H + (q .* exp(B))^T diag(a) dY,  hz likewise with b
  /// and k .* dk subtracted from the gate gradient rows (if wanted).
  template <class Phi, class DK>
  void key_value(const Phi& phi, const DK& K, RowMatrix<Scalar>& H, ColVector<Scalar>& hz,
                 const Scalar* a, const Scalar* b, Eigen::Ref<RowMatrix<Scalar>>& dK,
                 Eigen::Ref<RowMatrix<Scalar>>& dV, Scalar* d_gate) {
    const Index n = n_;
    product<Scalar, false>(r_, padded(n), dv_, H.data(), dv_, v_t_.data(), P_, rows_t_.data(), P_,
                           Triangle::none, nullptr, &prefetch_);
    transpose_block(r_, n, rows_t_.data(), P_, rows_r_.data(), r_);
    for (Index j = 0; j < n; ++j) rows_r_.row(j) += hz.transpose();
    scale_rows(rows_r_, kscale_, n);
    if (per_channel_)
      channel_key_terms();
    else
      upper_product<Scalar, true>(n, r_, d_scores_.data(), P_, qf_.data(), r_, rows_r_.data(), r_,
                                  d_scores_t_.data(), P_, &prefetch_);
    add_gate_terms(d_gate, kf_, rows_r_, Scalar(-1));
    {
      Eigen::Ref<RowMatrix<Scalar>> dk_rows(dK.middleRows(first_, n));
      phi.backward(K.middleRows(first_, n), kf_.topRows(n), rows_r_.topRows(n), dk_rows);
    }
    // dV into a contiguous block first: its bits then do not depend on dV's layout.
    if (per_channel_)
      product<Scalar, false>(n, dv_, r_, khat_.data(), r_, H.data(), dv_, dv_rows_.data(), dv_,
                             Triangle::none, nullptr, &prefetch_);
    else
      product<Scalar, false>(n, dv_, r_, kf_.data(), r_, H.data(), dv_, dv_rows_.data(), dv_,
                             Triangle::none, kscale_.data(), &prefetch_);
    for (Index i = 0; i < n; ++i)
      rows_v_.row(i) = a[i] * Eigen::Map<const RowVector<Scalar>>(dy_ + i * ld_dy_, dv_);
    upper_product<Scalar, true>(n, dv_, scores_.data(), P_, rows_v_.data(), dv_, dv_rows_.data(),
                                dv_, scores_t_.data(), P_, &prefetch_);
    dV.middleRows(first_, n) = dv_rows_.topRows(n);
    if (per_channel_) {
      for (Index m = 0; m < r_; ++m) H.row(m) *= decay_end_(m);
      hz.array() *= decay_end_.transpose().array();
    } else {
      H *= decay_end_(0);
      hz *= decay_end_(0);
    }
    product<Scalar, true>(r_, dv_, n, qhat_t_.data(), P_, rows_v_.data(), dv_, H.data(), dv_,
                          Triangle::none, nullptr, &prefetch_);
    for (Index i = 0; i < n; ++i) hz += b[i] * qhat_.row(i).transpose();
  }

 private:
  static constexpr Index sub = gate_subchunk<Scalar>;
  static constexpr Index padded(Index n) noexcept {
    const Index lanes = kernel_lanes<Scalar>();
    return (n + lanes - 1) / lanes * lanes;
  }
  // x[0, n) = exp(x[0, n)) as one contiguous array (Eigen's packet exp for all but the tail).
  static void exp_in_place(Scalar* x, Index n) {
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> a(x, n);
    a = a.exp();
  }
  Scalar* kw_t(Index I) noexcept { return kw_t_.data() + (I - 1) * r_ * P_; }
  // Row i's weights W_i0 ... W_ii of the loaded chunk (n x n, row stride n).
  [[nodiscard]] Eigen::Map<const Eigen::Array<Scalar, 1, Eigen::Dynamic>> weight_row(Index i) const {
    return {weights_.data() + i * n_, i + 1};
  }
  // Sub-chunk row I's block of I sub rows (I >= 1), packed one after another from I = 1: where
  // a block lies depends on I alone, not on the chunk (see reuse).
  [[nodiscard]] static Index kw_offset(Index I, Index r) noexcept {
    return (I - 1) * I / 2 * sub * r;
  }
  Scalar* kw(Index I) noexcept { return kw_.data() + kw_offset(I, r_); }
  Scalar* kw_scale(Index I) noexcept { return kw_scale_.data() + kw_offset(I, r_); }

  // Rows [0, n) of m times their decay scales: per channel (scale's row, elementwise) or one
  // per row (scale's first column).
  void scale_rows(RowMatrix<Scalar>& m, const RowMatrix<Scalar>& scale, Index n) const {
    for (Index i = 0; i < n; ++i) {
      if (per_channel_)
        m.row(i).array() *= scale.row(i).array();
      else
        m.row(i) *= scale(i, 0);
    }
  }

  // q .* dq (sign +1, written: the query's share comes first, so the rows need no clearing)
  // or k .* dk (sign -1, added) into the chunk's rows of the gate gradient.
  void add_gate_terms(Scalar* d_gate, const RowMatrix<Scalar>& f, const RowMatrix<Scalar>& df,
                      Scalar sign) const {
    if (d_gate == nullptr) return;
    const bool first_share = sign > 0;
    for (Index i = 0; i < n_; ++i) {
      Scalar* row = d_gate + (first_ + i) * gc_;
      if (per_channel_) {
        Eigen::Map<RowVector<Scalar>> out(row, r_);
        if (first_share)
          out = sign * f.row(i).cwiseProduct(df.row(i));
        else
          out += sign * f.row(i).cwiseProduct(df.row(i));
      } else {
        const Scalar term = sign * f.row(i).dot(df.row(i));
        row[0] = first_share ? term : row[0] + term;
      }
    }
  }

  // Per-channel scores: sub-chunk row I against the earlier columns through the reference point
  // B_{i0-1} (one product), the diagonal blocks by products of the gates (as the forward).
  void channel_scores() {
    const Index n = n_, r = r_, nb = (n + sub - 1) / sub;
    for (Index I = 0; I < nb; ++I) {
      const Index i0 = I * sub, end = std::min(n, i0 + sub);
      if (I > 0) {
        const auto ref = log_cum_.row(i0 - 1);
        for (Index i = i0; i < end; ++i) qt_scale_.row(i) = log_cum_.row(i) - ref;
        exp_in_place(qt_scale_.row(i0).data(), (end - i0) * r);
        qt_.middleRows(i0, end - i0) =
            qf_.middleRows(i0, end - i0).cwiseProduct(qt_scale_.middleRows(i0, end - i0));
        Eigen::Map<RowMatrix<Scalar>> ks(kw_scale(I), i0, r), kw_rows(kw(I), i0, r);
        for (Index j = 0; j < i0; ++j) ks.row(j) = ref - log_cum_.row(j);
        exp_in_place(ks.data(), i0 * r);
        kw_rows = kf_.topRows(i0).cwiseProduct(ks);
        transpose_block(i0, r, kw(I), r, kw_t(I), P_);
        product<Scalar, false>(end - i0, i0, r, qt_.data() + i0 * r, r, kw_t(I), P_,
                               scores_.data() + i0 * P_, P_, Triangle::none, nullptr,
                               &prefetch_);
      }
      for (Index i = i0; i < end; ++i) {
        const Scalar* q = qf_.row(i).data();
        decayed_row_scores(q, gates_.data(), r, kf_.data(), r, r, i0, i, &scores_(i, 0),
                           acc_.data());
      }
    }
  }

  // dq's in-chunk terms, per channel: earlier sub-chunks by one product per sub-chunk row
  // (scaled by exp(B_i - B_{i0-1})), the diagonal block by Horner's rule over j.
  void channel_query_terms() {
    const Index n = n_, r = r_, nb = (n + sub - 1) / sub;
    for (Index I = 0; I < nb; ++I) {
      const Index i0 = I * sub, end = std::min(n, i0 + sub);
      if (I > 0) {
        product<Scalar, false>(end - i0, r, i0, d_scores_.data() + i0 * P_, P_, kw(I), r,
                               tmp_.data(), r);
        for (Index i = i0; i < end; ++i)
          d_features_.row(i).array() +=
              tmp_.row(i - i0).array() * qt_scale_.row(i).array();
      }
      // Terms j = i0 ... i, gate g_j applied to the terms before j (from row i0 + 1; row i0
      // when i = i0, where no gate is read, so that the pointer stays inside the buffer).
      for (Index i = i0; i < end; ++i)
        gated_horner(d_features_.row(i).data(), &d_scores_(i, i0), Index(1), kf_.row(i0).data(),
                     r, gates_.row(std::min(i0 + 1, i)).data(), r, i - i0 + 1, r);
    }
  }

  // dk's in-chunk terms, per channel: the diagonal block by Horner's rule over i (from the
  // sub-chunk's end), the later sub-chunks by one product each, scaled by exp(B_{i0-1} - B_j).
  void channel_key_terms() {
    const Index n = n_, r = r_, nb = (n + sub - 1) / sub;
    for (Index I = 0; I < nb; ++I) {
      const Index i0 = I * sub, end = std::min(n, i0 + sub);
      // Terms i = end - 1 down to j (a column of dA, read upwards), gate g_{i+1} applied to
      // the terms after i (from row end - 1 up).
      for (Index j = i0; j < end; ++j)
        gated_horner(rows_r_.row(j).data(), &d_scores_(end - 1, j), -P_,
                     qf_.row(end - 1).data(), -r, gates_.row(end - 1).data(), -r, end - j, r);
      if (I > 0) {
        const Index ni = end - i0;
        transpose_block(ni, i0, d_scores_.data() + i0 * P_, P_, block_t_.data(), P_);
        product<Scalar, false>(i0, r, ni, block_t_.data(), P_, qt_.data() + i0 * r, r,
                               tmp_.data(), r);
        const Eigen::Map<const RowMatrix<Scalar>> ks(kw_scale(I), i0, r);
        rows_r_.topRows(i0).array() += tmp_.topRows(i0).array() * ks.array();
      }
    }
  }

  Index C_, P_, r_, dv_, gc_;
  bool per_channel_;
  Index blocks_;
  Index first_ = 0, n_ = 0, ld_v_ = 0, ld_dy_ = 0;
  const Scalar* v_ = nullptr;
  const Scalar* dy_ = nullptr;
  RowMatrix<Scalar> qf_, kf_, qhat_, rows_r_, d_features_;       // C x r
  RowMatrix<Scalar> kf_t_, qhat_t_, rows_t_, v_t_, dy_t_;        // r x P, dv x P
  RowMatrix<Scalar> scores_, d_scores_, scores_t_, d_scores_t_;  // C x P
  RowMatrix<Scalar> rows_v_, dv_rows_, v_copy_, dy_copy_;        // C x dv
  RowMatrix<Scalar> log_cum_, qscale_, kscale_;                  // C x gc: B, exp(B), exp(B_last - B)
  RowVector<Scalar> decay_end_, acc_;                            // gc, r
  RowMatrix<Scalar> weights_;                                    // C x C (one gate per token)
  RowMatrix<Scalar> gates_, khat_, qt_, qt_scale_, tmp_;         // C x r (per channel)
  RowMatrix<Scalar> kw_, kw_scale_, kw_t_, block_t_;             // sub-chunk blocks (per channel)
  SpreadPrefetch prefetch_;                                      // the next chunk's rows
};

/// The forward's chunk kernel of the rule (one gate per token, or per channel) for its chunk
/// of C rows, used to move a state across a backward chunk with the forward's own arithmetic.
template <class Scalar>
class GatedForwardStep {
 public:
  GatedForwardStep(Index C, Index r, Index dv, bool per_channel) : C_(C), r_(r), dv_(dv) {
    if (per_channel)
      channel_.emplace(C, r, dv);
    else
      scalar_.emplace(C, r, dv);
  }
  /// Whether this step serves a call with the constructor's arguments (a BackwardWorkspace
  /// keeps it): the kernel's reuse, for the same C or a smaller one where the call is one chunk
  /// (then absorb() takes its rows in one piece, as a step for C rows would). No allocation.
  [[nodiscard]] bool reuse(Index C, Index r, Index dv, bool per_channel, bool one_chunk = false) {
    if (per_channel != channel_.has_value()) return false;
    return channel_ ? channel_->reuse(C, r, dv, one_chunk) : scalar_->reuse(C, r, dv, one_chunk);
  }
  /// Scalars held (scalars_for() of the constructor's arguments).
  [[nodiscard]] Index scalars() const noexcept {
    return scalars_for(C_, r_, dv_, channel_.has_value());
  }
  /// Scalars the forward kernel's constructor allocates (its buffers, gated_kernels.hpp).
  [[nodiscard]] static Index scalars_for(Index C, Index r, Index dv, bool per_channel) {
    static_cast<void>(dv);
    const Index ld = padded_columns<Scalar>(std::max<Index>(C, per_channel ? gate_subchunk<Scalar> : 1));
    if (!per_channel) return 2 * r * ld + 2 * C * ld + 5 * C + r;
    const Index b = (C + gate_subchunk<Scalar> - 1) / gate_subchunk<Scalar>;
    return 6 * C * r + r * ld + std::max<Index>(b - 1, 0) * r * ld + C * ld + 2 * b * r +
           3 * r + 2 * C;
  }
  /// S, z absorb rows [first, first + n) whose key features and values `w` has loaded, in the
  /// forward's chunks of C rows (`first` and the backward's chunk are multiples of C).
  void absorb(const GatedBackwardChunk<Scalar>& w, const TokenInputs<Scalar>& in, Index first,
              Index n, RowMatrix<Scalar>& S, ColVector<Scalar>& z) {
    const Index r = S.rows();
    for (Index off = 0; off < n; off += C_) {
      const Index m = std::min(C_, n - off), row = first + off;
      const Scalar* kf = w.key_features() + off * r;
      const Scalar* v = w.values() + off * w.values_stride();
      if (channel_) {
        channel_->prepare(m, kf, r, v, w.values_stride(),
                          TokenRows<Scalar>{in.log_gate.data + row * in.log_gate.row_stride,
                                            in.log_gate.row_stride});
        channel_->absorb(S, z);
      } else {
        const TokenValues<Scalar> gates =
            in.log_gate.empty()
                ? TokenValues<Scalar>{&in.constant_log_gate, 0}
                : TokenValues<Scalar>{in.log_gate.data + row * in.log_gate.row_stride,
                                      in.log_gate.row_stride};
        scalar_->prepare(m, kf, r, v, w.values_stride(), gates);
        scalar_->absorb(S, z);
      }
    }
  }

 private:
  Index C_, r_, dv_;
  std::optional<ScalarGatedChunk<Scalar>> scalar_;
  std::optional<ChannelGatedChunk<Scalar>> channel_;
};

/// What gated_backward_from allocates, kept by a caller between calls (BackwardWorkspace): the
/// chunk's buffers, the forward's chunk kernel, the state and H (r x dv, r), and per token
/// (a, b), grown to the longest call and never shrunk.
template <class Scalar>
struct GatedBackwardBuffers {
  std::optional<GatedBackwardChunk<Scalar>> chunk;
  std::optional<GatedForwardStep<Scalar>> forward;
  RowMatrix<Scalar> S, H;
  ColVector<Scalar> z, hz, a, b;
  RowVector<Scalar> final_term;

  /// Bytes held now.
  [[nodiscard]] std::size_t bytes() const noexcept {
    const Index scalars = (chunk ? chunk->scalars() : 0) + (forward ? forward->scalars() : 0) +
                          S.size() + H.size() + z.size() +
                          hz.size() + a.size() + b.size() + final_term.size();
    return static_cast<std::size_t>(scalars) * sizeof(Scalar);
  }
};

/// Bytes gated_backward_from allocates for T tokens, rebuilding the states or from saved ones:
/// GatedBackwardChunk for B = min(chunk, T) rows and the forward's chunk kernel for
/// min(forward_chunk, T), 2 (r dv + r) for the state and H, r for the final term, and per token
/// (a, b) when rebuilding (one chunk's otherwise).
template <class Scalar>
[[nodiscard]] std::size_t gated_backward_bytes(Index T, Index chunk, Index forward_chunk, Index r,
                                               Index dv, bool per_channel, bool rebuilds) {
  const Index B = std::min(chunk, std::max<Index>(T, 1));
  const Index C = std::min(forward_chunk, std::max<Index>(T, 1));
  const Index n = GatedBackwardChunk<Scalar>::scalars_for(B, r, dv, per_channel, false, false) +
                  GatedForwardStep<Scalar>::scalars_for(C, r, dv, per_channel) + 2 * (r * dv + r) +
                  r + 2 * (rebuilds ? T : B);
  return static_cast<std::size_t>(n) * sizeof(Scalar);
}

/// The backward over one call (see the file comment), in chunks of `chunk_size` rows, a
/// multiple of the forward's chunk `forward_chunk`. `in`: Gated's bound log-gates (T x 1 or
/// T x r) or, when empty, Decay's constant log-gate. Boundary states: `saved` (the states of
/// the forward of these inputs, one per `chunk_size` rows), or when null rebuilt from S0, z0
/// (z0 of length r) with the forward's chunk kernel. dS_T, dz_T: gradient of the final state (null: 0). Writes dQ,
/// dK, dV (may be strided views), d_gate (T x gate columns, contiguous, null: not wanted) and
/// dS0, dz0 (resized). Its buffers, the forward's chunk kernel among them, are `buffers`' (kept
/// there for the next call). DenominatorError as the forward read would throw it.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void gated_backward_from(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                         const TokenInputs<Scalar>& in, const RowMatrix<Scalar>* S0,
                         const ColVector<Scalar>* z0, const ChunkStates<Scalar>* saved,
                         Index r, const RowMatrix<Scalar>* dS_T, const ColVector<Scalar>* dz_T,
                         Index chunk_size, Index forward_chunk, const Normalization& norm,
                         Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                         Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_gate,
                         RowMatrix<Scalar>& dS0, ColVector<Scalar>& dz0,
                         GatedBackwardBuffers<Scalar>& buffers) {
  const Index T = Q.rows(), dv = V.cols();
  const bool per_channel = in.log_gate.cols > 1;
  const Index gc = per_channel ? r : 1;
  const Index C = std::min(chunk_size, std::max<Index>(T, 1));
  // A call of one chunk (T <= C) may take a kept chunk's and kernel's buffers for more rows.
  GatedBackwardChunk<Scalar>& w =
      chunk_scratch_in(buffers.chunk, T <= C, C, r, dv, per_channel, !has_row_major_storage<DV>(),
                       !has_row_major_storage<DY>());
  const Index forward_C = std::min(forward_chunk, std::max<Index>(T, 1));
  GatedForwardStep<Scalar>& forward =
      chunk_scratch_in(buffers.forward, T <= forward_C, forward_C, r, dv, per_channel);
  RowMatrix<Scalar>& S = buffers.S;
  RowMatrix<Scalar>& H = buffers.H;
  ColVector<Scalar>& z = buffers.z;
  ColVector<Scalar>& hz = buffers.hz;
  ColVector<Scalar>& a = buffers.a;
  ColVector<Scalar>& b = buffers.b;
  RowVector<Scalar>& final_term = buffers.final_term;
  S.resize(r, dv);
  H.resize(r, dv);
  z.resize(r);
  hz.resize(r);
  for (auto* per_token : {&a, &b})  // grown, never shrunk (only data() is read)
    if (const Index n = saved == nullptr ? T : C; per_token->size() < n) per_token->resize(n);
  final_term.setZero(r);
  if (dS_T != nullptr)
    H = *dS_T;
  else
    H.setZero();
  if (dz_T != nullptr)
    hz = *dz_T;
  else
    hz.setZero();
  const bool final_term_wanted = d_gate != nullptr && (dS_T != nullptr || dz_T != nullptr);
  // The final state's share of dL/dB_T: rowsum(S'_T .* H_T).
  const auto add_final_term = [&] {
    final_term = ((S.array() * H.array()).rowwise().sum() + z.array() * hz.array()).transpose();
  };
  const Index last_first = T == 0 ? -1 : (T - 1) / C * C;
  // d log g_s = sum_{t >= s} dL/dB_t, the final state's term on the last token: once a chunk's
  // rows hold both shares (query, then key), the suffix sum over them from the row after the
  // chunk, in the reverse sweep while they are in cache (a separate pass over T x gc, one more
  // trip to memory, gave the same bits).
  const auto sum_gate_suffix = [&](Index first, Index n) {
    if (d_gate == nullptr) return;
    for (Index t = first + n - 1; t >= first; --t) {
      Eigen::Map<RowVector<Scalar>> row(d_gate + t * gc, gc);
      if (t + 1 < T)
        row += Eigen::Map<const RowVector<Scalar>>(d_gate + (t + 1) * gc, gc);
      else if (per_channel)
        row += final_term;
      else
        row(0) += final_term.sum();
    }
  };

  if (saved == nullptr) {
    // ---- pass 1: forward; S' before each chunk (the forward's arithmetic), dQ, (a, b) ----
    S = *S0;
    z = *z0;
    for (Index first = 0; first < T; first += C) {
      const Index n = std::min(C, T - first);
      w.prefetch_chunk(Q, K, V, dY, in, first + C, std::min(C, T - first - C));
      w.load(phi, Q, K, V, dY, in, first, n);
      w.query(phi, Q, S.data(), z.data(), norm, a.data() + first, b.data() + first, dQ, d_gate);
      forward.absorb(w, in, first, n, S, z);
    }
    if (final_term_wanted) add_final_term();
    // ---- pass 2: reverse; H, dK, dV ----
    for (Index first = last_first; first >= 0; first -= C) {
      const Index n = std::min(C, T - first);
      w.prefetch_chunk(Q, K, V, dY, in, first - C, first > 0 ? C : 0);
      w.load(phi, Q, K, V, dY, in, first, n);
      w.weight_gradients(a.data() + first, b.data() + first);
      w.key_value(phi, K, H, hz, a.data() + first, b.data() + first, dK, dV, d_gate);
      sum_gate_suffix(first, n);
    }
  } else {
    // ---- one reverse sweep: each chunk's state from the saved forward ----
    for (Index first = last_first; first >= 0; first -= C) {
      const Index n = std::min(C, T - first), chunk = first / C;
      const Scalar* state = saved->states.data() + chunk * r * dv;
      const Scalar* sums = saved->sums.data() + chunk * r;
      // The chunk before this one: its rows and its saved state, behind this chunk's products.
      w.prefetch_chunk(Q, K, V, dY, in, first - C, first > 0 ? C : 0);
      if (chunk > 0) w.prefetch_more(saved->states, (chunk - 1) * r, r);
      w.load(phi, Q, K, V, dY, in, first, n);
      if (first == last_first && final_term_wanted) {
        // S'_T: the last saved state across the last chunk, with the forward's arithmetic.
        S = Eigen::Map<const RowMatrix<Scalar>>(state, r, dv);
        z = Eigen::Map<const ColVector<Scalar>>(sums, r);
        forward.absorb(w, in, first, n, S, z);
        add_final_term();
      }
      w.query(phi, Q, state, sums, norm, a.data(), b.data(), dQ, d_gate);
      w.key_value(phi, K, H, hz, a.data(), b.data(), dK, dV, d_gate);
      sum_gate_suffix(first, n);
    }
  }
  dS0 = H;
  dz0 = hz;
}

/// The recomputing backward from the initial state (S0, z0): gated_backward_from without a
/// saved forward.
template <class Scalar, class Phi, class DQ, class DK, class DV, class DY>
void gated_backward(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DY& dY,
                    const TokenInputs<Scalar>& in, const RowMatrix<Scalar>& S0,
                    const ColVector<Scalar>& z0, const RowMatrix<Scalar>* dS_T,
                    const ColVector<Scalar>* dz_T, Index chunk_size, Index forward_chunk,
                    const Normalization& norm, Eigen::Ref<RowMatrix<Scalar>> dQ, Eigen::Ref<RowMatrix<Scalar>> dK,
                    Eigen::Ref<RowMatrix<Scalar>> dV, Scalar* d_gate, RowMatrix<Scalar>& dS0,
                    ColVector<Scalar>& dz0, GatedBackwardBuffers<Scalar>& buffers) {
  gated_backward_from<Scalar>(phi, Q, K, V, dY, in, &S0, &z0,
                              static_cast<const ChunkStates<Scalar>*>(nullptr), S0.rows(), dS_T,
                              dz_T, chunk_size, forward_chunk, norm, dQ, dK, dV, d_gate, dS0,
                              dz0, buffers);
}

}  // namespace linattn::detail
