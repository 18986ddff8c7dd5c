// MultiHeadAttention over raw buffers: both layouts, grouped heads, packed and padded batches,
// decode state, continuous batching, thread-count independence and shape errors.
//
// References are independent of the library's indexing: heads are cut out of the flat
// buffers with explicit index formulas, and each head is compared with the double-precision
// loop of test_support.hpp (and with a single-head LinearAttention call on the copy).

#include <linattn/multihead.hpp>
#include <linattn/random_features.hpp>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <cmath>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace linattn;
using linattn_test::naive_attention;
using linattn_test::worst_error_ratio;

namespace {

// Same derivation as attention_test.cpp: each weight carries gamma_r, the sum over T keys
// gamma_T, numerator and denominator each, plus division and feature map: 2 (r + T + 4) u
// times sum|w||v| / |den|.
double bound_units(Index r, Index T) { return 2.0 * static_cast<double>(r + T + 4); }

enum class Layout { batch_first, head_first };

// Flat offset of element (b, t, h, c) of a row-major [B, T, H, d] or [B, H, T, d] buffer,
// written out independently of TensorView.
Index flat(Layout l, Index b, Index t, Index h, Index c, Index T, Index H, Index d) {
  return l == Layout::batch_first ? ((b * T + t) * H + h) * d + c : ((b * H + h) * T + t) * d + c;
}

template <class Scalar>
std::vector<Scalar> random_buffer(Index n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<Scalar> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<Scalar>(normal(gen));
  return v;
}

template <class Scalar>
TensorView<Scalar> view(Layout l, Scalar* p, Index B, Index T, Index H, Index d) {
  return l == Layout::batch_first ? TensorView<Scalar>::batch_first(p, B, T, H, d)
                                  : TensorView<Scalar>::head_first(p, B, H, T, d);
}

// Rows [first, first + n) of head h of entry b, copied into a contiguous matrix.
template <class Scalar>
RowMatrix<Scalar> cut(const std::vector<Scalar>& buf, Layout l, Index b, Index h, Index first,
                      Index n, Index T, Index H, Index d) {
  RowMatrix<Scalar> m(n, d);
  for (Index t = 0; t < n; ++t)
    for (Index c = 0; c < d; ++c)
      m(t, c) = buf[static_cast<std::size_t>(flat(l, b, first + t, h, c, T, H, d))];
  return m;
}

// Checks one head's output rows against the double loop (within the rounding bound) and
// against a single-head LinearAttention call on contiguous copies (within twice the bound,
// since both sit within one bound of the exact value).
template <class Scalar, class Attn>
void check_head(const Attn& attn, const RowMatrix<Scalar>& got, const RowMatrix<Scalar>& Q,
                const RowMatrix<Scalar>& K, const RowMatrix<Scalar>& V, bool causal) {
  const auto ref = naive_attention(Q, K, V, causal, linattn_test::elu_plus_one);
  const double units = bound_units(Q.cols(), K.rows());
  CHECK(worst_error_ratio<Scalar>(got, ref, units) <= 1.0);
  const RowMatrix<Scalar> single = attn.parallel(Q, K, V, causal ? Mask::causal : Mask::none);
  CHECK(worst_error_ratio<Scalar>(single, ref, units) <= 1.0);
  double worst = 0;
  for (Index i = 0; i < got.rows(); ++i)
    for (Index c = 0; c < got.cols(); ++c) {
      const double allowed = 2 * units * linattn_test::unit_roundoff<Scalar>() *
                                 ref.magnitude(i, c) +
                             std::numeric_limits<Scalar>::min();
      worst = std::max(worst, std::abs(static_cast<double>(got(i, c) - single(i, c))) / allowed);
    }
  CHECK(worst <= 1.0);
}

struct Dims {
  Index B, Tq, Tk, Hq, Hkv, dk, dv;
};

template <class Scalar>
void check_forward(Layout layout, const Dims& s, Mask mask, int threads) {
  const Index B = s.B, Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, Hkv = s.Hkv, dk = s.dk, dv = s.dv;
  const auto q = random_buffer<Scalar>(B * Tq * Hq * dk, 11);
  const auto k = random_buffer<Scalar>(B * Tk * Hkv * dk, 12);
  const auto v = random_buffer<Scalar>(B * Tk * Hkv * dv, 13);
  std::vector<Scalar> out(static_cast<std::size_t>(B * Tq * Hq * dv), Scalar(-7));
  Options opt;
  opt.chunk_size = 4;  // several chunks per sequence
  MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv}, EluPlusOne{}, opt);
  mha.set_threads(threads);
  mha.forward(view(layout, q.data(), B, Tq, Hq, dk), view(layout, k.data(), B, Tk, Hkv, dk),
              view(layout, v.data(), B, Tk, Hkv, dv), view(layout, out.data(), B, Tq, Hq, dv),
              mask);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < Hq; ++h) {
      const Index g = h / (Hq / Hkv);
      INFO("batch " << b << " head " << h << " kv head " << g);
      check_head<Scalar>(mha.attention(), cut(out, layout, b, h, 0, Tq, Tq, Hq, dv),
                         cut(q, layout, b, h, 0, Tq, Tq, Hq, dk),
                         cut(k, layout, b, g, 0, Tk, Tk, Hkv, dk),
                         cut(v, layout, b, g, 0, Tk, Tk, Hkv, dv), mask == Mask::causal);
    }
}

}  // namespace

