#pragma once
/// \file mpi_gradients.hpp
/// mpi::prefill_backward: the gradients of a sequence-parallel causal prefill of the additive
/// rule (LinearAttention), one head, each rank holding a contiguous slice of the sequence
/// (CMake target linattn::mpi), and of the write rules (Decay, Gated, Delta, GatedDelta: the
/// second overload, with their per-token inputs' gradients).
///
/// Math (gradients.hpp; REFERENCES.md sections 7 and 8). With rank p's slice of T_p tokens,
/// kf_t = phi(k_t), v'_t = [v_t, 1], the state gradient H flowing into the state after the
/// slice, and the single-process backward of the slice from its carried state C_p:
///   dS_before = L_p + H,   L_p = sum_t phi(q_t) G_t^T  (independent of H),
///   dV_t += H_S^T kf_t,    d kf_t += [H_S, H_z] v'_t   (the only terms of dQ, dK, dV in H).
/// So every rank runs its slice's backward with H = 0 at once, the ranks exchange L_p, and each
/// rank forms its own H_p = dS_final + sum_{q > p} L_q (a reverse scan, composed in the fixed
/// order q = P-1 down to p + 1 on every rank from the same gathered bytes: the same P and
/// slices give the same bits, whatever MPI's algorithms) and adds the terms above. The carried
/// states C_p come the same way from the slices' sums S_q = kf^T V_q, z_q = kf^T 1, composed in
/// rank order: C_p = S_init + S_0 + ... + S_{p-1}.
///
/// Cost per rank: the single-process backward of T_p tokens, plus 2 T_p r dv flops for S_p and
/// 4 T_p r dv for the H terms and the feature map's chain rule once more; two gathers of
/// (r dv + r) scalars (slice sums and L_p) and two records, two broadcasts of r dv + r scalars
/// (the initial state from rank 0, the final-state gradient from the last rank): independent
/// of T.
///
/// Errors: as SequenceParallel (linattn/mpi.hpp): every rank returns, or every rank throws the
/// same exception (naming the rank whose input was wrong); ranks that disagree on the
/// attention or dims throw mpi::RankMismatchError.

#include <linattn/attention.hpp>
#include <linattn/detail/bytes.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/mpi_backward_pipeline.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_prefill.hpp>
#include <linattn/detail/mpi_rule_backward.hpp>
#include <linattn/gradients.hpp>
#include <linattn/mpi.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::mpi {

