// libFuzzer target: the multi-head layer (multihead.hpp, multihead_gradients.hpp,
// multihead_saved_forward.hpp) over head configurations, sequence layouts, state slots and buffer
// placements chosen by the input. The input picks the scalar type, the attention (ELU+1 features
// with Additive, Decay, Gated with one gate per token or per channel, GatedDelta with
// L2-normalized keys and one log_alpha per token or per channel, or positive random features, whose log-scaled states are kept per query
// head), H_kv, the query and value groups G and G_v, dk, dv, B, T, the layout (batch, packed,
// padded) with its offsets or lengths, the carried states' positions and slots, each buffer's
// layout (batch-first or head-first) and its element offset from an allocation's start, the
// values, and sometimes one broken thing (a head count that is not a multiple, an offset list
// that does not end at T, a length past T, one view with a wrong extent, a slot out of range or
// repeated, an out-of-range gate or beta).
// Contract (docs/multihead.md, docs/input_contract.md):
// - a valid head configuration is accepted, an invalid one refused with a ShapeError; a broken
//   view, layout or slot list is refused with a std::invalid_argument by every call it reaches;
// - with valid moderate inputs every call succeeds, and gives the bits of the single-head calls
//   it is made of: each output head of each sequence is attn.parallel (or prefill, then step;
//   for query heads sharing a state the grouped step with the head alone) on copies of its rows,
//   read from query/key head h / G_v and key/value head h / G, continuing its state head's state
//   at the sequence's slot; padded output rows are zero; the saving forwards give the forwards'
//   bits (outputs and states);
// - the backwards (stateless and carried, recomputing and from a saved forward) give dQ, dK, dV,
//   the per-token inputs' gradients and the initial states' gradients of the single-head
//   backwards, summed over a group's members in member order where heads or states are shared
//   (the first member of a shared state carries the final state's gradient); padded rows get
//   zero gradients; state gradients at positions no slot names are not touched.
// ASan and UBSan watch every access of the layer's index arithmetic (detail::HeadMap, the
// sequence layouts, the slots, the views' strides).

#include "fuzz_support.hpp"

#include <linattn/linattn.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <vector>

using namespace linattn;
using linattn_fuzz::broken;
using linattn_fuzz::Bytes;
using linattn_fuzz::outcome;

namespace {

enum class Fill { moderate, special, log_gate, beta };

/// The values' bytes: a xorshift stream seeded from the input, so that a short input (the
/// fuzzer's are a few bytes, and Bytes gives zeros past the end) still fills its tensors with
/// distinct values: with equal values a head that read another head's rows would go unseen.
class Stream {
 public:
  explicit Stream(std::uint32_t seed) : x_(seed * 2654435761u + 1u) {}
  std::uint8_t u8() {
    x_ ^= x_ << 13;
    x_ ^= x_ >> 17;
    x_ ^= x_ << 5;
    return static_cast<std::uint8_t>(x_ >> 24);
  }

 private:
  std::uint32_t x_;
};

/// A [B, T, H, d] tensor: a buffer holding it in one layout, `offset` elements past the start of
/// its allocation (so the layer sees every alignment), and the single-head row copies.
template <class Scalar>
struct Tensor {
  Index B = 0, T = 0, H = 0, d = 0;
  bool head_first = false;
  Index offset = 0;
  std::vector<Scalar> buffer;

  Tensor(Bytes& in, Index B_, Index T_, Index H_, Index d_)
      : B(B_), T(T_), H(H_), d(d_), head_first(in.u8() % 2 == 1), offset(in.u8() % 9),
        buffer(static_cast<std::size_t>(offset + B_ * T_ * H_ * d_), Scalar(0)) {}

  [[nodiscard]] Index at(Index b, Index t, Index h, Index c) const {
    return offset + (head_first ? ((b * H + h) * T + t) * d + c : ((b * T + t) * H + h) * d + c);
  }
  Scalar& operator()(Index b, Index t, Index h, Index c) {
    return buffer[static_cast<std::size_t>(at(b, t, h, c))];
  }
  [[nodiscard]] Scalar operator()(Index b, Index t, Index h, Index c) const {
    return buffer[static_cast<std::size_t>(at(b, t, h, c))];
  }
  void fill(Bytes& in, Stream& stream, Fill kind) {
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < T; ++t)
        for (Index h = 0; h < H; ++h)
          for (Index c = 0; c < d; ++c) {
            const auto byte = static_cast<Scalar>(stream.u8());
            switch (kind) {
              case Fill::moderate: (*this)(b, t, h, c) = (byte - Scalar(128)) / Scalar(32); break;
              case Fill::special: (*this)(b, t, h, c) = in.special<Scalar>(); break;
              case Fill::log_gate: (*this)(b, t, h, c) = -byte / Scalar(64); break;
              case Fill::beta: (*this)(b, t, h, c) = byte / Scalar(128); break;
            }
          }
  }
  [[nodiscard]] TensorView<Scalar> view() {
    Scalar* p = buffer.data() + offset;
    return head_first ? TensorView<Scalar>::head_first(p, B, H, T, d)
                      : TensorView<Scalar>::batch_first(p, B, T, H, d);
  }
  [[nodiscard]] TensorView<const Scalar> cview() const {
    const Scalar* p = buffer.data() + offset;
    return head_first ? TensorView<const Scalar>::head_first(p, B, H, T, d)
                      : TensorView<const Scalar>::batch_first(p, B, T, H, d);
  }
  /// Rows [first, first + n) of head h of batch entry b, copied.
  [[nodiscard]] RowMatrix<Scalar> rows(Index b, Index h, Index first, Index n) const {
    RowMatrix<Scalar> m(n, d);
    for (Index t = 0; t < n; ++t)
      for (Index c = 0; c < d; ++c) m(t, c) = (*this)(b, first + t, h, c);
    return m;
  }
};