TEMPLATE_TEST_CASE("multi-head output equals per-head single-head attention", "[multihead]",
                   float, double) {
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Mask mask = GENERATE(Mask::causal, Mask::none);
  INFO((layout == Layout::batch_first ? "batch-first" : "head-first")
       << (mask == Mask::causal ? ", causal" : ", full"));
  SECTION("plain multi-head, dk != dv") { check_forward<TestType>(layout, {2, 13, 13, 3, 3, 6, 5}, mask, 1); }
  SECTION("grouped heads, H_q = 4, H_kv = 2") { check_forward<TestType>(layout, {2, 9, 9, 4, 2, 4, 7}, mask, 2); }
  SECTION("multi-query, H_kv = 1") { check_forward<TestType>(layout, {1, 10, 10, 4, 1, 5, 3}, mask, 2); }
  SECTION("T = 1 and T = 0") {
    check_forward<TestType>(layout, {2, 1, 1, 2, 1, 3, 2}, mask, 1);
    check_forward<TestType>(layout, {2, 0, 0, 2, 1, 3, 2}, mask, 1);
  }
}

TEMPLATE_TEST_CASE("full attention with Tq != Tk", "[multihead]", float, double) {
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  check_forward<TestType>(layout, {2, 5, 11, 4, 2, 4, 3}, Mask::none, 2);
}

TEST_CASE("a strided slice of a fused qkv buffer is read in place", "[multihead]") {
  // [B, T, 3, H, d] buffer (q, k, v interleaved per token), as a fused projection writes it.
  const Index B = 2, T = 7, H = 2, d = 4;
  const auto qkv = random_buffer<double>(B * T * 3 * H * d, 21);
  const TensorView<const double>::Extents shape{B, T, H, d};
  const TensorView<const double>::Extents strides{T * 3 * H * d, 3 * H * d, d, 1};
  const TensorView<const double> Q(qkv.data(), shape, strides);
  const TensorView<const double> K(qkv.data() + H * d, shape, strides);
  const TensorView<const double> V(qkv.data() + 2 * H * d, shape, strides);
  std::vector<double> out(static_cast<std::size_t>(B * T * H * d));
  const MultiHeadAttention<EluPlusOne, double> mha({H, H, d, d});
  mha.forward(Q, K, V, TensorView<double>::batch_first(out.data(), B, T, H, d), Mask::causal);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      RowMatrix<double> q(T, d), k(T, d), v(T, d);
      for (Index t = 0; t < T; ++t)
        for (Index c = 0; c < d; ++c) {
          const Index base = ((b * T + t) * 3) * H * d + h * d + c;
          q(t, c) = qkv[static_cast<std::size_t>(base)];
          k(t, c) = qkv[static_cast<std::size_t>(base + H * d)];
          v(t, c) = qkv[static_cast<std::size_t>(base + 2 * H * d)];
        }
      check_head<double>(mha.attention(), cut(out, Layout::batch_first, b, h, 0, T, T, H, d), q,
                         k, v, true);
    }
}

TEMPLATE_TEST_CASE("packed variable-length batch: each sequence on its own", "[multihead][varlen]",
                   float, double) {
  using Scalar = TestType;
  const Mask mask = GENERATE(Mask::causal, Mask::none);
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Index T = 20, Hq = 4, Hkv = 2, dk = 5, dv = 3;
  const std::vector<Index> offsets{0, 5, 5, 12, 20};  // lengths 5, 0, 7, 8
  auto q = random_buffer<Scalar>(T * Hq * dk, 31);
  auto k = random_buffer<Scalar>(T * Hkv * dk, 32);
  auto v = random_buffer<Scalar>(T * Hkv * dv, 33);
  std::vector<Scalar> out(static_cast<std::size_t>(T * Hq * dv));
  Options opt;
  opt.chunk_size = 3;
  MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv}, EluPlusOne{}, opt);
  mha.set_threads(2);
  auto run = [&](std::vector<Scalar>& o) {
    mha.forward(view<const Scalar>(layout, q.data(), 1, T, Hq, dk),
                view<const Scalar>(layout, k.data(), 1, T, Hkv, dk),
                view<const Scalar>(layout, v.data(), 1, T, Hkv, dv),
                view(layout, o.data(), 1, T, Hq, dv), mask, SequenceLayout::packed(offsets));
  };
  run(out);
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const Index first = offsets[s], n = offsets[s + 1] - offsets[s];
    for (Index h = 0; h < Hq; ++h) {
      const Index g = h / 2;
      INFO("sequence " << s << " head " << h);
      check_head<Scalar>(mha.attention(), cut(out, layout, 0, h, first, n, T, Hq, dv),
                         cut(q, layout, 0, h, first, n, T, Hq, dk),
                         cut(k, layout, 0, g, first, n, T, Hkv, dk),
                         cut(v, layout, 0, g, first, n, T, Hkv, dv), mask == Mask::causal);
    }
  }
  // Independence: changing the keys of sequence 0 leaves every other row bit-identical.
  for (Index t = 0; t < 5; ++t)
    for (Index c = 0; c < dk; ++c)
      k[static_cast<std::size_t>(flat(layout, 0, t, 1, c, T, Hkv, dk))] += Scalar(3);
  std::vector<Scalar> out2(out.size());
  run(out2);
  for (Index t = 5; t < T; ++t)
    for (Index h = 0; h < Hq; ++h)
      for (Index c = 0; c < dv; ++c) {
        const auto i = static_cast<std::size_t>(flat(layout, 0, t, h, c, T, Hq, dv));
        REQUIRE(out2[i] == out[i]);
      }
}

