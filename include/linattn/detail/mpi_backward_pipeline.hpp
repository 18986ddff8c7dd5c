#pragma once
// The pipeline schedule of the multi-head layer's sequence-parallel backward
// (linattn/mpi_gradients.hpp's mpi::prefill_backward_into with mpi::Schedule::pipeline, or
// automatic where the cost model below picks it). An item is one query head h of one sequence;
// the ranks that run it (backward_items: with the batch layout every rank, with a packed or
// padded layout those that hold rows of its sequence) form a chain in rank order, and the items
// run in two wavefronts along their chains:
//   1. forward: a rank takes item i's state before its rows from the rank before it in the
//      chain (the first: the call's initial state, which rank 0 holds and sends where the item
//      starts on another rank), runs its rows as a saving forward from it (saved_forward.hpp,
//      rule_saved_forward.hpp: the same bits as the layer's own prefill, keeping the chunk
//      states) and sends the state after them on to the next rank of the chain;
//   2. backward: a rank takes H, the gradient with respect to the state after its rows of item
//      i, from the next rank of the chain (the last: the final states' gradient, which the last
//      rank of the communicator holds and sends where the item ends on another rank, or zero),
//      runs the rows' backward from the saved forward with H after them, and sends the gradient
//      with respect to the state before them back along the chain. The first rank of the chain
//      keeps it (rank 0) or sends it to rank 0: the initial states' gradients.
// Each rank runs its items in the order wavefront_order gives: first those another rank waits
// for, so that with a packed layout (at most one sequence crosses from one rank's slice into
// the next) every rank works from the start. With the batch layout that is item order. Time
// ~ (n + P - 1) slots of one forward and one saved backward of T_p tokens for the batch layout,
// against the summaries schedule's n times a summary forward and two recomputing backwards
// (each a forward and a sweep); with a packed layout about one rank's share of the documents,
// plus the waits of the crossing documents. The saved forwards of the items that cross ranks are
// kept between the wavefronts (rule_saved_forward.hpp and saved_forward.hpp give the bytes), and
// three messages per such item (its state and gradient in, what it sends), all in the call's
// BackwardWorkspace: a caller that keeps one across calls allocates them once.
//
// Errors: as the forward's pipeline (mpi_pipeline.hpp): a rank that fails on an item, or hears
// of a failure, sends every later message with a 'failed' status and computes nothing more;
// every message is sent and received, the ranks agree after each wavefront and all throw the
// lowest failing rank's error. The gradient views' contents are then unspecified (the states
// are not touched: the backward writes none). The same P and slices give the same bits: states
// and gradients travel as exact copies and each rank runs its items in a fixed order.
//
// Messages: CarryMessage's layout (header: status, token count; then S, r x dv row-major, and
// z where the rule keeps it; a zero state or gradient travels as its header alone), tags
// kBackwardStateTag (a state along the chain), kStateGradientTag (a gradient back along it),
// kBackwardInitialStateTag, kFinalGradientTag and kInitialGradientTag (from rank 0, from the
// last rank, to rank 0). Every pair of ranks sends and receives each tag's messages in item order.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_pipeline.hpp>
#include <linattn/detail/multihead_backward.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
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


/// One item of the layer's sequence-parallel backward (query head `head` of one sequence) as
/// this rank sees it.
struct BackwardItem {
  Index entry = 0;     // the sequence's batch entry in the views
  Index head = 0;      // the output head (a query head, or with grouped values a value head)
  Index position = 0;  // the sequence's position in the states and state gradients (slots)
  Index first = 0, rows = 0;  // this rank's rows of it: [first, first + rows) of `entry`
  bool held = false;          // whether this rank runs it
  int prev = -1, next = -1;   // the ranks that run it before and after this one (-1: none)
  int first_rank = 0, last_rank = 0;  // the first and the last rank that run it
};