/// Whether a and b have the same shape and bits (NaN matching NaN).
template <class A, class B>
bool same_bits(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index i = 0; i < b.rows(); ++i)
    for (Index j = 0; j < b.cols(); ++j) {
      const auto x = a(i, j), y = b(i, j);
      if (!(x == y || (x != x && y != y))) return false;
    }
  return true;
}

/// The gradients a layer backward writes, each buffer pre-filled with values (a gradient the
/// layer fails to write shows).
template <class Scalar>
struct GradientBuffers {
  Tensor<Scalar> dQ, dK, dV;
  std::vector<Tensor<Scalar>> d_inputs;
  [[nodiscard]] GradientViews<Scalar> views() { return {dQ.view(), dK.view(), dV.view()}; }
};

/// Where sequence s lies: batch entry, first row, rows.
struct Span {
  Index batch, first, length;
};

struct Shape {
  Index Hkv, G, Gv, Hq, Hv, dk, dv, B, T;
  int rule;  // 0 Additive, 1 Decay, 2 Gated, 3 GatedDelta (ELU+1 or L2Normalize), 4 random features
  bool per_channel;
  int layout;  // 0 batch, 1 packed, 2 padded
  std::vector<Index> layout_numbers;
  bool broken_heads, broken_layout;
  int broken_view;  // 0 none, else which view gets a wrong extent
  bool special_values, inputs_out_of_range;
  Index extra_positions;  // carried states: positions no sequence's slot names
  bool use_slots, broken_slots;

  [[nodiscard]] SequenceLayout sequence_layout() const {
    if (layout == 1) return SequenceLayout::packed(layout_numbers);
    if (layout == 2) return SequenceLayout::padded(layout_numbers);
    return SequenceLayout::batch();
  }
  [[nodiscard]] Index sequences() const {
    return layout == 1 ? static_cast<Index>(layout_numbers.size()) - 1 : B;
  }
  [[nodiscard]] Span span(Index s) const {
    if (layout == 1)
      return {0, layout_numbers[static_cast<std::size_t>(s)],
              layout_numbers[static_cast<std::size_t>(s) + 1] - layout_numbers[static_cast<std::size_t>(s)]};
    if (layout == 2) return {s, 0, layout_numbers[static_cast<std::size_t>(s)]};
    return {s, 0, T};
  }
};

Shape read_shape(Bytes& in) {
  Shape s{};
  s.rule = in.u8() % 5;
  s.per_channel = in.u8() % 2 == 1;
  s.Hkv = 1 + in.u8() % 3;
  s.G = 1 + in.u8() % 3;
  s.Gv = 1 + in.u8() % 3;
  s.broken_heads = in.u8() % 16 == 1 && s.Hkv > 1;  // (any H_q is a multiple of 1)
  s.Hq = s.Hkv * s.G + (s.broken_heads ? 1 : 0);
  s.Hv = s.Hkv * s.Gv;
  s.dk = 1 + in.u8() % 4;
  s.dv = 1 + in.u8() % 4;
  s.T = in.u8() % 10;
  s.layout = in.u8() % 3;
  s.B = s.layout == 1 ? 1 : 1 + in.u8() % 3;
  s.broken_layout = in.u8() % 16 == 1;
  if (s.layout == 1) {
    const Index n = 1 + in.u8() % 4;
    s.layout_numbers.push_back(0);
    for (Index i = 1; i < n; ++i)
      s.layout_numbers.push_back(std::min<Index>(s.T, s.layout_numbers.back() + in.u8() % 4));
    s.layout_numbers.push_back(s.T + (s.broken_layout ? 1 : 0));
  } else if (s.layout == 2) {
    for (Index b = 0; b < s.B; ++b) s.layout_numbers.push_back(in.u8() % (s.T + 1));
    if (s.broken_layout) s.layout_numbers[0] = s.T + 1;
  } else {
    s.broken_layout = false;
  }
  s.broken_view = in.u8() % 12 == 1 ? 1 + in.u8() % 4 : 0;
  s.special_values = in.u8() % 8 == 1;
  s.inputs_out_of_range = in.u8() % 16 == 1;
  s.extra_positions = in.u8() % 3;
  s.use_slots = s.extra_positions > 0 || in.u8() % 2 == 1;
  s.broken_slots = s.use_slots && in.u8() % 16 == 1;
  return s;
}

/// The head configuration's own validity (docs/multihead.md, "Heads").
bool valid_heads(const Shape& s) { return !s.broken_heads && (s.G == 1 || s.Gv == 1); }

