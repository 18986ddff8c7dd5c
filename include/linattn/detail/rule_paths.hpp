#pragma once
// The paths of the write rules other than Additive (Decay, Gated, Delta, GatedDelta) behind
// RuleAttention: the chunked causal pass, the recurrent pass and the decode step, for one query
// head or for the query heads of one key/value head. The per-rule kernels live in
// rule_kernels.hpp; per-token inputs arrive bound and validated (token_inputs.hpp).

#include <linattn/detail/additive_paths.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/rule_kernels.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

namespace linattn::detail {

/// The log-gates of chunk rows [first, first + n): the caller's (Gated) or the constant
/// log(gamma) (Decay, from `constant`, a column of at least n entries).
template <class Scalar>
auto chunk_gates(const TokenInputs<Scalar>& in, const ColVector<Scalar>& constant, Index first,
                 Index n) {
  using Strides = Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>;
  using View = Eigen::Map<const RowMatrix<Scalar>, Eigen::Unaligned, Strides>;
  if (in.log_gate.empty()) return View(constant.data(), n, 1, Strides(1, 1));
  return in.log_gate.middle_rows(first, n).map();
}

/// The chunked causal pass of a decayed, gated or delta rule for `group` query heads over one
/// K, V with bound per-token inputs `in`, continuing `state`, which absorbs K, V once. Each
/// head's rows are normalized before the state absorbs their chunk, so after a
/// DenominatorError the state holds exactly the chunks before the failing one. Scratch is
/// allocated once per call. With G > 1 heads the chunk kernels run once per head on a copy of
/// the incoming state and once (the last head) on the state itself.
template <class Scalar, class Rule, class Phi, class QueryAt, class DK, class DV, class OutputAt>
void rule_chunked(const Phi& phi, const Normalization& norm, Index chunk_size, Index group,
                  const QueryAt& query, const DK& K, const DV& V, const TokenInputs<Scalar>& in,
                  RuleState<Rule, Scalar>& state, const OutputAt& output) {
  const Index T = K.rows(), r = state.feature_dim(), dv = state.value_dim();
  if (T == 0) return;
  auto& S = StateAccess::S(state);
  auto& z = StateAccess::z(state);
  const Index C = std::min(chunk_size, T);
  RowMatrix<Scalar> qf(C, r), kf(C, r), S_copy;
  ColVector<Scalar> z_copy;
  ColVector<Scalar> constant = ColVector<Scalar>::Constant(C, in.constant_log_gate);
  RuleScratch<Scalar> scratch(C, r, dv);
  constexpr bool delta_family =
      Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta;
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    const auto k_rows = map_rows<Scalar>(phi, K, first, n, kf);
    for (Index g = 0; g < group; ++g) {
      const bool last = g + 1 == group;
      if (!last) {
        S_copy = S;
        z_copy = z;
      }
      RowMatrix<Scalar>& s = last ? S : S_copy;
      ColVector<Scalar>& zz = last ? z : z_copy;
      const auto q_rows = map_rows<Scalar>(phi, query(g), first, n, qf);
      Eigen::Ref<RowMatrix<Scalar>> out = output(g);
      auto o = out.middleRows(first, n);
      if constexpr (delta_family) {
        const auto beta = in.beta.middle_rows(first, n).map().col(0);
        if constexpr (Rule::kind == WriteKind::gated_delta)
          delta_chunk(s, q_rows, k_rows, V.middleRows(first, n), beta,
                      in.log_alpha.middle_rows(first, n).map().col(0), o, scratch);
        else
          delta_chunk(s, q_rows, k_rows, V.middleRows(first, n), beta,
                      constant.segment(0, 0), o, scratch);
        static_cast<void>(zz);
      } else {
        const auto lg = chunk_gates(in, constant, first, n);
        if (lg.cols() == 1)
          scalar_gated_chunk(s, zz, q_rows, k_rows, V.middleRows(first, n), lg.col(0), o,
                             scratch, norm, first);
        else
          channel_gated_chunk(s, zz, q_rows, k_rows, V.middleRows(first, n), lg, o, scratch,
                              norm, first);
      }
    }
    StateAccess::tokens(state) += n;
  }
}

/// One decode token of a decayed, gated or delta rule for one query, on the rows q, k, v
/// (1 x d) into y; gates already in the state's scratch (bind_step_inputs). Strong guarantee.
template <class Scalar, class Rule, class Phi, class Rq, class Rk, class Rv, class Ry>
void rule_token(const Phi& phi, const Normalization& norm, RuleState<Rule, Scalar>& state,
                const Rq& q, const Rk& k, const Rv& v, const StepInputs<Scalar>& in, Ry&& y,
                Index row) {
  auto& scratch = StateAccess::scratch(state);
  Eigen::Ref<RowMatrix<Scalar>> qf(scratch.query_features), kf(scratch.key_features);
  phi.apply(q, qf);
  phi.apply(k, kf);
  if constexpr (Rule::kind == WriteKind::decay || Rule::kind == WriteKind::gated) {
    gated_token<Scalar>(StateAccess::S(state), StateAccess::z(state), scratch.z_next, qf.row(0),
                        kf.row(0), scratch.gates.row(0), v, y, norm, row);
  } else {
    delta_token<Scalar>(StateAccess::S(state), scratch.prediction, qf.row(0), kf.row(0), v,
                        in.beta, in.alpha, y);
  }
  ++StateAccess::tokens(state);
}

