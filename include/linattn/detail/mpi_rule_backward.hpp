#pragma once
// The sequence-parallel backward of one head under a write rule (Decay, Gated, Delta,
// GatedDelta), on every rank, in this order (linattn/mpi_gradients.hpp has the math):
//   1. check and agree (one record per rank), broadcast the initial state from rank 0 and the
//      final state's gradient from the last rank;
//   2. this slice's affine summary (A_p, B_p, b_p: detail/slice_summary.hpp), gathered; the
//      carried state C_p composed in rank order (CarryScan);
//   3. this slice's backward from C_p with no gradient after it: L_p, its initial-state
//      gradient, gathered;
//   4. the reverse scan H_p = dS_final, then H = A_q^T H + L_q for q = P-1 down to p+1 (the
//      fixed order on every rank, from the same gathered bytes: the same bits whatever MPI's
//      algorithms), and the slice's backward once more with H_p as its final gradient.
// Errors of any step are recorded and agreed on, so every rank returns or every rank throws.

#include <linattn/detail/flush_subnormals.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_prefill.hpp>
#include <linattn/detail/slice_summary.hpp>
#include <linattn/detail/token_inputs.hpp>
#include <linattn/mpi.hpp>
#include <linattn/rule_gradients.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace linattn::detail {

/// The affine summary of one slice (tokens > 0) packed as `layout` says: B, b from the slice
/// run from a zero state; A from the gates' sums (Decay, Gated) or the slice run from the
/// identity with zero values (the delta rules: A = prod_t alpha_t (I - beta_t kf_t kf_t^T), or
/// prod_t (I - beta_t kf_t kf_t^T) diag(alpha_t) for per-channel log_alpha).
/// O(T r dv), plus O(T r^2) for the delta rules.
template <class Phi, class Rule, class Scalar, class MQ, class MK, class MV, class... In>
void rule_slice_summary(const RuleAttention<Phi, Rule, Scalar>& attn, const MQ& Q, const MK& K,
                        const MV& V, const TokenInputs<Scalar>& bound, const SummaryLayout& layout,
                        Scalar* out, const In&... in) {
  const SummaryRef<Scalar> s{out, layout};
  const Index dk = K.cols(), dv = V.cols(), r = layout.r;
  auto state = attn.make_state(dk, dv);
  static_cast<void>(attn.prefill(state, Q, K, V, in...));
  s.B() = state.S();
  if constexpr (Rule::keeps_normalizer) s.b() = state.z();
  if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta) {
    const FlushSubnormalsScope flush;  // A's entries fall through the subnormal range
    auto identity = attn.make_state(dk, r);
    identity.assign(RowMatrix<Scalar>::Identity(r, r));
    static_cast<void>(attn.prefill(identity, Q, K, RowMatrix<Scalar>::Zero(K.rows(), r), in...));
    s.A() = identity.S();
  } else if constexpr (Rule::kind == WriteKind::gated) {
    slice_decay(bound.log_gate, K.rows(), bound.log_gate.cols, true, 0.0, s.a());
  } else {
    slice_decay(bound.log_gate, K.rows(), 1, false, static_cast<double>(bound.constant_log_gate),
                s.a());
  }
}

/// What both sequence-parallel backwards (the additive one of mpi_gradients.hpp and
/// mpi_rule_backward below) know after their first step, the same on every rank.
template <class Scalar>
struct BackwardStart {
  std::vector<Index> lengths;          // every rank's slice length
  Index offset = 0;                    // tokens before this rank's slice, the initial state's included
  std::vector<Scalar> initial;         // S0 (r x dv, row-major), then z0 where the rule keeps it
  std::vector<Scalar> final_gradient;  // dS_T, then dz_T likewise (zero where not given)
};