TEMPLATE_TEST_CASE("padded batch: padded keys reach neither output nor state",
                   "[multihead][padded]", float, double) {
  using Scalar = TestType;
  const Mask mask = GENERATE(Mask::causal, Mask::none);
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Index B = 3, T = 13, Hq = 2, Hkv = 1, dk = 4, dv = 3;
  const std::vector<Index> lengths{7, 0, 13};
  auto q = random_buffer<Scalar>(B * T * Hq * dk, 41);
  auto k = random_buffer<Scalar>(B * T * Hkv * dk, 42);
  auto v = random_buffer<Scalar>(B * T * Hkv * dv, 43);
  // Poison the padding: one NaN or Inf that leaked into S, z or a read would show up.
  const Scalar nan = std::numeric_limits<Scalar>::quiet_NaN();
  const Scalar inf = std::numeric_limits<Scalar>::infinity();
  for (Index b = 0; b < B; ++b)
    for (Index t = lengths[static_cast<std::size_t>(b)]; t < T; ++t) {
      for (Index h = 0; h < Hq; ++h)
        for (Index c = 0; c < dk; ++c) q[static_cast<std::size_t>(flat(layout, b, t, h, c, T, Hq, dk))] = nan;
      for (Index c = 0; c < dk; ++c) k[static_cast<std::size_t>(flat(layout, b, t, 0, c, T, Hkv, dk))] = inf;
      for (Index c = 0; c < dv; ++c) v[static_cast<std::size_t>(flat(layout, b, t, 0, c, T, Hkv, dv))] = nan;
    }
  std::vector<Scalar> out(static_cast<std::size_t>(B * T * Hq * dv), Scalar(5));
  MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv});
  mha.set_threads(2);
  const auto Qv = view<const Scalar>(layout, q.data(), B, T, Hq, dk);
  const auto Kv = view<const Scalar>(layout, k.data(), B, T, Hkv, dk);
  const auto Vv = view<const Scalar>(layout, v.data(), B, T, Hkv, dv);
  const auto Ov = view(layout, out.data(), B, T, Hq, dv);
  auto state = mha.make_state(B);
  if (mask == Mask::causal)
    mha.prefill(Qv, Kv, Vv, Ov, state, SequenceLayout::padded(lengths));
  else
    mha.forward(Qv, Kv, Vv, Ov, mask, SequenceLayout::padded(lengths));
  for (Index b = 0; b < B; ++b) {
    const Index n = lengths[static_cast<std::size_t>(b)];
    for (Index h = 0; h < Hq; ++h) {
      INFO("sequence " << b << " head " << h);
      const auto got = cut(out, layout, b, h, 0, T, T, Hq, dv);
      // Padded output rows are defined to be zero (they held 5 before the call).
      CHECK((got.bottomRows(T - n).array() == Scalar(0)).all());
      check_head<Scalar>(mha.attention(), RowMatrix<Scalar>(got.topRows(n)),
                         cut(q, layout, b, h, 0, n, T, Hq, dk), cut(k, layout, b, 0, 0, n, T, Hkv, dk),
                         cut(v, layout, b, 0, 0, n, T, Hkv, dv), mask == Mask::causal);
      if (mask != Mask::causal) continue;
      // The state holds the valid keys only: z = sum_{t < n} phi(k_t), by a plain double loop.
      // One state per key/value head: both query heads read head 0's.
      REQUIRE(state.heads() == Hkv);
      const auto& st = state.sequence(b).head(h / (Hq / Hkv));
      CHECK(st.tokens() == n);
      for (Index c = 0; c < dk; ++c) {
        double z = 0, z_abs = 0;
        for (Index t = 0; t < n; ++t) {
          const double f = linattn_test::elu_plus_one(static_cast<double>(
              k[static_cast<std::size_t>(flat(layout, b, t, 0, c, T, Hkv, dk))]));
          z += f;
          z_abs += std::abs(f);
        }
        // A sum of n positive terms: gamma_n plus the feature map's ulps.
        CHECK(std::abs(static_cast<double>(st.z()(c)) - z) <=
              (n + 4) * linattn_test::unit_roundoff<Scalar>() * z_abs);
      }
      CHECK(st.S().allFinite());
    }
  }
}

