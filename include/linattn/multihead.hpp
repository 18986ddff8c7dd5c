#pragma once
/// \file multihead.hpp
/// MultiHeadAttention<Attention>: one attention (LinearAttention or any RuleAttention) over
/// every head of a batch, reading Q, K, V and the rule's per-token inputs from a model's own
/// buffers and writing the output in place, with grouped heads, packed and padded
/// variable-length batches, per-sequence decode state and an optional executor for threads.
///
/// Math: for every sequence s and query head h, with key/value head g = h / (H_q / H_kv),
///   out[s, :, h, :] = attention(Q[s, :, h, :], K[s, :, g, :], V[s, :, g, :], inputs[s, :, g])
/// computed by the attention's own calls on views of the buffers: nothing is copied and no
/// math is repeated here. With grouped value heads (HeadConfig::value_heads = H_v > H_kv, and
/// H_q = H_kv) value head h reads query and key head c = h / (H_v / H_kv):
///   out[s, :, h, :] = attention(Q[s, :, c, :], K[s, :, c, :], V[s, :, h, :], inputs[s, :, h]).
///
/// Calls, in the attention's argument order ([state,] inputs, per-token inputs, [mask,] output,
/// then where the sequences lie):
///   parallel_into(Q, K, V, in..., mask, out, layout = batch())           stateless
///   prefill_into(state, Q, K, V, in..., out, layout = batch(), slots = {})  causal, carried
///   step_into(state, q, k, v, in..., out, slots = {})                     one token each
/// Q [B, Tq, H_q, dk], K [B, Tk, H_kv, dk], V [B, Tk, H_v, dv], out [B, Tq, max(H_q, H_v), dv]
/// (H_v = H_kv unless values are grouped); the rule's per-token inputs (Gated log-gates, Delta
/// beta, GatedDelta beta then log_alpha) are views [B, T, H_v, 1] (one per token and value head)
/// or, for per-channel gates (Gated's log-gates, GatedDelta's log_alpha: Kimi Delta Attention),
/// [B, T, H_v, r]; any strides with a contiguous last axis
/// (TensorView), read in place.
/// Sequence i of `layout` continues the state at batch position slots[i] (i when empty).
///
/// State per value head: the G = H_q / H_kv query heads of a group read the same sums, so
/// the state keeps them once per key/value head (state_heads() = H_v = H_kv) and a call absorbs
/// each group's keys once and reads them G times; grouped value heads each keep their own
/// (state_heads() = H_v). Random
/// features under the additive rule keep one state per output head: their log-domain kernels
/// rescale S per head.
///
/// Threads: with set_executor(&pool) (linattn/thread_pool.hpp) the work items (sequence,
/// state head) run on the pool's threads when a call has enough work to pay for the hand-off
/// (detail::kParallelGrainFlops); otherwise, and by default, on the calling thread. Results
/// are bit-identical for every executor and thread count.
///
/// Errors: ShapeError names the views and what disagrees; the attention's own errors pass
/// through. Every work item is computed even when one throws; the exception of the lowest
/// item (sequence-major) is rethrown afterwards, with the other items' states advanced.

#include <linattn/attention.hpp>
#include <linattn/batch_state.hpp>
#include <linattn/detail/multihead_views.hpp>
#include <linattn/errors.hpp>
#include <linattn/executor.hpp>
#include <linattn/head_config.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <concepts>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

namespace linattn {

/// Multi-head attention over raw buffers; see the file comment for the math and layouts.
/// Holds an attention (const, shareable) and an executor pointer; const members may be called
/// concurrently on different outputs and states.
template <class Attention>
class MultiHeadAttention {
 public:
  using attention_type = Attention;
  using scalar_type = typename Attention::scalar_type;
  using rule_type = typename Attention::rule_type;
  using HeadState = typename Attention::State;
  using State = BatchState<HeadState>;
  using ConstView = TensorView<const scalar_type>;
  using View = TensorView<scalar_type>;