/// The call's items, in the order (sequence, output head), for this rank. The batch layout: every
/// rank runs every item over all its rows, chained through all ranks in rank order (a rank with
/// an empty slice passes the state and the gradient on). A packed or padded layout: an item is
/// run by the ranks that hold rows of its sequence, chained in rank order (a sequence with no
/// rows: by rank 0 alone). `lengths` are the ranks' slice lengths (agreed). O(items P).
inline std::vector<BackwardItem> backward_items(const SequenceLayout& layout, Index batches,
                                                Index out_heads, std::span<const Index> slots,
                                                const std::vector<Index>& lengths, int rank) {
  const int P = static_cast<int>(lengths.size());
  std::vector<Index> starts(std::size_t(P) + 1, 0);
  for (int q = 0; q < P; ++q) starts[std::size_t(q) + 1] = starts[std::size_t(q)] + lengths[std::size_t(q)];
  const Index total = starts.back(), sequences = layout.count(batches);
  const bool whole = layout.kind() == SequenceLayout::Kind::batch;
  std::vector<BackwardItem> items;
  items.reserve(std::size_t(sequences * out_heads));
  for (Index s = 0; s < sequences; ++s) {
    BackwardItem item;
    item.entry = layout.batch_entry(s);
    item.position = slots.empty() ? s : slots[std::size_t(s)];
    if (whole) {
      item.rows = lengths[std::size_t(rank)];
      item.held = true;
      item.prev = rank > 0 ? rank - 1 : -1;
      item.next = rank < P - 1 ? rank + 1 : -1;
      item.last_rank = P - 1;
    } else {
      const Index begin = layout.first_row(s), end = begin + layout.length(s, total);
      int first_rank = -1, last_rank = -1, prev = -1, next = -1;
      for (int q = 0; q < P; ++q) {
        const Index lo = std::max(begin, starts[std::size_t(q)]),
                    hi = std::min(end, starts[std::size_t(q) + 1]);
        if (lo >= hi) continue;
        if (first_rank < 0) first_rank = q;
        last_rank = q;
        if (q < rank) prev = q;
        if (q > rank && next < 0) next = q;
        if (q == rank) {
          item.first = lo - starts[std::size_t(q)];
          item.rows = hi - lo;
        }
      }
      if (first_rank < 0) first_rank = last_rank = 0;  // no rows: rank 0 passes the gradient
      item.first_rank = first_rank;
      item.last_rank = last_rank;
      item.held = item.rows > 0 || (first_rank == rank && last_rank == rank);
      if (item.held) {
        item.prev = prev;
        item.next = next;
      }
    }
    for (Index h = 0; h < out_heads; ++h) {
      item.head = h;
      items.push_back(item);
    }
  }
  return items;
}

/// The order in which this rank runs its items in a wavefront: first those whose result
/// another rank waits for (`upstream`: the state sent on in the forward, the gradient sent back
/// in the backward), then those that need no message, then those that wait for one; each group
/// in item order, so that every pair of ranks sends and receives its messages in item order.
inline std::vector<Index> wavefront_order(const std::vector<BackwardItem>& items, bool forward) {
  std::vector<Index> order;
  order.reserve(items.size());
  for (int key = 0; key < 3; ++key)
    for (std::size_t i = 0; i < items.size(); ++i) {
      const BackwardItem& it = items[i];
      if (!it.held) continue;
      const int sends = forward ? it.next : it.prev, waits = forward ? it.prev : it.next;
      if ((sends >= 0 ? 0 : waits < 0 ? 1 : 2) == key) order.push_back(Index(i));
    }
  return order;
}

inline constexpr int kBackwardInitialStateTag = 0x4c45;  // an initial state, rank 0 to an item's first rank
inline constexpr int kFinalGradientTag = 0x4c46;  // a final state's gradient, last rank to an item's last
inline constexpr int kInitialGradientTag = 0x4c47;  // an initial state's gradient, to rank 0