namespace {

// Prefills the first T0 of the T tokens of q, k, v ([B, T, H, d] in `layout`) into `state`,
// then decodes the others one step at a time; returns the [B, T, Hq, dv] output. The prefill
// reads views whose T is T0 but whose strides are the full buffer's (head-first rows of one
// head are T apart, not T0).
template <class Scalar, class Mha>
std::vector<Scalar> prefill_then_decode(const Mha& mha, BatchState<Scalar>& state, Layout layout,
                                        const std::vector<Scalar>& q, const std::vector<Scalar>& k,
                                        const std::vector<Scalar>& v, Index B, Index T, Index T0) {
  const HeadConfig& h = mha.heads();
  auto sub = [&](const std::vector<Scalar>& buf, Index H, Index d, Index t0, Index n) {
    const TensorView<const Scalar> full = view<const Scalar>(layout, buf.data(), B, T, H, d);
    return TensorView<const Scalar>(&full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  };
  std::vector<Scalar> out(static_cast<std::size_t>(B * T * h.q_heads * h.value_dim));
  const TensorView<Scalar> out_full = view(layout, out.data(), B, T, h.q_heads, h.value_dim);
  mha.prefill(sub(q, h.q_heads, h.key_dim, 0, T0), sub(k, h.kv_heads, h.key_dim, 0, T0),
              sub(v, h.kv_heads, h.value_dim, 0, T0),
              TensorView<Scalar>(out.data(), {B, T0, h.q_heads, h.value_dim}, out_full.strides()),
              state);
  for (Index t = T0; t < T; ++t)
    mha.step(sub(q, h.q_heads, h.key_dim, t, 1), sub(k, h.kv_heads, h.key_dim, t, 1),
             sub(v, h.kv_heads, h.value_dim, t, 1),
             TensorView<Scalar>(&out_full(0, t, 0, 0), {B, 1, h.q_heads, h.value_dim},
                                out_full.strides()),
             state);
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("prefill then decode equals one causal pass", "[multihead][decode]", float,
                   double) {
  using Scalar = TestType;
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Index B = 3, T0 = 6, steps = 4, T = T0 + steps, Hq = 4, Hkv = 2, dk = 5, dv = 4;
  const auto q = random_buffer<Scalar>(B * T * Hq * dk, 51);
  const auto k = random_buffer<Scalar>(B * T * Hkv * dk, 52);
  const auto v = random_buffer<Scalar>(B * T * Hkv * dv, 53);
  MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv});
  mha.set_threads(2);
  auto state = mha.make_state(B);
  const auto out = prefill_then_decode(mha, state, layout, q, k, v, B, T, T0);
  for (Index b = 0; b < B; ++b) {
    CHECK(state.sequence(b).tokens() == T);
    for (Index h = 0; h < Hq; ++h)
      check_head<Scalar>(mha.attention(), cut(out, layout, b, h, 0, T, T, Hq, dv),
                         cut(q, layout, b, h, 0, T, T, Hq, dk),
                         cut(k, layout, b, h / 2, 0, T, T, Hkv, dk),
                         cut(v, layout, b, h / 2, 0, T, T, Hkv, dv), true);
  }
}

TEMPLATE_TEST_CASE("grouped query heads share one state per key/value head",
                   "[multihead][decode][group]", float, double) {
  // Each query head of the layer against its own single-head LinearAttention on contiguous
  // copies, with its own state: the layer keeps one state per key/value head and reads it
  // for each of the G = 3 query heads, which must give the single-head bits: prefill (the
  // chunked path per head, the update once) and decode with a decode block of 4 (absorb once,
  // read per head, which is step()'s arithmetic with a block).
  using Scalar = TestType;
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Index B = 2, T0 = 11, steps = 6, T = T0 + steps, Hq = 6, Hkv = 2, G = 3, dk = 16,
              dv = 16;
  const auto q = random_buffer<Scalar>(B * T * Hq * dk, 71);
  const auto k = random_buffer<Scalar>(B * T * Hkv * dk, 72);
  const auto v = random_buffer<Scalar>(B * T * Hkv * dv, 73);
  Options opt;
  opt.chunk_size = 4;
  opt.decode_block = 4;
  MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv}, EluPlusOne{}, opt);
  mha.set_threads(2);
  REQUIRE(mha.state_heads() == Hkv);
  auto state = mha.make_state(B);
  REQUIRE(state.heads() == Hkv);
  const auto out = prefill_then_decode(mha, state, layout, q, k, v, B, T, T0);
  const auto& attn = mha.attention();
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < Hq; ++h) {
      INFO("sequence " << b << " query head " << h);
      const Index g = h / G;
      const auto Q = cut(q, layout, b, h, 0, T, T, Hq, dk);
      const auto K = cut(k, layout, b, g, 0, T, T, Hkv, dk);
      const auto V = cut(v, layout, b, g, 0, T, T, Hkv, dv);
      auto single = attn.make_state(dk, dv);
      RowMatrix<Scalar> want(T, dv);
      attn.parallel_into(Q.topRows(T0), K.topRows(T0), V.topRows(T0), Mask::causal, single,
                         want.topRows(T0));
      for (Index t = T0; t < T; ++t) attn.step_into(single, Q.row(t), K.row(t), V.row(t), want.row(t));
      CHECK(cut(out, layout, b, h, 0, T, T, Hq, dv) == want);
      const auto& shared = state.sequence(b).head(g);
      CHECK(shared.tokens() == T);
      CHECK(shared.S() == single.S());
      CHECK(shared.z() == single.z());
    }
  // A stateless forward also reads each group's keys once, causal and full: each head has the
  // bits of a fresh single-head parallel_into.
  for (const Mask mask : {Mask::causal, Mask::none}) {
    std::vector<Scalar> fwd(out.size(), Scalar(-1));
    mha.forward(view<const Scalar>(layout, q.data(), B, T, Hq, dk),
                view<const Scalar>(layout, k.data(), B, T, Hkv, dk),
                view<const Scalar>(layout, v.data(), B, T, Hkv, dv),
                view(layout, fwd.data(), B, T, Hq, dv), mask);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h) {
        INFO("forward, causal " << (mask == Mask::causal) << ": sequence " << b << " query head "
                                << h);
        const Index g = h / G;
        RowMatrix<Scalar> want(T, dv);
        attn.parallel_into(cut(q, layout, b, h, 0, T, T, Hq, dk),
                           cut(k, layout, b, g, 0, T, T, Hkv, dk),
                           cut(v, layout, b, g, 0, T, T, Hkv, dv), mask, want);
        CHECK(cut(fwd, layout, b, h, 0, T, T, Hq, dv) == want);
      }
  }
}

