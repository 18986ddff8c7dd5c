// libFuzzer target: the multi-head layer (multihead.hpp, multihead_gradients.hpp) over head
// configurations, sequence layouts and buffer placements chosen by the input. The input picks
// the scalar type, the rule (Additive, Decay, Gated with one gate per token or per channel,
// GatedDelta), H_kv, the query and value groups G and G_v, dk, dv, B, T, the layout
// (batch, packed, padded) with its offsets or lengths, each buffer's layout (batch-first or
// head-first) and its element offset from an allocation's start, the values, and sometimes one
// broken thing (a head count that is not a multiple, an offset list that does not end at T, a
// length past T, one view with a wrong extent, an out-of-range gate or beta).
// Contract (docs/multihead.md, docs/input_contract.md):
// - a valid head configuration is accepted, an invalid one refused with a ShapeError; a broken
//   view or layout is refused with a std::invalid_argument by parallel_into, prefill_into and
//   parallel_backward_into alike;
// - with valid moderate inputs every call succeeds, and gives the bits of the single-head calls
//   it is made of: each output head of each sequence is attn.parallel (or prefill, then step;
//   for query heads sharing a state the grouped step with the head alone) on copies of its rows,
//   read from query/key head h / G_v and key/value head h / G; padded
//   output rows are zero; dQ, dK, dV and the per-token inputs' gradients are the single-head
//   backward's, summed over a group's members in member order where heads are shared.
// ASan and UBSan watch every access of the layer's index arithmetic (detail::HeadMap, the
// sequence layouts, the views' strides).

#include "fuzz_support.hpp"

#include <linattn/linattn.hpp>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <tuple>
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

template <class Scalar, class M>
bool same_bits(const M& layer, const RowMatrix<Scalar>& single) {
  if (layer.rows() != single.rows() || layer.cols() != single.cols()) return false;
  for (Index i = 0; i < single.rows(); ++i)
    for (Index j = 0; j < single.cols(); ++j) {
      const Scalar a = layer(i, j), b = single(i, j);
      if (!(a == b || (a != a && b != b))) return false;
    }
  return true;
}

/// Where sequence s lies: batch entry, first row, rows.
struct Span {
  Index batch, first, length;
};

struct Shape {
  Index Hkv, G, Gv, Hq, Hv, dk, dv, B, T;
  int rule;
  bool per_channel;
  int layout;  // 0 batch, 1 packed, 2 padded
  std::vector<Index> layout_numbers;
  bool broken_heads, broken_layout;
  int broken_view;  // 0 none, else which view gets a wrong extent
  bool special_values, inputs_out_of_range;

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
  s.rule = in.u8() % 4;
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
  std::fprintf(stderr, " )\n");
  broken(what);
}

