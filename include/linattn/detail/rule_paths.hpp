#pragma once
// The paths of the write rules other than Additive (Decay, Gated, Delta, GatedDelta) behind
// RuleAttention: the chunked causal pass, the recurrent pass and the decode step, for one query
// head or for the query heads of one key/value head. The kernels live in gated_kernels.hpp and
// delta_kernels.hpp; per-token inputs arrive bound and validated (token_inputs.hpp).

#include <linattn/detail/additive_paths.hpp>
#include <linattn/detail/chunk_observer.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_kernels.hpp>
#include <linattn/detail/gated_kernels.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/detail/rule_common.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/normalization.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>

namespace linattn::detail {

template <class Rule>
inline constexpr bool is_delta_rule = Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta;

/// The chunked causal pass of a decayed, gated or delta rule for `group` query heads over one
/// K, V with bound per-token inputs `in`, continuing `state`, which absorbs K, V once. Per chunk
/// the kernel prepares the key side once (features, decays, the delta rule's corrected values),
/// reads each head (each with a single-head call's bits), then updates the state. Each head's
/// rows are normalized before the state absorbs their chunk, so after a DenominatorError the
/// state holds exactly the chunks before the failing one. `observe` sees the state before each
/// chunk: observe(first, S, z) for Decay and Gated, observe(first, S, kernel) for the delta
/// rules, with the prepared DeltaChunk or ChannelDeltaChunk (NoChunkObserver: nothing; the
/// saving forwards keep them:
/// SaveChunkStates, SaveDeltaChunks). Scratch allocated once per call.
template <class Scalar, class Rule, class Phi, class QueryAt, class DK, class DV, class OutputAt,
          class Observer = NoChunkObserver>
void rule_chunked(const Phi& phi, const Normalization& norm, Index chunk_size, Index group,
                  const QueryAt& query, const DK& K, const DV& V, const TokenInputs<Scalar>& in,
                  RuleState<Rule, Scalar>& state, const OutputAt& output,
                  const Observer& observe = {}) {
  const Index T = K.rows(), r = state.feature_dim(), dv = state.value_dim();
  if (T == 0) return;
  auto& S = StateAccess::S(state);
  auto& z = StateAccess::z(state);
  const Index C = std::min(chunk_size, T);
  RowMatrix<Scalar> qf(C, r), kf(C, r), v_buffer(has_row_major_storage<DV>() ? 0 : C, dv);
  SpreadPrefetch next_rows;
  // Per-channel log-gates as rows (T x r through their row stride), prefetched with the
  // inputs; only when their channels are contiguous. Their first use, the gates' exponentials
  // in prepare(), otherwise waits on each row (it ran at a third of its in-cache speed for
  // 8 heads' gates in a [T, H r] buffer, d = 64, Zen 5).
  // (GatedDelta's per-channel log_alpha likewise.)
  using GateRows = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
  const TokenArray<Scalar>& channel_gates = in.log_alpha.cols > 1 ? in.log_alpha : in.log_gate;
  const bool gate_rows = channel_gates.cols > 1 && channel_gates.col_stride == 1;
  const GateRows log_gates(gate_rows ? channel_gates.data : nullptr, gate_rows ? T : 0,
                           gate_rows ? channel_gates.cols : 0,
                           Eigen::OuterStride<>(gate_rows ? channel_gates.row_stride : 0));
  const auto chunks = [&](auto& kernel, const auto& prepare) {
    kernel.prefetch = &next_rows;
    for (Index first = 0; first < T; first += C) {
      const Index n = std::min(C, T - first);
      if constexpr (!is_delta_rule<Rule>) observe(first, S, z);  // (delta: after prepare)
      // The next chunk's inputs stream in behind this one's products (see SpreadPrefetch).
      next_rows.add(K, first + C, C);
      next_rows.add(V, first + C, C);
      if (gate_rows) next_rows.add(log_gates, first + C, C);
      for (Index g = 0; g < group; ++g) next_rows.add(query(g), first + C, C);
      map_rows<Scalar>(phi, K, first, n, kf);
      const auto [v, ld_v] = row_major_rows(V, first, n, v_buffer);
      prepare(kernel, n, v, ld_v, first);
      for (Index g = 0; g < group; ++g) {
        map_rows<Scalar>(phi, query(g), first, n, qf);
        Eigen::Ref<RowMatrix<Scalar>> out = output(g);
        const Index ld_out = out.outerStride();
        if constexpr (is_delta_rule<Rule>)
          kernel.read(qf.data(), r, S, out.data() + first * ld_out, ld_out);
        else
          kernel.read(qf.data(), r, S, z, out.data() + first * ld_out, ld_out, norm, first);
      }
      if constexpr (is_delta_rule<Rule>)
        kernel.absorb(S);
      else
        kernel.absorb(S, z);
      next_rows.finish();
      StateAccess::tokens(state) += n;
    }
  };
  if constexpr (is_delta_rule<Rule>) {
    if (in.log_alpha.cols > 1) {
      // Per-channel log_alpha (the saving forwards keep the state before each chunk).
      ChannelDeltaChunk<Scalar> kernel(C, r, dv);
      chunks(kernel, [&](auto& k, Index n, const Scalar* v, Index ld_v, Index first) {
        k.prepare(n, kf.data(), r, v, ld_v, values_from(in.beta, first),
                  TokenRows<Scalar>{in.log_alpha.data + first * in.log_alpha.row_stride,
                                    in.log_alpha.row_stride},
                  S);
        observe(first, S, static_cast<const ChannelDeltaChunk<Scalar>&>(k));
      });
      return;
    }
    DeltaChunk<Scalar> kernel(C, r, dv);
    chunks(kernel, [&](auto& k, Index n, const Scalar* v, Index ld_v, Index first) {
      k.prepare(n, kf.data(), r, v, ld_v, values_from(in.beta, first),
                values_from(in.log_alpha, first), S);
      observe(first, S, static_cast<const DeltaChunk<Scalar>&>(k));
    });
  } else if (in.log_gate.cols > 1) {
    ChannelGatedChunk<Scalar> kernel(C, r, dv);
    chunks(kernel, [&](auto& k, Index n, const Scalar* v, Index ld_v, Index first) {
      k.prepare(n, kf.data(), r, v, ld_v,
                TokenRows<Scalar>{in.log_gate.data + first * in.log_gate.row_stride,
                                  in.log_gate.row_stride});
    });
  } else {
    ScalarGatedChunk<Scalar> kernel(C, r, dv);
    chunks(kernel, [&](auto& k, Index n, const Scalar* v, Index ld_v, Index first) {
      // Decay: the constant log(gamma) with stride 0 (the kernel builds its decays once).
      const TokenValues<Scalar> gates = in.log_gate.empty()
                                            ? TokenValues<Scalar>{&in.constant_log_gate, 0}
                                            : values_from(in.log_gate, first);
      k.prepare(n, kf.data(), r, v, ld_v, gates);
    });
  }
}

/// Applies the update still pending in a recurrent sweep (GatedRecurrence, DeltaRecurrence,
/// ChannelDeltaRecurrence) when the loop over the tokens ends, however it ends: S then holds
/// every token the recurrence took, also after a DenominatorError.
template <class Recurrence, class Scalar>
struct FinishPending {
  Recurrence& recurrence;
  RowMatrix<Scalar>& S;
  ~FinishPending() {
    if constexpr (requires { recurrence.finish(S, false); })
      recurrence.finish(S, false);
    else
      recurrence.finish(S);
  }
};

/// rule_recurrent for GatedDelta with per-channel gates (Kimi Delta Attention): one token per
/// sweep (ChannelDeltaRecurrence), the gates row by row as the per-channel chunk forms them (the
/// same bits whatever the buffer's layout), features in blocks of `block` rows; S exact when
/// the call ends however it ends. A function of its own, so that rule_recurrent's pair loop of
/// the scalar rules compiles as it did without it. `qf`, `kf` (block x r) and `v_buffer` are the
/// caller's feature blocks. No allocation per token.
template <class Scalar, class Phi, class DQ, class DK, class DV, class Tokens, class Out,
          class Prefetch>
void channel_delta_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                             const TokenInputs<Scalar>& in, RowMatrix<Scalar>& S, Tokens& tokens,
                             Out& out, Index block, RowMatrix<Scalar>& qf, RowMatrix<Scalar>& kf,
                             RowMatrix<Scalar>& v_buffer, const Prefetch& prefetch_next) {
  const Index T = Q.rows(), r = S.rows(), dv = S.cols();
  RowMatrix<Scalar> gates(block, r);
  ChannelDeltaRecurrence<Scalar> recurrence(r, dv);
  const FinishPending<ChannelDeltaRecurrence<Scalar>, Scalar> finish{recurrence, S};
  for (Index first = 0; first < T; first += block) {
    const Index n = std::min(block, T - first);
    map_rows<Scalar>(phi, Q, first, n, qf);
    map_rows<Scalar>(phi, K, first, n, kf);
    const auto [v, ld_v] = row_major_rows(V, first, n, v_buffer);
    for (Index i = 0; i < n; ++i)
      gates_from_logs(&in.log_alpha.data[(first + i) * in.log_alpha.row_stride], 1,
                      gates.row(i).data(), r);
    for (Index i = 0; i < n; ++i) {
      const Index t = first + i;
      if (i % 2 == 0) prefetch_next(t);
      recurrence.token(S, qf.row(i).data(), kf.row(i).data(), gates.row(i).data(), v + i * ld_v,
                       in.beta(t), out.row(t).data(), t % 2 != 0);
      ++tokens;
    }
  }
}