  /// Whether the query heads of a key/value head share one state (see the file comment).
  static constexpr bool shares_states = !Attention::log_scaled;

  /// Heads as in `heads` and a default-constructed attention.
  explicit MultiHeadAttention(HeadConfig heads)
    requires std::default_initializable<Attention>
      : MultiHeadAttention(heads, Attention{}) {}
  /// Heads as in `heads`, each computed by `attention`. Throws ShapeError if a count or dim is
  /// not positive, H_q or H_v is not a multiple of H_kv, or grouped value heads come with
  /// H_q != H_kv.
  MultiHeadAttention(HeadConfig heads, Attention attention)
      : attention_(std::move(attention)), heads_(heads) {
    detail::check_head_config(heads_);
  }

  [[nodiscard]] const Attention& attention() const noexcept { return attention_; }
  [[nodiscard]] const HeadConfig& heads() const noexcept { return heads_; }
  /// r, the feature dimension of one head's state.
  [[nodiscard]] Index feature_dim() const { return attention_.feature_dim(heads_.key_dim); }
  /// Head states per sequence: H_v (= H_kv unless values are grouped) when shares_states, else
  /// one per output head, max(H_q, H_v).
  [[nodiscard]] Index state_heads() const noexcept {
    return shares_states ? heads_.v_heads() : heads_.out_heads();
  }
  /// G = H_q / H_kv, the query heads of one key/value head.
  [[nodiscard]] Index group_size() const noexcept { return heads_.q_heads / heads_.kv_heads; }
  /// G_v = H_v / H_kv, the value heads of one key head (1 unless values are grouped).
  [[nodiscard]] Index value_group_size() const noexcept {
    return heads_.v_heads() / heads_.kv_heads;
  }

  /// Runs later calls' work items on `executor` (not owned; null: the calling thread only).
  void set_executor(Executor* executor) noexcept { executor_ = executor; }
  [[nodiscard]] Executor* executor() const noexcept { return executor_; }

  /// A batch state of `sequences` empty sequences for this layer.
  [[nodiscard]] State make_state(Index sequences = 0) const {
    return State(state_heads(), attention_.make_state(heads_.key_dim, heads_.value_dim), sequences);
  }

  /// State against K/V cache for one sequence of this layer.
  [[nodiscard]] StateFootprint footprint() const {
    return state_footprint(state_heads(), heads_.kv_heads, feature_dim(), heads_.key_dim,
                           heads_.value_dim, rule_type::keeps_normalizer, heads_.v_heads());
  }

  /// parallel_into(Q, K, V, in..., mask, out, layout = batch()): every head of every sequence,
  /// full (Mask::none, additive only; Tq may differ from Tk with layout batch()) or causal from
  /// an empty state.
  template <class... Args>
  void parallel_into(ConstView Q, ConstView K, ConstView V, Args&&... args) const {
    constexpr std::size_t N = rule_type::token_inputs;
    static_assert(sizeof...(Args) == N + 2 || sizeof...(Args) == N + 3,
                  "parallel_into takes Q, K, V, the rule's per-token input views, the mask, the "
                  "output and optionally a SequenceLayout");
    auto all = std::forward_as_tuple(args...);
    const auto inputs = detail::token_views<N, scalar_type>(all);
    const auto& mask = std::get<N>(all);
    const View out = std::get<N + 1>(all);
    const SequenceLayout layout = optional_layout<N + 2>(all);
    const bool causal = Mask(mask).is_causal();
    check(Q, K, V, inputs, out, layout, causal);
    over_items(Q, K, V, inputs, out, layout, nullptr, {}, [&](const auto& q, const auto& k,
                                                               const auto& v, const auto& in,
                                                               const auto& o, HeadState*) {
      std::apply([&](const auto&... x) { attention_.parallel_into(q, k, v, x..., mask, o); }, in);
    });
  }

