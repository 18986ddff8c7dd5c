#pragma once
/// \file multihead.hpp
/// MultiHeadAttention<Phi, Scalar>: linear attention over every head of a batch, reading Q, K, V
/// from a model's own buffers and writing the output in place, with grouped heads, packed and
/// padded variable-length batches, per-sequence decode state and threads over (sequence, head).
///
/// Math: for every sequence s and query head h, with key/value head g = h / (H_q / H_kv),
///   out[s, :, h, :] = LinearAttention(Q[s, :, h, :], K[s, :, g, :], V[s, :, g, :])
/// computed by LinearAttention::parallel_into or parallel_group_into (forward, prefill) and
/// step_into or step_group_into (decode) on Eigen::Map views of the buffers: no math is
/// repeated here and nothing is copied.
///
/// State per key/value head: the G = H_q / H_kv query heads of a group attend over the same
/// keys and values, so their S and z are the same sums. With an ordinary feature map the
/// state keeps them once per key/value head (state_heads() = H_kv), as a K/V cache keeps
/// keys once per key/value head: a prefill absorbs each group's keys once and reads it G
/// times, a decode step absorbs once and reads G times. A log-scaled map (random features)
/// keeps one state per query head (state_heads() = H_q): its log-domain kernels, which
/// rescale S as the keys' running maximum grows, have no grouped form.
///
/// Buffers are TensorView<const Scalar> (inputs) and TensorView<Scalar> (output), logical axes
/// (batch, time, head, feature), any strides with a contiguous feature axis: [B, T, H, d] and
/// [B, H, T, d] are TensorView::batch_first and ::head_first.
///
/// Which rows form a sequence is a SequenceLayout:
///   batch()          sequence b = all T rows of batch entry b (B sequences).
///   packed(offsets)  B = 1 and sequence s = rows [offsets[s], offsets[s+1]), offsets
///                    cumulative lengths starting at 0 and ending at T (fla's cu_seqlens).
///   padded(lengths)  sequence b = rows [0, lengths[b]) of batch entry b; rows at and after
///                    lengths[b] are padding: their keys and values never enter any read or
///                    any state (not S, not z), their queries are not read, and their output
///                    rows are set to zero.
///
/// Threads: the work items are split over an OpenMP team when the code is compiled with
/// OpenMP (the CMake target links it when found, see LINATTN_USE_OPENMP), serially otherwise:
/// (sequence, state head) pairs for prefill(), step() and forward() with grouped heads,
/// (sequence, query head) pairs otherwise; so a single sequence of a multi-query layer
/// (H_kv = 1) runs on one thread. set_threads(n): n = 1 creates no thread; 0 means OpenMP's
/// default. Results are bit-identical for every thread count.
///
/// Errors: ShapeError names the views and what disagrees; DenominatorError comes from the
/// Normalization policy. Every work item is computed even when one throws; the exception of
/// the lowest item (sequence-major) is rethrown afterwards. A failing item's state is as
/// LinearAttention leaves it (decode: unchanged; prefill: the chunks before the failing one,
/// with the group's outputs from that chunk on unspecified); the other items have advanced.
///
/// Complexity: per sequence and token, H_q reads (2 r dv each, plus the chunked path's
/// C (r + dv)) and state_heads() updates (2 r dv each); memory beyond the buffers is the
/// single-head scratch per item (chunk buffers for the parallel path, none for a decode step).

#include <linattn/attention.hpp>
#include <linattn/batch_state.hpp>
#include <linattn/detail/parallel_for.hpp>
#include <linattn/errors.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <utility>

namespace linattn {

/// Head counts and per-head dimensions of a multi-head attention layer.
struct HeadConfig {
  /// H_q, the number of query (and output) heads.
  Index q_heads = 1;
  /// H_kv, the number of key/value heads; H_q must be a multiple of it (grouped-query
  /// attention when H_kv < H_q, multi-query when H_kv = 1).
  Index kv_heads = 1;
  /// dk, the query/key dimension of one head.
  Index key_dim = 0;
  /// dv, the value/output dimension of one head.
  Index value_dim = 0;
};

/// Which rows of a view form each sequence. Non-owning: the spans must outlive the call.
class SequenceLayout {
 public:
  enum class Kind { batch, packed, padded };