namespace {

// Batched decode driver for the continuous-batching and thread tests: a fixed token stream
// per conversation (seeded by its number), fed through prefill and steps.
struct Conversation {
  static constexpr Index Hq = 4, Hkv = 2, dk = 8, dv = 6, T0 = 9;
  std::vector<float> q, k, v;  // [T, H, d] batch-first, T = T0 + decode steps
  Index T;
  Conversation(int id, Index steps)
      : q(random_buffer<float>((T0 + steps) * Hq * dk, 1000 + 3 * static_cast<std::uint64_t>(id))),
        k(random_buffer<float>((T0 + steps) * Hkv * dk, 1001 + 3 * static_cast<std::uint64_t>(id))),
        v(random_buffer<float>((T0 + steps) * Hkv * dv, 1002 + 3 * static_cast<std::uint64_t>(id))),
        T(T0 + steps) {}
};

using Mha = MultiHeadAttention<EluPlusOne, float>;

// Gathers token t of the given conversations into a [N, 1, H, d] batch-first buffer.
std::vector<float> gather(const std::vector<const std::vector<float>*>& src, Index t, Index H,
                          Index d) {
  std::vector<float> out;
  for (const auto* s : src)
    out.insert(out.end(), s->begin() + t * H * d, s->begin() + (t + 1) * H * d);
  return out;
}

// Prefills conversation c alone into batch position `slot` of `state`; returns its outputs.
std::vector<float> prefill_one(const Mha& mha, BatchState<float>& state, const Conversation& c,
                               Index slot) {
  using C = Conversation;
  std::vector<float> out(static_cast<std::size_t>(C::T0 * C::Hq * C::dv));
  const Index slots[] = {slot};
  mha.prefill(TensorView<const float>::batch_first(c.q.data(), 1, C::T0, C::Hq, C::dk),
              TensorView<const float>::batch_first(c.k.data(), 1, C::T0, C::Hkv, C::dk),
              TensorView<const float>::batch_first(c.v.data(), 1, C::T0, C::Hkv, C::dv),
              TensorView<float>::batch_first(out.data(), 1, C::T0, C::Hq, C::dv), state,
              SequenceLayout::batch(), slots);
  return out;
}

// One decode step of the listed conversations at their token t (all at the same t here);
// returns [N, Hq, dv] outputs.
std::vector<float> step_all(const Mha& mha, BatchState<float>& state,
                            const std::vector<const Conversation*>& cs, Index t) {
  using C = Conversation;
  std::vector<const std::vector<float>*> qs, ks, vs;
  for (const auto* c : cs) {
    qs.push_back(&c->q);
    ks.push_back(&c->k);
    vs.push_back(&c->v);
  }
  const auto q = gather(qs, t, C::Hq, C::dk), k = gather(ks, t, C::Hkv, C::dk),
             v = gather(vs, t, C::Hkv, C::dv);
  const auto N = static_cast<Index>(cs.size());
  std::vector<float> out(static_cast<std::size_t>(N * C::Hq * C::dv));
  mha.step(TensorView<const float>::batch_first(q.data(), N, 1, C::Hq, C::dk),
           TensorView<const float>::batch_first(k.data(), N, 1, C::Hkv, C::dk),
           TensorView<const float>::batch_first(v.data(), N, 1, C::Hkv, C::dv),
           TensorView<float>::batch_first(out.data(), N, 1, C::Hq, C::dv), state);
  return out;
}

std::vector<float> row_of(const std::vector<float>& batch_out, Index i) {
  const Index n = Conversation::Hq * Conversation::dv;
  return {batch_out.begin() + i * n, batch_out.begin() + (i + 1) * n};
}

}  // namespace

TEST_CASE("continuous batching: a sequence's outputs do not depend on its batch mates",
          "[multihead][decode]") {
  using C = Conversation;
  const Index steps = 5;
  const Conversation a(0, steps), b(1, steps), c(2, steps), d(3, steps);
  Mha mha({C::Hq, C::Hkv, C::dk, C::dv});
  mha.set_threads(GENERATE(1, 2));

  // Conversation b decoding alone.
  auto solo = mha.make_state(1);
  const auto b_prefill = prefill_one(mha, solo, b, 0);
  std::vector<std::vector<float>> b_alone;
  for (Index t = C::T0; t < b.T; ++t) b_alone.push_back(step_all(mha, solo, {&b}, t));

  // b shares the batch with a and c; after two steps a leaves and d joins (prefilled alone
  // into its new slot while the others wait), then everyone steps together.
  auto batch = mha.make_state();
  const SequenceId ida = batch.add_sequence();
  const SequenceId idb = batch.add_sequence();
  batch.add_sequence();
  CHECK(prefill_one(mha, batch, a, 0).size() == b_prefill.size());
  CHECK(prefill_one(mha, batch, b, 1) == b_prefill);
  static_cast<void>(prefill_one(mha, batch, c, 2));
  std::vector<const Conversation*> members{&a, &b, &c};
  Index t = C::T0;
  for (; t < C::T0 + 2; ++t)
    CHECK(row_of(step_all(mha, batch, members, t), batch.index_of(idb)) ==
          b_alone[static_cast<std::size_t>(t - C::T0)]);
  batch.drop_sequence(ida);
  members.erase(members.begin());
  CHECK(batch.index_of(idb) == 0);
  CHECK_THROWS_AS(batch.index_of(ida), std::out_of_range);
  // d joins: its prefill goes to slot 2 only, the others are not touched.
  const auto before = batch.sequence(0).head(0).S();
  batch.add_sequence();
  static_cast<void>(prefill_one(mha, batch, d, 2));
  CHECK(batch.sequence(0).head(0).S() == before);
  // d is T0 tokens in and b is further along; feed d its own first decode tokens while b
  // continues: the batch holds sequences at different positions.
  for (Index i = 0; t < b.T; ++t, ++i) {
    const auto q = [&] {
      auto x = gather({&b.q, &c.q}, t, C::Hq, C::dk);
      auto y = gather({&d.q}, C::T0 + i, C::Hq, C::dk);
      x.insert(x.end(), y.begin(), y.end());
      return x;
    }();
    auto k = gather({&b.k, &c.k}, t, C::Hkv, C::dk);
    auto kd = gather({&d.k}, C::T0 + i, C::Hkv, C::dk);
    k.insert(k.end(), kd.begin(), kd.end());
    auto v = gather({&b.v, &c.v}, t, C::Hkv, C::dv);
    auto vd = gather({&d.v}, C::T0 + i, C::Hkv, C::dv);
    v.insert(v.end(), vd.begin(), vd.end());
    std::vector<float> out(static_cast<std::size_t>(3 * C::Hq * C::dv));
    mha.step(TensorView<const float>::batch_first(q.data(), 3, 1, C::Hq, C::dk),
             TensorView<const float>::batch_first(k.data(), 3, 1, C::Hkv, C::dk),
             TensorView<const float>::batch_first(v.data(), 3, 1, C::Hkv, C::dv),
             TensorView<float>::batch_first(out.data(), 3, 1, C::Hq, C::dv), batch);
    CHECK(row_of(out, 0) == b_alone[static_cast<std::size_t>(t - C::T0)]);
  }
  CHECK(batch.sequence(0).tokens() == b.T);
  CHECK(batch.sequence(2).tokens() == C::T0 + 3);
  // A sequence can also step alone through slots, leaving the others as they are.
  const auto c_state = batch.sequence(1).head(1).S();
  const Index slot[] = {0};
  auto q1 = gather({&b.q}, 0, C::Hq, C::dk), k1 = gather({&b.k}, 0, C::Hkv, C::dk),
       v1 = gather({&b.v}, 0, C::Hkv, C::dv);
  std::vector<float> o1(static_cast<std::size_t>(C::Hq * C::dv));
  mha.step(TensorView<const float>::batch_first(q1.data(), 1, 1, C::Hq, C::dk),
           TensorView<const float>::batch_first(k1.data(), 1, 1, C::Hkv, C::dk),
           TensorView<const float>::batch_first(v1.data(), 1, 1, C::Hkv, C::dv),
           TensorView<float>::batch_first(o1.data(), 1, 1, C::Hq, C::dv), batch, slot);
  CHECK(batch.sequence(1).head(1).S() == c_state);
  CHECK(batch.sequence(0).tokens() == b.T + 1);
}

