#pragma once
/// \file mpi.hpp
/// SequenceParallel: causal prefill of one long sequence (or a batch of them, or packed
/// documents) split into contiguous slices across the ranks of an MPI communicator (CMake
/// target linattn::mpi; the core never includes this header). docs/distributed.md says when
/// it pays and how to run it.
///
/// Math (REFERENCES.md section 8; LASP, Sun et al. 2024): every write rule maps the state
/// affinely over a slice p of the sequence, S -> A_p S + B_p (z likewise where kept), so rank p
/// needs only the summaries (A_q, B_q) of the ranks q < p to know the state its slice starts
/// from: C_p = A_{p-1} (... (A_0 S_init + B_0) ...) + B_{p-1}. Each rank computes its slice's
/// outputs from a zero carry and its summary, the summaries are gathered on every rank
/// (MPI_Allgather) and composed in rank order, and each rank adds the read of its carry:
///   y_t = (qf_t^T B_t + (qf_t .* d_t)^T C_p) / divisor(qf_t^T z_t)   (decayed rules; d_t the
///         decay since the slice's start, 1 for Additive), or qf_t^T B_t + (qf_t^T A_t) C_p
///         (delta rules).
/// The composition runs in the same order on every rank from the same gathered bytes, so the
/// results do not depend on how MPI moves them: the same P and slices give the same bits.
/// They agree with a single-process prefill of the whole sequence to rounding (the sums are
/// grouped differently, over at most P more terms); the first non-empty slice of a sequence
/// that starts empty is computed as a single process computes it (the same bits where the
/// slice holds whole chunks).
///
/// That is Schedule::summaries. Schedule::pipeline (detail/mpi_pipeline.hpp) runs a wavefront
/// over the call's items instead: rank p receives item i's state after slice p-1 from rank
/// p-1, prefills its slice from it and sends the state after its slice to rank p+1 (in a
/// fixed order: the same P and slices give the same bits; slices of whole chunks, each at
/// least one, give a single process's bits). Schedule::hybrid is the pipeline with each rank's
/// idle start-up slots filled by the summaries' zero-carry pass of its last items.
/// Carry::schedule chooses (Schedule).
///
/// Exchanged per rank (summaries), whatever the slice length: one summary per state head of
/// r dv + r scalars (Additive), r dv + r + 1 (Decay), r dv + 2 r (Gated), r dv + r r (Delta,
/// GatedDelta), plus two records of about 700 bytes, plus the initial state from its holder
/// where it is not zero. MPI_Allgather delivers each summary to the P - 1 other ranks.
/// Pipeline and hybrid: one state per item (r dv + r scalars, r dv for the delta rules, and
/// 16 bytes) to the next rank only, the records, the initial state from its holder to rank 0
/// where it is not zero, and with broadcast_final the last rank's states to all.
///
/// Compute per rank, for a slice of T_p tokens (summaries): a single-process prefill of T_p
/// tokens on the first non-empty rank of a sequence that starts empty; elsewhere that plus
/// 2 r dv flops per token and query head for the carry (decayed rules), or about twice a
/// prefill (delta rules: A_p is a second pass of width r); then O(P r dv) (O(P r^2 dv)) per
/// state head to compose. balanced_slices() sizes the slices for that difference. Pipeline:
/// one prefill of T_p tokens per item, items in order (the layer's executor is not used);
/// hybrid: the summaries' cost for the k_p filled items, the pipeline's for the others.
/// Memory: per query head T_p x r values and T_p denominators between the summaries' phases
/// (the hybrid's filled items likewise), one state per item (pipeline, hybrid); kept by the
/// object from call to call, so repeated calls of one shape touch no new memory. A layer call
/// over token-major buffers also keeps head-major copies of this rank's Q, K, V and out
/// (Carry::stage_token_major), allocated by the first call that needs them (on huge pages where
/// the kernel gives them, faulted in at once; that call is the slower one). Calls on one object
/// must not overlap; give each thread its own object and communicator.
///
/// Errors: a call either returns on every rank or throws on every rank the same exception
/// (type and message), and then no rank's state has changed (outputs may have been written).
/// Before any data moves, the ranks gather one record each: a rank whose inputs are wrong
/// makes every rank throw its error (ShapeError, StateMismatchError, std::invalid_argument...
/// naming the rank); ranks that disagree on the configuration (attention, rule or parameter,
/// feature map, normalization, dims, heads, sequences, scalar type, Carry) make every rank throw
/// RankMismatchError naming the first field and the ranks. A DenominatorError names the row in
/// the whole sequence. Every rank of the communicator must make the call (a rank that never
/// calls leaves the others waiting, as with any MPI collective), from one thread.