/// The recurrent pass over T tokens of a decayed, gated or delta rule continuing `state`: two
/// tokens per sweep of S (GatedRecurrence, DeltaRecurrence), features in blocks of 32 rows, the
/// state exact when the call ends however it ends. After a DenominatorError the state holds the
/// tokens before the failing row. No allocation per token.
template <class Scalar, class Rule, class Phi, class DQ, class DK, class DV, class Out>
void rule_recurrent(const Phi& phi, const Normalization& norm, const DQ& Q, const DK& K,
                    const DV& V, const TokenInputs<Scalar>& in, RuleState<Rule, Scalar>& state,
                    Out& out) {
  const Index T = Q.rows(), r = state.feature_dim(), dv = state.value_dim();
  if (T == 0) return;
  auto& S = StateAccess::S(state);
  auto& tokens = StateAccess::tokens(state);
  const Index block = std::min<Index>(T, 32);
  RowMatrix<Scalar> qf(block, r), kf(block, r), v_buffer(has_row_major_storage<DV>() ? 0 : block, dv);
  // Per-channel log-gates (Gated's, or GatedDelta's log_alpha) as rows (T x r through their
  // row stride), to prefetch them as the inputs are; only when their channels are contiguous.
  using GateRows = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
  const TokenArray<Scalar>& channel_gates = in.log_alpha.cols > 1 ? in.log_alpha : in.log_gate;
  const bool gate_rows = channel_gates.cols > 1 && channel_gates.col_stride == 1;
  const bool scalar_gates = in.log_gate.cols == 1 && !in.log_gate.empty();
  const bool scalar_alpha = in.log_alpha.cols == 1 && !in.log_alpha.empty();
  const GateRows log_gates(gate_rows ? channel_gates.data : nullptr, gate_rows ? T : 0,
                           gate_rows ? channel_gates.cols : 0,
                           Eigen::OuterStride<>(gate_rows ? channel_gates.row_stride : 0));
  const auto prefetch_next = [&](Index t) {
    // Output rows of later sweeps (prefetch_rule_output_rows), and the inputs of the block of
    // features after this one, a pair of rows per pair of tokens (as the additive recurrent
    // pass does): one head's rows of a model's token-major buffers lie on different pages,
    // which the hardware prefetchers do not follow.
    prefetch_rule_output_rows(out, t, dv);
    prefetch_rows(Q, t + block, 2);
    prefetch_rows(K, t + block, 2);
    prefetch_rows(V, t + block, 2);
    if (gate_rows) prefetch_rows(log_gates, t + block, 2);
    // One value per token (scalar gates, beta, log-alpha) at a stride of H values in a model's
    // [B, T, H, 1] buffers: the line of the pair's values a block ahead, whose load otherwise
    // stalls the pair's first use of it.
    if (t + block < T) {
      if (scalar_gates) prefetch_value(&in.log_gate.data[(t + block) * in.log_gate.row_stride]);
      if (!in.beta.empty()) prefetch_value(&in.beta.data[(t + block) * in.beta.row_stride]);
      if (scalar_alpha) prefetch_value(&in.log_alpha.data[(t + block) * in.log_alpha.row_stride]);
    }
  };
  if constexpr (is_delta_rule<Rule>) {
    if (in.log_alpha.cols > 1) {
      channel_delta_recurrent(phi, Q, K, V, in, S, tokens, out, block, qf, kf, v_buffer,
                              prefetch_next);
      return;
    }
    DeltaRecurrence<Scalar> recurrence(r, dv);
    const FinishPending<DeltaRecurrence<Scalar>, Scalar> finish{recurrence, S};
    const auto alpha = [&](Index t) {
      return in.log_alpha.empty() ? Scalar(1) : std::exp(in.log_alpha(t));
    };
    for (Index first = 0; first < T; first += block) {
      const Index n = std::min(block, T - first);
      map_rows<Scalar>(phi, Q, first, n, qf);
      map_rows<Scalar>(phi, K, first, n, kf);
      const auto [v, ld_v] = row_major_rows(V, first, n, v_buffer);
      Index i = 0;
      for (; i + 1 < n; i += 2) {
        const Index t = first + i;
        prefetch_next(t);
        const Scalar* const vs[2] = {v + i * ld_v, v + (i + 1) * ld_v};
        const Scalar* const q[2] = {qf.row(i).data(), qf.row(i + 1).data()};
        const Scalar* const k[2] = {kf.row(i).data(), kf.row(i + 1).data()};
        const Scalar b[2] = {in.beta(t), in.beta(t + 1)}, a[2] = {alpha(t), alpha(t + 1)};
        Scalar* const y[2] = {out.row(t).data(), out.row(t + 1).data()};
        recurrence.pair(S, q, k, vs, b, a, y, (t / 2) % 2 != 0);
        tokens += 2;
      }
      if (i < n) {
        const Index t = first + i;
        recurrence.single(S, qf.row(i).data(), kf.row(i).data(), v + i * ld_v, in.beta(t),
                          alpha(t), out.row(t).data(), (t / 2) % 2 != 0);
        ++tokens;
      }
    }
  } else {
    auto& z = StateAccess::z(state);
    const bool per_channel = in.log_gate.cols > 1;
    const bool fixed = in.log_gate.empty();  // Decay: one gate for every token
    RowMatrix<Scalar> gates(per_channel ? block : 0, r);
    GatedRecurrence<Scalar> recurrence(r, dv);
    const FinishPending<GatedRecurrence<Scalar>, Scalar> finish{recurrence, S};
    const Scalar fixed_gate = fixed ? std::exp(in.constant_log_gate) : Scalar(1);
    for (Index first = 0; first < T; first += block) {
      const Index n = std::min(block, T - first);
      map_rows<Scalar>(phi, Q, first, n, qf);
      map_rows<Scalar>(phi, K, first, n, kf);
      if (per_channel)
        for (Index i = 0; i < n; ++i)
          gates_from_logs(&in.log_gate.data[(first + i) * in.log_gate.row_stride], 1,
                          gates.row(i).data(), r);
      // Not a structured binding: clang 14 cannot capture those in a lambda.
      const auto v_rows = row_major_rows(V, first, n, v_buffer);
      const Scalar* const v = v_rows.first;
      const Index ld_v = v_rows.second;
      const auto token = [&](Index i) {
        GatedToken<Scalar> tk;
        tk.qf = qf.row(i).data();
        tk.kf = kf.row(i).data();
        tk.v = v + i * ld_v;
        if (per_channel)
          tk.gates = gates.row(i).data();
        else
          tk.gate = fixed ? fixed_gate : std::exp(in.log_gate(first + i));
        tk.y = out.row(first + i).data();
        return tk;
      };
      Index i = 0;
      for (; i + 1 < n; i += 2) {
        const Index t = first + i;
        prefetch_next(t);
        const GatedToken<Scalar> pair[2] = {token(i), token(i + 1)};
        recurrence.pair(S, z, pair, norm, t, tokens, t + 2 >= T);
      }
      if (i < n) recurrence.single(S, z, token(i), norm, first + i, tokens, true);
    }
  }
}