TEMPLATE_TEST_CASE("one and two threads give identical bytes", "[multihead][threads]", float,
                   double) {
  using Scalar = TestType;
  INFO("compiled with OpenMP: " << detail::openmp_enabled);
  const Index B = 3, T = 37, Hq = 4, Hkv = 2, dk = 16, dv = 8;
  const auto q = random_buffer<Scalar>(B * T * Hq * dk, 61);
  const auto k = random_buffer<Scalar>(B * T * Hkv * dk, 62);
  const auto v = random_buffer<Scalar>(B * T * Hkv * dv, 63);
  const std::vector<Index> lengths{37, 20, 3};
  auto run = [&](int threads, std::vector<Scalar>& out, std::vector<Scalar>& dec,
                 BatchState<Scalar>& state) {
    MultiHeadAttention<EluPlusOne, Scalar> mha({Hq, Hkv, dk, dv});
    mha.set_threads(threads);
    const auto Q = TensorView<const Scalar>::head_first(q.data(), B, Hq, T, dk);
    const auto K = TensorView<const Scalar>::head_first(k.data(), B, Hkv, T, dk);
    const auto V = TensorView<const Scalar>::head_first(v.data(), B, Hkv, T, dv);
    mha.prefill(Q, K, V, TensorView<Scalar>::head_first(out.data(), B, Hq, T, dv), state,
                SequenceLayout::padded(lengths));
    // Decode token 0 of every sequence again as a new step (any data will do).
    const auto q1 = TensorView<const Scalar>::batch_first(q.data(), B, 1, Hq, dk);
    const auto k1 = TensorView<const Scalar>::batch_first(k.data(), B, 1, Hkv, dk);
    const auto v1 = TensorView<const Scalar>::batch_first(v.data(), B, 1, Hkv, dv);
    mha.step(q1, k1, v1, TensorView<Scalar>::batch_first(dec.data(), B, 1, Hq, dv), state);
    // Stateless full attention over the same rows packed as one sequence per batch entry
    // would need B = 1; read batch entry 0's rows as three packed sequences instead.
    const std::vector<Index> offsets{0, 10, 11, T};
    std::vector<Scalar> packed(static_cast<std::size_t>(T * Hq * dv));
    mha.forward(TensorView<const Scalar>::head_first(q.data(), 1, Hq, T, dk),
                TensorView<const Scalar>::head_first(k.data(), 1, Hkv, T, dk),
                TensorView<const Scalar>::head_first(v.data(), 1, Hkv, T, dv),
                TensorView<Scalar>::head_first(packed.data(), 1, Hq, T, dv), Mask::none,
                SequenceLayout::packed(offsets));
    out.insert(out.end(), packed.begin(), packed.end());
  };
  const auto n = static_cast<std::size_t>(B * T * Hq * dv);
  std::vector<Scalar> out1(n), out2(n), dec1(static_cast<std::size_t>(B * Hq * dv)), dec2(dec1);
  // One state per key/value head (MultiHeadAttention::state_heads() for ELU+1).
  auto s1 = BatchState<Scalar>(Hkv, dk, dk, dv, B), s2 = BatchState<Scalar>(Hkv, dk, dk, dv, B);
  run(1, out1, dec1, s1);
  run(2, out2, dec2, s2);
  REQUIRE(out1.size() == n + static_cast<std::size_t>(T * Hq * dv));
  REQUIRE(out2.size() == out1.size());
  CHECK(std::memcmp(out1.data(), out2.data(), out1.size() * sizeof(Scalar)) == 0);
  CHECK(std::memcmp(dec1.data(), dec2.data(), dec1.size() * sizeof(Scalar)) == 0);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < Hkv; ++h) {
      CHECK(s1.sequence(b).head(h).S() == s2.sequence(b).head(h).S());
      CHECK(s1.sequence(b).head(h).z() == s2.sequence(b).head(h).z());
    }
}