#include <linattn/attention.hpp>
#include <linattn/batch_state.hpp>
#include <linattn/detail/bytes.hpp>
#include <linattn/detail/checks.hpp>
#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/head_major_stage.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_prefill.hpp>
#include <linattn/detail/multihead_views.hpp>
#include <linattn/detail/slice_runner.hpp>
#include <linattn/multihead.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <span>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::mpi {

/// Carry::initial_rank's default: the last rank, where a call leaves the final state.
inline constexpr int kLastRank = -1;

/// How the ranks carry the state from slice to slice (docs/distributed.md has the model and
/// the measurements); n is the call's number of items (state heads of the sequences).
///   summaries  every rank runs its slice of every item from a zero carry, the summaries are
///              all-gathered and composed, and every rank but the first reads its carry (the
///              file comment). Time ~ (T/P)(1 + c) per item: c = 0.35 for the decayed rules,
///              about 1 for the delta rules (their zero-carry pass runs an extended state).
///   pipeline   a wavefront over the items: rank p takes item i's state from rank p-1, runs its
///              slice as the attention's own prefill from it and sends the state after its
///              slice on to rank p+1 while it goes on with item i+1. Time ~ (n + P - 1) T/P:
///              every rule alike.
///   hybrid     the pipeline, but rank p > 0 first runs its last k_p items from a zero carry as
///              the summaries do, in the slots it would wait for item 0 (k_p = min(p, n) for
///              even slices); when such an item's state arrives it sends the state after its
///              slice on at once (one scan step of the summaries) and then reads the carry into
///              the outputs. Time ~ (n + (P - 1) c) T/P. Delta and GatedDelta: their
///              zero-carry pass costs about two slots, so hybrid runs the pipeline for them
///              (ExchangeStats::schedule says pipeline).
///   automatic  the least modelled time on the actual slice lengths (detail/schedule_model.hpp;
///              ties to the summaries, then the pipeline); the summaries for one item or fewer
///              items than ranks; never the hybrid for the delta rules.
/// Bits: every schedule gives the same bits for the same P and slices whatever MPI does (the
/// hybrid's k_p follow from the agreed slice lengths, and each rank handles the items in a
/// fixed order). Under the hybrid an item that rank p and every rank before it pipelined has
/// the pipeline's bits (a single process's where the slices hold whole chunks); a filled item's
/// outputs and states agree with a single process to rounding, as the summaries' do.
enum class Schedule { automatic = 0, summaries = 1, pipeline = 2, hybrid = 3 };
static_assert(int(Schedule::pipeline) == int(linattn::detail::ScheduleCode::pipeline) &&
              int(Schedule::hybrid) == int(linattn::detail::ScheduleCode::hybrid));

/// Where the state before the call comes from, where the state after it goes, and how it
/// travels between the ranks.
struct Carry {
  /// The rank whose state argument holds the sequence's state before the first token of rank
  /// 0's slice (kLastRank: the last rank, so that consecutive calls continue each other); the
  /// other ranks' states only need this attention's shape and identity.
  int initial_rank = kLastRank;
  /// After the call every rank's state holds the state after the whole sequence (composed
  /// from the same summaries on every rank: no extra message, the same bits everywhere).
  /// Otherwise rank p's holds the state after its own slice, and the last rank's the final one.
  bool broadcast_final = false;
  /// The schedule; every rank must pass the same.
  Schedule schedule = Schedule::automatic;
  /// Multi-head calls over token-major buffers ([B, T_p, H, d]: one head's rows H d apart):
  /// copy this rank's Q, K and V head-major before the items run, and the outputs back after
  /// (detail/head_major_stage.hpp; for a packed or padded layout, each sequence's rows), so
  /// each item reads contiguous rows instead of one page per row. 1.4 x faster items for 4 KiB
  /// token rows on the Zen 5 VM of docs/distributed.md; costs
  /// memory the size of this rank's slices of Q, K, V and out, kept by the object. The same
  /// bits either way, so ranks may differ in it.
  bool stage_token_major = true;
};