  /// Every batch entry is one sequence of all T rows.
  [[nodiscard]] static SequenceLayout batch() { return SequenceLayout(Kind::batch, {}); }
  /// B = 1; sequence s is rows [offsets[s], offsets[s+1]); offsets.size() = sequences + 1.
  [[nodiscard]] static SequenceLayout packed(std::span<const Index> offsets) {
    return SequenceLayout(Kind::packed, offsets);
  }
  /// Sequence b is rows [0, lengths[b]) of batch entry b; lengths.size() = B.
  [[nodiscard]] static SequenceLayout padded(std::span<const Index> lengths) {
    return SequenceLayout(Kind::padded, lengths);
  }

  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  [[nodiscard]] std::span<const Index> values() const noexcept { return values_; }

  /// Number of sequences in a view with B batch entries (after check()).
  [[nodiscard]] Index count(Index B) const noexcept {
    return kind_ == Kind::packed ? static_cast<Index>(values_.size()) - 1 : B;
  }
  /// Batch entry, first row and length of sequence s in a view of T rows (after check()).
  [[nodiscard]] Index batch_entry(Index s) const noexcept { return kind_ == Kind::packed ? 0 : s; }
  [[nodiscard]] Index first_row(Index s) const noexcept {
    return kind_ == Kind::packed ? at(s) : 0;
  }
  [[nodiscard]] Index length(Index s, Index T) const noexcept {
    switch (kind_) {
      case Kind::packed:
        return at(s + 1) - at(s);
      case Kind::padded:
        return at(s);
      case Kind::batch:
        break;
    }
    return T;
  }

  /// Throws ShapeError unless this layout fits a view of B entries and T rows.
  void check(Index B, Index T) const {
    if (kind_ == Kind::packed) {
      if (B != 1)
        detail::throw_shape_error("a packed (offsets) layout needs batch size 1, got B=", B);
      if (values_.empty() || values_.front() != 0 || values_.back() != T)
        detail::throw_shape_error("packed offsets must start at 0 and end at T=", T, ", got ",
                                  values_.size(), " offsets from ",
                                  values_.empty() ? -1 : values_.front(), " to ",
                                  values_.empty() ? -1 : values_.back());
      for (std::size_t i = 1; i < values_.size(); ++i)
        if (values_[i] < values_[i - 1])
          detail::throw_shape_error("packed offsets must not decrease, got ", values_[i - 1],
                                    " then ", values_[i], " at position ", i);
    } else if (kind_ == Kind::padded) {
      if (static_cast<Index>(values_.size()) != B)
        detail::throw_shape_error("padded layout has ", values_.size(),
                                  " lengths for batch size B=", B);
      for (std::size_t i = 0; i < values_.size(); ++i)
        if (values_[i] < 0 || values_[i] > T)
          detail::throw_shape_error("padded length ", values_[i], " of sequence ", i,
                                    " is outside [0, T=", T, "]");
    }
  }

 private:
  SequenceLayout(Kind kind, std::span<const Index> values) : kind_(kind), values_(values) {}
  [[nodiscard]] Index at(Index i) const noexcept { return values_[static_cast<std::size_t>(i)]; }

  Kind kind_ = Kind::batch;
  std::span<const Index> values_;
};

/// Multi-head linear attention over raw buffers; see the file comment for the math and layouts.
///
/// Holds a LinearAttention (const, shareable) and a thread count; const members may be called
/// concurrently on different outputs and states.
template <class Phi, class Scalar = float>
class MultiHeadAttention {
 public:
  using Attention = LinearAttention<Phi, Scalar>;
  using scalar_type = Scalar;
  using feature_map_type = Phi;
  using ConstView = TensorView<const Scalar>;
  using View = TensorView<Scalar>;
  using State = BatchState<Scalar>;

  /// Heads as in `heads`, feature map and options as for LinearAttention.
  /// Throws ShapeError if a count or dim is not positive or H_q is not a multiple of H_kv.
  explicit MultiHeadAttention(HeadConfig heads, Phi phi = Phi{}, Options options = {})
      : attention_(std::move(phi), options), heads_(heads) {
    if (heads_.q_heads < 1 || heads_.kv_heads < 1 || heads_.key_dim < 1 || heads_.value_dim < 1)
      detail::throw_shape_error("multi-head attention needs positive heads and dims, got H_q=",
                                heads_.q_heads, " H_kv=", heads_.kv_heads,
                                " dk=", heads_.key_dim, " dv=", heads_.value_dim);
    if (heads_.q_heads % heads_.kv_heads != 0)
      detail::throw_shape_error("query heads H_q=", heads_.q_heads,
                                " must be a multiple of key/value heads H_kv=", heads_.kv_heads);
  }