/// What every rank knows about the call's ends (from the gathered records): whether rank 0's
/// initial states are all zero with one token count, and whether the last rank has final states'
/// gradients. Where they are zero, no message carries them.
struct BackwardEnds {
  bool initial_zero = false;
  std::int64_t initial_tokens = 0;  // the token count of the zero initial states
  bool final_gradients = true;
};

/// The pipeline schedule (see the file comment) for the `items` of backward_items, on this
/// rank. Returns the failure every rank agreed on, or nothing. `states` (rank 0's: the states
/// before the call), `final_gradients` (the last rank's; null: zero); the gradients go into
/// `grads` and `d_inputs` (this rank's rows of the items it runs) and into `initial`: where
/// `every_rank_initial`, on every rank the gradient with respect to the state its slice starts
/// from; else on rank 0 the initial states' gradients (another rank adds up there those of the
/// items it runs first, and sends them to rank 0). `workspace` keeps the buffers: the single-head
/// backwards', the saved forwards of the items that cross ranks and the messages.
template <class Attention, std::size_t N>
std::optional<Failure> run_backward_pipeline(
    MPI_Comm comm, int rank, int P, const MultiHeadAttention<Attention>& layer,
    const std::vector<BackwardItem>& items, bool every_rank_initial, const BackwardEnds& ends,
    const BatchState<typename Attention::State>& states,
    const TensorView<const typename Attention::scalar_type>& Q,
    const TensorView<const typename Attention::scalar_type>& K,
    const TensorView<const typename Attention::scalar_type>& V,
    const std::array<TensorView<const typename Attention::scalar_type>, N>& inputs,
    const TensorView<const typename Attention::scalar_type>& dY,
    const BatchStateGradient<typename Attention::scalar_type>* final_gradients,
    const GradientViews<typename Attention::scalar_type>& grads,
    const std::array<TensorView<typename Attention::scalar_type>, N>& d_inputs,
    BatchStateGradient<typename Attention::scalar_type>& initial,
    BackwardWorkspace<typename Attention::scalar_type>& workspace) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  using Message = CarryMessage<Scalar, Rule::keeps_normalizer>;
  const HeadMap map(layer.heads(), MultiHeadAttention<Attention>::shares_states);
  constexpr std::int64_t kOk = 0, kFailed = 1, kZero = 2;  // a message's status
  const Attention& attn = layer.attention();
  const HeadConfig& heads = layer.heads();
  const Index r = layer.feature_dim(), dk = heads.key_dim, dv = heads.value_dim;
  const Index members = map.members(), n = Index(items.size());
  const Message message{r, dv, Rule::keeps_normalizer ? r : 0};
  const Index m = message.scalars();
  if (Index(sizeof(Scalar)) * m > Index{2147483647})  // the same verdict on every rank
    return Failure{FailureKind::shape, "linattn::mpi: a carried state of " + std::to_string(m) +
                                           " values is more than one MPI message moves"};
  const bool first = rank == 0, last = rank == P - 1;
  const auto crossing = [](const BackwardItem& it) { return it.prev >= 0 || it.next >= 0; };
  // Which items travel in messages on this rank: those run on other ranks too, and those whose
  // initial state or final gradient is elsewhere and not zero. Each has a slot of one message in
  // each buffer: the state before this rank's rows (received, or packed here), what this rank
  // sends (the state after them, then the gradient before them), and the gradient after them.
  // Items of this rank alone (a packed layout's documents within a slice) have none: with zero
  // initial states and no final gradients, a call of many documents allocates messages for the
  // few that cross.
  const auto has_slot = [&](const BackwardItem& it) {
    if (it.held)
      return crossing(it) || (it.prev < 0 && !first && !ends.initial_zero) ||
             (it.next < 0 && !last && ends.final_gradients);
    return (first && it.first_rank != 0 && !ends.initial_zero) ||
           (last && it.last_rank != P - 1 && ends.final_gradients);
  };
  std::vector<Index> slot(std::size_t(n), -1);
  Index slots = 0;
  for (Index i = 0; i < n; ++i)
    if (has_slot(items[std::size_t(i)])) slot[std::size_t(i)] = slots++;
  // The three message buffers and one message of scratch, in the workspace (grown, never
  // shrunk; every message is written before it is read, so what an earlier call left there is
  // never read).
  BackwardBuffers<Scalar>& buffers = BackwardWorkspaceAccess::buffers(workspace);
  if (buffers.messages.size() < std::size_t((3 * slots + 1) * m))
    buffers.messages.resize(std::size_t((3 * slots + 1) * m));
  Scalar* const states_in = buffers.messages.data();
  Scalar* const outgoing = states_in + slots * m;
  Scalar* const gradients_in = outgoing + slots * m;
  Scalar* const scratch = gradients_in + slots * m;
  const auto at = [&](Scalar* buffer, Index i) { return buffer + slot[std::size_t(i)] * m; };
  std::vector<MPI_Request> sends;
  sends.reserve(std::size_t(2 * slots));
  // An item's head is an output head: member j = head % members of key head head / members.
  const auto state_head = [&](const BackwardItem& it) {
    return map.member_state(it.head / members, it.head % members);
  };
  // Receives are blocking and made when an item needs its message (pre-posted receives made the
  // batch layout's wavefronts about 10% slower on the Zen 5 VM). Each (source, tag) stream
  // delivers its items in item order, and a rank may run them in another order (its wavefront
  // order), so a receive takes the stream's earlier messages into their own slots first.
  struct Stream {
    int source = 0, tag = 0;
    std::vector<Index> items;  // in item order: the order the source sends them
    std::size_t next = 0;
  };
  std::vector<Stream> streams;  // at most two per wavefront
  std::vector<std::size_t> stream_of(std::size_t(n), 0);
  std::vector<Scalar*> target(std::size_t(n), nullptr);
  std::vector<char> arrived(std::size_t(n), 0);
  const auto expect = [&](Scalar* into, int source, int tag, Index i) {
    std::size_t k = 0;
    while (k < streams.size() && (streams[k].source != source || streams[k].tag != tag)) ++k;
    if (k == streams.size()) streams.push_back({source, tag, {}, 0});
    streams[k].items.push_back(i);
    stream_of[std::size_t(i)] = k;
    target[std::size_t(i)] = into;
    arrived[std::size_t(i)] = 0;
  };
  const auto post_send = [&](Scalar* from, int dest, int tag) {
    sends.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Isend(from, message.bytes(Message::status(from) == kOk), MPI_BYTE, dest, tag,
                        comm, &sends.back()),
              "MPI_Isend (backward pipeline)");
  };
  // Receives item i's message (and the earlier ones of its stream); false where it says
  // 'failed'; a zero message is filled in.
  const auto wait = [&](Index i) {
    Scalar* into = target[std::size_t(i)];
    Stream& stream = streams[stream_of[std::size_t(i)]];
    while (!arrived[std::size_t(i)]) {
      const Index j = stream.items[stream.next++];
      check_mpi(MPI_Recv(target[std::size_t(j)], message.bytes(true), MPI_BYTE, stream.source,
                         stream.tag, comm, MPI_STATUS_IGNORE),
                "MPI_Recv (backward pipeline)");
      arrived[std::size_t(j)] = 1;
    }
    if (Message::status(into) == kZero) message.clear(into);
    return Message::status(into) != kFailed;
  };
  // Packs rank 0's initial state of item `it` into message `to`.
  const auto pack_initial = [&](const BackwardItem& it, Scalar* to) {
    const auto& start = states.sequence(it.position).head(state_head(it));
    Message::set_header(to, kOk, start.tokens());
    message.pack(start, to);
  };
  RankRecord late;
  bool failed = false;
  const auto wait_and_agree = [&]() -> std::optional<Failure> {
    check_mpi(MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE),
              "MPI_Waitall (backward pipeline)");
    sends.clear();
    streams.clear();
    return first_failure(gather_records(comm, late, P));
  };
  // What the backward wavefront starts from: each item's saved forward, or (the delta rules,
  // see keeps_saved_forward, and an item of this rank alone) the state before its rows, from
  // which its backward rebuilds them as a single process does. An item of one rank needs no
  // forward before the backward wavefront; its rows are often a short document, whose rebuilt
  // states stay in cache where saved ones would come back from memory.
  constexpr bool keep_saved = keeps_saved_forward<Rule>();
  const auto saves = [&](const BackwardItem& it) { return keep_saved && crossing(it); };
  // One per message slot (an item that crosses has one), kept in the workspace: a slot whose
  // rows keep their length from call to call reuses its saved forward's memory.
  std::vector<SavedForward<Scalar>>& saved = buffers.crossing_saved;
  if (keep_saved && saved.size() < std::size_t(slots)) saved.resize(std::size_t(slots));
  const auto saved_of = [&](Index i) -> SavedForward<Scalar>& {
    return saved[std::size_t(slot[std::size_t(i)])];
  };
  // The state before item i's rows on this rank, as a message.
  const auto start_message = [&](const BackwardItem& it, Index i) -> const Scalar* {
    if (slot[std::size_t(i)] >= 0) return at(states_in, i);  // received or packed (step 1)
    if (first) {
      pack_initial(it, scratch);
    } else {  // a zero initial state (otherwise it has a slot)
      Message::set_header(scratch, kOk, ends.initial_tokens);
      message.clear(scratch);
    }
    return scratch;
  };

  // 1. The forward wavefront. First the messages each item expects; rank 0 sends the initial
  // states of the items that start on another rank.
  for (Index i = 0; i < n; ++i) {
    const BackwardItem& it = items[std::size_t(i)];
    if (it.held && it.prev >= 0) {
      expect(at(states_in, i), it.prev, kBackwardStateTag, i);
    } else if (it.held && !first && !ends.initial_zero) {
      expect(at(states_in, i), 0, kBackwardInitialStateTag, i);
    } else if (!it.held && first && it.first_rank != 0 && !ends.initial_zero) {
      pack_initial(it, at(states_in, i));
      post_send(at(states_in, i), it.first_rank, kBackwardInitialStateTag);
    }
  }
  {
    auto state = attn.make_state(dk, dv);
    for (const Index i : wavefront_order(items, true)) {
      const BackwardItem& it = items[std::size_t(i)];
      if (slot[std::size_t(i)] < 0) continue;  // its start: at its backward (start_message)
      const Index g = it.head / members, j = it.head % members;
      const Index qh = map.member_query(g, j), vh = map.member_value(g, j);
      Scalar* in = at(states_in, i);
      bool ok = !failed;
      if (it.prev >= 0 || (!first && !ends.initial_zero)) {
        ok = wait(i) && ok;
      } else if (first) {
        pack_initial(it, in);
      } else {
        Message::set_header(in, kOk, ends.initial_tokens);
        message.clear(in);
      }
      const std::int64_t tokens = Message::tokens(in);
      Scalar* out = at(outgoing, i);
      if (ok && crossing(it)) {  // (an item of this rank alone: no forward)
        try {
          state.assign(message.S(in), message.zmap(in), tokens);
          if (it.rows > 0) {
            const auto q = Q.head_rows(it.entry, qh, it.first, it.rows);
            const auto k = K.head_rows(it.entry, g, it.first, it.rows);
            const auto v = V.head_rows(it.entry, vh, it.first, it.rows);
            // The forward's outputs (the caller has them) go into the head gradient rows' room.
            buffers.fit_heads(it.rows, it.rows, dk, dv);
            auto discarded = buffers.head_V.topRows(it.rows);
            std::apply(
                [&](const auto&... x) {
                  if (saves(it))
                    prefill_saving_into(attn, state, q, k, v, x..., discarded, saved_of(i));
                  else
                    attn.prefill_into(state, q, k, v, x..., discarded);
                },
                rows_inputs(inputs, it.entry, vh, it.first, it.rows));
          }
          message.pack(state, out);
          if (!all_finite(
                  Eigen::Map<const ColVector<Scalar>>(out + Message::header, m - Message::header)))
            throw std::domain_error("linattn::mpi: the state after the slice is not finite "
                                    "(an input held Inf or NaN, or the sums overflowed)");
        } catch (...) {
          record_failure(late);
          ok = false;
        }
      }
      failed = !ok;
      if (it.next >= 0) {
        Message::set_header(out, ok ? kOk : kFailed, tokens + it.rows);
        post_send(out, it.next, kBackwardStateTag);
      }
    }
    if (auto failure = wait_and_agree()) return failure;
  }

  // 2. The backward wavefront. First the messages each item expects; the last rank sends the
  // final states' gradients of the items that end on another rank.
  const auto final_of = [&](const BackwardItem& it) -> const StateGradient<Scalar>* {
    if (final_gradients == nullptr || !map.first_of_state(it.head % members)) return nullptr;
    return &final_gradients->head(it.position, state_head(it));
  };
  for (Index i = 0; i < n; ++i) {
    const BackwardItem& it = items[std::size_t(i)];
    if (it.held && it.next >= 0) {
      expect(at(gradients_in, i), it.next, kStateGradientTag, i);
    } else if (it.held && !last && ends.final_gradients) {
      expect(at(gradients_in, i), P - 1, kFinalGradientTag, i);
    } else if (!it.held && last && it.last_rank != P - 1 && ends.final_gradients) {
      Scalar* to = at(gradients_in, i);
      const StateGradient<Scalar>* fin = final_of(it);
      Message::set_header(to, fin != nullptr ? kOk : kZero, 0);
      if (fin != nullptr) {
        Eigen::Map<RowMatrix<Scalar>>(to + Message::header, r, dv) = fin->S;
        Eigen::Map<ColVector<Scalar>>(to + Message::header + r * dv, message.z) = fin->z;
      }
      post_send(to, it.last_rank, kFinalGradientTag);
    }
  }
  auto start = attn.make_state(dk, dv);
  StateGradient<Scalar> after{RowMatrix<Scalar>::Zero(r, dv), ColVector<Scalar>::Zero(message.z)};
  StateGradient<Scalar> before = after;
  for (const Index i : wavefront_order(items, false)) {
    const BackwardItem& it = items[std::size_t(i)];
    const Index g = it.head / members, j = it.head % members;
    const Index qh = map.member_query(g, j), vh = map.member_value(g, j);
    bool ok = !failed;
    if (it.next >= 0 || (!last && ends.final_gradients)) {
      Scalar* in = at(gradients_in, i);
      ok = wait(i) && ok;
      if (ok) {
        after.S = message.S(in);
        after.z = message.zmap(in);
      }
    } else if (const StateGradient<Scalar>* fin = last ? final_of(it) : nullptr) {
      after.S = fin->S;
      after.z = fin->z;
    } else {
      after.S.setZero();
      after.z.setZero();
    }
    if (ok) {
      try {
        if (it.rows > 0) {
          const Index t0 = it.first, rows = it.rows;
          const auto q = Q.head_rows(it.entry, qh, t0, rows);
          const auto k = K.head_rows(it.entry, g, t0, rows);
          const auto v = V.head_rows(it.entry, vh, t0, rows);
          const auto dy = dY.head_rows(it.entry, it.head, t0, rows);
          buffers.fit_heads(rows, rows, dk, dv);
          auto dQ_head = buffers.head_Q.topRows(rows);
          auto dK_head = buffers.head_K.topRows(rows);
          auto dV_head = buffers.head_V.topRows(rows);
          GradientsRef<Scalar> out_rows{dQ_head, dK_head, dV_head};
          const InputGradientRows<Scalar> d_in_head =
              head_input_rows<Rule>(buffers.inputs, rows, d_inputs);
          std::apply(
              [&](const auto&... x) {
                if (!saves(it)) {
                  const Scalar* msg = start_message(it, i);
                  start.assign(message.S(msg), message.zmap(msg), Message::tokens(msg));
                  if constexpr (Rule::kind == WriteKind::additive)
                    prefill_backward_into(attn, start, q, k, v, dy, &after, out_rows, before,
                                          &workspace);
                  else
                    prefill_backward_into(attn, start, q, k, v, x..., dy, &after, out_rows,
                                          d_in_head, before, &workspace);
                } else if constexpr (keep_saved) {
                  if constexpr (Rule::kind == WriteKind::additive)
                    prefill_backward_into(attn, saved_of(i), q, k, v, dy, &after,
                                          out_rows, before, &workspace);
                  else
                    prefill_backward_into(attn, saved_of(i), q, k, v, x..., dy,
                                          &after, out_rows, d_in_head, before, &workspace);
                }
              },
              rows_inputs(inputs, it.entry, vh, t0, rows));
          write_or_add(map.first_of_query(j), grads.Q.head_rows(it.entry, qh, t0, rows), dQ_head);
          add_key_value_share<Rule>(j == 0, map.first_of_value(j), grads.K, grads.V, d_inputs,
                                    it.entry, g, vh, t0, rows, dK_head, dV_head, d_in_head);
        } else {
          before.S = after.S;
          before.z = after.z;
        }
        // The gradient with respect to the state before its rows: into the initial states'
        // gradients (the G heads of a shared state added in head order: the same bits every
        // run); then back along the chain.
        if (every_rank_initial || it.first_rank == rank)
          add_state_share(map.first_of_state(j), initial.head(it.position, state_head(it)), before.S,
                          before.z);
        if (it.prev >= 0) {
          Scalar* out = at(outgoing, i);
          Eigen::Map<RowMatrix<Scalar>>(out + Message::header, r, dv) = before.S;
          Eigen::Map<ColVector<Scalar>>(out + Message::header + r * dv, message.z) = before.z;
        }
      } catch (...) {
        record_failure(late);
        ok = false;
      }
    }
    failed = !ok;
    if (it.prev >= 0) {
      Message::set_header(at(outgoing, i), ok ? kOk : kFailed, 0);
      post_send(at(outgoing, i), it.prev, kStateGradientTag);
    }
  }
  // 3. The initial states' gradients that another rank added up (one per state head of a
  // sequence that starts there), to rank 0, in item order.
  if (!every_rank_initial && P > 1) {
    for (Index i = 0; i < n; ++i) {
      const BackwardItem& it = items[std::size_t(i)];
      if (!map.first_of_state(it.head % members) ||
          (first ? it.first_rank == 0 : it.first_rank != rank))
        continue;
      StateGradient<Scalar>& d0 = initial.head(it.position, state_head(it));
      if (first) {
        MPI_Status status;
        check_mpi(MPI_Recv(scratch, message.bytes(true), MPI_BYTE, it.first_rank,
                           kInitialGradientTag, comm, &status),
                  "MPI_Recv (backward pipeline)");
        if (Message::status(scratch) == kOk) {
          d0.S = message.S(scratch);
          d0.z = message.zmap(scratch);
        }
      } else {
        Message::set_header(scratch, failed ? kFailed : kOk, 0);
        if (!failed) {
          Eigen::Map<RowMatrix<Scalar>>(scratch + Message::header, r, dv) = d0.S;
          Eigen::Map<ColVector<Scalar>>(scratch + Message::header + r * dv, message.z) = d0.z;
        }
        check_mpi(MPI_Send(scratch, message.bytes(!failed), MPI_BYTE, 0,
                           kInitialGradientTag, comm),
                  "MPI_Send (backward pipeline)");
      }
    }
  }
  return wait_and_agree();
}

}  // namespace linattn::detail