/// Prints the case before broken(): what a reproduction needs to know first.
[[noreturn]] void broken_for(const Shape& s, const char* what) {
  std::fprintf(stderr,
               "linattn fuzz: rule %d%s, H_q=%td H_kv=%td H_v=%td dk=%td dv=%td B=%td T=%td, "
               "layout %d (",
               s.rule, s.per_channel ? " per channel" : "", s.Hq, s.Hkv, s.Hv, s.dk, s.dv, s.B, s.T,
               s.layout);
  for (const Index n : s.layout_numbers) std::fprintf(stderr, " %td", n);
  std::fprintf(stderr, " ), %td extra state positions%s%s\n", s.extra_positions,
               s.use_slots ? ", slots" : "", s.broken_slots ? " (broken)" : "");
  broken(what);
}

template <class Scalar, class Attention>
void run_layer(Bytes& in, const Shape& s, const Attention& attn) {
  const auto broken = [&s](const char* what) { broken_for(s, what); };
  const auto broken_in = [&s](const char* call, const char* what) {
    std::fprintf(stderr, "linattn fuzz: in %s\n", call);
    broken_for(s, what);
  };
  using Rule = typename Attention::rule_type;
  using Layer = MultiHeadAttention<Attention>;
  constexpr int inputs = Rule::token_inputs;
  const HeadConfig heads{.q_heads = s.Hq, .kv_heads = s.Hkv, .key_dim = s.dk, .value_dim = s.dv,
                         .value_heads = s.Hv};
  std::optional<Layer> layer;
  const int made = outcome([&] { layer.emplace(heads, attn); });
  if (made != 0 && made != 2) broken("a head configuration refused with a non-shape error");
  if ((made == 0) != valid_heads(s)) broken("a head configuration accepted or refused wrongly");
  if (made != 0) return;

  const Index Hout = std::max(s.Hq, s.Hv), r = attn.feature_dim(s.dk);
  const Index gate_width =
      (Rule::kind == WriteKind::gated || Rule::kind == WriteKind::gated_delta) && s.per_channel
          ? r
          : 1;
  // One view may get a wrong extent (allocated as such: the layer must refuse it, not read it).
  auto extent = [&](int which, Index value) { return value + (s.broken_view == which ? 1 : 0); };
  Tensor<Scalar> Q(in, s.B, s.T, extent(1, s.Hq), s.dk), K(in, s.B, s.T, s.Hkv, extent(2, s.dk)),
      V(in, s.B, s.T, s.Hv, s.dv), out(in, s.B, s.T, extent(3, Hout), s.dv);
  const std::uint32_t seed_low = in.u8(), seed_high = in.u8();
  Stream stream(seed_low | (seed_high << 8));
  const Fill values = s.special_values ? Fill::special : Fill::moderate;
  out.fill(in, stream, Fill::moderate);  // not zero: the layer must write (or zero) every row
  Q.fill(in, stream, values);
  K.fill(in, stream, values);
  V.fill(in, stream, values);
  std::vector<Tensor<Scalar>> token_inputs;
  for (int i = 0; i < inputs; ++i) {
    const bool gate = Rule::kind == WriteKind::gated || i == 1;
    token_inputs.emplace_back(in, s.B, s.T, extent(4, s.Hv), gate ? gate_width : 1);
    token_inputs.back().fill(in, stream, s.inputs_out_of_range ? Fill::special
                                 : gate                 ? Fill::log_gate
                                                        : Fill::beta);
  }
  // (a wrong extent for the per-token inputs breaks only a rule that takes them)
  const bool broken_call = s.broken_layout || (s.broken_view != 0 && (s.broken_view != 4 || inputs > 0));
  const bool moderate = !s.special_values && !s.inputs_out_of_range;
  const SequenceLayout layout = s.sequence_layout();

  // Calls the layer with the per-token input views spliced in after Q, K, V.
  auto with_inputs = [&](auto&& f) {
    if constexpr (inputs == 0) return f();
    else if constexpr (inputs == 1) return f(token_inputs[0].cview());
    else return f(token_inputs[0].cview(), token_inputs[1].cview());
  };
  // ... and with the views of a backward's per-token input gradients.
  auto with_d_inputs = [](GradientBuffers<Scalar>& g, auto&& f) {
    if constexpr (inputs == 0) return f();
    else if constexpr (inputs == 1) return f(g.d_inputs[0].view());
    else return f(g.d_inputs[0].view(), g.d_inputs[1].view());
  };
  // Calls a single-head function with one head's per-token input rows spliced in.
  auto splice = [](const std::vector<RowMatrix<Scalar>>& x, auto&& f) {
    if constexpr (inputs == 0) return f();
    else if constexpr (inputs == 1) return f(x[0]);
    else return f(x[0], x[1]);
  };
  auto single_inputs = [&](const Span& sp, Index vh) {
    std::vector<RowMatrix<Scalar>> rows;
    for (const auto& t : token_inputs) rows.push_back(t.rows(sp.batch, vh, sp.first, sp.length));
    return rows;
  };
  // Output head h reads query head q_of(h), key head k_of(h), value head (and inputs) v_of(h),
  // and the state of state head state_of(h); the first reader of a shared state carries the
  // final state's gradient in a carried backward.
  auto q_of = [&](Index h) { return s.Gv > 1 ? h / s.Gv : h; };
  auto k_of = [&](Index h) { return s.Gv > 1 ? h / s.Gv : h / s.G; };
  auto v_of = [&](Index h) { return s.Gv > 1 ? h : h / s.G; };
  auto state_of = [&](Index h) { return Layer::shares_states ? v_of(h) : h; };
  auto first_reader = [&](Index h) { return !Layer::shares_states || h % s.G == 0; };
  auto expect = [&](int result, const char* what) {
    if (broken_call) {
      if (result != 2) broken(what);
    } else if (moderate && result != 0) {
      broken(what);
    } else if (result == 3) {
      broken(what);
    }
  };
  auto make_gradients = [&] {
    GradientBuffers<Scalar> g{Tensor<Scalar>(in, s.B, s.T, s.Hq, s.dk),
                              Tensor<Scalar>(in, s.B, s.T, s.Hkv, s.dk),
                              Tensor<Scalar>(in, s.B, s.T, s.Hv, s.dv), {}};
    for (Tensor<Scalar>* grad : {&g.dQ, &g.dK, &g.dV}) grad->fill(in, stream, Fill::moderate);
    for (const auto& t : token_inputs) {
      g.d_inputs.emplace_back(in, t.B, t.T, t.H, t.d);
      g.d_inputs.back().fill(in, stream, Fill::moderate);
    }
    return g;
  };

  // The carried states' positions and the sequences' slots among them (a permutation's first N
  // positions; sometimes one out of range or repeated).
  const Index N = s.sequences(), P = N + s.extra_positions;
  std::vector<Index> slots;
  if (s.use_slots) {
    std::vector<Index> positions(static_cast<std::size_t>(P));
    for (Index i = 0; i < P; ++i) positions[static_cast<std::size_t>(i)] = i;
    for (Index i = P - 1; i > 0; --i)
      std::swap(positions[static_cast<std::size_t>(i)], positions[stream.u8() % static_cast<std::size_t>(i + 1)]);
    slots.assign(positions.begin(), positions.begin() + N);
    if (s.broken_slots) {
      const int how = stream.u8() % 3;
      slots[0] = how == 0 && N > 1 ? slots[static_cast<std::size_t>(N) - 1] : how == 1 ? -1 : P;
    }
  }
  const std::span<const Index> slot_span(slots);
  auto position_of = [&](Index seq) { return slots.empty() ? seq : slots[static_cast<std::size_t>(seq)]; };

  // The buffers and calls of every section, made first: a broken call must be refused by each.
  auto state = layer->make_state(N);
  Tensor<Scalar> q1(in, N, 1, s.Hq, s.dk), k1(in, N, 1, s.Hkv, s.dk), v1(in, N, 1, s.Hv, s.dv),
      o1(in, N, 1, Hout, s.dv);
  o1.fill(in, stream, Fill::moderate);
  q1.fill(in, stream, Fill::moderate);
  k1.fill(in, stream, Fill::moderate);
  v1.fill(in, stream, Fill::moderate);
  std::vector<Tensor<Scalar>> step_inputs;
  for (int i = 0; i < inputs; ++i) {
    const bool gate = Rule::kind == WriteKind::gated || i == 1;
    step_inputs.emplace_back(in, N, 1, s.Hv, gate ? gate_width : 1);
    step_inputs.back().fill(in, stream, gate ? Fill::log_gate : Fill::beta);
  }
  const auto prefill_call = [&] {
    with_inputs([&](const auto&... x) {
      layer->prefill_into(state, Q.cview(), K.cview(), V.cview(), x..., out.view(), layout);
    });
    if constexpr (inputs == 0)
      layer->step_into(state, q1.cview(), k1.cview(), v1.cview(), o1.view());
    else if constexpr (inputs == 1)
      layer->step_into(state, q1.cview(), k1.cview(), v1.cview(), step_inputs[0].cview(), o1.view());
    else
      layer->step_into(state, q1.cview(), k1.cview(), v1.cview(), step_inputs[0].cview(),
                       step_inputs[1].cview(), o1.view());
  };
  Tensor<Scalar> dY(in, s.B, s.T, Hout, s.dv);
  dY.fill(in, stream, Fill::moderate);
  auto grads = make_gradients();
  const auto backward_call = [&](GradientBuffers<Scalar>& g) {
    with_inputs([&](const auto&... x) {
      with_d_inputs(g, [&](const auto&... dx) {
        parallel_backward_into(*layer, Q.cview(), K.cview(), V.cview(), x..., Mask::causal,
                               dY.cview(), g.views(), dx..., layout);
      });
    });
  };
  LayerSavedForward<Scalar> saved;
  Tensor<Scalar> out_saved(in, s.B, s.T, extent(3, Hout), s.dv);
  out_saved.fill(in, stream, Fill::moderate);
  const auto saving_call = [&] {
    with_inputs([&](const auto&... x) {
      parallel_saving_into(*layer, Q.cview(), K.cview(), V.cview(), x..., Mask::causal,
                           out_saved.view(), saved, layout);
    });
  };
  const auto saved_backward_call = [&](GradientBuffers<Scalar>& g) {
    with_inputs([&](const auto&... x) {
      with_d_inputs(g, [&](const auto&... dx) {
        parallel_backward_into(*layer, saved, Q.cview(), K.cview(), V.cview(), x..., Mask::causal,
                               dY.cview(), g.views(), dx..., layout);
      });
    });
  };
  auto carried = layer->make_state(P);
  // State gradients shaped like the carried states, every entry a value from the stream.
  const auto state_gradients = [&] {
    BatchStateGradient<Scalar> gradients(carried);
    for (Index p = 0; p < P; ++p)
      for (Index h = 0; h < gradients.heads(); ++h) {
        StateGradient<Scalar>& g = gradients.head(p, h);
        for (Index i = 0; i < g.S.size(); ++i) g.S.data()[i] = (stream.u8() - Scalar(128)) / Scalar(32);
        for (Index i = 0; i < g.z.size(); ++i) g.z[i] = (stream.u8() - Scalar(128)) / Scalar(32);
      }
    return gradients;
  };
  const BatchStateGradient<Scalar> final_gradients = state_gradients();
  LayerSavedForward<Scalar> carried_saved;
  const auto carried_prefill = [&](auto& st, Tensor<Scalar>& o) {
    with_inputs([&](const auto&... x) {
      layer->prefill_into(st, Q.cview(), K.cview(), V.cview(), x..., o.view(), layout, slot_span);
    });
  };
  const auto carried_saving = [&](auto& st, Tensor<Scalar>& o) {
    with_inputs([&](const auto&... x) {
      prefill_saving_into(*layer, st, Q.cview(), K.cview(), V.cview(), x..., o.view(),
                          carried_saved, layout, slot_span);
    });
  };
  // From the states before the call (a BatchState) or from the saving forward's LayerSavedForward.
  const auto carried_backward = [&](const auto& from, GradientBuffers<Scalar>& g,
                                    BatchStateGradient<Scalar>& initial) {
    with_inputs([&](const auto&... x) {
      with_d_inputs(g, [&](const auto&... dx) {
        prefill_backward_into(*layer, from, Q.cview(), K.cview(), V.cview(), x..., dY.cview(),
                              &final_gradients, g.views(), dx..., initial, layout, slot_span);
      });
    });
  };

  // 1. Stateless causal forward.
  const int forward = outcome([&] {
    with_inputs([&](const auto&... x) {
      layer->parallel_into(Q.cview(), K.cview(), V.cview(), x..., Mask::causal, out.view(), layout);
    });
  });
  expect(forward, "parallel_into: a broken call accepted or a valid one refused");
  if (broken_call) {
    if (outcome(prefill_call) != 2) broken("prefill_into: a broken call not refused as such");
    if (outcome(saving_call) != 2) broken("parallel_saving_into: a broken call not refused as such");
    if (outcome([&] { carried_prefill(carried, out); }) != 2)
      broken("prefill_into at slots: a broken call not refused as such");
    if (outcome([&] { carried_saving(carried, out); }) != 2)
      broken("prefill_saving_into: a broken call not refused as such");
    // (the backward takes dY, not the output: a wrong output extent does not concern it)
    const int refused = outcome([&] { backward_call(grads); });
    BatchStateGradient<Scalar> initial(carried);
    const int carried_refused = outcome([&] { carried_backward(carried, grads, initial); });
    if (s.broken_layout || s.broken_view != 3) {
      if (refused != 2) broken("parallel_backward_into: a broken call not refused as such");
      if (carried_refused != 2) broken("prefill_backward_into: a broken call not refused as such");
    } else {
      if (moderate && refused != 0) broken("parallel_backward_into refused valid inputs");
      if (s.broken_slots ? carried_refused != 2 : moderate && carried_refused != 0)
        broken("prefill_backward_into: a broken slot list accepted or valid inputs refused");
    }
    return;
  }
  if (s.broken_slots) {  // every call with slots refuses them, whatever the values
    if (outcome([&] { carried_prefill(carried, out); }) != 2)
      broken("prefill_into: a broken slot list not refused as such");
    if (outcome([&] { carried_saving(carried, out); }) != 2)
      broken("prefill_saving_into: a broken slot list not refused as such");
    BatchStateGradient<Scalar> initial(carried);
    if (outcome([&] { carried_backward(carried, grads, initial); }) != 2)
      broken("prefill_backward_into: a broken slot list not refused as such");
  }
  if (!moderate) return;
  // Every output head of every sequence of `o` against expected(seq, h, sp), and padded rows zero.
  const auto check_outputs = [&](const char* call, const Tensor<Scalar>& o, const auto& expected) {
    for (Index seq = 0; seq < N; ++seq) {
      const Span sp = s.span(seq);
      for (Index h = 0; h < Hout; ++h)
        if (!same_bits(o.rows(sp.batch, h, sp.first, sp.length), expected(seq, h, sp)))
          broken_in(call, "a head differs from its single-head call");
    }
    if (s.layout == 2)
      for (Index b = 0; b < s.B; ++b)
        for (Index t = s.layout_numbers[static_cast<std::size_t>(b)]; t < s.T; ++t)
          for (Index h = 0; h < Hout; ++h)
            for (Index c = 0; c < s.dv; ++c)
              if (o(b, t, h, c) != Scalar(0)) broken_in(call, "a padded output row is not zero");
  };
  const auto head_rows = [&](const Tensor<Scalar>& t, const Span& sp, Index head) {
    return t.rows(sp.batch, head, sp.first, sp.length);
  };
  check_outputs("parallel_into", out, [&](Index, Index h, const Span& sp) {
    return splice(single_inputs(sp, v_of(h)), [&](const auto&... x) {
      return attn.parallel(head_rows(Q, sp, q_of(h)), head_rows(K, sp, k_of(h)),
                           head_rows(V, sp, v_of(h)), x..., Mask::causal);
    });
  });
  const Tensor<Scalar> parallel_out = out;
  if (outcome(saving_call) != 0) broken("parallel_saving_into refused valid inputs");
  check_outputs("parallel_saving_into", out_saved, [&](Index, Index h, const Span& sp) {
    return head_rows(parallel_out, sp, h);
  });

  // 2. Prefill, then one decode step per sequence, against the single-head state's.
  const int prefilled = outcome(prefill_call);
  if (prefilled != 0) broken("prefill_into or step_into refused valid inputs");
  check_outputs("prefill_into", out, [&](Index, Index h, const Span& sp) {
    auto head = attn.make_state(s.dk, s.dv);
    return splice(single_inputs(sp, v_of(h)), [&](const auto&... x) {
      return attn.prefill(head, head_rows(Q, sp, q_of(h)), head_rows(K, sp, k_of(h)),
                          head_rows(V, sp, v_of(h)), x...);
    });
  });
  for (Index seq = 0; seq < N; ++seq) {
    const Span sp = s.span(seq);
    for (Index h = 0; h < Hout; ++h) {
      auto head = attn.make_state(s.dk, s.dv);
      splice(single_inputs(sp, v_of(h)), [&](const auto&... x) {
        static_cast<void>(attn.prefill(head, head_rows(Q, sp, q_of(h)), head_rows(K, sp, k_of(h)),
                                       head_rows(V, sp, v_of(h)), x...));
      });
      const RowMatrix<Scalar> q = q1.rows(seq, q_of(h), 0, 1), k = k1.rows(seq, k_of(h), 0, 1),
                              v = v1.rows(seq, v_of(h), 0, 1);
      // The step's per-token inputs: a number each, or a per-channel gate's row.
      const auto step_in = [&](const Tensor<Scalar>& t) {
        if constexpr (Rule::kind == WriteKind::gated) return t.rows(seq, v_of(h), 0, 1);
        else return t(seq, 0, v_of(h), 0);
      };
      RowMatrix<Scalar> y(1, s.dv);
      const auto step = [&](const auto&... x) {
        if constexpr (Layer::shares_states) {
          if (s.G > 1) {
            // Query heads sharing a state decode through the grouped step (absorb once, read
            // per head); the reference is that step with this head alone. It agrees with the
            // plain step to rounding only (attention.hpp), so the plain step is not the
            // reference here.
            const std::vector<ConstRowsView<Scalar>> queries{
                ConstRowsView<Scalar>(q.data(), 1, s.dk, Eigen::OuterStride<>(s.dk))};
            const std::vector<RowsView<Scalar>> outputs{
                RowsView<Scalar>(y.data(), 1, s.dv, Eigen::OuterStride<>(s.dv))};
            attn.step_into(head, queries, k.row(0), v.row(0), x..., outputs);
            return;
          }
        }
        attn.step_into(head, q.row(0), k.row(0), v.row(0), x..., y.row(0));
      };
      if constexpr (inputs == 0) step();
      else if constexpr (inputs == 1) step(step_in(step_inputs[0]));
      else if (s.per_channel)  // GatedDelta's per-channel log_alpha: the row
        step(step_in(step_inputs[0]), step_inputs[1].rows(seq, v_of(h), 0, 1));
      else step(step_in(step_inputs[0]), step_in(step_inputs[1]));
      if (!same_bits(o1.rows(seq, h, 0, 1), y))
        broken("step_into: a head differs from its single-head step");
    }
  }

  // The gradients a layer backward wrote into g (and, for a carried backward, into `initial` at
  // the sequences' positions) against single(seq, h, Qh, Kh, Vh, x, dYh, final) of each output
  // head, summed over shared heads and states in member order (the first written, the others
  // added); padded rows zero; positions no slot names keep `untouched`'s gradients.
  const auto check_gradients = [&](const char* call, const GradientBuffers<Scalar>& g,
                                   const auto& single, const BatchStateGradient<Scalar>* initial,
                                   const BatchStateGradient<Scalar>* untouched) {
    const auto add = [](auto& sum, const auto& term) {
      if (sum.size() == 0 && term.size() != 0) sum = term;
      else if (term.size() != 0) sum += term;
    };
    const auto count = [](Index n) { return static_cast<std::size_t>(n); };
    std::vector<bool> named(count(P), false);
    for (Index seq = 0; seq < N; ++seq) {
      const Span sp = s.span(seq);
      // (a stateless backward has no positions, and its slots may be the broken ones)
      const Index position = initial != nullptr ? position_of(seq) : 0;
      if (initial != nullptr) named[count(position)] = true;
      std::vector<RowMatrix<Scalar>> sum_Q(count(s.Hq)), sum_K(count(s.Hkv)), sum_V(count(s.Hv));
      std::vector<std::vector<RowMatrix<Scalar>>> sum_in(count(inputs),
                                                         std::vector<RowMatrix<Scalar>>(count(s.Hv)));
      std::vector<RowMatrix<Scalar>> sum_S(count(layer->state_heads()));
      std::vector<ColVector<Scalar>> sum_z(count(layer->state_heads()));
      for (Index h = 0; h < Hout; ++h) {
        const StateGradient<Scalar>* final_gradient =
            initial != nullptr && first_reader(h) ? &final_gradients.head(position, state_of(h)) : nullptr;
        const auto gr = single(seq, h, head_rows(Q, sp, q_of(h)), head_rows(K, sp, k_of(h)),
                               head_rows(V, sp, v_of(h)), single_inputs(sp, v_of(h)),
                               head_rows(dY, sp, h), final_gradient);
        add(sum_Q[count(q_of(h))], gr.Q);
        add(sum_K[count(k_of(h))], gr.K);
        add(sum_V[count(v_of(h))], gr.V);
        const auto vh = count(v_of(h));
        if constexpr (Rule::kind == WriteKind::gated) {
          add(sum_in[0][vh], gr.inputs.log_gate);
        } else if constexpr (inputs == 2) {
          add(sum_in[0][vh], RowMatrix<Scalar>(gr.inputs.beta));
          add(sum_in[1][vh], RowMatrix<Scalar>(gr.inputs.log_alpha));
        }
        add(sum_S[count(state_of(h))], gr.initial.S);
        add(sum_z[count(state_of(h))], gr.initial.z);
      }
      const auto check = [&](const Tensor<Scalar>& grad, const std::vector<RowMatrix<Scalar>>& sums,
                             const char* what) {
        for (Index h = 0; h < static_cast<Index>(sums.size()); ++h) {
          const auto& expected = sums[count(h)];
          if (sp.length == 0 || expected.size() == 0) continue;
          if (!same_bits(head_rows(grad, sp, h), expected)) broken_in(call, what);
        }
        if (s.layout == 2)  // padded rows: zero gradients
          for (Index t = sp.length; t < s.T; ++t)
            for (Index h = 0; h < grad.H; ++h)
              for (Index c = 0; c < grad.d; ++c)
                if (grad(sp.batch, t, h, c) != Scalar(0)) broken_in(call, "a padded row's gradient is not zero");
      };
      check(g.dQ, sum_Q, "dQ differs from the single-head backwards' sum");
      check(g.dK, sum_K, "dK differs from the single-head backwards' sum");
      check(g.dV, sum_V, "dV differs from the single-head backwards' sum");
      for (int i = 0; i < inputs; ++i)
        check(g.d_inputs[count(i)], sum_in[count(i)],
              "a per-token input's gradient differs from the single-head backwards' sum");
      if (initial != nullptr)
        for (Index sh = 0; sh < layer->state_heads(); ++sh) {
          const StateGradient<Scalar>& got = initial->head(position, sh);
          if (!same_bits(got.S, sum_S[count(sh)]) || !same_bits(got.z, sum_z[count(sh)]))
            broken_in(call, "an initial state's gradient differs from the single-head backwards' sum");
        }
    }
    if (initial != nullptr)
      for (Index p = 0; p < P; ++p)
        for (Index sh = 0; sh < layer->state_heads() && !named[count(p)]; ++sh)
          if (!same_bits(initial->head(p, sh).S, untouched->head(p, sh).S) ||
              !same_bits(initial->head(p, sh).z, untouched->head(p, sh).z))
            broken_in(call, "a state gradient at a position no slot names changed");
  };

  // 3. The stateless backwards, recomputing and from the saved forward of section 1.
  if (outcome([&] { backward_call(grads); }) != 0) broken("parallel_backward_into refused valid inputs");
  check_gradients("parallel_backward_into", grads,
                  [&](Index, Index, const auto& Qh, const auto& Kh, const auto& Vh, const auto& x,
                      const auto& dYh, const StateGradient<Scalar>*) {
                    return splice(x, [&](const auto&... xi) {
                      return parallel_backward(attn, Qh, Kh, Vh, xi..., Mask::causal, dYh);
                    });
                  },
                  nullptr, nullptr);
  auto saved_grads = make_gradients();
  if (outcome([&] { saved_backward_call(saved_grads); }) != 0)
    broken("parallel_backward_into from a saved forward refused valid inputs");
  check_gradients("parallel_backward_into from a saved forward", saved_grads,
                  [&](Index, Index, const auto& Qh, const auto& Kh, const auto& Vh, const auto& x,
                      const auto& dYh, const StateGradient<Scalar>*) {
                    SavedForward<Scalar> one;
                    RowMatrix<Scalar> y(Qh.rows(), s.dv);
                    return splice(x, [&](const auto&... xi) {
                      parallel_saving_into(attn, Qh, Kh, Vh, xi..., Mask::causal, y, one);
                      return parallel_backward(attn, one, Qh, Kh, Vh, xi..., Mask::causal, dYh);
                    });
                  },
                  nullptr, nullptr);
  if (s.broken_slots) return;

  // 4. Carried states at slots (training in segments): the named positions filled by a first
  // prefill; then prefill_into and prefill_saving_into continuing them, and both backwards.
  if (outcome([&] { carried_prefill(carried, out); }) != 0) broken("prefill_into at slots refused valid inputs");
  const auto before = carried;
  if (outcome([&] { carried_prefill(carried, out); }) != 0) broken("prefill_into at slots refused valid inputs");
  const auto head_before = [&](Index seq, Index h) {
    return before.sequence(position_of(seq)).head(state_of(h));
  };
  check_outputs("prefill_into at slots", out, [&](Index seq, Index h, const Span& sp) {
    auto head = head_before(seq, h);
    return splice(single_inputs(sp, v_of(h)), [&](const auto&... x) {
      return attn.prefill(head, head_rows(Q, sp, q_of(h)), head_rows(K, sp, k_of(h)),
                          head_rows(V, sp, v_of(h)), x...);
    });
  });
  auto saving_state = before;
  Tensor<Scalar> out_carried(in, s.B, s.T, Hout, s.dv);
  out_carried.fill(in, stream, Fill::moderate);
  if (outcome([&] { carried_saving(saving_state, out_carried); }) != 0)
    broken("prefill_saving_into refused valid inputs");
  check_outputs("prefill_saving_into", out_carried, [&](Index, Index h, const Span& sp) {
    return head_rows(out, sp, h);
  });
  for (Index p = 0; p < P; ++p)
    for (Index sh = 0; sh < layer->state_heads(); ++sh) {
      const auto& a = saving_state.sequence(p).head(sh);
      const auto& b = carried.sequence(p).head(sh);
      bool same = same_bits(a.S(), b.S()) && a.tokens() == b.tokens();
      if constexpr (Rule::keeps_normalizer) same = same && same_bits(a.z(), b.z());
      if (!same) broken("prefill_saving_into: a state differs from prefill_into's");
    }
  for (Index p = 0; p < P; ++p) {
    bool named = false;
    for (Index seq = 0; seq < N; ++seq) named = named || position_of(seq) == p;
    for (Index sh = 0; sh < layer->state_heads() && !named; ++sh)
      if (!same_bits(carried.sequence(p).head(sh).S(), before.sequence(p).head(sh).S()) ||
          carried.sequence(p).head(sh).tokens() != before.sequence(p).head(sh).tokens())
        broken("prefill_into: a state at a position no slot names changed");
  }

  const BatchStateGradient<Scalar> untouched = state_gradients();
  auto initial = untouched;
  auto carried_grads = make_gradients();
  if (outcome([&] { carried_backward(before, carried_grads, initial); }) != 0)
    broken("prefill_backward_into refused valid inputs");
  check_gradients("prefill_backward_into", carried_grads,
                  [&](Index seq, Index h, const auto& Qh, const auto& Kh, const auto& Vh,
                      const auto& x, const auto& dYh, const StateGradient<Scalar>* final_gradient) {
                    const auto head = head_before(seq, h);
                    return splice(x, [&](const auto&... xi) {
                      return prefill_backward(attn, head, Qh, Kh, Vh, xi..., dYh, final_gradient);
                    });
                  },
                  &initial, &untouched);
  auto initial_saved = untouched;
  auto carried_saved_grads = make_gradients();
  if (outcome([&] { carried_backward(carried_saved, carried_saved_grads, initial_saved); }) != 0)
    broken("prefill_backward_into from a saved forward refused valid inputs");
  check_gradients("prefill_backward_into from a saved forward", carried_saved_grads,
                  [&](Index seq, Index h, const auto& Qh, const auto& Kh, const auto& Vh,
                      const auto& x, const auto& dYh, const StateGradient<Scalar>* final_gradient) {
                    auto head = head_before(seq, h);
                    SavedForward<Scalar> one;
                    RowMatrix<Scalar> y(Qh.rows(), s.dv);
                    return splice(x, [&](const auto&... xi) {
                      prefill_saving_into(attn, head, Qh, Kh, Vh, xi..., y, one);
                      return prefill_backward(attn, one, Qh, Kh, Vh, xi..., dYh, final_gradient);
                    });
                  },
                  &initial_saved, &untouched);
}

template <class Scalar>
void run(Bytes& in) {
  const Shape s = read_shape(in);
  switch (s.rule) {
    case 0: run_layer<Scalar>(in, s, LinearAttention<EluPlusOne, Scalar>()); break;
    case 1: run_layer<Scalar>(in, s, RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.5))); break;
    case 2: run_layer<Scalar>(in, s, RuleAttention<EluPlusOne, Gated, Scalar>()); break;
    case 3: run_layer<Scalar>(in, s, RuleAttention<L2Normalize, GatedDelta, Scalar>()); break;
    default:
      run_layer<Scalar>(in, s, LinearAttention<PositiveRandomFeatures<Scalar>, Scalar>(
                                   PositiveRandomFeatures<Scalar>(s.dk, 3, 1)));
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  if (in.u8() % 2 == 0)
    run<float>(in);
  else
    run<double>(in);
  return 0;
}