/// Gradients of this rank's slice of Y = attn.prefill(state, Q, K, V) run over the whole
/// sequence split across the ranks of `comm` in rank order (as SequenceParallel splits it),
/// given dY (T_p x dv) for this rank's rows. `initial_state` is the state before the sequence,
/// read on rank 0 (other ranks pass any state of this attention and shape, e.g.
/// attn.make_state(dk, dv)); `final_gradient`, the loss's gradient with respect to the state
/// after the sequence, is read on the last rank (null there: zero). Returns this rank's dQ, dK,
/// dV and, as `initial`, the gradient with respect to the state its slice starts from (on rank
/// 0: with respect to initial_state). Equal to linattn::prefill_backward over the whole sequence
/// to rounding. Collective over `comm`; needs an ordinary, differentiable feature map. Slices
/// may be empty. Complexity in the file comment.
template <class Phi, class Scalar, class DQ, class DK, class DV, class DY>
[[nodiscard]] Gradients<Scalar> prefill_backward(
    MPI_Comm comm, const LinearAttention<Phi, Scalar>& attn,
    const typename LinearAttention<Phi, Scalar>::State& initial_state,
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DY>& dY, const StateGradient<Scalar>* final_gradient = nullptr) {
  static_assert(!LogScaledFeatureMap<Phi, Scalar>,
                "the sequence-parallel backward needs an ordinary feature map: a log-scaled map "
                "(random features) keeps S scaled by a running maximum, which has no summary");
  linattn::detail::require_differentiable<Phi, Scalar>();
  namespace ld = linattn::detail;
  int rank = 0, P = 1;
  ld::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  ld::check_mpi(MPI_Comm_size(comm, &P), "MPI_Comm_size");
  const Index dk = K.cols(), dv = V.cols(), T = K.rows();
  const Index r = attn.feature_map().feature_dim(dk), m = r * dv + r;
  const auto agree = [&](const ld::RankRecord& record) {
    const auto records = ld::gather_records(comm, record, P);
    if (auto failure = ld::first_failure(records)) detail::raise(*failure);
    return records;
  };

  // 1, 2. Check this rank's inputs, agree, broadcast the initial state and the final gradient.
  ld::BackwardStart<Scalar> begun = ld::start_backward<true>(
      comm, rank, P, attn, initial_state, dk, dv, T, 3, final_gradient,
      [&] { ld::check_backward_shapes(Q, K, V, dY, Mask::causal); });
  const Index offset = begun.offset;
  std::vector<Scalar>& initial = begun.initial;
  std::vector<Scalar>& final_grad = begun.final_gradient;
  const int count = ld::mpi_count(m, "a state");

  // 3. The slices' sums, gathered; the carried state composed in rank order.
  const auto& Qm = ld::materialize(Q);
  const auto& Km = ld::materialize(K);
  const auto& Vm = ld::materialize(V);
  const auto& dYm = ld::materialize(dY);
  RowMatrix<Scalar> kf(T, r);
  std::vector<Scalar> sums(static_cast<std::size_t>(m)), all(static_cast<std::size_t>(m * P));
  if (T > 0) {  // (Eigen's column sums of an empty matrix offset a null pointer)
    Eigen::Ref<RowMatrix<Scalar>> f(kf);
    attn.feature_map().apply(Km, f);
    // `sums` is a fresh vector whose address differs between calls; Eigen's vectorized loops
    // start at its first aligned element, so the product goes through product_into and the
    // column sums (summed as a tree within packets, in order one by one) into a vector of
    // Eigen's own alignment first: the same bits wherever `sums` lies.
    ld::product_into<false>(Eigen::Map<RowMatrix<Scalar>>(sums.data(), r, dv), kf.transpose(), Vm);
    const ColVector<Scalar> key_sums = kf.colwise().sum().transpose();
    Eigen::Map<ColVector<Scalar>>(sums.data() + r * dv, r) = key_sums;
  } else {
    std::fill(sums.begin(), sums.end(), Scalar(0));
  }
  ld::check_mpi(MPI_Allgather(sums.data(), count, ld::mpi_type<Scalar>(), all.data(), count,
                              ld::mpi_type<Scalar>(), comm),
                "MPI_Allgather (slice sums)");
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> carried(initial.data(), m);
  for (int q = 0; q < rank; ++q)
    carried += Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(all.data() + q * m, m);

  // 4. This slice's backward from its carried state with no gradient after it.
  Gradients<Scalar> grads;
  ld::RankRecord late;
  try {
    auto start = attn.make_state(dk, dv);
    start.assign(Eigen::Map<const RowMatrix<Scalar>>(initial.data(), r, dv),
                 Eigen::Map<const ColVector<Scalar>>(initial.data() + r * dv, r), offset);
    grads = linattn::prefill_backward(attn, start, Qm, Km, Vm, dYm);
  } catch (...) {
    ld::record_failure(late);
  }
  agree(late);

  // 5. The reverse scan: H = dS_final + L_{P-1} + ... + L_{p+1}, then H's terms.
  Eigen::Map<RowMatrix<Scalar>>(sums.data(), r, dv) = grads.initial.S;
  Eigen::Map<ColVector<Scalar>>(sums.data() + r * dv, r) = grads.initial.z;
  ld::check_mpi(MPI_Allgather(sums.data(), count, ld::mpi_type<Scalar>(), all.data(), count,
                              ld::mpi_type<Scalar>(), comm),
                "MPI_Allgather (state gradients)");
  Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> H(final_grad.data(), m);
  for (int q = P - 1; q > rank; --q)
    H += Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(all.data() + q * m, m);
  const Eigen::Map<const RowMatrix<Scalar>> H_S(final_grad.data(), r, dv);
  const Eigen::Map<const RowVector<Scalar>> H_z(final_grad.data() + r * dv, r);
  if (T > 0 && (H != Scalar(0)).any()) {
    grads.V.noalias() += kf * H_S;
    RowMatrix<Scalar> d_features = Vm * H_S.transpose();
    d_features.rowwise() += H_z;
    RowMatrix<Scalar> d_keys(T, dk);
    Eigen::Ref<RowMatrix<Scalar>> d_x(d_keys);
    attn.feature_map().backward(Km, kf, d_features, d_x);
    grads.K += d_keys;
  }
  grads.initial.S += H_S;
  grads.initial.z += H_z.transpose();
  return grads;
}