  [[nodiscard]] const Attention& attention() const noexcept { return attention_; }
  [[nodiscard]] const HeadConfig& heads() const noexcept { return heads_; }
  /// r, the feature dimension of one head's state.
  [[nodiscard]] Index feature_dim() const { return attention_.feature_dim(heads_.key_dim); }

  /// Whether the query heads of a key/value head share one state (ordinary feature maps) or
  /// keep one each (log-scaled maps); see the file comment.
  static constexpr bool shares_states = !LogScaledFeatureMap<Phi, Scalar>;
  /// Head states per sequence: H_kv when shares_states, else H_q.
  [[nodiscard]] Index state_heads() const noexcept {
    return shares_states ? heads_.kv_heads : heads_.q_heads;
  }
  /// G = H_q / H_kv, the query heads of one key/value head.
  [[nodiscard]] Index group_size() const noexcept { return heads_.q_heads / heads_.kv_heads; }

  /// Threads for later calls: 1 = the calling thread only (no thread is created), n > 1 = an
  /// OpenMP team of at most n, 0 = OpenMP's default (OMP_NUM_THREADS). Without OpenMP every
  /// count runs serially. Throws std::invalid_argument for a negative count.
  void set_threads(int n) {
    if (n < 0) throw std::invalid_argument("linattn: thread count must be >= 0");
    threads_ = n;
  }
  [[nodiscard]] int threads() const noexcept { return threads_; }

  /// A batch state of `sequences` empty sequences for this layer.
  [[nodiscard]] State make_state(Index sequences = 0) const {
    return State(state_heads(), feature_dim(), heads_.key_dim, heads_.value_dim, sequences,
                 LogScaledFeatureMap<Phi, Scalar>,
                 attention_.decode_block(feature_dim(), heads_.value_dim));
  }

  /// State against K/V cache for one sequence of this layer.
  [[nodiscard]] StateFootprint footprint() const {
    return state_footprint(state_heads(), heads_.kv_heads, feature_dim(), heads_.key_dim,
                           heads_.value_dim);
  }

  /// Stateless attention of every head of every sequence: full (Mask::none) or causal from an
  /// empty state. Q [B, Tq, H_q, dk], K [B, Tk, H_kv, dk], V [B, Tk, H_kv, dv],
  /// out [B, Tq, H_q, dv]; Tq may differ from Tk only for Mask::none with layout batch().
  /// With grouped heads and an ordinary map, parallel_group_into runs per key/value head (the
  /// keys read once per group, each output with parallel_into's bits).
  void forward(ConstView Q, ConstView K, ConstView V, View out, Mask mask,
               const SequenceLayout& layout = SequenceLayout::batch()) const {
    check_views(Q, K, V, out, layout, mask == Mask::causal);
    const Index sequences = layout.count(Q.batches());
    if constexpr (shares_states) {
      if (group_size() > 1) {
        // Each group's keys are read once (causal: per chunk; full: phi(K)^T V once), and
        // each head's output has the bits of parallel_into.
        over_sequence_groups(Q, K, V, out, layout, sequences,
                             [&](auto&& query, const auto& k, const auto& v, auto&& output,
                                 Index, Index) {
                               attention_.parallel_group_into(group_size(), query, k, v, mask,
                                                              output);
                             });
        return;
      }
    }
    over_sequence_heads(Q, K, V, out, layout, sequences,
                        [&](const auto& q, const auto& k, const auto& v, auto o, Index, Index) {
                          attention_.parallel_into(q, k, v, mask, o);
                        });
  }

  /// Causal prefill: sequence i of `layout` continues the state at batch position slots[i]
  /// (or i when `slots` is empty), which absorbs its tokens. Views as in forward() with
  /// Tq = Tk. Throws ShapeError if the number of sequences does not match, a slot is out of
  /// range or repeated, or the state's shape differs from this layer's.
  void prefill(ConstView Q, ConstView K, ConstView V, View out, State& state,
               const SequenceLayout& layout = SequenceLayout::batch(),
               std::span<const Index> slots = {}) const {
    check_views(Q, K, V, out, layout, true);
    const Index sequences = layout.count(Q.batches());
    check_state(state, sequences, slots);
    if constexpr (!shares_states) {
      over_sequence_heads(
          Q, K, V, out, layout, sequences,
          [&](const auto& q, const auto& k, const auto& v, auto o, Index s, Index h) {
            attention_.parallel_into(q, k, v, Mask::causal, slot_state(state, slots, s, h), o);
          });
    } else {
      over_sequence_groups(Q, K, V, out, layout, sequences,
                           [&](auto&& query, const auto& k, const auto& v, auto&& output,
                               Index s, Index g) {
                             attention_.parallel_group_into(group_size(), query, k, v,
                                                            slot_state(state, slots, s, g),
                                                            output);
                           });
    }
  }

