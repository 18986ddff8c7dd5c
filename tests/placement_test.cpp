// Results do not depend on where the caller's buffers sit in memory. Eigen's vectorized loops
// start their packets at the first aligned address of a row or vector and take the elements
// before it one by one; a packet's sum runs in another order than a scalar loop's, and with FMA
// a packet's multiply-add rounds once where the scalar form rounds twice. A library that hands
// such a loop the caller's memory gives bits that depend on the buffer's address. This file
// places Q, K, V, the per-token inputs, dY and the outputs at every element offset within a
// 64-byte line (the widest packet) and checks every entry point gives the bits of the aligned
// placement, for each rule, both kernel forms (a value width the register kernel takes and one
// it does not) and both scalar types. It is part of the groups the CI builds at a packet width
// wider than the baseline (scripts/test.sh), where the test buffers' 16-byte alignment differs
// from Eigen's own allocations.

#include <linattn/gradients.hpp>
#include <linattn/linattn.hpp>
#include <linattn/random_features.hpp>
#include <linattn/rule_gradients.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace placement_test {  // this file's own names: it builds inside a group

using namespace linattn;
using linattn_test::random_matrix;
using linattn_test::uniform_matrix;

namespace {

template <class Scalar>
using Placed = Eigen::Map<RowMatrix<Scalar>, Eigen::Unaligned, Eigen::OuterStride<>>;

// A copy of `m` at `offset` elements into a fresh buffer whose rows are `pad` elements longer
// than m's (so row r starts at offset + r (cols + pad)), and the Map over it.
template <class Scalar>
struct PlacedCopy {
  std::vector<Scalar> storage;
  Placed<Scalar> view;
  PlacedCopy(const RowMatrix<Scalar>& m, Index offset, Index pad)
      : storage(static_cast<std::size_t>(offset + m.rows() * (m.cols() + pad) + 1), Scalar(-7)),
        view(storage.data() + offset, m.rows(), m.cols(), Eigen::OuterStride<>(m.cols() + pad)) {
    view = m;
  }
};

// Everything one placement computes: the outputs of the forward entry points and, for the
// rules with gradients, the backward's.
template <class Scalar>
struct Results {
  std::vector<RowMatrix<Scalar>> parts;
};

template <class Attention, std::size_t N>
Results<typename Attention::scalar_type> run_all(const Attention& attn,
                                                 const std::array<RowMatrix<typename Attention::scalar_type>, 3 + N + 1>& data,
                                                 Index offset, Index pad, Index T0) {
  using Scalar = typename Attention::scalar_type;
  std::vector<PlacedCopy<Scalar>> placed;
  placed.reserve(data.size());
  for (std::size_t i = 0; i < data.size(); ++i)
    // Each buffer at its own offset (7 i apart) so no two share a placement.
    placed.emplace_back(data[i], (offset + 7 * Index(i)) % 16, pad);
  const auto& Q = placed[0].view;
  const auto& K = placed[1].view;
  const auto& V = placed[2].view;
  const auto& dY = placed[3 + N].view;
  const Index T = Q.rows(), dv = V.cols();
  Results<Scalar> res;
  const auto out = [&] { return PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, dv), (offset + 5) % 16, pad); };

  [&]<std::size_t... I>(std::index_sequence<I...>) {
    // Stateless causal forward, chunked and token by token, into placed outputs.
    auto y = out();
    attn.parallel_into(Q, K, V, placed[3 + I].view..., Mask::causal, y.view);
    res.parts.push_back(y.view);
    auto y2 = out();
    auto fresh = attn.make_state(Q.cols(), dv);
    attn.recurrent_into(fresh, Q, K, V, placed[3 + I].view..., y2.view);
    res.parts.push_back(y2.view);
    // Prefill T0 tokens, then decode the rest step by step.
    auto state = attn.make_state(Q.cols(), dv);
    auto y3 = out();
    attn.prefill_into(state, Q.topRows(T0), K.topRows(T0), V.topRows(T0),
                      placed[3 + I].view.topRows(T0)..., y3.view.topRows(T0));
    for (Index t = T0; t < T; ++t) {
      [[maybe_unused]] const auto step_input = [&](const Placed<Scalar>& x) {
        if constexpr (Attention::rule_type::kind == WriteKind::gated) return x.row(t);
        else return x(t, 0);
      };
      auto yt = y3.view.row(t);
      attn.step_into(state, Q.row(t), K.row(t), V.row(t), step_input(placed[3 + I].view)..., yt);
    }
    res.parts.push_back(y3.view);
    res.parts.push_back(state.S());
    // The backward, into placed gradients.
    if constexpr (Attention::rule_type::kind == WriteKind::additive) {
      auto dq = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, Q.cols()), (offset + 3) % 16, pad);
      auto dk = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, K.cols()), (offset + 9) % 16, pad);
      auto dvv = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, dv), (offset + 13) % 16, pad);
      parallel_backward_into(attn, Q, K, V, Mask::causal, dY, GradientsRef<Scalar>{dq.view, dk.view, dvv.view});
      res.parts.push_back(dq.view);
      res.parts.push_back(dk.view);
      res.parts.push_back(dvv.view);
    } else {
      auto dq = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, Q.cols()), (offset + 3) % 16, pad);
      auto dk = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, K.cols()), (offset + 9) % 16, pad);
      auto dvv = PlacedCopy<Scalar>(RowMatrix<Scalar>::Zero(T, dv), (offset + 13) % 16, pad);
      RuleInputGradients<Scalar> d_in;
      parallel_backward_into(attn, Q, K, V, placed[3 + I].view..., Mask::causal, dY,
                             GradientsRef<Scalar>{dq.view, dk.view, dvv.view}, d_in);
      res.parts.push_back(dq.view);
      res.parts.push_back(dk.view);
      res.parts.push_back(dvv.view);
      res.parts.push_back(d_in.log_gate);
      res.parts.push_back(d_in.beta);
      res.parts.push_back(d_in.log_alpha);
    }
  }(std::make_index_sequence<N>{});
  return res;
}

