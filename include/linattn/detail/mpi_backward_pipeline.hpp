#pragma once
// The pipeline schedule of the multi-head layer's sequence-parallel backward
// (linattn/mpi_gradients.hpp's mpi::prefill_backward_into with mpi::Schedule::pipeline, or
// automatic where the cost model below picks it). An item is one query head h of one sequence
// b; the items run in the order (b, h) on every rank, in two wavefronts:
//   1. forward: rank p takes item i's state before its slice from rank p-1 (rank 0: the
//      call's initial state), runs its slice as a saving forward from it (saved_forward.hpp,
//      rule_saved_forward.hpp: the same bits as the layer's own prefill, keeping the chunk
//      states) and sends the state after its slice on to rank p+1;
//   2. backward: rank p takes H, the gradient with respect to the state after its slice of
//      item i, from rank p+1 (the last rank: the final states' gradient, or zero), runs the
//      slice's backward from its saved forward with H after it, and sends the gradient with
//      respect to the state before its slice back to rank p-1 (rank 0 keeps it: the initial
//      states' gradient).
// Each rank runs every item's forward and backward once: time ~ (n + P - 1) slots of one
// forward and one saved backward of T_p tokens, against the summaries schedule's n times a
// summary forward and two recomputing backwards (each a forward and a sweep). The saved
// forwards of all n items are kept between the wavefronts: n times the single-head saved
// forward of T_p tokens (rule_saved_forward.hpp and saved_forward.hpp give the bytes).
//
// Errors: as the forward's pipeline (mpi_pipeline.hpp): a rank that fails on an item, or hears
// of a failure, sends every later message with a 'failed' status and computes nothing more;
// the ranks agree after each wavefront and all throw the lowest failing rank's error. The
// gradient views' contents are then unspecified (the states are not touched: the backward
// writes none). The same P and slices give the same bits: states and gradients travel as exact
// copies and each rank runs its items in order.
//
// Messages: CarryMessage's layout (header: status, token count; then S, r x dv row-major, and
// z where the rule keeps it), for states (tag kBackwardStateTag, rank p-1 to p) and state
// gradients (kStateGradientTag, rank p+1 to p).

#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_pipeline.hpp>
#include <linattn/detail/multihead_backward.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace linattn::detail {

inline constexpr int kBackwardStateTag = 0x4c43;  // the state after a slice, to rank p+1
inline constexpr int kStateGradientTag = 0x4c44;  // the gradient before a slice, to rank p-1

/// Time per item of the layer's sequence-parallel backward, in forwards of one slice (the
/// single-process ratios measured on the Zen 3 and Zen 5 VMs, docs/gradients.md): the summaries
/// schedule runs a summary (a forward; for the delta rules also one with r value columns for
/// A_p) and two recomputing backwards (about 3 forwards each: 3.4 to 4 for the delta rules), or
/// for the additive rule one and its H terms; the pipeline one forward and one backward from
/// saved states (1.2 to 1.6 forwards; 1.6 to 1.9 for the delta rules).
struct BackwardCosts {
  double summaries = 0;  // per item
  double pipeline = 0;   // per slot: n + P - 1 slots
};

template <class Rule>
constexpr BackwardCosts backward_costs() noexcept {
  if constexpr (Rule::kind == WriteKind::additive)
    return {4.0, 2.4};
  else if constexpr (Rule::kind == WriteKind::delta || Rule::kind == WriteKind::gated_delta)
    return {9.4, 4.7};
  else
    return {7.0, 2.4};
}

/// Whether the pipeline keeps every item's saved forward between its wavefronts (Additive,
/// Decay, Gated), or only the state before each slice and rebuilds the forward data in the
/// backward (Delta, GatedDelta: their saved forward, 5 KiB per token at d = 128 in float,
/// comes back from memory slower than the backward rebuilds it; measured on the Zen 5 VM,
/// docs/distributed.md).
template <class Rule>
constexpr bool keeps_saved_forward() noexcept {
  return Rule::kind != WriteKind::delta && Rule::kind != WriteKind::gated_delta;
}

/// Whether Schedule::automatic runs the pipeline for `items` items over P ranks: when its
/// (items + P - 1) slots take less time than the summaries schedule's items.
inline bool backward_pipeline_pays(Index items, int P, const BackwardCosts& c) noexcept {
  return items > 0 && double(items + P - 1) * c.pipeline < double(items) * c.summaries;
}