/// Step 1 of both backwards: check this rank's inputs (check_inputs() throws for its own; the
/// initial state on rank 0 and the final state's gradient on the last rank are checked here),
/// agree on them and on the configuration (every rank throws the same error otherwise), then
/// broadcast the initial state from rank 0 and the final state's gradient from the last rank:
/// 2 (r dv + r) scalars, or 2 r dv where the rule keeps no z. `call` tells the backwards apart
/// in the configuration record.
template <bool keeps_z, class Attention, class State, class Scalar, class CheckInputs>
BackwardStart<Scalar> start_backward(MPI_Comm comm, int rank, int P, const Attention& attn,
                                     const State& initial_state, Index dk, Index dv, Index T,
                                     std::int32_t call,
                                     const StateGradient<Scalar>* final_gradient,
                                     CheckInputs&& check_inputs) {
  const Index r = attn.feature_map().feature_dim(dk);
  RankRecord mine;
  describe_attention(attn, dk, dv, mine.config);
  mine.config.call = call;
  mine.tokens = T;
  try {
    check_inputs();
    if (rank == 0) {
      initial_state.check_shape(r, dk, dv);
      initial_state.check_identity(attn.state_identity());
      mine.initial_tokens = initial_state.tokens();
    }
    if (rank == P - 1) check_final_gradient(final_gradient, r, dv, keeps_z);
  } catch (...) {
    record_failure(mine);
  }
  const auto records = gather_records(comm, mine, P);
  if (auto failure = first_failure(records)) mpi::detail::raise(*failure);
  if (auto mismatch = first_disagreement(records)) mpi::detail::raise(*mismatch);

  BackwardStart<Scalar> start;
  start.lengths.assign(std::size_t(P), 0);
  start.offset = records[0].initial_tokens;
  for (int q = 0; q < P; ++q) {
    start.lengths[std::size_t(q)] = records[std::size_t(q)].tokens;
    if (q < rank) start.offset += start.lengths[std::size_t(q)];
  }
  const Index z_length = keeps_z ? r : 0, per_state = r * dv + z_length;
  const int count = mpi_count(per_state, "a state");
  start.initial.assign(std::size_t(per_state), Scalar(0));
  start.final_gradient.assign(std::size_t(per_state), Scalar(0));
  if (rank == 0) {
    Eigen::Map<RowMatrix<Scalar>>(start.initial.data(), r, dv) = initial_state.S();
    if constexpr (keeps_z)
      Eigen::Map<ColVector<Scalar>>(start.initial.data() + r * dv, r) = initial_state.z();
  }
  if (rank == P - 1 && final_gradient != nullptr) {
    Eigen::Map<RowMatrix<Scalar>>(start.final_gradient.data(), r, dv) = final_gradient->S;
    Eigen::Map<ColVector<Scalar>>(start.final_gradient.data() + r * dv, z_length) =
        final_gradient->z;
  }
  check_mpi(MPI_Bcast(start.initial.data(), count, mpi_type<Scalar>(), 0, comm),
            "MPI_Bcast (initial state)");
  check_mpi(MPI_Bcast(start.final_gradient.data(), count, mpi_type<Scalar>(), P - 1, comm),
            "MPI_Bcast (final-state gradient)");
  return start;
}

template <class Phi, class Rule, class Scalar, class MQ, class MK, class MV, class MY,
          class... In>