/// mpi::prefill_backward(comm, attn, initial_state, Q, K, V, inputs..., dY[, final_gradient]):
/// the write rules' (Decay, Gated, Delta, GatedDelta) gradients of this rank's slice of
/// Y = attn.prefill(state, Q, K, V, inputs...) run over the whole sequence split across the
/// ranks of `comm` in rank order; inputs... are this rank's rows of the rule's per-token inputs
/// (as linattn::prefill_backward takes them). initial_state is read on rank 0, final_gradient
/// (a const StateGradient*, null or omitted: zero) on the last rank. Returns this rank's dQ, dK,
/// dV, the inputs' gradients and, as `initial`, the gradient with respect to the state its slice
/// starts from. Equal to linattn::prefill_backward over the whole sequence to rounding; the same
/// P and slices give the same bits. Collective; slices may be empty.
///
/// Math: each slice maps the state affinely, S -> A_p S + B_p (detail/slice_summary.hpp: A_p =
/// gamma^T_p, diag(exp(sum log g)), or prod alpha_t (I - beta_t kf_t kf_t^T)), so the gradient
/// flowing into slice p's initial state is A_p^T H_p + L_p, with H_p the gradient after the
/// slice and L_p the slice's own part (its backward with no gradient after it). The ranks
/// gather (A_q, B_q) for the carried states, then L_q, and each forms
/// H_p = A_{p+1}^T (... (A_{P-1}^T dS_final + L_{P-1}) ...) + L_{p+1} in the fixed order
/// q = P-1 down to p+1, then runs its slice's backward with H_p after it.
/// Cost per rank: two single-process backwards of T_p tokens and one forward (plus, for the
/// delta rules, a forward with r value columns for A_p: O(T_p r^2)); gathers of one summary
/// (r dv + r + |A|) and one state gradient per rank: independent of T.
template <class Phi, linattn::detail::GradientRule Rule, class Scalar, class DQ, class DK,
          class DV, class... Args>
  requires(sizeof...(Args) == Rule::token_inputs + 1 || sizeof...(Args) == Rule::token_inputs + 2)
[[nodiscard]] RuleGradients<Scalar> prefill_backward(
    MPI_Comm comm, const RuleAttention<Phi, Rule, Scalar>& attn,
    const RuleState<Rule, Scalar>& initial_state, const Eigen::MatrixBase<DQ>& Q,
    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, const Args&... args) {
  linattn::detail::require_differentiable<Phi, Scalar>();
  constexpr std::size_t n = Rule::token_inputs;
  const auto all = std::forward_as_tuple(args...);
  const auto& dY = std::get<n>(all);
  const StateGradient<Scalar>* final_gradient = nullptr;
  if constexpr (sizeof...(Args) == n + 2) final_gradient = std::get<n + 1>(all);
  return linattn::detail::with_first<n>(all, [&](const auto&... in) {
    return linattn::detail::mpi_rule_backward(comm, attn, initial_state, Q, K, V, dY,
                                              final_gradient, in...);
  });
}