TEST_CASE("an error in one head is reported once, after every other head ran", "[multihead]") {
  // Identity features: a query orthogonal to the keys gives a zero denominator in head 1 only.
  const Index H = 2, d = 2;
  std::vector<double> q{1, 0, 0, 1}, k{1, 0, 1, 0}, v{1, 2, 3, 4};  // [1, 1, H, d]
  std::vector<double> out(4, -1.0);
  MultiHeadAttention<Identity, double> mha({H, H, d, d});
  mha.set_threads(2);
  auto state = mha.make_state(1);
  const auto Q = TensorView<const double>::batch_first(q.data(), 1, 1, H, d);
  const auto K = TensorView<const double>::batch_first(k.data(), 1, 1, H, d);
  const auto V = TensorView<const double>::batch_first(v.data(), 1, 1, H, d);
  CHECK_THROWS_AS(mha.step(Q, K, V, TensorView<double>::batch_first(out.data(), 1, 1, H, d), state),
                  DenominatorError);
  CHECK(state.sequence(0).head(0).tokens() == 1);  // head 0 stepped: y = v = (1, 2)
  CHECK(out[0] == 1.0);
  CHECK(out[1] == 2.0);
  CHECK(state.sequence(0).head(1).tokens() == 0);  // head 1 unchanged (step's guarantee)
  CHECK(state.sequence(0).head(1).z().isZero(0));
}

TEST_CASE("shape errors name the views", "[multihead][errors]") {
  const Index B = 2, T = 4, H = 2, d = 3;
  std::vector<float> buf(static_cast<std::size_t>(B * T * H * d * 2), 0.5f);
  std::vector<float> out(buf.size());
  auto in = [&](Index b, Index t, Index h, Index dd) {
    return TensorView<const float>::batch_first(buf.data(), b, t, h, dd);
  };
  auto o = [&](Index b, Index t, Index h, Index dd) {
    return TensorView<float>::batch_first(out.data(), b, t, h, dd);
  };
  const MultiHeadAttention<EluPlusOne, float> mha({H, 1, d, d});
  auto fails = [](auto&& call, const std::string& part) {
    try {
      call();
      FAIL("no exception; expected one mentioning: " << part);
    } catch (const ShapeError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  const Mask c = Mask::causal;
  fails([&] { mha.forward(in(B, T, 3, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c); }, "H_q heads");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 2, d), in(B, T, 1, d), o(B, T, H, d), c); }, "H_kv heads");
  fails([&] { mha.forward(in(B, T, H, 2), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c); }, "dim dk");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, 2), o(B, T, H, d), c); }, "dim dv");
  fails([&] { mha.forward(in(B, T, H, d), in(1, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c); }, "batch size");
  fails([&] { mha.forward(in(B, T, H, d), in(B, 3, 1, d), in(B, T, 1, d), o(B, T, H, d), Mask::none); }, "K and V");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, 3, H, d), c); }, "out needs");
  fails([&] { mha.forward(in(B, T, H, d), in(B, 3, 1, d), in(B, 3, 1, d), o(B, T, H, d), c); }, "as many queries as keys");
  // The message names the views.
  fails([&] { mha.forward(in(B, T, 3, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c); }, "[B=2, T=4, H=3, d=3]");

  const std::vector<Index> bad_offsets{0, 3, 2, 4}, short_offsets{0, 3}, lengths{4, 5};
  fails([&] { mha.forward(in(1, T, H, d), in(1, T, 1, d), in(1, T, 1, d), o(1, T, H, d), c, SequenceLayout::packed(bad_offsets)); }, "must not decrease");
  fails([&] { mha.forward(in(1, T, H, d), in(1, T, 1, d), in(1, T, 1, d), o(1, T, H, d), c, SequenceLayout::packed(short_offsets)); }, "end at T=4");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c, SequenceLayout::packed(short_offsets)); }, "batch size 1");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c, SequenceLayout::padded(lengths)); }, "outside [0, T=4]");
  fails([&] { mha.forward(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), c, SequenceLayout::padded(bad_offsets)); }, "4 lengths for batch size B=2");

  auto state = mha.make_state(3);
  fails([&] { mha.prefill(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), state); }, "the batch state 3");
  const Index dup[] = {1, 1}, far[] = {0, 3};
  fails([&] { mha.prefill(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), state, SequenceLayout::batch(), dup); }, "given twice");
  fails([&] { mha.prefill(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), state, SequenceLayout::batch(), far); }, "outside the batch state");
  fails([&] { mha.step(in(3, 2, H, d), in(3, 2, 1, d), in(3, 2, 1, d), o(3, 2, H, d), state); }, "one token per sequence");
  auto other = BatchState<float>(H, d, d, d + 1, 2);
  fails([&] { mha.prefill(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), other); }, "this layer needs");

  fails([] { MultiHeadAttention<EluPlusOne, float>({3, 2, 4, 4}); }, "multiple of");
  fails([] { MultiHeadAttention<EluPlusOne, float>({2, 1, 0, 4}); }, "positive");
  fails([&] { static_cast<void>(TensorView<float>(out.data(), {1, 2, 2, 3}, {12, 6, 3, 2})); }, "contiguous feature axis");
  fails([&] { static_cast<void>(TensorView<float>(out.data(), {1, -2, 2, 3}, {12, 6, 3, 1})); }, "negative");
  fails([] { static_cast<void>(TensorView<float>(nullptr, {1, 2, 2, 3}, {12, 6, 3, 1})); }, "null");
  fails([&] { static_cast<void>(TensorView<float>::batch_first(out.data(), 1, 2, 2, 3).head_matrix(0, 2)); }, "outside tensor view");
  fails([&] { auto s = mha.make_state(); s.add_sequence(SequenceState<float>(mha.state_heads(), d, d, d + 1)); }, "dv=");
  CHECK_THROWS_AS(mha.make_state(1).drop_sequence(99), std::out_of_range);
}