/// The pipeline schedule (see the file comment) for the layer's items, on this rank. Returns
/// the failure every rank agreed on, or nothing. `states` (rank 0's: the states before the
/// call), `final_gradients` (the last rank's; null: zero); the gradients go into `grads`,
/// `d_inputs` and `initial` as the layer's prefill_backward_into writes them.
template <class Attention, std::size_t N>
std::optional<Failure> run_backward_pipeline(
    MPI_Comm comm, int rank, int P, const MultiHeadAttention<Attention>& layer,
    const BatchState<typename Attention::State>& states,
    const TensorView<const typename Attention::scalar_type>& Q,
    const TensorView<const typename Attention::scalar_type>& K,
    const TensorView<const typename Attention::scalar_type>& V,
    const std::array<TensorView<const typename Attention::scalar_type>, N>& inputs,
    const TensorView<const typename Attention::scalar_type>& dY,
    const BatchStateGradient<typename Attention::scalar_type>* final_gradients,
    const GradientViews<typename Attention::scalar_type>& grads,
    const std::array<TensorView<typename Attention::scalar_type>, N>& d_inputs,
    BatchStateGradient<typename Attention::scalar_type>& initial) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  using Message = CarryMessage<Scalar, Rule::keeps_normalizer>;
  constexpr bool shared = MultiHeadAttention<Attention>::shares_states;
  const Attention& attn = layer.attention();
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim(), dk = heads.key_dim, dv = heads.value_dim;
  const Index G = layer.group_size(), T = Q.times(), B = Q.batches();
  const Index n = B * heads.q_heads;
  const Message message{r, dv, Rule::keeps_normalizer ? r : 0};
  const Index m = message.scalars();
  const bool first = rank == 0, last = rank == P - 1;
  if (Index(sizeof(Scalar)) * m > Index{2147483647})  // the same verdict on every rank
    return Failure{FailureKind::shape, "linattn::mpi: a carried state of " + std::to_string(m) +
                                           " values is more than one MPI message moves"};
  const auto at = [m](std::vector<Scalar>& buffer, Index i) { return buffer.data() + i * m; };
  // Item i: sequence b = i / H_q, query head h = i % H_q of key/value head g = h / G.
  const auto item = [&](Index i) {
    const Index b = i / heads.q_heads, h = i % heads.q_heads, g = h / G;
    return std::array<Index, 4>{b, h, g, shared ? g : h};
  };
  std::vector<Scalar> incoming(static_cast<std::size_t>(m)), outgoing(static_cast<std::size_t>(n * m));
  std::vector<MPI_Request> requests(static_cast<std::size_t>(n), MPI_REQUEST_NULL);
  // What the backward wavefront starts from: each item's saved forward, or (the delta rules,
  // see keeps_saved_forward) the state before the slice, from which it rebuilds them.
  constexpr bool keep_saved = keeps_saved_forward<Rule>();
  std::vector<SavedForward<Scalar>> saved(keep_saved ? static_cast<std::size_t>(n) : 0);
  std::vector<Scalar> starts(keep_saved ? 0 : static_cast<std::size_t>(n * m));
  RankRecord late;
  bool failed = false;
  const auto wait_and_agree = [&]() -> std::optional<Failure> {
    check_mpi(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
              "MPI_Waitall (backward pipeline)");
    return first_failure(gather_records(comm, late, P));
  };
  // Receives one message from `source` into `incoming`; false where it says 'failed'.
  const auto receive = [&](int source, int tag) {
    MPI_Status status;
    check_mpi(MPI_Recv(incoming.data(), message.bytes(true), MPI_BYTE, source, tag, comm, &status),
              "MPI_Recv (backward pipeline)");
    return Message::status(incoming.data()) == 0;
  };
  const auto send = [&](Index i, bool ok, std::int64_t tokens, int dest, int tag) {
    Scalar* out = at(outgoing, i);
    Message::set_header(out, ok ? 0 : 1, tokens);
    check_mpi(MPI_Isend(out, message.bytes(ok), MPI_BYTE, dest, tag, comm, &requests[std::size_t(i)]),
              "MPI_Isend (backward pipeline)");
  };

  // 1. The forward wavefront.
  {
    RowMatrix<Scalar> discarded(T, dv);  // the forward's outputs: the caller has them
    auto state = attn.make_state(dk, dv);
    for (Index i = 0; i < n; ++i) {
      const auto it = item(i);
      const Index b = it[0], h = it[1], g = it[2], sh = it[3];
      std::int64_t tokens = 0;
      bool ok = !failed;
      if (first) {
        const auto& start = states.sequence(b).head(sh);
        tokens = start.tokens();
        Message::set_header(incoming.data(), 0, tokens);
        if (ok) message.pack(start, incoming.data());
      } else {
        ok = receive(rank - 1, kBackwardStateTag) && ok;
        tokens = Message::tokens(incoming.data());
      }
      Scalar* out = at(outgoing, i);
      if (ok) {
        try {
          state.assign(message.S(incoming.data()), message.zmap(incoming.data()), tokens);
          if (T > 0) {
            const auto q = Q.head_rows(b, h, 0, T);
            const auto k = K.head_rows(b, g, 0, T);
            const auto v = V.head_rows(b, g, 0, T);
            std::apply(
                [&](const auto&... x) {
                  if constexpr (keep_saved) {
                    prefill_saving_into(attn, state, q, k, v, x..., discarded, saved[std::size_t(i)]);
                  } else {
                    std::copy(incoming.begin(), incoming.end(), starts.begin() + i * m);
                    attn.prefill_into(state, q, k, v, x..., discarded);
                  }
                },
                rows_inputs(inputs, b, g, 0, T));
          }
          message.pack(state, out);
          if (!Eigen::Map<const ColVector<Scalar>>(out + Message::header, m - Message::header)
                   .allFinite())
            throw std::domain_error("linattn::mpi: the state after the slice is not finite "
                                    "(an input held Inf or NaN, or the sums overflowed)");
        } catch (...) {
          record_failure(late);
          ok = false;
        }
      }
      failed = !ok;
      if (!last) send(i, ok, tokens + T, rank + 1, kBackwardStateTag);
    }
    if (auto failure = wait_and_agree()) return failure;
  }

  // 2. The backward wavefront.
  std::fill(requests.begin(), requests.end(), MPI_REQUEST_NULL);
  RowMatrix<Scalar> dQ_head(T, dk), dK_head(T, dk), dV_head(T, dv);
  RuleInputGradients<Scalar> d_in_head;
  BackwardWorkspace<Scalar> workspace;  // the delta rules' rebuilt forward data, item to item
  auto start = attn.make_state(dk, dv);
  StateGradient<Scalar> after{RowMatrix<Scalar>::Zero(r, dv), ColVector<Scalar>::Zero(message.z)};
  StateGradient<Scalar> before = after;
  for (Index i = 0; i < n; ++i) {
    const auto it = item(i);
    const Index b = it[0], h = it[1], g = it[2], sh = it[3];
    const Index j = h % G;
    bool ok = !failed;
    if (last) {
      const bool carries = final_gradients != nullptr && (!shared || j == 0);
      if (carries) {
        after.S = final_gradients->head(b, sh).S;
        after.z = final_gradients->head(b, sh).z;
      } else {
        after.S.setZero();
        after.z.setZero();
      }
    } else {
      ok = receive(rank + 1, kStateGradientTag) && ok;
      if (ok) {
        after.S = message.S(incoming.data());
        after.z = message.zmap(incoming.data());
      }
    }
    if (ok) {
      try {
        if (T > 0) {
          const auto q = Q.head_rows(b, h, 0, T);
          const auto k = K.head_rows(b, g, 0, T);
          const auto v = V.head_rows(b, g, 0, T);
          const auto dy = dY.head_rows(b, h, 0, T);
          GradientsRef<Scalar> out{dQ_head, dK_head, dV_head};
          std::apply(
              [&](const auto&... x) {
                if constexpr (!keep_saved) {
                  const Scalar* msg = starts.data() + i * m;
                  start.assign(message.S(msg), message.zmap(msg), Message::tokens(msg));
                  prefill_backward_into(attn, start, q, k, v, x..., dy, &after, out, d_in_head,
                                        before, &workspace);
                } else if constexpr (Rule::kind == WriteKind::additive) {
                  prefill_backward_into(attn, saved[std::size_t(i)], q, k, v, dy, &after, out, before);
                } else {
                  prefill_backward_into(attn, saved[std::size_t(i)], q, k, v, x..., dy, &after, out,
                                        d_in_head, before);
                }
              },
              rows_inputs(inputs, b, g, 0, T));
          grads.Q.head_rows(b, h, 0, T) = dQ_head;
          add_group_share<Rule>(j, grads.K, grads.V, d_inputs, b, g, 0, T, dK_head, dV_head,
                                d_in_head);
        } else {
          before.S = after.S;
          before.z = after.z;
        }
        StateGradient<Scalar>& d0 = initial.head(b, sh);
        if (j == 0 || !shared) {
          d0.S = before.S;
          d0.z = before.z;
        } else {
          d0.S += before.S;
          if (d0.z.size() > 0) d0.z += before.z;
        }
        Scalar* out = at(outgoing, i);
        Eigen::Map<RowMatrix<Scalar>>(out + Message::header, r, dv) = before.S;
        Eigen::Map<ColVector<Scalar>>(out + Message::header + r * dv, message.z) = before.z;
      } catch (...) {
        record_failure(late);
        ok = false;
      }
    }
    failed = !ok;
    if (!first) send(i, ok, 0, rank - 1, kStateGradientTag);
  }
  return wait_and_agree();
}

}  // namespace linattn::detail