/// mpi::prefill_backward_into(comm, layer, state, Q, K, V, in..., dY, final_gradients, grads,
/// d_in..., initial_gradients[, layout[, slots]][, schedule][, workspace]): the multi-head
/// layer's backward of a sequence-parallel prefill (every rule;
/// SequenceParallel<MultiHeadAttention>::prefill_into with the same layout and slots), each rank
/// holding its slice of the tokens as [B, T_p, H, d]
/// views (T_p may differ between ranks and be 0). The gradients of this rank's rows go into
/// `grads` and d_in... (as multihead_gradients.hpp's prefill_backward_into). `state` (the states
/// before the sequences) is read on rank 0, `final_gradients` (null: zero) on the last rank;
/// other ranks pass the layer's make_state(B) (or any batch state of its shape) and null.
/// `layout` (default batch()) describes the whole sequence, rows [0, T) with T = T_0 + ... +
/// T_{P-1}, as SequenceParallel's prefill_into takes it; sequence i's states and state
/// gradients are at position slots[i] (or i).
/// - batch(): for every sequence b and state head h, initial_gradients.head(b, h) receives on
///   every rank the gradient with respect to the state this rank's slice starts from (rank 0:
///   the initial states').
/// - packed(offsets), padded(lengths): rank 0's initial_gradients receives the initial states'
///   gradients (at the slots' positions); the other ranks' is scratch (contents unspecified).
///   Padded rows get zero gradients and are never read.
/// Equal to the single-process layer backward of the whole sequence to rounding; the same P,
/// slices and schedule give the same bits. Collective; the items (one per sequence and query
/// head) run in a fixed order on every rank (no executor: their messages must match).
///
/// `schedule` (every rank the same; default Schedule::automatic):
/// - Schedule::summaries: per item, the single-head distributed backward above (the G heads of
///   a group add their shares of the key/value head's gradients, and of a shared state's: head
///   0 of the group carries the final gradient, by linearity, in head order). Cost per rank:
///   B H_q times a summary and two recomputing backwards of T_p tokens (of its rows of the
///   sequence, for a packed or padded layout); B H_q rounds of collectives.
/// - Schedule::pipeline: two wavefronts over the items (detail/mpi_backward_pipeline.hpp): a
///   saving forward from the state the previous rank of the item sends, then the backward from
///   the saved states with the state gradient the next rank sends. Batch layout: (B H_q + P - 1)
///   slots of one forward and one saved backward of T_p tokens per rank; packed: every rank runs
///   its own documents' heads first where no other rank waits on them. Point-to-point messages
///   of r dv + r scalars per item and direction (and, for a packed or padded layout, an item's
///   initial state from rank 0, final gradient from the last rank and initial gradient to rank
///   0 where they are elsewhere); memory for the saved forwards of this rank's rows.
/// - Schedule::automatic: the batch layout: the pipeline where the cost model
///   (detail::backward_costs) says its slots take less time (on 2 ranks: from 2 items; Decay
///   and Gated from 1), else the summaries; a packed or padded layout: the pipeline.
/// - Schedule::hybrid: std::invalid_argument (the backward has none), on every rank.
/// `workspace` (a BackwardWorkspace<Scalar>*, null: the call's own): the pipeline's buffers kept
/// across calls (the single-head backwards' scratch, the saved forwards of the items that cross
/// ranks, the messages), as a training loop keeps one per layer; the same bits with or without
/// it. The summaries schedule's per-item collectives do not use it.
/// Throws as the single-process backward, on every rank (naming the rank whose input was
/// wrong); ranks that disagree on the layer, dims, heads, layout or schedule throw
/// RankMismatchError; the gradient views' contents are then unspecified.
template <class Attention, class... Args>
void prefill_backward_into(
    MPI_Comm comm, const MultiHeadAttention<Attention>& layer,
    const BatchState<typename Attention::State>& state,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> Q,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> K,
    std::type_identity_t<TensorView<const typename Attention::scalar_type>> V, Args&&... args) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  namespace ld = linattn::detail;
  constexpr std::size_t N = Rule::token_inputs, fixed = 2 * N + 4;
  static_assert(sizeof...(Args) >= fixed && sizeof...(Args) <= fixed + 4,
                "mpi::prefill_backward_into takes comm, the layer, the state, Q, K, V, the rule's "
                "per-token input views, dY, the final states' gradient (or nullptr), the "
                "GradientViews, the per-token inputs' gradient views, the initial states' "
                "gradient and optionally a SequenceLayout, slots, an mpi::Schedule and a "
                "BackwardWorkspace*");
  const auto all = std::forward_as_tuple(args...);
  const auto inputs = ld::token_views<N, Scalar>(all);
  const TensorView<const Scalar> dY = std::get<N>(all);
  const BatchStateGradient<Scalar>* final_gradients = std::get<N + 1>(all);
  const GradientViews<Scalar> grads = std::get<N + 2>(all);
  const auto d_inputs = ld::views_at<N + 3, N, Scalar>(all);
  BatchStateGradient<Scalar>& initial = std::get<2 * N + 3>(all);
  SequenceLayout layout = SequenceLayout::batch();
  std::span<const Index> slots;
  Schedule schedule = Schedule::automatic;
  BackwardWorkspace<Scalar>* workspace = nullptr;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    const auto take = [&]<std::size_t At>(std::integral_constant<std::size_t, At>) {
      using Arg = std::remove_cvref_t<std::tuple_element_t<At, decltype(all)>>;
      if constexpr (std::is_same_v<Arg, SequenceLayout>)
        layout = std::get<At>(all);
      else if constexpr (std::is_same_v<Arg, Schedule>)
        schedule = std::get<At>(all);
      else if constexpr (std::is_same_v<Arg, BackwardWorkspace<Scalar>*>)
        workspace = std::get<At>(all);
      else {
        static_assert(std::is_convertible_v<const Arg&, std::span<const Index>>,
                      "mpi::prefill_backward_into: after the initial states' gradient come a "
                      "SequenceLayout, the slots (a span of Index), an mpi::Schedule and a "
                      "BackwardWorkspace<Scalar>*");
        slots = std::get<At>(all);
      }
    };
    (take(std::integral_constant<std::size_t, fixed + I>{}), ...);
  }(std::make_index_sequence<sizeof...(Args) - fixed>{});
  int rank = 0, P = 1;
  ld::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  ld::check_mpi(MPI_Comm_size(comm, &P), "MPI_Comm_size");
  // Every rank checks its views before any collective and the ranks agree on the outcome, so
  // a view that does not fit on one rank makes every rank throw (naming that rank's shapes).
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim(), B = Q.batches(), S = layout.count(B);
  const bool whole_rows = layout.kind() == SequenceLayout::Kind::batch;
  ld::RankRecord mine;
  ld::describe_attention(layer.attention(), heads.key_dim, heads.value_dim, mine.config);
  mine.config.call = 5;
  mine.config.schedule = static_cast<std::int32_t>(schedule);
  mine.config.sequences = S;
  mine.config.q_heads = heads.q_heads;
  mine.config.kv_heads = heads.kv_heads;
  mine.config.value_heads = heads.v_heads();
  mine.config.layout = static_cast<std::int32_t>(layout.kind());
  mine.config.layout_hash = ld::fnv1a64(std::as_bytes(layout.values()));
  mine.tokens = Q.times();
  try {
    if (schedule == Schedule::hybrid)
      throw std::invalid_argument("linattn::mpi::prefill_backward_into: the backward has no "
                                  "hybrid schedule (automatic, summaries or pipeline)");
    ld::check_views(heads, r, Q, K, V, dY, SequenceLayout::batch(), true);
    layout.check_entries(B);
    for (std::size_t i = 0; i < N; ++i) {
      ld::check_token_view(inputs[i], K, heads.v_heads(), r, ld::per_channel_input<Rule>(i));
      ld::check_gradient_view("of a per-token input", d_inputs[i], inputs[i]);
    }
    ld::check_gradient_view("dQ", grads.Q, Q);
    ld::check_gradient_view("dK", grads.K, K);
    ld::check_gradient_view("dV", grads.V, V);
    ld::check_slots(state, layer, S, slots);
    initial.check_like(state, "the initial states' gradient");
    if (rank == P - 1 && final_gradients != nullptr) {
      final_gradients->check_like(state, "the final states' gradient");
      mine.final_gradients = 1;
    }
    if (rank == 0)  // whether the initial states need messages (see detail::BackwardEnds)
      for (Index s = 0; s < S; ++s)
        for (Index h = 0; h < state.heads(); ++h)
          ld::note_initial_state<Rule>(
              mine, state.sequence(slots.empty() ? s : slots[std::size_t(s)]).head(h),
              s == 0 && h == 0);
  } catch (...) {
    ld::record_failure(mine);
  }
  const auto records = ld::gather_records(comm, mine, P);
  if (auto failure = ld::first_failure(records)) detail::raise(*failure);
  if (auto mismatch = ld::first_disagreement(records)) detail::raise(*mismatch);
  std::vector<Index> lengths(std::size_t(P), 0);
  Index total = 0;
  for (int q = 0; q < P; ++q) total += lengths[std::size_t(q)] = records[std::size_t(q)].tokens;
  layout.check(B, total);  // agreed layout and lengths: the same verdict on every rank
  const auto items = ld::backward_items(layout, B, heads.out_heads(), slots, lengths, rank);
  // An item's head is an output head: member j of key head g (detail::HeadMap).
  const ld::HeadMap map(heads, MultiHeadAttention<Attention>::shares_states);
  const Index members = map.members(), T = Q.times();
  if (layout.kind() == SequenceLayout::Kind::padded)  // this rank's padded rows: zero
    for (const auto& it : items) {
      const Index end = it.first + it.rows, g = it.head / members, j = it.head % members;
      if (map.first_of_query(j))
        ld::zero_rows(grads.Q.slice(it.entry, end, T - end, map.member_query(g, j), 1));
      if (j == 0) ld::zero_rows(grads.K.slice(it.entry, end, T - end, g, 1));
      if (map.first_of_value(j)) {
        const Index vh = map.member_value(g, j);
        ld::zero_rows(grads.V.slice(it.entry, end, T - end, vh, 1));
        for (std::size_t i = 0; i < N; ++i)
          ld::zero_rows(d_inputs[i].slice(it.entry, end, T - end, vh, 1));
      }
    }
  if (schedule == Schedule::pipeline ||
      (schedule == Schedule::automatic &&
       (!whole_rows ||
        ld::backward_pipeline_pays(Index(items.size()), P, ld::backward_costs<Rule>())))) {
    const ld::BackwardEnds ends{records.front().initial_nonzero == 0, records.front().initial_tokens,
                                records.back().final_gradients != 0};
    BackwardWorkspace<Scalar> call_only;
    if (auto failure = ld::run_backward_pipeline(
            comm, rank, P, layer, items, whole_rows, ends, state, Q, K, V, inputs, dY,
            final_gradients, grads, d_inputs, initial, workspace != nullptr ? *workspace : call_only))
      detail::raise(*failure);
    return;
  }
  const auto& attn = layer.attention();
  for (const auto& it : items) {
    const Index g = it.head / members, j = it.head % members, sh = map.member_state(g, j);
    const Index qh = map.member_query(g, j), vh = map.member_value(g, j);
    const Index t0 = it.first, n = it.rows;
    const StateGradient<Scalar>* fin =
        rank == P - 1 && final_gradients != nullptr && map.first_of_state(j)
            ? &final_gradients->head(it.position, sh)
            : nullptr;
    const auto& start = state.sequence(it.position).head(sh);
    const auto q = Q.head_rows(it.entry, qh, t0, n);
    const auto k = K.head_rows(it.entry, g, t0, n);
    const auto v = V.head_rows(it.entry, vh, t0, n);
    const auto dy = dY.head_rows(it.entry, it.head, t0, n);
    const auto got = std::apply(
        [&](const auto&... x) { return prefill_backward(comm, attn, start, q, k, v, x..., dy, fin); },
        ld::rows_inputs(inputs, it.entry, vh, t0, n));
    ld::write_or_add(map.first_of_query(j), grads.Q.head_rows(it.entry, qh, t0, n), got.Q);
    if (whole_rows || rank == 0)
      ld::add_state_share(map.first_of_state(j), initial.head(it.position, sh), got.initial.S,
                          got.initial.z);
    if constexpr (N > 0)
      ld::add_key_value_share<Rule>(j == 0, map.first_of_value(j), grads.K, grads.V, d_inputs,
                                    it.entry, g, vh, t0, n, got.K, got.V, got.inputs);
    else  // the additive backward's result has no per-token inputs
      ld::add_key_value_share<Rule>(j == 0, map.first_of_value(j), grads.K, grads.V, d_inputs,
                                    it.entry, g, vh, t0, n, got.K, got.V,
                                    RuleInputGradients<Scalar>{});
  }
}

}  // namespace linattn::mpi