  /// One decode token for each sequence: q [N, 1, H_q, dk], k [N, 1, H_kv, dk],
  /// v [N, 1, H_kv, dv], out [N, 1, H_q, dv]; batch row i steps the state at position
  /// slots[i] (or i when `slots` is empty). Allocates nothing. Throws as prefill().
  void step(ConstView q, ConstView k, ConstView v, View out, State& state,
            std::span<const Index> slots = {}) const {
    if (q.times() != 1)
      detail::throw_shape_error("a decode step takes one token per sequence, got q ",
                                q.describe());
    check_views(q, k, v, out, SequenceLayout::batch(), true);
    check_state(state, q.batches(), slots);
    const Index H = state_heads(), G = group_size();
    detail::parallel_for(q.batches() * H, threads_, [&](Index item) {
      const Index b = item / H, h = item % H;
      if (!shares_states || G == 1) {
        const Index g = kv_head(h);
        attention_.step_into(slot_state(state, slots, b, h), q.head_matrix(b, h).row(0),
                             k.head_matrix(b, g).row(0), v.head_matrix(b, g).row(0),
                             out.head_matrix(b, h).row(0));
      } else if constexpr (shares_states) {
        // h is key/value head g; its query heads are g G ... g G + G - 1.
        attention_.step_group_into(
            slot_state(state, slots, b, h), G,
            [&](Index i) { return q.head_matrix(b, h * G + i).row(0); },
            k.head_matrix(b, h).row(0), v.head_matrix(b, h).row(0),
            [&](Index i) { return out.head_matrix(b, h * G + i).row(0); });
      }
    });
  }

 private:
  struct Rows {
    Index entry, first, q_len, k_len, rows;
  };

  // Calls attend(q, k, v, o, s, h) for every (sequence s, query head h) of `sequences`,
  // spread over threads_: q, k, v, o are head h's matrices cut to sequence s's rows (k, v those
  // of h's key/value head); padded rows of the output are zeroed first.
  template <class Attend>
  void over_sequence_heads(const ConstView& Q, const ConstView& K, const ConstView& V,
                           const View& out, const SequenceLayout& layout, Index sequences,
                           Attend&& attend) const {
    const Index H = heads_.q_heads;
    detail::parallel_for(sequences * H, threads_, [&](Index item) {
      const Index s = item / H, h = item % H;
      const Rows rows = rows_of(layout, s, Q.times(), K.times());
      auto o = out.head_matrix(rows.entry, h);
      zero_padding(o, rows, layout);
      const Index g = kv_head(h);
      attend(Q.head_matrix(rows.entry, h).middleRows(rows.first, rows.q_len),
             K.head_matrix(rows.entry, g).middleRows(rows.first, rows.k_len),
             V.head_matrix(rows.entry, g).middleRows(rows.first, rows.k_len),
             o.middleRows(rows.first, rows.q_len), s, h);
    });
  }

  // Calls attend(query, k, v, output, s, g) for every (sequence s, key/value head g), spread
  // over threads_: query(i) and output(i) are query head g G + i's matrices cut to sequence
  // s's rows, k and v those of g; padded rows of the group's outputs are zeroed first.
  template <class AttendGroup>
  void over_sequence_groups(const ConstView& Q, const ConstView& K, const ConstView& V,
                            const View& out, const SequenceLayout& layout, Index sequences,
                            AttendGroup&& attend) const {
    const Index Hkv = heads_.kv_heads, G = group_size();
    detail::parallel_for(sequences * Hkv, threads_, [&](Index item) {
      const Index s = item / Hkv, g = item % Hkv;
      const Rows rows = rows_of(layout, s, Q.times(), K.times());
      for (Index h = g * G; h < (g + 1) * G; ++h) {
        auto o = out.head_matrix(rows.entry, h);
        zero_padding(o, rows, layout);
      }
      attend(
          [&](Index i) {
            return Q.head_matrix(rows.entry, g * G + i).middleRows(rows.first, rows.q_len);
          },
          K.head_matrix(rows.entry, g).middleRows(rows.first, rows.k_len),
          V.head_matrix(rows.entry, g).middleRows(rows.first, rows.k_len),
          [&](Index i) {
            return out.head_matrix(rows.entry, g * G + i).middleRows(rows.first, rows.q_len);
          },
          s, g);
    });
  }