template <class Attention, std::size_t N>
void check_placements(const std::string& name, const Attention& attn, Index dk, Index dv,
                      const std::array<std::array<double, 3>, N>& inputs) {
  using Scalar = typename Attention::scalar_type;
  const Index T = 23, T0 = 17;
  std::array<RowMatrix<Scalar>, 3 + N + 1> data;
  data[0] = random_matrix<Scalar>(T, dk, 100);
  data[1] = random_matrix<Scalar>(T, dk, 101);
  data[2] = random_matrix<Scalar>(T, dv, 102);
  for (std::size_t i = 0; i < N; ++i)  // {columns (0: dk), lo, hi}
    data[3 + i] = uniform_matrix<Scalar>(T, inputs[i][0] == 0 ? dk : Index(inputs[i][0]), 103 + i,
                                         inputs[i][1], inputs[i][2]);
  data[3 + N] = random_matrix<Scalar>(T, dv, 110);
  const Results<Scalar> aligned = run_all<Attention, N>(attn, data, 0, 0, T0);
  for (const Index pad : {Index(0), Index(3)})
    for (Index offset = 0; offset < 16; ++offset) {
      INFO(name << ", dk " << dk << ", dv " << dv << ", offset " << offset << ", row padding " << pad);
      const Results<Scalar> got = run_all<Attention, N>(attn, data, offset, pad, T0);
      REQUIRE(got.parts.size() == aligned.parts.size());
      for (std::size_t p = 0; p < got.parts.size(); ++p) {
        INFO("result " << p);
        CHECK(linattn_test::same_bits(got.parts[p], aligned.parts[p]));
      }
    }
}

template <class Scalar>
void check_every_rule(Index dk, Index dv, Index chunk) {
  Options opt;
  opt.chunk_size = chunk;  // several chunks, the last one partial
  Options unnormalized = opt;
  unnormalized.normalization = Normalization::unnormalized();
  using None = std::array<std::array<double, 3>, 0>;
  check_placements("additive, elu + 1", LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, opt), dk, dv, None{});
  check_placements("additive, l2 normalize", LinearAttention<L2Normalize, Scalar>(L2Normalize{}, unnormalized), dk, dv, None{});
  check_placements("decay", RuleAttention<EluPlusOne, Decay, Scalar>(EluPlusOne{}, Decay(0.9), opt), dk, dv, None{});
  check_placements("scalar gates", RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, opt), dk, dv,
                   std::array<std::array<double, 3>, 1>{{{1, -0.5, -0.01}}});
  check_placements("per-channel gates", RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, opt), dk, dv,
                   std::array<std::array<double, 3>, 1>{{{0, -0.5, -0.01}}});
  check_placements("delta", RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, unnormalized), dk, dv,
                   std::array<std::array<double, 3>, 1>{{{1, 0.1, 0.9}}});
  check_placements("gated delta", RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, unnormalized), dk, dv,
                   std::array<std::array<double, 3>, 2>{{{1, 0.1, 0.9}, {1, -0.5, -0.01}}});
}