template <class Scalar, class Attention>
void run_layer(Bytes& in, const Shape& s, const Attention& attn) {
  const auto broken = [&s](const char* what) { broken_for(s, what); };
  using Rule = typename Attention::rule_type;
  constexpr int inputs = Rule::token_inputs;
  const HeadConfig heads{.q_heads = s.Hq, .kv_heads = s.Hkv, .key_dim = s.dk, .value_dim = s.dv,
                         .value_heads = s.Hv};
  std::optional<MultiHeadAttention<Attention>> layer;
  const int made = outcome([&] { layer.emplace(heads, attn); });
  if (made != 0 && made != 2) broken("a head configuration refused with a non-shape error");
  if ((made == 0) != valid_heads(s)) broken("a head configuration accepted or refused wrongly");
  if (made != 0) return;

  const Index Hout = std::max(s.Hq, s.Hv), r = attn.feature_dim(s.dk);
  const Index gate_width = Rule::kind == WriteKind::gated && s.per_channel ? r : 1;
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
  auto single_inputs = [&](const Span& sp, Index vh) {
    std::vector<RowMatrix<Scalar>> rows;
    for (const auto& t : token_inputs) rows.push_back(t.rows(sp.batch, vh, sp.first, sp.length));
    return rows;
  };
  // Output head h reads query head q_of(h), key head k_of(h), value head (and inputs) v_of(h).
  auto q_of = [&](Index h) { return s.Gv > 1 ? h / s.Gv : h; };
  auto k_of = [&](Index h) { return s.Gv > 1 ? h / s.Gv : h / s.G; };
  auto v_of = [&](Index h) { return s.Gv > 1 ? h : h / s.G; };
  auto expect = [&](int result, const char* what) {
    if (broken_call) {
      if (result != 2) broken(what);
    } else if (moderate && result != 0) {
      broken(what);
    } else if (result == 3) {
      broken(what);
    }
  };

  // The buffers and calls of the prefill and decode step (2.) and the backward (3.), made
  // first: a broken call must be refused by each of them.
  const Index N = s.sequences();
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
  Tensor<Scalar> dY(in, s.B, s.T, Hout, s.dv), dQ(in, s.B, s.T, s.Hq, s.dk),
      dK(in, s.B, s.T, s.Hkv, s.dk), dV(in, s.B, s.T, s.Hv, s.dv);
  dY.fill(in, stream, Fill::moderate);
  for (Tensor<Scalar>* grad : {&dQ, &dK, &dV}) grad->fill(in, stream, Fill::moderate);
  std::vector<Tensor<Scalar>> d_inputs;
  for (const auto& t : token_inputs) {
    d_inputs.emplace_back(in, t.B, t.T, t.H, t.d);
    d_inputs.back().fill(in, stream, Fill::moderate);
  }
  const GradientViews<Scalar> grads{dQ.view(), dK.view(), dV.view()};
  const auto backward_call = [&] {
    with_inputs([&](const auto&... x) {
      if constexpr (inputs == 0)
        parallel_backward_into(*layer, Q.cview(), K.cview(), V.cview(), Mask::causal,
                               dY.cview(), grads, layout);
      else if constexpr (inputs == 1)
        parallel_backward_into(*layer, Q.cview(), K.cview(), V.cview(), x..., Mask::causal,
                               dY.cview(), grads, d_inputs[0].view(), layout);
      else
        parallel_backward_into(*layer, Q.cview(), K.cview(), V.cview(), x..., Mask::causal,
                               dY.cview(), grads, d_inputs[0].view(), d_inputs[1].view(), layout);
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
    // (the backward takes dY, not the output: a wrong output extent does not concern it)
    const int refused = outcome(backward_call);
    if (s.broken_layout || s.broken_view != 3) {
      if (refused != 2) broken("parallel_backward_into: a broken call not refused as such");
    } else if (moderate && refused != 0) {
      broken("parallel_backward_into refused valid inputs");
    }
    return;
  }
  if (!moderate) return;
  for (Index seq = 0; seq < s.sequences(); ++seq) {
    const Span sp = s.span(seq);
    for (Index h = 0; h < Hout; ++h) {
      const auto x = single_inputs(sp, v_of(h));
      const RowMatrix<Scalar> Qh = Q.rows(sp.batch, q_of(h), sp.first, sp.length),
                              Kh = K.rows(sp.batch, k_of(h), sp.first, sp.length),
                              Vh = V.rows(sp.batch, v_of(h), sp.first, sp.length);
      RowMatrix<Scalar> expected;
      if constexpr (inputs == 0) expected = attn.parallel(Qh, Kh, Vh, Mask::causal);
      else if constexpr (inputs == 1) expected = attn.parallel(Qh, Kh, Vh, x[0], Mask::causal);
      else expected = attn.parallel(Qh, Kh, Vh, x[0], x[1], Mask::causal);
      if (!same_bits<Scalar>(out.rows(sp.batch, h, sp.first, sp.length), expected))
        broken("parallel_into: a head differs from its single-head call");
    }
  }
  if (s.layout == 2)
    for (Index b = 0; b < s.B; ++b)
      for (Index t = s.layout_numbers[static_cast<std::size_t>(b)]; t < s.T; ++t)
        for (Index h = 0; h < Hout; ++h)
          for (Index c = 0; c < s.dv; ++c)
            if (out(b, t, h, c) != Scalar(0)) broken("parallel_into: a padded output row is not zero");

  // 2. Prefill, then one decode step per sequence, against the single-head state's.
  const int prefilled = outcome(prefill_call);
  if (prefilled != 0) broken("prefill_into or step_into refused valid inputs");
  for (Index seq = 0; seq < N; ++seq) {
    const Span sp = s.span(seq);
    for (Index h = 0; h < Hout; ++h) {
      const auto x = single_inputs(sp, v_of(h));
      auto head = attn.make_state(s.dk, s.dv);
      const RowMatrix<Scalar> Qh = Q.rows(sp.batch, q_of(h), sp.first, sp.length),
                              Kh = K.rows(sp.batch, k_of(h), sp.first, sp.length),
                              Vh = V.rows(sp.batch, v_of(h), sp.first, sp.length);
      RowMatrix<Scalar> prefix;
      if constexpr (inputs == 0) prefix = attn.prefill(head, Qh, Kh, Vh);
      else if constexpr (inputs == 1) prefix = attn.prefill(head, Qh, Kh, Vh, x[0]);
      else prefix = attn.prefill(head, Qh, Kh, Vh, x[0], x[1]);
      if (!same_bits<Scalar>(out.rows(sp.batch, h, sp.first, sp.length), prefix))
        broken("prefill_into: a head differs from its single-head prefill");
      const RowMatrix<Scalar> q = q1.rows(seq, q_of(h), 0, 1), k = k1.rows(seq, k_of(h), 0, 1),
                              v = v1.rows(seq, v_of(h), 0, 1);
      // The step's per-token inputs: a number each, or a per-channel gate's row.
      const auto step_in = [&](const Tensor<Scalar>& t) {
        if constexpr (Rule::kind == WriteKind::gated) return t.rows(seq, v_of(h), 0, 1);
        else return t(seq, 0, v_of(h), 0);
      };
      RowMatrix<Scalar> y(1, s.dv);
      const auto step = [&](const auto&... x) {
        if (s.G > 1) {
          // Query heads sharing a state decode through the grouped step (absorb once, read per
          // head); the reference is that step with this head alone. It agrees with the plain
          // step to rounding only (attention.hpp), so the plain step is not the reference here.
          const std::vector<ConstRowsView<Scalar>> queries{
              ConstRowsView<Scalar>(q.data(), 1, s.dk, Eigen::OuterStride<>(s.dk))};
          const std::vector<RowsView<Scalar>> outputs{
              RowsView<Scalar>(y.data(), 1, s.dv, Eigen::OuterStride<>(s.dv))};
          attn.step_into(head, queries, k.row(0), v.row(0), x..., outputs);
        } else {
          attn.step_into(head, q.row(0), k.row(0), v.row(0), x..., y.row(0));
        }
      };
      if constexpr (inputs == 0) step();
      else if constexpr (inputs == 1) step(step_in(step_inputs[0]));
      else step(step_in(step_inputs[0]), step_in(step_inputs[1]));
      if (!same_bits<Scalar>(o1.rows(seq, h, 0, 1), y))
        broken("step_into: a head differs from its single-head step");
    }
  }

  // 3. The stateless backward, against the single-head backwards (summed in member order).
  const int backward = outcome(backward_call);
  if (backward != 0) broken("parallel_backward_into refused valid inputs");
  for (Index seq = 0; seq < N; ++seq) {
    const Span sp = s.span(seq);
    // Sums of the shared heads' gradients, in member order (the first written, the others added).
    std::vector<RowMatrix<Scalar>> sum_Q(static_cast<std::size_t>(s.Hq)),
        sum_K(static_cast<std::size_t>(s.Hkv)), sum_V(static_cast<std::size_t>(s.Hv));
    std::vector<std::vector<RowMatrix<Scalar>>> sum_in(static_cast<std::size_t>(inputs),
                                                       std::vector<RowMatrix<Scalar>>(static_cast<std::size_t>(s.Hv)));
    auto add = [](RowMatrix<Scalar>& sum, const auto& g) {
      if (sum.size() == 0 && g.size() != 0) sum = g;
      else if (g.size() != 0) sum += g;
    };
    for (Index h = 0; h < Hout; ++h) {
      const auto x = single_inputs(sp, v_of(h));
      const RowMatrix<Scalar> Qh = Q.rows(sp.batch, q_of(h), sp.first, sp.length),
                              Kh = K.rows(sp.batch, k_of(h), sp.first, sp.length),
                              Vh = V.rows(sp.batch, v_of(h), sp.first, sp.length),
                              dYh = dY.rows(sp.batch, h, sp.first, sp.length);
      if constexpr (inputs == 0) {
        const auto g = parallel_backward(attn, Qh, Kh, Vh, Mask::causal, dYh);
        add(sum_Q[static_cast<std::size_t>(q_of(h))], g.Q);
        add(sum_K[static_cast<std::size_t>(k_of(h))], g.K);
        add(sum_V[static_cast<std::size_t>(v_of(h))], g.V);
      } else {
        const auto g = [&] {
          if constexpr (inputs == 1) return parallel_backward(attn, Qh, Kh, Vh, x[0], Mask::causal, dYh);
          else return parallel_backward(attn, Qh, Kh, Vh, x[0], x[1], Mask::causal, dYh);
        }();
        add(sum_Q[static_cast<std::size_t>(q_of(h))], g.Q);
        add(sum_K[static_cast<std::size_t>(k_of(h))], g.K);
        add(sum_V[static_cast<std::size_t>(v_of(h))], g.V);
        const auto vh = static_cast<std::size_t>(v_of(h));
        if constexpr (Rule::kind == WriteKind::gated) {
          add(sum_in[0][vh], g.inputs.log_gate);
        } else {
          add(sum_in[0][vh], RowMatrix<Scalar>(g.inputs.beta));
          add(sum_in[1][vh], RowMatrix<Scalar>(g.inputs.log_alpha));
        }
      }
    }
    auto check = [&](const Tensor<Scalar>& grad, const std::vector<RowMatrix<Scalar>>& sums,
                     const char* what) {
      for (Index h = 0; h < static_cast<Index>(sums.size()); ++h) {
        const auto& expected = sums[static_cast<std::size_t>(h)];
        if (sp.length == 0 || expected.size() == 0) continue;
        if (!same_bits<Scalar>(grad.rows(sp.batch, h, sp.first, sp.length), expected)) broken(what);
      }
    };
    if (s.layout == 2) {  // padded rows: zero gradients
      auto zero_past = [&](const Tensor<Scalar>& grad, const char* what) {
        for (Index t = sp.length; t < s.T; ++t)
          for (Index h = 0; h < grad.H; ++h)
            for (Index c = 0; c < grad.d; ++c)
              if (grad(sp.batch, t, h, c) != Scalar(0)) broken(what);
      };
      zero_past(dQ, "parallel_backward_into: a padded row of dQ is not zero");
      zero_past(dK, "parallel_backward_into: a padded row of dK is not zero");
      zero_past(dV, "parallel_backward_into: a padded row of dV is not zero");
    }
    check(dQ, sum_Q, "parallel_backward_into: dQ differs from the single-head backwards' sum");
    check(dK, sum_K, "parallel_backward_into: dK differs from the single-head backwards' sum");
    check(dV, sum_V, "parallel_backward_into: dV differs from the single-head backwards' sum");
    for (int i = 0; i < inputs; ++i)
      check(d_inputs[static_cast<std::size_t>(i)], sum_in[static_cast<std::size_t>(i)],
            "parallel_backward_into: a per-token input's gradient differs from the single-head sum");
  }
}

template <class Scalar>
void run(Bytes& in) {
  const Shape s = read_shape(in);
  switch (s.rule) {
    case 0: run_layer<Scalar>(in, s, LinearAttention<EluPlusOne, Scalar>()); break;
    case 1: run_layer<Scalar>(in, s, RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.5))); break;
    case 2: run_layer<Scalar>(in, s, RuleAttention<EluPlusOne, Gated, Scalar>()); break;
    default: run_layer<Scalar>(in, s, RuleAttention<L2Normalize, GatedDelta, Scalar>()); break;
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