  /// prefill_into(state, Q, K, V, in..., out, layout = batch(), slots = {}): causal prefill;
  /// sequence i continues the state at batch position slots[i] (or i). Views as for
  /// parallel_into with Tq = Tk. Throws ShapeError if the number of sequences does not match, a
  /// slot is out of range or repeated, or the state is not this layer's.
  template <class... Args>
  void prefill_into(State& state, ConstView Q, ConstView K, ConstView V, Args&&... args) const {
    constexpr std::size_t N = rule_type::token_inputs;
    static_assert(sizeof...(Args) >= N + 1 && sizeof...(Args) <= N + 3,
                  "prefill_into takes the state, Q, K, V, the rule's per-token input views, the "
                  "output and optionally a SequenceLayout and slots");
    auto all = std::forward_as_tuple(args...);
    const auto inputs = detail::token_views<N, scalar_type>(all);
    const View out = std::get<N>(all);
    const SequenceLayout layout = optional_layout<N + 1>(all);
    const std::span<const Index> slots = optional_slots<N + 2>(all);
    check(Q, K, V, inputs, out, layout, true);
    detail::check_slots(state, *this, layout.count(Q.batches()), slots);
    over_items(Q, K, V, inputs, out, layout, &state, slots,
               [&](const auto& q, const auto& k, const auto& v, const auto& in, const auto& o,
                   HeadState* head) {
                 std::apply([&](const auto&... x) { attention_.prefill_into(*head, q, k, v, x..., o); },
                            in);
               });
  }

  /// step_into(state, q, k, v, in..., out, slots = {}): one decode token per sequence;
  /// q [N, 1, H_q, dk], k [N, 1, H_kv, dk], v [N, 1, H_v, dv], in [N, 1, H_v, 1 or r],
  /// out [N, 1, max(H_q, H_v), dv]; batch row i steps the state at position slots[i] (or i).
  /// Allocates nothing. Throws as prefill_into().
  template <class... Args>
  void step_into(State& state, ConstView q, ConstView k, ConstView v, Args&&... args) const {
    constexpr std::size_t N = rule_type::token_inputs;
    static_assert(sizeof...(Args) == N + 1 || sizeof...(Args) == N + 2,
                  "step_into takes the state, q, k, v, the rule's per-token input views, the "
                  "output and optionally slots");
    auto all = std::forward_as_tuple(args...);
    const auto inputs = detail::token_views<N, scalar_type>(all);
    const View out = std::get<N>(all);
    const std::span<const Index> slots = optional_slots<N + 1>(all);
    if (q.times() != 1)
      detail::throw_shape_error("a decode step takes one token per sequence, got q ", q.describe());
    check(q, k, v, inputs, out, SequenceLayout::batch(), true);
    detail::check_slots(state, *this, q.batches(), slots);
    const detail::HeadMap map(heads_, shares_states);
    const Index H = state_heads(), G = map.query_count();
    const double flops = 4.0 * double(feature_dim()) * double(heads_.value_dim) * double(G);
    detail::parallel_for(q.batches() * H, executor_, flops, [&](Index item) {
      const Index b = item / H, h = item % H;
      HeadState& head = slot_state(state, slots, b, h);
      const Index kh = map.key_of(h), vh = map.value_of(h), q0 = map.query_first(h),
                  o0 = map.out_first(h);
      const auto step = [&](const auto& in) {
        std::apply(
            [&](const auto&... x) {
              const auto one = [&] {
                attention_.step_into(head, q.head_rows(b, q0, 0, 1), k.head_rows(b, kh, 0, 1),
                                     v.head_rows(b, vh, 0, 1), x..., out.head_rows(b, o0, 0, 1));
              };
              if constexpr (!shares_states) {
                one();
              } else if (G == 1) {
                one();
              } else {
                attention_.step_into(head, q.slice(b, 0, 1, q0, G), k.head_rows(b, kh, 0, 1),
                                     v.head_rows(b, vh, 0, 1), x..., out.slice(b, 0, 1, o0, G));
              }
            },
            in);
      };
      if constexpr (rule_type::kind == WriteKind::gated_delta) {
        if (inputs[1].dim() > 1) return step(detail::channel_step_inputs(inputs, b, vh));
      }
      step(detail::step_inputs<rule_type>(inputs, b, vh));
    });
  }