/// Memory for the head-major copies of a rank's token-major slices (Carry::stage_token_major):
/// about the size of the rank's slices of Q, K, V and out, allocated by the first call that
/// stages (2 MiB aligned, on transparent huge pages where the kernel gives them, faulted in at
/// once), grown for a larger slice, never shrunk. Each SequenceParallel layer object has its
/// own unless given one; objects given the same StageMemory share it, so a model whose layers
/// run one after the other keeps one copy of its largest slice instead of one per layer. Objects
/// that share it must not be called at the same time. bytes() says what it holds, release()
/// frees it.
template <class Scalar>
using StageMemory = linattn::detail::StageMemory<Scalar>;

/// What one call put into the exchange and took out of it, for this rank, in bytes.
struct ExchangeStats {
  int ranks = 1;
  int rank = 0;
  /// The two records every rank contributes (configuration and errors).
  std::size_t record_bytes = 0;
  /// This rank's summaries: a status word and one summary per state head. Independent of T.
  std::size_t summary_bytes = 0;
  /// The initial state this rank broadcast (its holder, when that state is not zero).
  std::size_t initial_state_bytes = 0;
  /// Everything this rank received: P - 1 records twice, P - 1 summaries, the initial state.
  std::size_t received_bytes = 0;
  /// The schedule that ran (summaries, pipeline or hybrid; never automatic).
  Schedule schedule = Schedule::summaries;
  /// Pipeline and hybrid: the states this rank sent to the next rank (one per item: a 16-byte
  /// header and S, plus z for the rules that keep it) and, with broadcast_final, on the last
  /// rank, the final states it broadcast. Independent of T. 0 for the summaries.
  std::size_t state_bytes = 0;
  /// What this rank contributed: records, summaries or states, and any initial state.
  [[nodiscard]] std::size_t sent_bytes() const noexcept {
    return record_bytes + summary_bytes + state_bytes + initial_state_bytes;
  }
};

/// Thrown on every rank when the ranks disagree on a call's configuration.
class RankMismatchError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Slice lengths for `tokens` tokens over `ranks` ranks (contiguous, in rank order) that even
/// out the work of a sequence that starts empty: rank 0 computes its slice as a single process
/// would, every other rank also reads its carry, at `carry_cost` times the cost of its own
/// prefill. Rank 0 gets 1 + carry_cost shares, the others one each; remainders go to the
/// first ranks. carry_cost = 0 splits evenly. Throws std::invalid_argument for tokens < 0,
/// ranks < 1 or carry_cost < 0. O(ranks).
[[nodiscard]] inline std::vector<Index> balanced_slices(Index tokens, int ranks,
                                                        double carry_cost) {
  if (tokens < 0 || ranks < 1 || !(carry_cost >= 0))
    throw std::invalid_argument("linattn::mpi: balanced_slices needs tokens >= 0, ranks >= 1 "
                                "and carry_cost >= 0");
  std::vector<Index> lengths(static_cast<std::size_t>(ranks), 0);
  const double share = static_cast<double>(tokens) / (ranks + carry_cost);
  Index given = 0;
  for (int p = 1; p < ranks; ++p) given += lengths[std::size_t(p)] = static_cast<Index>(share);
  lengths[0] = tokens - given;
  return lengths;
}