/// One decode step's gated token: features and value of the rows, gates from the bound inputs
/// (a per-channel row, or one gate).
template <class Scalar>
GatedToken<Scalar> step_token(const StepScratch<Scalar>& scratch, const StepInputs<Scalar>& in,
                              const Scalar* v) {
  GatedToken<Scalar> tk;
  tk.kf = scratch.key_features.data();
  tk.v = v;
  if (in.per_channel)
    tk.gates = scratch.gates.data();
  else
    tk.gate = scratch.gates(0, 0);
  return tk;
}

/// One decode token of a decayed, gated or delta rule for one query, on the rows q, k, v
/// (1 x d, contiguous) into y: one fused sweep (gated_token, delta_token). Strong guarantee.
template <class Scalar, class Rule, class Phi, class Rq, class Rk, class Rv, class Ry>
void rule_token(const Phi& phi, const Normalization& norm, RuleState<Rule, Scalar>& state,
                const Rq& q, const Rk& k, const Rv& v, const StepInputs<Scalar>& in, Ry&& y,
                Index row) {
  auto& scratch = StateAccess::scratch(state);
  Eigen::Ref<RowMatrix<Scalar>> qf(scratch.query_features), kf(scratch.key_features);
  phi.apply(q, qf);
  phi.apply(k, kf);
  auto& S = StateAccess::S(state);
  auto& tokens = StateAccess::tokens(state);
  if constexpr (is_delta_rule<Rule>) {
    if (in.per_channel)
      channel_delta_token<Scalar>(S, scratch.prediction.data(), qf.data(), kf.data(),
                                  scratch.gates.data(), scratch.z_next.data(), v.data(), in.beta,
                                  y.data(), tokens % 2 != 0);
    else
      delta_token<Scalar>(S, scratch.prediction.data(), qf.data(), kf.data(), v.data(), in.beta,
                          in.alpha, y.data(), tokens % 2 != 0);
    ++tokens;
  } else {
    GatedToken<Scalar> tk = step_token(scratch, in, v.data());
    tk.qf = qf.data();
    tk.y = y.data();
    gated_token(S, StateAccess::z(state), scratch.z_next, tk, norm, row, tokens);
  }
}