 private:
  template <std::size_t I, class Tuple>
  static SequenceLayout optional_layout(const Tuple& all) {
    if constexpr (I < std::tuple_size_v<Tuple>)
      return std::get<I>(all);
    else
      return SequenceLayout::batch();
  }
  template <std::size_t I, class Tuple>
  static std::span<const Index> optional_slots(const Tuple& all) {
    if constexpr (I < std::tuple_size_v<Tuple>)
      return std::get<I>(all);
    else
      return {};
  }

  template <class Inputs>
  void check(const ConstView& Q, const ConstView& K, const ConstView& V, const Inputs& inputs,
             const View& out, const SequenceLayout& layout, bool same_length) const {
    detail::check_views(heads_, feature_dim(), Q, K, V, out, layout, same_length);
    for (std::size_t i = 0; i < inputs.size(); ++i)
      detail::check_token_view(inputs[i], K, heads_.v_heads(), feature_dim(),
                               detail::per_channel_input<rule_type>(i));
  }

  // The state of state head h of sequence s (at batch position slots[s], or s).
  static HeadState& slot_state(State& state, std::span<const Index> slots, Index s, Index h) {
    const Index position = slots.empty() ? s : slots[static_cast<std::size_t>(s)];
    return state.sequence(position).head(h);
  }