namespace detail {
/// Throws the failure every rank agreed on, as its own exception type.
[[noreturn]] inline void raise(const linattn::detail::Failure& f) {
  using Kind = linattn::detail::FailureKind;
  switch (f.kind) {
    case Kind::shape:
      throw ShapeError(f.message);
    case Kind::state_mismatch:
      throw StateMismatchError(f.message);
    case Kind::invalid_argument:
      throw std::invalid_argument(f.message);
    case Kind::denominator:
      throw DenominatorError(f.message, f.row, f.value);
    case Kind::domain:
      throw std::domain_error(f.message);
    case Kind::out_of_range:
      throw std::out_of_range(f.message);
    case Kind::rank_mismatch:
      throw RankMismatchError(f.message);
    case Kind::none:
    case Kind::out_of_memory:
    case Kind::other:
      break;
  }
  throw std::runtime_error(f.message);
}

inline ExchangeStats stats_of(const linattn::detail::ExchangeCounts& c) {
  return {c.ranks, c.rank, c.record_bytes, c.summary_bytes, c.initial_state_bytes,
          c.received_bytes, static_cast<Schedule>(c.schedule), c.state_bytes};
}
}  // namespace detail

/// Sequence-parallel prefill with `Attention`: a RuleAttention (one head) or a
/// MultiHeadAttention (a batch of sequences, all heads); see the file comment.
template <class Attention>
class SequenceParallel;

/// One head: every rank passes its slice Q_p, K_p (T_p x dk), V_p (T_p x dv) and the rule's
/// per-token inputs for those rows; T_p may differ between ranks, and may be 0.
template <class Phi, class Rule, class Scalar>
class SequenceParallel<RuleAttention<Phi, Rule, Scalar>> {
 public:
  using Attention = RuleAttention<Phi, Rule, Scalar>;
  using State = typename Attention::State;
  static_assert(!Attention::log_scaled,
                "sequence-parallel prefill needs an ordinary feature map: a log-scaled map "
                "(random features) keeps S scaled by a running maximum, which has no summary");

  /// Runs `attention` across the ranks of `comm` (not duplicated: the caller's communicator;
  /// collectives, and the wavefront's messages with tags 0x4c41 and 0x4c42: no receive of the
  /// caller's with MPI_ANY_TAG may be pending on it during a call).
  SequenceParallel(Attention attention, MPI_Comm comm, Carry carry = {})
      : attention_(std::move(attention)), comm_(comm), carry_(carry) {}

  [[nodiscard]] const Attention& attention() const noexcept { return attention_; }
  [[nodiscard]] MPI_Comm communicator() const noexcept { return comm_; }
  [[nodiscard]] const Carry& carry() const noexcept { return carry_; }

  /// prefill_into(state, Q, K, V, inputs..., out): this rank's T_p x dv outputs of the causal
  /// attention of the whole sequence, and `state` as Carry says. Inputs are any Eigen
  /// expressions (copied once unless they are contiguous rows of Scalar); out binds to
  /// Eigen::Ref<RowMatrix<Scalar>>. Collective over the communicator.
  template <class DQ, class DK, class DV, class... Args>
  ExchangeStats prefill_into(State& state, const Eigen::MatrixBase<DQ>& Q,
                             const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                             Args&&... args) {
    static_assert(sizeof...(Args) == Rule::token_inputs + 1,
                  "prefill_into takes the state, Q, K, V, the rule's per-token inputs "
                  "(Gated: log-gates; Delta: beta; GatedDelta: beta, log_alpha) and the output");
    return linattn::detail::with_last(
        [&](const auto& inputs, auto&& out_arg) {
          typename Attention::OutputRef out(out_arg);
          std::vector<RowMatrix<Scalar>> copies;
          copies.reserve(3);
          linattn::detail::CallConfig config;
          config.call = 1;
          config.sequences = config.q_heads = config.kv_heads = config.value_heads = 1;
          configure(config, K.cols(), V.cols());
          const auto prepare = [&](auto& work) {
            linattn::detail::check_inputs(Q, K, V, true);
            linattn::detail::check_output(out, Q.rows(), V.cols());
            state.check_shape(attention_.feature_dim(K.cols()), K.cols(), V.cols());
            state.check_identity(attention_.state_identity());
            work.reset(1);
            auto& item = work.items.front();
            item.queries.push_back(linattn::detail::rows_spec_of<Scalar>(Q, copies));
            item.keys = linattn::detail::rows_spec_of<Scalar>(K, copies);
            item.values = linattn::detail::rows_spec_of<Scalar>(V, copies);
            item.outputs.push_back(linattn::detail::RowsSpec<Scalar>::of(out));
            linattn::detail::bind_token_inputs<Scalar>(
                attention_.rule(), inputs, K.rows(), attention_.feature_dim(K.cols()), item.inputs);
            work.states.push_back(&state);
            work.tokens = K.rows();
          };
          return finish(linattn::detail::run_sequence_parallel(
              comm_, attention_, K.cols(), V.cols(), config, nullptr, work_, prepare,
              [](auto&, Index, Index) {}));
        },
        std::forward<Args>(args)...);
  }