/// The recurrent pass over T tokens of a decayed, gated or delta rule continuing `state`.
/// Allocates nothing per token. After a DenominatorError the state holds the earlier tokens.
template <class Scalar, class Rule, class Phi, class DQ, class DK, class DV, class Out>
void rule_recurrent(const Phi& phi, const Normalization& norm, const DQ& Q, const DK& K,
                    const DV& V, const TokenInputs<Scalar>& in, RuleState<Rule, Scalar>& state,
                    Out& out) {
  auto& gates = StateAccess::scratch(state).gates;
  for (Index t = 0; t < Q.rows(); ++t) {
    StepInputs<Scalar> step;
    if constexpr (Rule::kind == WriteKind::decay) {
      gates.setConstant(std::exp(in.constant_log_gate));
    } else if constexpr (Rule::kind == WriteKind::gated) {
      if (in.log_gate.cols == 1)
        gates.setConstant(std::exp(in.log_gate(t)));
      else
        for (Index c = 0; c < gates.cols(); ++c) gates(0, c) = std::exp(in.log_gate(t, c));
    } else {
      step.beta = in.beta(t);
      if constexpr (Rule::kind == WriteKind::gated_delta) step.alpha = std::exp(in.log_alpha(t));
    }
    rule_token(phi, norm, state, Q.row(t), K.row(t), V.row(t), step, out.row(t), t);
  }
}

/// absorb(): the rule's update of one token without a read (features kf, value row v).
template <class Scalar, class Rule, class Kf, class Vr>
void rule_absorb_features(RuleState<Rule, Scalar>& state, const Kf& kf, const Vr& v,
                          const StepInputs<Scalar>& in) {
  auto& S = StateAccess::S(state);
  auto& scratch = StateAccess::scratch(state);
  if constexpr (Rule::kind == WriteKind::decay || Rule::kind == WriteKind::gated) {
    auto& z = StateAccess::z(state);
    const auto g = scratch.gates.row(0);
    for (Index i = 0; i < S.rows(); ++i) S.row(i) = g(i) * S.row(i) + kf(0, i) * v;
    z = z.cwiseProduct(g.transpose()) + kf.transpose();
  } else {
    auto& u = scratch.prediction;
    u.noalias() = kf * S;
    u = in.beta * (v - in.alpha * u);
    S *= in.alpha;
    S.noalias() += kf.transpose() * u;
  }
  ++StateAccess::tokens(state);
}

/// One decode token for the query heads qs of one state: absorbs (k, v) once, then reads
/// qs[g] into ys[g] (normalized for the decayed and gated rules). Strong guarantee: every
/// head's denominator is checked before the state changes. Uses the state's own scratch.
template <class Scalar, class Rule, class Phi, class Queries, class Outputs, class Rk, class Rv>
void rule_step_group(const Phi& phi, const Normalization& norm, RuleState<Rule, Scalar>& state,
                     const Queries& qs, const Rk& k_row, const Rv& v_row,
                     const StepInputs<Scalar>& in, const Outputs& ys) {
  auto& scratch = StateAccess::scratch(state);
  const Index r = state.feature_dim();
  Eigen::Ref<RowMatrix<Scalar>> kf(scratch.key_features), qf(scratch.query_features);
  phi.apply(k_row, kf);
  constexpr bool normalized = Rule::keeps_normalizer;
  if constexpr (normalized) {
    scratch.z_next = StateAccess::z(state).cwiseProduct(scratch.gates.row(0).transpose()) +
                     kf.transpose();
    if (norm.divides())
      for (Index g = 0; g < qs.size(); ++g) {
        phi.apply(qs[g], qf);
        static_cast<void>(
            norm.divisor(ordered_dot(qf.data(), scratch.z_next.data(), r), state.tokens()));
      }
  }
  rule_absorb_features(state, kf, v_row, in);
  for (Index g = 0; g < qs.size(); ++g) {
    phi.apply(qs[g], qf);
    auto y = ys[g];
    y.noalias() = qf * StateAccess::S(state);
    if constexpr (normalized) {
      if (norm.divides())
        y /= norm.divisor(ordered_dot(qf.data(), StateAccess::z(state).data(), r),
                          state.tokens() - 1);
    }
  }
}

}  // namespace linattn::detail
