#pragma once
// The additive rule's paths behind RuleAttention<Phi, Additive, Scalar> (LinearAttention): the
// full read, the chunked causal pass, the token-pair recurrent pass and the decode step, each
// for one query head or for the query heads of one key/value head (grouped-query attention).
// The kernels they run live in chunked.hpp, recurrent_sweep.hpp, deferred.hpp and (for
// log-scaled maps) log_domain.hpp.

#include <linattn/detail/chunked.hpp>
#include <linattn/detail/deferred.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/log_domain.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/normalization.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>

namespace linattn::detail {

/// phi of rows [first, first + n) of X into the first n rows of `buffer`; returns that block.
template <class Scalar, class Phi, class DX>
auto map_rows(const Phi& phi, const DX& X, Index first, Index n, RowMatrix<Scalar>& buffer) {
  Eigen::Ref<RowMatrix<Scalar>> f(buffer.topRows(n));
  phi.apply(X.middleRows(first, n), f);
  return buffer.topRows(n);
}

/// Full reads of `group` query heads against one K, V: S = phi(K)^T V and z = phi(K)^T 1 once,
/// then output(g) = phi(query(g)) S / phi(query(g)) z. No key (Tk = 0) makes every weight sum
/// zero: the normalized read is undefined there (the policy decides), the unnormalized one 0.
template <class Scalar, class Phi, class QueryAt, class DK, class DV, class OutputAt>
void additive_full(const Phi& phi, const Normalization& norm, Index group, const QueryAt& query,
                   const DK& K, const DV& V, const OutputAt& output) {
  const Index Tk = K.rows(), dv = V.cols();
  if (Tk == 0) {
    for (Index g = 0; g < group; ++g) {
      Eigen::Ref<RowMatrix<Scalar>> out = output(g);
      if (norm.divides() && out.rows() > 0) static_cast<void>(norm.divisor(Scalar(0), 0));
      out.setZero();
    }
    return;
  }
  if constexpr (LogScaledFeatureMap<Phi, Scalar>) {
    for (Index g = 0; g < group; ++g) log_domain_full_read<Scalar>(phi, query(g), K, V, output(g), norm);
  } else {
    const Index r = phi.feature_dim(K.cols());
    RowMatrix<Scalar> qf, kf(Tk, r);
    map_rows<Scalar>(phi, K, 0, Tk, kf);
    const RowMatrix<Scalar> S = kf.transpose() * V;
    const ColVector<Scalar> z = kf.colwise().sum().transpose();
    ColVector<Scalar> den;
    for (Index g = 0; g < group; ++g) {
      const auto& Q = query(g);
      Eigen::Ref<RowMatrix<Scalar>> out = output(g);
      if (Q.rows() == 0) continue;
      qf.resize(Q.rows(), r);
      map_rows<Scalar>(phi, Q, 0, Q.rows(), qf);
      product_into<false>(out, qf, S);
      if (!norm.divides()) continue;
      den.noalias() = qf * z;
      for (Index i = 0; i < out.rows(); ++i) out.row(i) /= norm.divisor(den(i), i);
    }
    static_cast<void>(dv);
  }
}

/// Chunked causal pass of `group` query heads over one K, V, continuing `state` (whose pending
/// decode tokens are folded first); the state absorbs K, V once.
template <class Scalar, class Phi, class QueryAt, class DK, class DV, class OutputAt>
void additive_chunked(const Phi& phi, const Normalization& norm, Index chunk_size, Index group,
                      const QueryAt& query, const DK& K, const DV& V, AttentionState<Scalar>& state,
                      const OutputAt& output) {
  state.settle();
  auto& S = StateAccess::S(state);
  auto& z = StateAccess::z(state);
  auto& tokens = StateAccess::tokens(state);
  if constexpr (LogScaledFeatureMap<Phi, Scalar>) {
    log_domain_causal<Scalar>(phi, query(0), K, V, S, z, StateAccess::log_scale(state), tokens,
                              chunk_size, output(0), norm);
    static_cast<void>(group);
  } else {
    causal_chunked<Scalar>(phi, group, query, K, V, S, z, tokens, chunk_size, norm, output);
  }
}

/// One token through the fused sweep or the deferred block (ordinary maps) or the log domain;
/// q, k, v are contiguous 1 x d rows, y a contiguous 1 x dv row. Strong guarantee.
template <class Scalar, class Phi, class Rq, class Rk, class Rv, class Ry>
void additive_token(const Phi& phi, const Normalization& norm, AttentionState<Scalar>& state,
                    const Rq& q, const Rk& k, const Rv& v, Ry&& y, Index row) {
  auto& S = StateAccess::S(state);
  auto& z = StateAccess::z(state);
  auto& tokens = StateAccess::tokens(state);
  auto& scratch = StateAccess::scratch(state);
  if constexpr (LogScaledFeatureMap<Phi, Scalar>) {
    log_domain_step<Scalar>(phi, q, k, v, scratch.query_features, scratch.key_features, S, z,
                            scratch.z_next, StateAccess::log_scale(state), y, norm, row);
    ++tokens;
  } else {
    prefetch_for_write(y.data(), y.size());
    Eigen::Ref<RowMatrix<Scalar>> qf(scratch.query_features), kf(scratch.key_features);
    phi.apply(q, qf);
    phi.apply(k, kf);
    auto& pending = StateAccess::pending(state);
    // Each advances `tokens` once the token is absorbed.
    if (pending.capacity > 0)
      deferred_token<Scalar>(S, z, scratch.z_next, pending, qf.data(), kf.data(), v.data(),
                             y.data(), norm, row, tokens);
    else
      recurrent_token_fused<Scalar>(S, z, scratch.z_next, qf.data(), kf.data(), v.data(),
                                    y.data(), norm, row, tokens);
  }
}

/// The recurrent pass over T tokens continuing `state`. Features are computed for blocks of
/// tokens at a time, and tokens at positions (2m, 2m + 1) share one sweep over S, which halves
/// the state traffic per token; a token without its partner in this call sweeps alone. The
/// arithmetic per token is the same either way (sweep_tokens), so the results equal step()'s
/// bit for bit whatever the split between calls. Allocates the block scratch once per call.
/// Log-scaled maps go token by token through the log domain.
template <class Scalar, class Phi, class DQ, class DK, class DV, class Out>
void additive_recurrent(const Phi& phi, const Normalization& norm, const DQ& Q, const DK& K,
                        const DV& V, AttentionState<Scalar>& state, Out& out) {
  state.settle();
  const Index T = Q.rows(), r = state.feature_dim(), dv = state.value_dim();
  if (T == 0) return;
  if constexpr (LogScaledFeatureMap<Phi, Scalar>) {
    for (Index t = 0; t < T; ++t) additive_token(phi, norm, state, Q.row(t), K.row(t), V.row(t), out.row(t), t);
    static_cast<void>(r);
    static_cast<void>(dv);
  } else {
    auto& S = StateAccess::S(state);
    auto& z = StateAccess::z(state);
    auto& tokens = StateAccess::tokens(state);
    auto& z_next = StateAccess::scratch(state).z_next;
    // 32 tokens of features per block: few calls of the feature map, scratch that stays in L1.
    const Index block = std::min<Index>(T + 1, 32);
    // Feature rows start at the alignment Eigen vectorizes for, as the 1 x r rows step() uses:
    // a vectorized feature map then takes the same packet or scalar path for every element
    // either way, so features do not differ in the last bit between the two paths.
    constexpr Index align = std::max<Index>(1, EIGEN_MAX_ALIGN_BYTES / Index{sizeof(Scalar)});
    const Index ld = (r + align - 1) / align * align;
    RowMatrix<Scalar> qf_rows(block, ld), kf_rows(block, ld);
    constexpr bool contiguous_v = DV::IsRowMajor && DV::InnerStrideAtCompileTime == 1;
    RowMatrix<Scalar> v_rows(contiguous_v ? 0 : block, dv);
    ColVector<Scalar> z_mid(r);
    using FeatureRows = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    Index first = 0;
    while (first < T) {
      // Blocks end at even positions, so a pair never straddles two blocks.
      const Index n = std::min(block - (tokens + first) % 2, T - first);
      FeatureRows qf_map(qf_rows.data(), n, r, Eigen::OuterStride<>(ld));
      FeatureRows kf_map(kf_rows.data(), n, r, Eigen::OuterStride<>(ld));
      Eigen::Ref<RowMatrix<Scalar>> qf(qf_map), kf(kf_map);
      phi.apply(Q.middleRows(first, n), qf);
      phi.apply(K.middleRows(first, n), kf);
      if constexpr (!contiguous_v) v_rows.topRows(n) = V.middleRows(first, n);
      const auto v_row = [&](Index i) -> const Scalar* {
        if constexpr (contiguous_v)
          return V.row(first + i).data();
        else
          return v_rows.row(i).data();
      };
      Index i = 0;
      while (i < n) {
        const Index t = first + i;
        // Output rows of the next sweep, requested now so that they arrive during this one,
        // and the inputs of the next block of features, a pair of rows per pair of tokens.
        for (Index ahead = t + 2; ahead < std::min(t + 4, T); ++ahead)
          prefetch_for_write(out.row(ahead).data(), dv);
        prefetch_rows(Q, t + block, 2);
        prefetch_rows(K, t + block, 2);
        prefetch_rows(V, t + block, 2);
        if (tokens % 2 == 0 && i + 1 < n) {
          const Scalar* const qf2[2] = {qf.row(i).data(), qf.row(i + 1).data()};
          const Scalar* const kf2[2] = {kf.row(i).data(), kf.row(i + 1).data()};
          const Scalar* const v2[2] = {v_row(i), v_row(i + 1)};
          Scalar* const y2[2] = {out.row(t).data(), out.row(t + 1).data()};
          recurrent_token_pair<Scalar>(S, z, z_mid, z_next, qf2, kf2, v2, y2, norm, t, tokens);
          i += 2;
        } else {
          recurrent_token_fused<Scalar>(S, z, z_next, qf.row(i).data(), kf.row(i).data(),
                                        v_row(i), out.row(t).data(), norm, t, tokens);
          i += 1;
        }
      }
      first += n;
    }
  }
}

/// absorb()'s update from the key's features kf (1 x r) and the value row v_row.
template <class Scalar, class Kf, class Vr>
void additive_absorb_features(AttentionState<Scalar>& state, const Kf& kf, const Vr& v_row) {
  StateAccess::z(state) += kf.transpose();
  auto& pending = StateAccess::pending(state);
  if (pending.capacity > 0)
    append_pending(StateAccess::S(state), pending, kf.data(), v_row.data());
  else
    StateAccess::S(state).noalias() += kf.transpose() * v_row;
  ++StateAccess::tokens(state);
}

/// read_into()'s read from the query's features qf (r scalars) into y (dv scalars), with
/// `scores` room for the pending tokens; the denominator's row is the last absorbed token.
template <class Scalar>
void additive_read_features(const Normalization& norm, const AttentionState<Scalar>& state,
                            const Scalar* qf, Scalar* y, Scalar* scores) {
  const Scalar den = ordered_dot(qf, state.z().data(), state.feature_dim());
  const Index row = std::max<Index>(state.tokens() - 1, 0);
  const Scalar divisor = norm.divisor(den, row);
  auto& st = const_cast<AttentionState<Scalar>&>(state);  // read only: S and the block
  read_with_pending(StateAccess::S(st), StateAccess::pending(st), qf, y, scores, divisor,
                    norm.divides(), false);
}

/// One decode token for the query heads qs of one state: absorbs (k, v) once, then reads
/// qs[g] into ys[g]; the same as absorb() then read_into() per head. Strong guarantee: every
/// head's denominator is checked before the state changes. Uses the state's own scratch.
template <class Scalar, class Phi, class Queries, class Outputs, class Rk, class Rv>
void additive_step_group(const Phi& phi, const Normalization& norm, AttentionState<Scalar>& state,
                         const Queries& qs, const Rk& k_row, const Rv& v_row, const Outputs& ys) {
  auto& scratch = StateAccess::scratch(state);
  const Index r = state.feature_dim();
  Eigen::Ref<RowMatrix<Scalar>> kf(scratch.key_features), qf(scratch.query_features);
  phi.apply(k_row, kf);
  // z after this token, with the adds the absorb will make, for the checks.
  scratch.z_next = state.z() + kf.transpose();
  if (norm.divides())
    for (Index g = 0; g < qs.size(); ++g) {
      phi.apply(qs[g], qf);
      static_cast<void>(
          norm.divisor(ordered_dot(qf.data(), scratch.z_next.data(), r), state.tokens()));
    }
  additive_absorb_features(state, kf, v_row);  // kf still holds phi(k)
  auto& scores = StateAccess::pending(state).scores;
  for (Index g = 0; g < qs.size(); ++g) {
    phi.apply(qs[g], qf);
    additive_read_features(norm, state, qf.data(), ys[g].data(), scores.data());
  }
}

}  // namespace linattn::detail
