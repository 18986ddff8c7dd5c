// MultiHeadAttention over raw buffers: both layouts, grouped heads, packed and padded batches,
// decode state, continuous batching, thread-count independence and shape errors.
//
// References are independent of the library's indexing: heads are cut out of the flat
// buffers with explicit index formulas, and each head is compared with the double-precision
// loop of test_support.hpp (and with a single-head LinearAttention call on the copy).

#include <linattn/multihead.hpp>
#include <linattn/random_features.hpp>
#include <linattn/thread_pool.hpp>

#include <catch2/catch.hpp>

#include "multihead_buffers.hpp"
#include "test_support.hpp"

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace multihead_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::bound_units;
using linattn_test::cut;
using linattn_test::flat;
using linattn_test::Layout;
using linattn_test::random_buffer;
using linattn_test::view;
using linattn_test::naive_attention;
using linattn_test::worst_error_ratio;

namespace {

template <class Scalar>
using Elu = LinearAttention<EluPlusOne, Scalar>;
template <class Scalar>
using EluLayer = MultiHeadAttention<Elu<Scalar>>;

// A layer of ELU+1 heads with the given chunk size and decode block.
template <class Scalar>
EluLayer<Scalar> elu_layer(HeadConfig heads, Index chunk = kAuto, Index block = kAuto) {
  Options opt;
  opt.chunk_size = chunk;
  opt.decode_block = block;
  return EluLayer<Scalar>(heads, Elu<Scalar>(EluPlusOne{}, opt));
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
  const RowMatrix<Scalar> single = attn.parallel(Q, K, V, Mask::causal_if(causal));
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
  ThreadPool pool(threads);
  const Index B = s.B, Tq = s.Tq, Tk = s.Tk, Hq = s.Hq, Hkv = s.Hkv, dk = s.dk, dv = s.dv;
  const auto q = random_buffer<Scalar>(B * Tq * Hq * dk, 11);
  const auto k = random_buffer<Scalar>(B * Tk * Hkv * dk, 12);
  const auto v = random_buffer<Scalar>(B * Tk * Hkv * dv, 13);
  std::vector<Scalar> out(static_cast<std::size_t>(B * Tq * Hq * dv), Scalar(-7));
  auto mha = elu_layer<Scalar>({Hq, Hkv, dk, dv}, 4);  // several chunks per sequence
  mha.set_executor(&pool);
  mha.parallel_into(view<const Scalar>(layout, q.data(), B, Tq, Hq, dk),
                    view<const Scalar>(layout, k.data(), B, Tk, Hkv, dk),
                    view<const Scalar>(layout, v.data(), B, Tk, Hkv, dv), mask,
                    view(layout, out.data(), B, Tq, Hq, dv));
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
  const Mask mask = GENERATE(Mask(Mask::causal), Mask(Mask::none));
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
  const EluLayer<double> mha({H, H, d, d});
  mha.parallel_into(Q, K, V, Mask::causal, TensorView<double>::batch_first(out.data(), B, T, H, d));
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
  const Mask mask = GENERATE(Mask(Mask::causal), Mask(Mask::none));
  const Layout layout = GENERATE(Layout::batch_first, Layout::head_first);
  const Index T = 20, Hq = 4, Hkv = 2, dk = 5, dv = 3;
  const std::vector<Index> offsets{0, 5, 5, 12, 20};  // lengths 5, 0, 7, 8
  auto q = random_buffer<Scalar>(T * Hq * dk, 31);
  auto k = random_buffer<Scalar>(T * Hkv * dk, 32);
  auto v = random_buffer<Scalar>(T * Hkv * dv, 33);
  std::vector<Scalar> out(static_cast<std::size_t>(T * Hq * dv));
  ThreadPool pool(2);
  auto mha = elu_layer<Scalar>({Hq, Hkv, dk, dv}, 3);
  mha.set_executor(&pool);
  auto run = [&](std::vector<Scalar>& o) {
    mha.parallel_into(view<const Scalar>(layout, q.data(), 1, T, Hq, dk),
                      view<const Scalar>(layout, k.data(), 1, T, Hkv, dk),
                      view<const Scalar>(layout, v.data(), 1, T, Hkv, dv), mask,
                      view(layout, o.data(), 1, T, Hq, dv), SequenceLayout::packed(offsets));
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
  const Mask mask = GENERATE(Mask(Mask::causal), Mask(Mask::none));
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
  ThreadPool pool(2);
  EluLayer<Scalar> mha({Hq, Hkv, dk, dv});
  mha.set_executor(&pool);
  const auto Qv = view<const Scalar>(layout, q.data(), B, T, Hq, dk);
  const auto Kv = view<const Scalar>(layout, k.data(), B, T, Hkv, dk);
  const auto Vv = view<const Scalar>(layout, v.data(), B, T, Hkv, dv);
  const auto Ov = view(layout, out.data(), B, T, Hq, dv);
  auto state = mha.make_state(B);
  if (mask == Mask::causal)
    mha.prefill_into(state, Qv, Kv, Vv, Ov, SequenceLayout::padded(lengths));
  else
    mha.parallel_into(Qv, Kv, Vv, mask, Ov, SequenceLayout::padded(lengths));
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
              static_cast<double>(n + 4) * linattn_test::unit_roundoff<Scalar>() * z_abs);
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
std::vector<Scalar> prefill_then_decode(const Mha& mha, typename Mha::State& state, Layout layout,
                                        const std::vector<Scalar>& q, const std::vector<Scalar>& k,
                                        const std::vector<Scalar>& v, Index B, Index T, Index T0) {
  const HeadConfig& h = mha.heads();
  auto sub = [&](const std::vector<Scalar>& buf, Index H, Index d, Index t0, Index n) {
    const TensorView<const Scalar> full = view<const Scalar>(layout, buf.data(), B, T, H, d);
    return TensorView<const Scalar>(&full(0, t0, 0, 0), {B, n, H, d}, full.strides());
  };
  std::vector<Scalar> out(static_cast<std::size_t>(B * T * h.q_heads * h.value_dim));
  const TensorView<Scalar> out_full = view(layout, out.data(), B, T, h.q_heads, h.value_dim);
  mha.prefill_into(state, sub(q, h.q_heads, h.key_dim, 0, T0), sub(k, h.kv_heads, h.key_dim, 0, T0),
                   sub(v, h.kv_heads, h.value_dim, 0, T0),
                   TensorView<Scalar>(out.data(), {B, T0, h.q_heads, h.value_dim}, out_full.strides()));
  for (Index t = T0; t < T; ++t)
    mha.step_into(state, sub(q, h.q_heads, h.key_dim, t, 1), sub(k, h.kv_heads, h.key_dim, t, 1),
                  sub(v, h.kv_heads, h.value_dim, t, 1),
                  TensorView<Scalar>(&out_full(0, t, 0, 0), {B, 1, h.q_heads, h.value_dim},
                                     out_full.strides()));
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
  ThreadPool pool(2);
  EluLayer<Scalar> mha({Hq, Hkv, dk, dv});
  mha.set_executor(&pool);
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
  ThreadPool pool(2);
  auto mha = elu_layer<Scalar>({Hq, Hkv, dk, dv}, 4, 4);
  mha.set_executor(&pool);
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
      attn.prefill_into(single, Q.topRows(T0), K.topRows(T0), V.topRows(T0), want.topRows(T0));
      for (Index t = T0; t < T; ++t) attn.step_into(single, Q.row(t), K.row(t), V.row(t), want.row(t));
      CHECK(cut(out, layout, b, h, 0, T, T, Hq, dv) == want);
      const auto& shared = state.sequence(b).head(g);
      CHECK(shared.tokens() == T);
      CHECK(shared.S() == single.S());
      CHECK(shared.z() == single.z());
    }
  // A stateless call also reads each group's keys once, causal and full: each head has the
  // bits of a fresh single-head parallel_into.
  for (const Mask mask : {Mask(Mask::causal), Mask(Mask::none)}) {
    std::vector<Scalar> fwd(out.size(), Scalar(-1));
    mha.parallel_into(view<const Scalar>(layout, q.data(), B, T, Hq, dk),
                      view<const Scalar>(layout, k.data(), B, T, Hkv, dk),
                      view<const Scalar>(layout, v.data(), B, T, Hkv, dv), mask,
                      view(layout, fwd.data(), B, T, Hq, dv));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h) {
        INFO("stateless, causal " << (mask == Mask::causal) << ": sequence " << b
                                  << " query head " << h);
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

using Mha = EluLayer<float>;
using Batch = Mha::State;

// Gathers token t of the given conversations into a [N, 1, H, d] batch-first buffer.
std::vector<float> gather(const std::vector<const std::vector<float>*>& src, Index t, Index H,
                          Index d) {
  std::vector<float> out;
  for (const auto* s : src)
    out.insert(out.end(), s->begin() + t * H * d, s->begin() + (t + 1) * H * d);
  return out;
}

// Prefills conversation c alone into batch position `slot` of `state`; returns its outputs.
std::vector<float> prefill_one(const Mha& mha, Batch& state, const Conversation& c, Index slot) {
  using C = Conversation;
  std::vector<float> out(static_cast<std::size_t>(C::T0 * C::Hq * C::dv));
  const Index slots[] = {slot};
  mha.prefill_into(state, TensorView<const float>::batch_first(c.q.data(), 1, C::T0, C::Hq, C::dk),
                   TensorView<const float>::batch_first(c.k.data(), 1, C::T0, C::Hkv, C::dk),
                   TensorView<const float>::batch_first(c.v.data(), 1, C::T0, C::Hkv, C::dv),
                   TensorView<float>::batch_first(out.data(), 1, C::T0, C::Hq, C::dv),
                   SequenceLayout::batch(), std::span<const Index>(slots));
  return out;
}

// One decode step of the listed conversations at their token t (all at the same t here);
// returns [N, Hq, dv] outputs.
std::vector<float> step_all(const Mha& mha, Batch& state,
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
  mha.step_into(state, TensorView<const float>::batch_first(q.data(), N, 1, C::Hq, C::dk),
                TensorView<const float>::batch_first(k.data(), N, 1, C::Hkv, C::dk),
                TensorView<const float>::batch_first(v.data(), N, 1, C::Hkv, C::dv),
                TensorView<float>::batch_first(out.data(), N, 1, C::Hq, C::dv));
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
  ThreadPool pool(GENERATE(1, 2));
  mha.set_executor(&pool);

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
    auto q = gather({&b.q, &c.q}, t, C::Hq, C::dk);
    const auto qd = gather({&d.q}, C::T0 + i, C::Hq, C::dk);
    q.insert(q.end(), qd.begin(), qd.end());
    auto k = gather({&b.k, &c.k}, t, C::Hkv, C::dk);
    const auto kd = gather({&d.k}, C::T0 + i, C::Hkv, C::dk);
    k.insert(k.end(), kd.begin(), kd.end());
    auto v = gather({&b.v, &c.v}, t, C::Hkv, C::dv);
    const auto vd = gather({&d.v}, C::T0 + i, C::Hkv, C::dv);
    v.insert(v.end(), vd.begin(), vd.end());
    std::vector<float> out(static_cast<std::size_t>(3 * C::Hq * C::dv));
    mha.step_into(batch, TensorView<const float>::batch_first(q.data(), 3, 1, C::Hq, C::dk),
                  TensorView<const float>::batch_first(k.data(), 3, 1, C::Hkv, C::dk),
                  TensorView<const float>::batch_first(v.data(), 3, 1, C::Hkv, C::dv),
                  TensorView<float>::batch_first(out.data(), 3, 1, C::Hq, C::dv));
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
  mha.step_into(batch, TensorView<const float>::batch_first(q1.data(), 1, 1, C::Hq, C::dk),
                TensorView<const float>::batch_first(k1.data(), 1, 1, C::Hkv, C::dk),
                TensorView<const float>::batch_first(v1.data(), 1, 1, C::Hkv, C::dv),
                TensorView<float>::batch_first(o1.data(), 1, 1, C::Hq, C::dv),
                std::span<const Index>(slot));
  CHECK(batch.sequence(1).head(1).S() == c_state);
  CHECK(batch.sequence(0).tokens() == b.T + 1);
}

namespace {
// ELU+1 that counts the calls made off the thread that started the layer's call: the proof
// that a pool's threads actually ran work items.
struct Probe {
  static inline std::atomic<int> calls_off_caller{0};
  static inline std::thread::id caller;
  static constexpr bool strictly_positive = true;
  static constexpr const char* name = "probe";
  [[nodiscard]] Index feature_dim(Index d) const noexcept { return d; }
  template <class In, class Out>
  void apply(const In& x, Out& out) const {
    EluPlusOne{}.apply(x, out);
    if (std::this_thread::get_id() != caller) ++calls_off_caller;
  }
};

// Threads of this process, from /proc (Linux); -1 where that is not available.
Index process_threads() {
  std::error_code ec;
  Index n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return ec ? -1 : n;
}
}  // namespace

TEMPLATE_TEST_CASE("one and two threads give identical bytes", "[multihead][threads]", float,
                   double) {
  // Work large enough for the pool's grain (each of the 3 x 2 prefill items is 64 tokens x
  // 2 query heads x 4 r dv flops = 0.26 MFLOP at r = 32, dv = 16), so two threads really run:
  // the probe map counts the work items computed off the calling thread.
  using Scalar = TestType;
  const Index B = 3, T = 64, Hq = 4, Hkv = 2, dk = 32, dv = 16;
  const auto q = random_buffer<Scalar>(B * T * Hq * dk, 61);
  const auto k = random_buffer<Scalar>(B * T * Hkv * dk, 62);
  const auto v = random_buffer<Scalar>(B * T * Hkv * dv, 63);
  const std::vector<Index> lengths{64, 20, 3};
  using Layer = MultiHeadAttention<LinearAttention<Probe, Scalar>>;
  auto run = [&](int threads, std::vector<Scalar>& out, std::vector<Scalar>& dec,
                 typename Layer::State& state) {
    Layer mha({Hq, Hkv, dk, dv});
    ThreadPool pool(threads);
    mha.set_executor(&pool);
    const auto Q = TensorView<const Scalar>::head_first(q.data(), B, Hq, T, dk);
    const auto K = TensorView<const Scalar>::head_first(k.data(), B, Hkv, T, dk);
    const auto V = TensorView<const Scalar>::head_first(v.data(), B, Hkv, T, dv);
    mha.prefill_into(state, Q, K, V, TensorView<Scalar>::head_first(out.data(), B, Hq, T, dv),
                     SequenceLayout::padded(lengths));
    // Decode token 0 of every sequence again as a new step (any data will do).
    const auto q1 = TensorView<const Scalar>::batch_first(q.data(), B, 1, Hq, dk);
    const auto k1 = TensorView<const Scalar>::batch_first(k.data(), B, 1, Hkv, dk);
    const auto v1 = TensorView<const Scalar>::batch_first(v.data(), B, 1, Hkv, dv);
    mha.step_into(state, q1, k1, v1, TensorView<Scalar>::batch_first(dec.data(), B, 1, Hq, dv));
    // Batch entry 0's rows as three packed sequences, full attention.
    const std::vector<Index> offsets{0, 10, 11, T};
    std::vector<Scalar> packed(static_cast<std::size_t>(T * Hq * dv));
    mha.parallel_into(TensorView<const Scalar>::head_first(q.data(), 1, Hq, T, dk),
                      TensorView<const Scalar>::head_first(k.data(), 1, Hkv, T, dk),
                      TensorView<const Scalar>::head_first(v.data(), 1, Hkv, T, dv), Mask::none,
                      TensorView<Scalar>::head_first(packed.data(), 1, Hq, T, dv),
                      SequenceLayout::packed(offsets));
    out.insert(out.end(), packed.begin(), packed.end());
  };
  Probe::caller = std::this_thread::get_id();
  const auto n = static_cast<std::size_t>(B * T * Hq * dv);
  std::vector<Scalar> out1(n), out2(n), dec1(static_cast<std::size_t>(B * Hq * dv)), dec2(dec1);
  const Layer layer({Hq, Hkv, dk, dv});
  auto s1 = layer.make_state(B), s2 = layer.make_state(B);
  Probe::calls_off_caller = 0;
  run(1, out1, dec1, s1);
  CHECK(Probe::calls_off_caller == 0);
  run(2, out2, dec2, s2);
  CHECK(Probe::calls_off_caller > 0);  // the second thread did run items
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

TEST_CASE("without an executor no thread is created and every item runs on the caller",
          "[multihead][threads]") {
  const Index B = 2, T = 128, H = 2, d = 64;
  const auto q = random_buffer<float>(B * T * H * d, 81);
  std::vector<float> out(q.size());
  MultiHeadAttention<LinearAttention<Probe>> mha({H, H, d, d});
  const auto in = TensorView<const float>::batch_first(q.data(), B, T, H, d);
  const auto o = TensorView<float>::batch_first(out.data(), B, T, H, d);
  Probe::caller = std::this_thread::get_id();
  Probe::calls_off_caller = 0;
  const Index before = process_threads();
  mha.parallel_into(in, in, in, Mask::causal, o);
  mha.parallel_into(in, in, in, Mask::none, o);
  auto state = mha.make_state(B);
  mha.prefill_into(state, in, in, in, o);
  CHECK(process_threads() == before);
  CHECK(Probe::calls_off_caller == 0);
}

TEST_CASE("a call below the grain size stays on the calling thread", "[multihead][threads]") {
  // One sequence of one token at d = 8: 2 heads x 4 r dv = 512 flops, far below
  // detail::kParallelGrainFlops: handing it to a thread would cost more than it saves.
  const Index H = 2, d = 8;
  const auto x = random_buffer<float>(H * d, 82);
  std::vector<float> out(x.size());
  MultiHeadAttention<LinearAttention<Probe>> mha({H, H, d, d});
  ThreadPool pool(2);
  mha.set_executor(&pool);
  auto state = mha.make_state(1);
  const auto in = TensorView<const float>::batch_first(x.data(), 1, 1, H, d);
  Probe::caller = std::this_thread::get_id();
  Probe::calls_off_caller = 0;
  for (int i = 0; i < 10; ++i)
    mha.step_into(state, in, in, in, TensorView<float>::batch_first(out.data(), 1, 1, H, d));
  CHECK(Probe::calls_off_caller == 0);
}

TEST_CASE("an error in one head is reported once, after every other head ran", "[multihead]") {
  // Identity features: a query orthogonal to the keys gives a zero denominator in head 1 only.
  const Index H = 2, d = 2;
  std::vector<double> q{1, 0, 0, 1}, k{1, 0, 1, 0}, v{1, 2, 3, 4};  // [1, 1, H, d]
  std::vector<double> out(4, -1.0);
  MultiHeadAttention<LinearAttention<Identity, double>> mha({H, H, d, d});
  auto state = mha.make_state(1);
  const auto Q = TensorView<const double>::batch_first(q.data(), 1, 1, H, d);
  const auto K = TensorView<const double>::batch_first(k.data(), 1, 1, H, d);
  const auto V = TensorView<const double>::batch_first(v.data(), 1, 1, H, d);
  CHECK_THROWS_AS(mha.step_into(state, Q, K, V, TensorView<double>::batch_first(out.data(), 1, 1, H, d)),
                  DenominatorError);
  CHECK(state.sequence(0).head(0).tokens() == 1);  // head 0 stepped: y = v = (1, 2)
  CHECK(out[0] == 1.0);
  CHECK(out[1] == 2.0);
  CHECK(state.sequence(0).head(1).tokens() == 0);  // head 1 unchanged (step's guarantee)
  CHECK(state.sequence(0).head(1).z().isZero(0));
}

TEST_CASE("a token-major prefill in blocks names the failing row within its sequence",
          "[multihead][errors]") {
  // Identity features, every key (1, 0): the denominator of row t is q_t . (t + 1, 0), zero
  // where q_t = (0, 1). Plant that at row 90 of head 1, inside the second of the layer's
  // 64-row blocks (chunk 32), so the block call sees it as its row 26.
  const Index T = 100, H = 2, d = 2, bad_row = 90;
  std::vector<double> q(T * H * d, 0.0), k(T * H * d, 0.0), v(T * H * d, 1.0), out(T * H * d);
  for (Index t = 0; t < T; ++t)
    for (Index h = 0; h < H; ++h) {
      q[static_cast<std::size_t>((t * H + h) * d)] = 1.0;
      k[static_cast<std::size_t>((t * H + h) * d)] = 1.0;
    }
  q[static_cast<std::size_t>((bad_row * H + 1) * d)] = 0.0;
  q[static_cast<std::size_t>((bad_row * H + 1) * d + 1)] = 1.0;
  Options opt;
  opt.chunk_size = 32;
  MultiHeadAttention<LinearAttention<Identity, double>> mha(
      {H, H, d, d}, LinearAttention<Identity, double>(Identity{}, opt));
  auto state = mha.make_state(1);
  const auto view_of = [&](std::vector<double>& x) {
    return TensorView<const double>::batch_first(x.data(), 1, T, H, d);
  };
  try {
    mha.prefill_into(state, view_of(q), view_of(k), view_of(v),
                     TensorView<double>::batch_first(out.data(), 1, T, H, d));
    FAIL("no DenominatorError");
  } catch (const DenominatorError& e) {
    CHECK(e.row() == bad_row);
    CHECK(std::string(e.what()).find("row 90 ") != std::string::npos);
  }
  // As after one call over the sequence: head 0 took every token, head 1 the chunks before
  // the failing one (rows 64 ... 95 hold row 90).
  CHECK(state.sequence(0).head(0).tokens() == T);
  CHECK(state.sequence(0).head(1).tokens() == 64);
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
  const EluLayer<float> mha({H, 1, d, d});
  auto fails = [](auto&& call, const std::string& part) {
    try {
      call();
      FAIL("no exception; expected one mentioning: " << part);
    } catch (const ShapeError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  const auto c = Mask::causal;
  fails([&] { mha.parallel_into(in(B, T, 3, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d)); }, "H_q heads");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 2, d), in(B, T, 1, d), c, o(B, T, H, d)); }, "H_kv heads");
  fails([&] { mha.parallel_into(in(B, T, H, 2), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d)); }, "dim dk");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, 2), c, o(B, T, H, d)); }, "dim dv");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(1, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d)); }, "batch size");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, 3, 1, d), in(B, T, 1, d), Mask::none, o(B, T, H, d)); }, "K and V");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, 3, H, d)); }, "out needs");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, 3, 1, d), in(B, 3, 1, d), c, o(B, T, H, d)); }, "as many queries as keys");
  // The message names the views.
  fails([&] { mha.parallel_into(in(B, T, 3, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d)); }, "[B=2, T=4, H=3, d=3]");

  const std::vector<Index> bad_offsets{0, 3, 2, 4}, short_offsets{0, 3}, lengths{4, 5};
  fails([&] { mha.parallel_into(in(1, T, H, d), in(1, T, 1, d), in(1, T, 1, d), c, o(1, T, H, d), SequenceLayout::packed(bad_offsets)); }, "must not decrease");
  fails([&] { mha.parallel_into(in(1, T, H, d), in(1, T, 1, d), in(1, T, 1, d), c, o(1, T, H, d), SequenceLayout::packed(short_offsets)); }, "end at T=4");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d), SequenceLayout::packed(short_offsets)); }, "batch size 1");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d), SequenceLayout::padded(lengths)); }, "outside [0, T=4]");
  fails([&] { mha.parallel_into(in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), c, o(B, T, H, d), SequenceLayout::padded(bad_offsets)); }, "4 lengths for batch size B=2");

  auto state = mha.make_state(3);
  const auto all = SequenceLayout::batch();
  fails([&] { mha.prefill_into(state, in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d)); }, "the batch state 3");
  const Index dup[] = {1, 1}, far[] = {0, 3};
  fails([&] { mha.prefill_into(state, in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), all, std::span<const Index>(dup)); }, "given twice");
  fails([&] { mha.prefill_into(state, in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d), all, std::span<const Index>(far)); }, "outside the batch state");
  fails([&] { mha.step_into(state, in(3, 2, H, d), in(3, 2, 1, d), in(3, 2, 1, d), o(3, 2, H, d)); }, "one token per sequence");
  const EluLayer<float> wider({H, 1, d, d + 1});
  auto other = wider.make_state(2);
  fails([&] { mha.prefill_into(other, in(B, T, H, d), in(B, T, 1, d), in(B, T, 1, d), o(B, T, H, d)); }, "this layer needs");

  fails([] { EluLayer<float>({3, 2, 4, 4}); }, "multiple of");
  fails([] { EluLayer<float>({2, 1, 0, 4}); }, "positive");
  fails([&] { auto s = mha.make_state(); s.add_sequence(Batch::Sequence(mha.state_heads(), wider.make_state(1).empty_head())); }, "dv=");
  CHECK_THROWS_AS(mha.make_state(1).drop_sequence(99), std::out_of_range);
}

TEST_CASE("a state made by another layer's attention is refused", "[multihead][errors]") {
  // Same dims, another feature map: StateMismatchError names both identities.
  const Index H = 2, d = 4;
  const EluLayer<float> elu({H, H, d, d});
  const MultiHeadAttention<LinearAttention<Identity>> identity({H, H, d, d});
  auto state = identity.make_state(1);
  const auto x = random_buffer<float>(H * d, 83);
  std::vector<float> out(x.size());
  const auto in = TensorView<const float>::batch_first(x.data(), 1, 1, H, d);
  try {
    elu.step_into(state, in, in, in, TensorView<float>::batch_first(out.data(), 1, 1, H, d));
    FAIL("accepted");
  } catch (const StateMismatchError& e) {
    CHECK(std::string(e.what()).find("identity") != std::string::npos);
    CHECK(std::string(e.what()).find("elu_plus_one") != std::string::npos);
  }
}

}  // namespace multihead_test