// The chunked and token-by-token forward and the backward of `attn` from Q, K, V in the storage
// order the caller's types give them (the per-token inputs and dY row-major).
template <class Attention, class MQ, class MK, class MV, class... Inputs>
Results<typename Attention::scalar_type> run_stored(const Attention& attn, const MQ& Q, const MK& K, const MV& V,
                                                    const RowMatrix<typename Attention::scalar_type>& dY,
                                                    const Inputs&... inputs) {
  using Scalar = typename Attention::scalar_type;
  const Index T = Q.rows(), dv = V.cols();
  Results<Scalar> res;
  RowMatrix<Scalar> y(T, dv);
  attn.parallel_into(Q, K, V, inputs..., Mask::causal, y);
  res.parts.push_back(y);
  auto state = attn.make_state(Q.cols(), dv);
  attn.recurrent_into(state, Q, K, V, inputs..., y);
  res.parts.push_back(y);
  res.parts.push_back(state.S());
  RowMatrix<Scalar> dq(T, Q.cols()), dk(T, K.cols()), dvv(T, dv);
  if constexpr (Attention::rule_type::kind == WriteKind::additive) {
    parallel_backward_into(attn, Q, K, V, Mask::causal, dY, GradientsRef<Scalar>{dq, dk, dvv});
  } else {
    RuleInputGradients<Scalar> d_in;
    parallel_backward_into(attn, Q, K, V, inputs..., Mask::causal, dY, GradientsRef<Scalar>{dq, dk, dvv}, d_in);
    res.parts.push_back(d_in.beta);
  }
  res.parts.push_back(dq);
  res.parts.push_back(dk);
  res.parts.push_back(dvv);
  return res;
}

// Q, K, V column-major, and as every other element of rows twice as long: the bits of
// row-major Q, K, V.
template <class Attention, class... Inputs>
void check_storage_orders(const std::string& name, const Attention& attn, Index dk, Index dv,
                          const Inputs&... inputs) {
  using Scalar = typename Attention::scalar_type;
  using ColumnMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
  using EveryOther = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::Stride<Eigen::Dynamic, 2>>;
  const Index T = 23;
  const RowMatrix<Scalar> Q = random_matrix<Scalar>(T, dk, 100), K = random_matrix<Scalar>(T, dk, 101),
                          V = random_matrix<Scalar>(T, dv, 102), dY = random_matrix<Scalar>(T, dv, 110);
  const Results<Scalar> row_major = run_stored(attn, Q, K, V, dY, inputs...);
  const ColumnMajor Qc = Q, Kc = K, Vc = V;
  const Results<Scalar> column_major = run_stored(attn, Qc, Kc, Vc, dY, inputs...);
  const auto spread = [](const RowMatrix<Scalar>& m) {
    RowMatrix<Scalar> wide = RowMatrix<Scalar>::Zero(m.rows(), 2 * m.cols());
    for (Index j = 0; j < m.cols(); ++j) wide.col(2 * j) = m.col(j);
    return wide;
  };
  const RowMatrix<Scalar> Qw = spread(Q), Kw = spread(K), Vw = spread(V);
  const auto every_other = [](const RowMatrix<Scalar>& wide) {
    return EveryOther(wide.data(), wide.rows(), wide.cols() / 2, Eigen::Stride<Eigen::Dynamic, 2>(wide.cols(), 2));
  };
  const Results<Scalar> strided = run_stored(attn, every_other(Qw), every_other(Kw), every_other(Vw), dY, inputs...);
  for (std::size_t p = 0; p < row_major.parts.size(); ++p) {
    INFO(name << ", dk " << dk << ", dv " << dv << ", result " << p);
    CHECK(linattn_test::same_bits(column_major.parts[p], row_major.parts[p]));
    CHECK(linattn_test::same_bits(strided.parts[p], row_major.parts[p]));
  }
}