  // Calls attend(queries, k, v, inputs, outputs, state) for every (sequence, state head) of
  // `layout`, spread over the executor: a group of G query heads (shares_states) or one query
  // head (detail::HeadMap), each cut to the sequence's rows; padded rows of the outputs are zeroed first. A
  // prefill over token-major buffers runs block by block (prefill_block()).
  template <class Inputs, class Attend>
  void over_items(const ConstView& Q, const ConstView& K, const ConstView& V,
                  const Inputs& inputs, const View& out, const SequenceLayout& layout,
                  State* state, std::span<const Index> slots, Attend&& attend) const {
    const detail::HeadMap map(heads_, shares_states);
    const Index H = state_heads(), G = map.query_count(), sequences = layout.count(Q.batches());
    const Index heads_per_item = G;
    // Work per item for the grain decision: 4 r dv flops per token and query head (the reads
    // and the update), over the average sequence length.
    const double rows_per_sequence = layout.kind() == SequenceLayout::Kind::packed
                                         ? double(Q.times()) / double(std::max<Index>(sequences, 1))
                                         : double(Q.times());
    const double flops = 4.0 * double(feature_dim()) * double(heads_.value_dim) *
                         rows_per_sequence * double(heads_per_item);
    const bool full_rows = layout.kind() == SequenceLayout::Kind::batch;
    const auto query_rows = [&](Index s) {
      return full_rows ? Q.times() : layout.length(s, Q.times());
    };
    // Item (sequence s, state head h) on rows [offset, offset + count) of its sequence.
    const auto run = [&](Index item, Index offset, Index count) {
      const Index s = item / H, h = item % H;
      const Index entry = layout.batch_entry(s), first = layout.first_row(s) + offset;
      const Index q_len = query_rows(s);
      // All of K's rows for a whole sequence (a full mask may have Tk != Tq), else the block's.
      const Index k_len = full_rows && count == q_len ? K.times() : count;
      const Index q0 = map.query_first(h), o0 = map.out_first(h), kh = map.key_of(h),
                  vh = map.value_of(h);
      if (offset == 0 && layout.kind() == SequenceLayout::Kind::padded)
        detail::zero_rows(out.slice(entry, q_len, out.times() - q_len, o0, heads_per_item));
      HeadState* head = state != nullptr ? &slot_state(*state, slots, s, h) : nullptr;
      const auto in = detail::rows_inputs(inputs, entry, vh, first, k_len);
      const auto k = K.head_rows(entry, kh, first, k_len), v = V.head_rows(entry, vh, first, k_len);
      if constexpr (shares_states) {
        if (G > 1) {
          attend(Q.slice(entry, first, count, q0, G), k, v, in,
                 out.slice(entry, first, count, o0, G), head);
          return;
        }
      }
      attend(Q.head_rows(entry, q0, first, count), k, v, in,
             out.head_rows(entry, o0, first, count), head);
    };
    const Index items = sequences * H, block = prefill_block(Q, state);
    if (block == 0) {
      detail::parallel_for(items, executor_, flops,
                           [&](Index item) { run(item, 0, query_rows(item / H)); });
      return;
    }
    // Blocks outer, the sequence's heads inner: each head's rows are the bits of one call
    // (block is a multiple of the chunk size, so the chunks are the same), and the block's
    // [block, H d] rows of the buffers stream through the cache once instead of once per head.
    detail::FirstItemError errors(items);
    auto range = [&](Index begin, Index end) {
      std::vector<char> failed(static_cast<std::size_t>(end - begin), 0);
      for (Index s_begin = begin; s_begin < end;) {
        const Index s = s_begin / H, s_end = std::min(end, (s + 1) * H), rows = query_rows(s);
        for (Index offset = 0; offset == 0 || offset < rows; offset += block)
          for (Index item = s_begin; item < s_end; ++item) {
            char& item_failed = failed[static_cast<std::size_t>(item - begin)];
            if (item_failed) continue;
            try {
              // The whole sequence's room first, as a single call checks it.
              if (offset == 0) slot_state(*state, slots, s, item % H).check_room(rows);
              run(item, offset, std::min(block, rows - offset));
            } catch (const DenominatorError& e) {
              item_failed = 1;
              try {
                // Name the row within the sequence, as one call over it would.
                if (offset > 0)
                  static_cast<void>(attention_.options().normalization.divisor(
                      static_cast<scalar_type>(e.value()), e.row() + offset));
                throw;
              } catch (...) {
                errors.record(item);
              }
            } catch (...) {
              item_failed = 1;
              errors.record(item);
            }
          }
        s_begin = s_end;
      }
    };
    detail::parallel_ranges(items, executor_, flops, range);
    errors.rethrow();
  }

  // Rows per block of a prefill that runs blocks outer and heads inner, or 0 for one call per
  // item. Pays where one head's rows lie far apart (token-major [B, T, H, d] buffers: a row
  // per token and head, H d apart, which the hardware prefetchers do not follow across pages)
  // and there are heads to interleave. The smallest multiple of the chunk size from 64 rows:
  // measured on Zen 3 (one thread, H = 8, T = 16384) at 1.29 x (d = 64) and 1.24 x (d = 128)
  // the head-outer order, flat from 16 to 64 rows, slower from 128 (the block's rows of every
  // head leave L2). Ordinary maps only: the log-domain kernels rescale per call.
  [[nodiscard]] Index prefill_block(const ConstView& Q, const State* state) const {
    if constexpr (LogScaledFeatureMap<typename Attention::feature_map_type, scalar_type>) {
      return 0;
    } else {
      if (state == nullptr || state_heads() < 2 || Q.stride(ConstView::head) >= Q.stride(ConstView::time))
        return 0;
      const Index C = attention_.chunk_size(feature_dim(), heads_.value_dim);
      return (64 + C - 1) / C * C;
    }
  }

  Attention attention_;
  HeadConfig heads_;
  Executor* executor_ = nullptr;
};

}  // namespace linattn