  /// prefill(state, Q, K, V, inputs...): prefill_into() returning this rank's outputs.
  template <class DQ, class DK, class DV, class... In>
  [[nodiscard]] typename Attention::Output prefill(State& state, const Eigen::MatrixBase<DQ>& Q,
                                                   const Eigen::MatrixBase<DK>& K,
                                                   const Eigen::MatrixBase<DV>& V,
                                                   const In&... inputs) {
    typename Attention::Output out(Q.rows(), V.cols());
    prefill_into(state, Q, K, V, inputs..., out);
    return out;
  }

 private:
  void configure(linattn::detail::CallConfig& config, Index dk, Index dv) const {
    linattn::detail::describe_attention(attention_, dk, dv, config);
    config.initial_rank = carry_.initial_rank;
    config.broadcast_final = carry_.broadcast_final ? 1 : 0;
    config.schedule = static_cast<std::int32_t>(carry_.schedule);
  }
  static ExchangeStats finish(const linattn::detail::SequenceParallelResult& result) {
    if (result.failure) detail::raise(*result.failure);
    return detail::stats_of(result.counts);
  }

  Attention attention_;
  MPI_Comm comm_;
  Carry carry_;
  linattn::detail::RankWork<Attention> work_;
};

/// A multi-head layer: every rank passes its slice of every sequence of the batch, views
/// [B, T_p, H, d] as MultiHeadAttention::prefill_into takes them (any strides with a
/// contiguous last axis, so batch-first and head-first buffers alike), and the layer's batch
/// state; grouped query heads share a state per key/value head, grouped value heads keep one each. Every batch entry is one sequence
/// (the batch layout), or a SequenceLayout over the whole sequence says which rows form each
/// (packed documents, padded entries). The layer's executor runs the state heads of this rank.
template <class HeadAttention>
class SequenceParallel<MultiHeadAttention<HeadAttention>> {
 public:
  using Layer = MultiHeadAttention<HeadAttention>;
  using Scalar = typename Layer::scalar_type;
  using Rule = typename Layer::rule_type;
  using State = typename Layer::State;
  using ConstView = typename Layer::ConstView;
  using View = typename Layer::View;
  static_assert(Layer::shares_states,
                "sequence-parallel prefill needs an ordinary feature map: a log-scaled map "
                "(random features) keeps S scaled by a running maximum, which has no summary");

  /// With `stage_memory`, the head-major copies of token-major slices live in that memory,
  /// shared with every object given the same (see StageMemory); without, in the object's own.
  /// A move takes the memory along.
  SequenceParallel(Layer layer, MPI_Comm comm, Carry carry = {},
                   std::shared_ptr<StageMemory<Scalar>> stage_memory = nullptr)
      : layer_(std::move(layer)), comm_(comm), carry_(carry) {
    if (stage_memory) stage_.memory = std::move(stage_memory);
  }

  [[nodiscard]] const Layer& layer() const noexcept { return layer_; }
  /// The memory of the head-major copies (null only in a moved-from object): pass it to the
  /// next layer's object to share it.
  [[nodiscard]] const std::shared_ptr<StageMemory<Scalar>>& stage_memory() const noexcept {
    return stage_.memory;
  }
  [[nodiscard]] MPI_Comm communicator() const noexcept { return comm_; }
  [[nodiscard]] const Carry& carry() const noexcept { return carry_; }