  [[nodiscard]] Index kv_head(Index h) const noexcept {
    return h / (heads_.q_heads / heads_.kv_heads);
  }

  static Rows rows_of(const SequenceLayout& layout, Index s, Index Tq, Index Tk) {
    Rows r{};
    r.entry = layout.batch_entry(s);
    r.first = layout.first_row(s);
    r.rows = Tq;
    if (layout.kind() == SequenceLayout::Kind::batch) {
      r.q_len = Tq;
      r.k_len = Tk;
    } else {
      r.q_len = r.k_len = layout.length(s, Tq);
    }
    return r;
  }

  // Padded rows of a padded layout are defined to be zero.
  template <class O>
  static void zero_padding(O& o, const Rows& rows, const SequenceLayout& layout) {
    if (layout.kind() == SequenceLayout::Kind::padded && rows.q_len < rows.rows)
      o.bottomRows(rows.rows - rows.q_len).setZero();
  }

  // The state of state head h (a key/value head when shares_states, else a query head).
  static AttentionState<Scalar>& slot_state(State& state, std::span<const Index> slots, Index s,
                                            Index h) {
    const Index position = slots.empty() ? s : slots[static_cast<std::size_t>(s)];
    return state.sequence(position).head(h);
  }

  void check_state(const State& state, Index sequences, std::span<const Index> slots) const {
    if (state.heads() != state_heads() || state.feature_dim() != feature_dim() ||
        state.key_dim() != heads_.key_dim || state.value_dim() != heads_.value_dim)
      detail::throw_shape_error("batch state has heads=", state.heads(),
                                " r=", state.feature_dim(), " dk=", state.key_dim(),
                                " dv=", state.value_dim(), " but this layer needs heads=",
                                state_heads(), " r=", feature_dim(), " dk=", heads_.key_dim,
                                " dv=", heads_.value_dim);
    if (slots.empty()) {
      if (state.size() != sequences)
        detail::throw_shape_error("the inputs hold ", sequences, " sequences but the batch state ",
                                  state.size(), " (pass slots to use a subset)");
      return;
    }
    if (static_cast<Index>(slots.size()) != sequences)
      detail::throw_shape_error("the inputs hold ", sequences, " sequences but ", slots.size(),
                                " slots were given");
    // Slots must be distinct: two batch rows on one state would race and double-count.
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] < 0 || slots[i] >= state.size())
        detail::throw_shape_error("slot ", slots[i], " is outside the batch state of size ",
                                  state.size());
      for (std::size_t j = 0; j < i; ++j)
        if (slots[j] == slots[i])
          detail::throw_shape_error("slot ", slots[i], " is given twice");
    }
  }

  void check_views(const ConstView& Q, const ConstView& K, const ConstView& V, const View& out,
                   const SequenceLayout& layout, bool same_length) const {
    auto fail = [&](const char* what) {
      detail::throw_shape_error(what, "; Q ", Q.describe(), ", K ", K.describe(), ", V ",
                                V.describe(), ", out ", out.describe(), " for H_q=",
                                heads_.q_heads, " H_kv=", heads_.kv_heads,
                                " dk=", heads_.key_dim, " dv=", heads_.value_dim);
    };
    if (Q.heads() != heads_.q_heads || out.heads() != heads_.q_heads)
      fail("Q and out need H_q heads");
    if (K.heads() != heads_.kv_heads || V.heads() != heads_.kv_heads)
      fail("K and V need H_kv heads");
    if (Q.dim() != heads_.key_dim || K.dim() != heads_.key_dim) fail("Q and K need dim dk");
    if (V.dim() != heads_.value_dim || out.dim() != heads_.value_dim)
      fail("V and out need dim dv");
    if (K.batches() != Q.batches() || V.batches() != Q.batches() ||
        out.batches() != Q.batches())
      fail("Q, K, V and out need the same batch size");
    if (K.times() != V.times()) fail("K and V need the same number of tokens");
    if (out.times() != Q.times()) fail("out needs as many tokens as Q");
    if ((same_length || layout.kind() != SequenceLayout::Kind::batch) && Q.times() != K.times())
      fail("causal and variable-length attention need as many queries as keys");
    layout.check(Q.batches(), Q.times());
  }

  Attention attention_;
  HeadConfig heads_;
  int threads_ = 0;
};

}  // namespace linattn