/// One decode token for the query heads qs of one state: absorbs (k, v) once (gated_absorb,
/// delta_absorb), then reads qs[g] into ys[g] with the read-only sweep (normalized for the
/// decayed and gated rules): gated_token's bits for each head. Strong guarantee: every head's
/// denominator is checked before the state changes. Uses the state's own scratch.
template <class Scalar, class Rule, class Phi, class Queries, class Outputs, class Rk, class Rv>
void rule_step_group(const Phi& phi, const Normalization& norm, RuleState<Rule, Scalar>& state,
                     const Queries& qs, const Rk& k_row, const Rv& v_row,
                     const StepInputs<Scalar>& in, const Outputs& ys) {
  auto& scratch = StateAccess::scratch(state);
  auto& S = StateAccess::S(state);
  auto& tokens = StateAccess::tokens(state);
  const Index r = state.feature_dim(), dv = state.value_dim();
  Eigen::Ref<RowMatrix<Scalar>> kf(scratch.key_features), qf(scratch.query_features);
  phi.apply(k_row, kf);
  const bool reverse = tokens % 2 != 0;
  if constexpr (is_delta_rule<Rule>) {
    if (in.per_channel)
      channel_delta_absorb<Scalar>(S, scratch.prediction.data(), kf.data(), scratch.gates.data(),
                                   scratch.z_next.data(), v_row.data(), in.beta, reverse);
    else
      delta_absorb<Scalar>(S, scratch.prediction.data(), kf.data(), v_row.data(), in.beta,
                           in.alpha, reverse);
  } else {
    auto& z = StateAccess::z(state);
    GatedToken<Scalar> tk = step_token(scratch, in, v_row.data());
    if (norm.divides())
      for (Index g = 0; g < qs.size(); ++g) {
        phi.apply(qs[g], qf);
        tk.qf = qf.data();
        static_cast<void>(norm.divisor(gate_keys_and_dot(z.data(), tk, scratch.z_next.data(), r),
                                       tokens));
      }
    tk.qf = nullptr;
    gated_absorb(S, z, scratch.z_next, tk, reverse);
  }
  ++tokens;
  for (Index g = 0; g < qs.size(); ++g) {
    phi.apply(qs[g], qf);
    SweepToken<Scalar> read{qf.data(), nullptr, nullptr, ys[g].data(), Scalar(1)};
    bool divide = false;
    if constexpr (!is_delta_rule<Rule>) {
      divide = norm.divides();
      if (divide)
        read.divisor = norm.divisor(ordered_dot(qf.data(), StateAccess::z(state).data(), r), tokens - 1);
    }
    sweep_tokens<1, Scalar, false>(S.data(), dv, r, dv, &read, divide, reverse);
  }
}

}  // namespace linattn::detail