// phi.apply (and apply_scaled where the map has it) of x into `out` placed at every offset and
// with padded rows, from x placed likewise, column-major, and strided: the bits of the aligned
// call; and phi.backward from each of those x. The maps' exp, sin and cos have packet and scalar
// forms that differ in the last bit, which Eigen's own loops would pick per element by the
// destination's address; their row norms sum in packets over a contiguous row and one element at
// a time over a strided one.
template <class Scalar, class Phi>
void check_feature_map(const std::string& name, const Phi& phi, Index d) {
  const Index T = 5, r = phi.feature_dim(d);
  const RowMatrix<Scalar> x = random_matrix<Scalar>(T, d, 41, 2.0);
  RowMatrix<Scalar> aligned(T, r);
  phi.apply(x, aligned);
  ColVector<Scalar> aligned_scale(T), log_scale(T);
  RowMatrix<Scalar> aligned_scaled(T, r);
  constexpr bool scaled = requires { phi.apply_scaled(x, aligned_scaled, log_scale); };
  if constexpr (scaled) phi.apply_scaled(x, aligned_scaled, aligned_scale);
  const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> column_major = x;
  // x's rows at every other element of rows twice as long.
  RowMatrix<Scalar> spread = RowMatrix<Scalar>::Zero(T, 2 * d);
  for (Index j = 0; j < d; ++j) spread.col(2 * j) = x.col(j);
  using EveryOther = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::Stride<Eigen::Dynamic, 2>>;
  const EveryOther every_other(spread.data(), T, d, Eigen::Stride<Eigen::Dynamic, 2>(2 * d, 2));
  const RowMatrix<Scalar> d_features = random_matrix<Scalar>(T, r, 43);
  RowMatrix<Scalar> aligned_d_x(T, d), d_x(T, d);
  phi.backward(x, aligned, d_features, aligned_d_x);
  const auto check_from = [&](const auto& input, auto& out) {
    out.setZero();
    phi.apply(input, out);
    CHECK(linattn_test::same_bits(out, aligned));
    if constexpr (scaled) {
      out.setZero();
      phi.apply_scaled(input, out, log_scale);
      CHECK(linattn_test::same_bits(out, aligned_scaled));
      CHECK(linattn_test::same_bits(log_scale, aligned_scale));
    }
    d_x.setZero();
    phi.backward(input, aligned, d_features, d_x);
    CHECK(linattn_test::same_bits(d_x, aligned_d_x));
  };
  for (Index offset = 0; offset < 16; ++offset)
    for (Index pad : {0, 3}) {
      CAPTURE(name, d, offset, pad);
      PlacedCopy<Scalar> input(x, (offset + 9) % 16, pad);
      PlacedCopy<Scalar> out(RowMatrix<Scalar>::Zero(T, r), offset, pad);
      check_from(input.view, out.view);
      {
        INFO("column-major x");
        check_from(column_major, out.view);
      }
      {
        INFO("x with inner stride 2");
        check_from(every_other, out.view);
      }
    }
}

}  // namespace

TEMPLATE_TEST_CASE("feature maps give the same bits wherever the caller's buffers sit, in any storage order",
                   "[placement]", float, double) {
  using Scalar = TestType;
  // Row lengths with and without a tail past the last whole packet, and one longer than the
  // 256-scalar segments that map_row_uniformly takes off the aligned path.
  for (const Index d : {Index(13), Index(16), Index(300)}) {
    placement_test::check_feature_map<Scalar>("elu + 1", EluPlusOne{}, d);
    placement_test::check_feature_map<Scalar>("l2 normalize", L2Normalize{}, d);
    placement_test::check_feature_map<Scalar>(
        "positive random features", PositiveRandomFeatures<Scalar>(d, d + 3, 11), d);
    RandomFeatureOptions hyperbolic;
    hyperbolic.hyperbolic = true;
    placement_test::check_feature_map<Scalar>(
        "hyperbolic random features", PositiveRandomFeatures<Scalar>(d, d + 3, 11, hyperbolic), d);
    placement_test::check_feature_map<Scalar>(
        "trig random features", TrigRandomFeatures<Scalar>(d, d + 3, 11), d);
  }
}

TEMPLATE_TEST_CASE("every entry point gives the same bits wherever the caller's buffers sit",
                   "[placement]", float, double) {
  // dv = 5: no packet width divides it (the Eigen-product forms); dv = 32: every width does
  // (the register kernels). dk = 13 and 16: a feature row with and without a scalar tail.
  // dk = 6, dv = 5 in chunks of 3: products so small that Eigen evaluates them coefficient by
  // coefficient (rows + columns + depth < 20), in packets from the destination's first aligned
  // element.
  placement_test::check_every_rule<TestType>(13, 5, 8);
  placement_test::check_every_rule<TestType>(16, 32, 8);
  placement_test::check_every_rule<TestType>(6, 5, 3);
}

TEMPLATE_TEST_CASE("column-major and strided inputs give the bits of row-major ones", "[placement]", float,
                   double) {
  // The maps that sum along a row (L2Normalize's and the random maps' norms) read each row
  // contiguously, so a result does not follow the caller's storage order: the additive rule
  // with ELU + 1 and with L2Normalize, and the delta rule (its map is L2Normalize), at the
  // shapes above. (Each map on its own, the random ones included: the test case above.)
  using Scalar = TestType;
  Options opt;
  opt.chunk_size = 8;
  Options unnormalized = opt;
  unnormalized.normalization = Normalization::unnormalized();
  const RowMatrix<Scalar> beta = uniform_matrix<Scalar>(23, 1, 103, 0.1, 0.9);
  for (const auto& [dk, dv] : {std::pair<Index, Index>{13, 5}, {16, 32}}) {
    placement_test::check_storage_orders("additive, elu + 1", LinearAttention<EluPlusOne, Scalar>(EluPlusOne{}, opt), dk, dv);
    placement_test::check_storage_orders("additive, l2 normalize",
                                         LinearAttention<L2Normalize, Scalar>(L2Normalize{}, unnormalized), dk, dv);
    placement_test::check_storage_orders("delta", RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, unnormalized),
                                         dk, dv, beta);
  }
}

}  // namespace placement_test