  /// prefill_into(state, Q, K, V, in..., out, layout = batch(), slots = {}): Q [B, T_p, H_q, dk],
  /// K [B, T_p, H_kv, dk], V [B, T_p, H_v, dv], per-token input views [B, T_p, H_v, 1 or r],
  /// out [B, T_p, max(H_q, H_v), dv] (grouped query or value heads, as the layer); sequence i continues the state at position slots[i] (or i).
  /// `layout` describes the whole sequence, rows [0, T) with T = T_0 + ... + T_{P-1}, the same
  /// on every rank; rank p holds rows [T_0 + ... + T_{p-1}, ... + T_p) of it:
  ///   batch()          every batch entry is one sequence of all T rows;
  ///   packed(offsets)  B = 1, sequence s is rows [offsets[s], offsets[s+1]) of the whole
  ///                    stream (offsets end at T): a sequence may lie on one rank, or cross
  ///                    into the next ones, which then read its carry;
  ///   padded(lengths)  sequence b is rows [0, lengths[b]) of entry b; this rank's rows at and
  ///                    after it are padding (never read, outputs set to zero).
  /// Collective over the communicator; B, the heads, dims and layout must agree across ranks,
  /// T_p not. A layout other than batch() binds each rank's rows once the ranks have agreed on
  /// the slice lengths and gathers the records once more (errors of the per-token inputs then
  /// throw on every rank); with the summaries schedule every rank exchanges one summary per
  /// (sequence, state head), whether its slice holds rows of that sequence or not. Padding is
  /// never read or checked.
  template <class... Args>
  ExchangeStats prefill_into(State& state, ConstView Q, ConstView K, ConstView V,
                             Args&&... args) {
    constexpr std::size_t N = Rule::token_inputs;
    static_assert(sizeof...(Args) >= N + 1 && sizeof...(Args) <= N + 3,
                  "prefill_into takes the state, Q, K, V, the rule's per-token input views, the "
                  "output and optionally a SequenceLayout and slots");
    auto all = std::forward_as_tuple(args...);
    const auto inputs = linattn::detail::token_views<N, Scalar>(all);
    const View out = std::get<N>(all);
    SequenceLayout layout = SequenceLayout::batch();
    std::span<const Index> slots;
    if constexpr (sizeof...(Args) >= N + 2) {
      using Next = std::remove_cvref_t<std::tuple_element_t<N + 1, decltype(all)>>;
      if constexpr (std::is_same_v<Next, SequenceLayout>) {
        layout = std::get<N + 1>(all);
        if constexpr (sizeof...(Args) == N + 3) slots = std::get<N + 2>(all);
      } else {
        static_assert(sizeof...(Args) == N + 2,
                      "prefill_into: the layout comes before the slots");
        slots = std::get<N + 1>(all);
      }
    }
    const HeadConfig& heads = layer_.heads();
    const linattn::detail::HeadMap map(heads, true);
    const Index G = map.query_count(), r = layer_.feature_dim();
    const bool whole_rows = layout.kind() == SequenceLayout::Kind::batch;
    linattn::detail::CallConfig config;
    config.call = 2;
    config.sequences = layout.count(Q.batches());
    config.q_heads = heads.q_heads;
    config.kv_heads = heads.kv_heads;
    config.value_heads = heads.v_heads();
    linattn::detail::describe_attention(layer_.attention(), heads.key_dim, heads.value_dim,
                                        config);
    config.initial_rank = carry_.initial_rank;
    config.broadcast_final = carry_.broadcast_final ? 1 : 0;
    config.schedule = static_cast<std::int32_t>(carry_.schedule);
    config.layout = static_cast<std::int32_t>(layout.kind());
    // Ranks that pass other offsets or lengths disagree on it (up to a 2^-64 chance).
    config.layout_hash = linattn::detail::fnv1a64(std::as_bytes(layout.values()));
    const Index S = layout.count(Q.batches()), H = layer_.state_heads();
    // Before the ranks agree: the checks of the shapes, the slots and the states. The items'
    // rows, their per-token inputs (bound and checked) and the head-major copies: here for the
    // batch layout, after the ranks agree on the slice lengths for another (bind).
    const auto bind_item = [&](auto& item, Index b, Index h, Index first, Index n) {
      for (Index j = 0; j < G; ++j) {
        item.queries.push_back(linattn::detail::RowsSpec<const Scalar>::of(
            Q.head_rows(b, map.query_first(h) + j, first, n)));
        item.outputs.push_back(linattn::detail::RowsSpec<Scalar>::of(
            out.head_rows(b, map.out_first(h) + j, first, n)));
      }
      const Index kh = map.key_of(h), vh = map.value_of(h);
      item.keys = linattn::detail::RowsSpec<const Scalar>::of(K.head_rows(b, kh, first, n));
      item.values = linattn::detail::RowsSpec<const Scalar>::of(V.head_rows(b, vh, first, n));
      linattn::detail::bind_token_inputs<Scalar>(
          layer_.attention().rule(), linattn::detail::rows_inputs(inputs, b, vh, first, n), n, r,
          item.inputs);
    };
    const auto prepare = [&](auto& work) {
      linattn::detail::check_views(heads, r, Q, K, V, out, SequenceLayout::batch(), true);
      layout.check_entries(Q.batches());
      for (std::size_t i = 0; i < inputs.size(); ++i)
        linattn::detail::check_token_view(inputs[i], K, heads.v_heads(), r,
                                          linattn::detail::per_channel_input<Rule>(i));
      linattn::detail::check_slots(state, layer_, S, slots);
      const Index T = K.times();
      work.reset(S * H);
      for (Index s = 0; s < S; ++s)
        for (Index h = 0; h < H; ++h) {
          const Index position = slots.empty() ? s : slots[std::size_t(s)];
          work.states.push_back(&state.sequence(position).head(h));
          if (whole_rows) bind_item(work.items[std::size_t(s * H + h)], s, h, 0, T);
        }
      work.tokens = T;
      if (whole_rows && carry_.stage_token_major) stage_.stage(work.items);
    };
    // With this rank's first row `start` in the whole sequence of `total` rows: each sequence's
    // rows on this rank, local rows [first, first + n) of batch entry b.
    const auto bind = [&](auto& work, Index start, Index total) {
      layout.check(Q.batches(), total);
      const Index T = K.times();
      work.extent_begin.resize(std::size_t(S * H));
      work.extent_end.resize(std::size_t(S * H));
      for (Index s = 0; s < S; ++s) {
        const Index b = layout.batch_entry(s);
        const Index begin = layout.first_row(s), end = begin + layout.length(s, total);
        const Index first = std::clamp(begin - start, Index{0}, T),
                    n = std::clamp(end - start, Index{0}, T) - first;
        for (Index h = 0; h < H; ++h) {
          const auto i = std::size_t(s * H + h);
          work.extent_begin[i] = begin;
          work.extent_end[i] = end;
          if (layout.kind() == SequenceLayout::Kind::padded)
            linattn::detail::zero_rows(out.slice(b, n, T - n, map.out_first(h), G));
          bind_item(work.items[i], b, h, first, n);
        }
      }
      if (carry_.stage_token_major) stage_.stage(work.items);
    };
    stage_.active = false;
    const auto result = linattn::detail::run_sequence_parallel(
        comm_, layer_.attention(), heads.key_dim, heads.value_dim, config, layer_.executor(),
        work_, prepare, bind);
    if (result.failure) detail::raise(*result.failure);
    stage_.finish();
    return detail::stats_of(result.counts);
  }

 private:
  Layer layer_;
  MPI_Comm comm_;
  Carry carry_;
  linattn::detail::RankWork<HeadAttention> work_;
  linattn::detail::HeadMajorStage<Scalar> stage_;
};

}  // namespace linattn::mpi