TEST_CASE("TensorView addresses both layouts", "[tensor_view]") {
  std::vector<int> idx(2 * 3 * 4 * 5);
  std::vector<double> buf(idx.size());
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<double>(i);
  const auto bf = TensorView<const double>::batch_first(buf.data(), 2, 3, 4, 5);
  const auto hf = TensorView<const double>::head_first(buf.data(), 2, 4, 3, 5);
  CHECK(bf(1, 2, 3, 4) == static_cast<double>(((1 * 3 + 2) * 4 + 3) * 5 + 4));
  CHECK(hf(1, 2, 3, 4) == static_cast<double>(((1 * 4 + 3) * 3 + 2) * 5 + 4));
  CHECK(hf.times() == 3);
  CHECK(hf.heads() == 4);
  const auto m = bf.head_matrix(1, 2);
  CHECK(m.rows() == 3);
  CHECK(m.cols() == 5);
  CHECK(m(2, 1) == bf(1, 2, 2, 1));
  const auto n = hf.head_matrix(1, 2);
  CHECK(n(2, 1) == hf(1, 2, 2, 1));
  CHECK(n.data() == &hf(1, 0, 2, 0));  // a view, not a copy
}

TEST_CASE("state size against a K/V cache", "[batch_state]") {
  // One head, r = dk = dv = 128: the state is 128*128 + 128 = 16,512 scalars; a K/V cache
  // adds 128 + 128 = 256 per token, 64 * 256 = 16,384 <= 16,512 < 16,640 = 65 * 256.
  const auto one = state_footprint(1, 1, 128, 128, 128);
  CHECK(one.state_scalars_per_head == 16512);
  CHECK(one.kv_scalars_per_token == 256);
  CHECK(one.kv_cache_crossover == 65);
  // dk = dv = 64: 64*64 + 64 = 4160 against 128 per token: 32 * 128 = 4096 <= 4160 < 4224.
  CHECK(state_footprint(1, 1, 64, 64, 64).kv_cache_crossover == 33);
  // 8 state heads against 2 kv heads (a log-scaled map keeps a state per query head), d = 128:
  // 8 * 16512 = 132096 state scalars, 2 * 256 = 512 per token; 132096 / 512 = 258 exactly,
  // so the cache passes it at 259.
  const auto per_query = state_footprint(8, 2, 128, 128, 128);
  CHECK(per_query.state_scalars == 132096);
  CHECK(per_query.kv_cache_crossover == 259);
  // An ordinary map shares one state per kv head: 2 * 16512 = 33024 scalars against 512 per
  // token, 64 * 512 = 32768 <= 33024 < 33280 = 65 * 512: the same 65 as one plain head.
  const MultiHeadAttention<EluPlusOne, float> mha({8, 2, 128, 128});
  CHECK(mha.state_heads() == 2);
  CHECK(mha.footprint().state_scalars == 33024);
  CHECK(mha.footprint().kv_cache_crossover == 65);
  const auto state = mha.make_state(2);
  CHECK(state.heads() == 2);
  CHECK(state.bytes_per_sequence() == 33024u * sizeof(float));
  CHECK(state.sequence(1).scalar_count() == 33024);
  // Random features keep one state per query head: r = 128 features of dk = 64 keys.
  const MultiHeadAttention<PositiveRandomFeatures<float>, float> favor(
      {8, 2, 64, 64}, PositiveRandomFeatures<float>(64, 128, 7));
  CHECK(favor.state_heads() == 8);
  CHECK(favor.make_state(1).heads() == 8);
  CHECK(favor.footprint().state_scalars == 8 * (128 * 64 + 128));
}

namespace {
// Threads of this process, from /proc (Linux); -1 where that is not available.
Index process_threads() {
  std::error_code ec;
  Index n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return ec ? -1 : n;
}

// ELU+1 that records, from inside the work items, on which thread it runs and how many
// threads a parallel region opened there (e.g. by Eigen's GEMM) could get.
struct Probe {
  static inline std::atomic<int> widest_nested{0};
  static inline std::atomic<int> calls_off_caller{0};
  static inline std::thread::id caller;
  static constexpr bool strictly_positive = true;
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    EluPlusOne{}.apply(x, out);
    if (std::this_thread::get_id() != caller) ++calls_off_caller;
#ifdef _OPENMP
    int seen = widest_nested.load();
    const int now = omp_get_max_threads();
    while (now > seen && !widest_nested.compare_exchange_weak(seen, now)) {
    }
#endif
  }
};
}  // namespace

TEST_CASE("one thread requested: no thread is created", "[multihead][threads]") {
  // Products of 64 x 128 x 128 (a chunk against the state) are large enough for Eigen's GEMM
  // to open an OpenMP team of its own. Two checks: (1) inside every work item a nested region
  // could get only one thread (omp_get_max_threads() == 1, which is what Eigen asks), for one
  // and for two linattn threads; (2) with one thread requested everything runs on the calling
  // thread and the process has no more threads afterwards (ctest runs each test case in its
  // own process, so this starts from a process without an OpenMP pool).
  const Index B = 2, T = 128, H = 2, d = 128;
  const auto q = random_buffer<float>(B * T * H * d, 81);
  std::vector<float> out(q.size());
  MultiHeadAttention<Probe, float> mha({H, H, d, d});
  auto in = TensorView<const float>::batch_first(q.data(), B, T, H, d);
  auto o = TensorView<float>::batch_first(out.data(), B, T, H, d);
  auto run = [&] {
    mha.forward(in, in, in, o, Mask::causal);
    mha.forward(in, in, in, o, Mask::none);
    auto state = mha.make_state(B);
    mha.prefill(in, in, in, o, state);
  };
  Probe::caller = std::this_thread::get_id();
  mha.set_threads(1);
  const Index before = process_threads();
  run();
  CHECK(process_threads() == before);
  CHECK(Probe::calls_off_caller == 0);
  mha.set_threads(2);
  run();
  if (detail::openmp_enabled) {
    CHECK(Probe::widest_nested == 1);
  }
}