RuleGradients<Scalar> mpi_rule_backward(MPI_Comm comm, const RuleAttention<Phi, Rule, Scalar>& attn,
                                        const RuleState<Rule, Scalar>& initial_state, const MQ& Q,
                                        const MK& K, const MV& V, const MY& dY,
                                        const StateGradient<Scalar>* final_gradient,
                                        const In&... in) {
  int rank = 0, P = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &P), "MPI_Comm_size");
  const Index dk = K.cols(), dv = V.cols(), T = K.rows();
  const Index r = attn.feature_map().feature_dim(dk);
  const SummaryLayout layout = SummaryLayout::of<Rule>(r, dv);
  const Index per_state = layout.a_offset(), m = layout.scalars();
  const auto agree = [&](const RankRecord& record) {
    const auto records = gather_records(comm, record, P);
    if (auto failure = first_failure(records)) mpi::detail::raise(*failure);
    return records;
  };
  TokenInputs<Scalar> bound;
  // 1. Check this rank's inputs, agree, broadcast the initial state and the final gradient.
  BackwardStart<Scalar> begun = start_backward<Rule::keeps_normalizer>(
      comm, rank, P, attn, initial_state, dk, dv, T, 4, final_gradient,
      [&] {
        check_backward_shapes(Q, K, V, dY, Mask::causal);
        bind_token_inputs<Scalar>(attn.rule(), std::forward_as_tuple(in...), T, r, bound);
      });
  const std::vector<Index>& lengths = begun.lengths;
  const Index offset = begun.offset;
  std::vector<Scalar>& initial = begun.initial;
  std::vector<Scalar>& H = begun.final_gradient;
  const int state_count = mpi_count(per_state, "a state");
  const int summary_count = mpi_count(m, "a slice summary");
  const auto S_of = [&](std::vector<Scalar>& x) { return Eigen::Map<RowMatrix<Scalar>>(x.data(), r, dv); };
  const auto z_of = [&](std::vector<Scalar>& x) {
    return Eigen::Map<ColVector<Scalar>>(x.data() + r * dv, Rule::keeps_normalizer ? r : 0);
  };

  // 2. The slices' summaries, gathered; the carried state composed in rank order.
  const auto& Qm = materialize(Q);
  const auto& Km = materialize(K);
  const auto& Vm = materialize(V);
  const auto& dYm = materialize(dY);
  std::vector<Scalar> summary(std::size_t(m), Scalar(0)), all(std::size_t(m) * std::size_t(P));
  RankRecord late;
  try {
    if (T > 0) rule_slice_summary(attn, Qm, Km, Vm, bound, layout, summary.data(), in...);
  } catch (...) {
    record_failure(late);
  }
  agree(late);
  check_mpi(MPI_Allgather(summary.data(), summary_count, mpi_type<Scalar>(), all.data(),
                          summary_count, mpi_type<Scalar>(), comm),
            "MPI_Allgather (slice summaries)");
  CarryScan<Scalar> scan(layout);
  scan.start(S_of(initial), z_of(initial), false);
  for (int q = 0; q < rank; ++q) scan.advance(all.data() + std::size_t(q) * std::size_t(m), lengths[std::size_t(q)]);

  // 3. This slice's backward from its carried state with no gradient after it.
  auto start = attn.make_state(dk, dv);
  RuleGradients<Scalar> grads;
  RankRecord late2;
  try {
    if constexpr (Rule::keeps_normalizer)
      start.assign(scan.S(), scan.z(), offset);
    else
      start.assign(scan.S(), offset);
    if (T > 0) grads = linattn::prefill_backward(attn, start, Qm, Km, Vm, in..., dYm);
  } catch (...) {
    record_failure(late2);
  }
  agree(late2);
  std::vector<Scalar> local(std::size_t(per_state), Scalar(0)), locals(std::size_t(per_state) * std::size_t(P));
  if (T > 0) {
    S_of(local) = grads.initial.S;
    z_of(local) = grads.initial.z;
  }
  check_mpi(MPI_Allgather(local.data(), state_count, mpi_type<Scalar>(), locals.data(), state_count,
                          mpi_type<Scalar>(), comm),
            "MPI_Allgather (state gradients)");

  // 4. The reverse scan, then the slice's backward with H as the gradient after it.
  RowMatrix<Scalar> H_S = S_of(H), scratch(r, dv);
  ColVector<Scalar> H_z = z_of(H);
  for (int q = P - 1; q > rank; --q) {
    if (lengths[std::size_t(q)] == 0) continue;  // an empty slice: A = I and L = 0
    carry_back(all.data() + std::size_t(q) * std::size_t(m), layout, H_S, H_z, scratch);
    const Scalar* L = locals.data() + std::size_t(q) * std::size_t(per_state);
    H_S += Eigen::Map<const RowMatrix<Scalar>>(L, r, dv);
    H_z += Eigen::Map<const ColVector<Scalar>>(L + r * dv, H_z.size());
  }
  const StateGradient<Scalar> after{H_S, H_z};
  RankRecord late3;
  if (T == 0) {
    grads.Q.resize(0, dk);
    grads.K.resize(0, dk);
    grads.V.resize(0, dv);
    grads.initial = after;
    if constexpr (Rule::kind == WriteKind::gated) grads.inputs.log_gate.resize(0, bound.log_gate.cols);
    if constexpr (Rule::kind == WriteKind::gated_delta)
      grads.inputs.log_alpha.resize(0, std::max<Index>(bound.log_alpha.cols, 1));
  } else {
    try {
      if ((H_S.array() != Scalar(0)).any() || (H_z.array() != Scalar(0)).any())
        grads = linattn::prefill_backward(attn, start, Qm, Km, Vm, in..., dYm, &after);
    } catch (...) {
      record_failure(late3);
    }
  }
  agree(late3);
  return grads;
}

}  // namespace linattn::detail
