// The write-rule kernels (detail/gated_kernels.hpp, detail/delta_kernels.hpp) called directly on
// features: chunk classes chunk by chunk, the recurrences token by token, decode steps and
// grouped reads, against the independent double references of tests/rule_reference.hpp (the
// Identity feature map, so the features given to the kernels are the reference's inputs).
// Odd sizes (value widths that are not a multiple of any packet width take the fallback
// products and the scalar column tail), T not a multiple of the chunk, per-token inputs read
// through a stride, gates near 0 and 1, beta 0 and 1, and the group interface (several query
// heads reading one chunk get a single-head call's bits).

#include <linattn/detail/delta_kernels.hpp>
#include <linattn/detail/gated_kernels.hpp>
#include <linattn/detail/recurrent_sweep.hpp>
#include <linattn/normalization.hpp>

#include <catch2/catch.hpp>

#include "rule_reference.hpp"
#include "test_support.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace rule_kernels_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using linattn_test::naive_delta;
using linattn_test::naive_gated;
using linattn_test::random_matrix;
using linattn_test::worst_ratio;
using linattn_test::MatrixXdR;
using PhiKind = linattn_test::Phi;

namespace {

struct Size {
  Index T, r, dv, C;
};
// r and dv not multiples of any packet width (4, 8, 16 floats; 2, 4, 8 doubles) next to ones
// that are; C not dividing T, below and above the sub-chunk of 16, and C = 1.
// The sanitizer build (-O0; kSanitizedBuild) runs the longest at T = 96, still two chunks with
// a partial last one: the definitions the tests compare against are O(T^2) loops.
const std::vector<Size> sizes{{100, 7, 5, 16},  {100, 16, 24, 37}, {130, 33, 13, 64},
                              {70, 8, 16, 1},   {1, 5, 3, 64},
                              {linattn_test::kSanitizedBuild ? 96 : 200, 24, 32, 64}};

// Uniform entries in [lo, hi], rows x cols, fixed seed.
template <class Scalar>
RowMatrix<Scalar> uniform(Index rows, Index cols, std::uint64_t seed, double lo, double hi) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(u(gen));
  return m;
}

// The delta tests' betas by kind: 0 random in [0, 1], 1 all 0 (nothing written), 2 all 1,
// 3 random in [0, 2] (negative eigenvalues 1 - beta along the key), 4 all 2 (reflections).
constexpr int kBetaKinds = 5;
template <class Scalar>
RowMatrix<Scalar> betas_of_kind(int kind, Index T, std::uint64_t seed) {
  RowMatrix<Scalar> beta = uniform<Scalar>(T, 1, seed, 0.0, kind == 3 ? 2.0 : 1.0);
  if (kind == 1 || kind == 2 || kind == 4) beta.setConstant(Scalar(kind == 1 ? 0 : kind == 2 ? 1 : 2));
  return beta;
}

// Rows scaled to unit norm (the delta rules' keys).
template <class Scalar>
RowMatrix<Scalar> unit_rows(RowMatrix<Scalar> m) {
  for (Index i = 0; i < m.rows(); ++i) m.row(i) /= m.row(i).norm();
  return m;
}

// A [T, H, cols] buffer whose head h holds `x` (T x cols): per-token inputs of head h are read
// in place through a row stride of H cols, as from a model's activations.
template <class Scalar>
RowMatrix<Scalar> interleave(const RowMatrix<Scalar>& x, Index H, Index h, std::uint64_t seed) {
  RowMatrix<Scalar> buffer = uniform<Scalar>(x.rows(), H * x.cols(), seed, -3.0, 0.0);
  buffer.middleCols(h * x.cols(), x.cols()) = x;
  return buffer;
}

// Gates of one kind: log-gates uniform in [lo, hi] (<= 0), scalar (T x 1) or per channel.
struct GateRange {
  double lo, hi;
};
const std::vector<GateRange> gate_ranges{{-0.5, 0.0}, {-1e-4, 0.0}, {-30.0, -20.0}};

// Runs a gated chunk kernel chunk by chunk from (S, z); `gates_from(first)` gives the chunk's
// per-token view. Returns the T x dv output.
template <class Kernel, class Scalar, class GatesFrom>
RowMatrix<Scalar> gated_chunks(const RowMatrix<Scalar>& qf, const RowMatrix<Scalar>& kf,
                               const RowMatrix<Scalar>& v, Index C, GatesFrom&& gates_from,
                               const Normalization& norm, RowMatrix<Scalar>& S,
                               ColVector<Scalar>& z) {
  const Index T = qf.rows(), r = qf.cols(), dv = v.cols();
  RowMatrix<Scalar> out(T, dv);
  Kernel kernel(C, r, dv);
  for (Index first = 0; first < T; first += C) {
    const Index n = std::min(C, T - first);
    kernel.prepare(n, kf.row(first).data(), r, v.row(first).data(), dv, gates_from(first));
    kernel.read(qf.row(first).data(), r, S, z, out.row(first).data(), dv, norm, first);
    kernel.absorb(S, z);
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("gated chunks, scalar and per-channel gates, against the definition",
                   "[kernels][gated]", float, double) {
  using Scalar = TestType;
  const Index H = 3, h = 1;  // per-token inputs of head 1 of 3, read through a stride
  for (const Size& s : sizes) {
    for (const GateRange& range : gate_ranges) {
      for (bool per_channel : {false, true}) {
        for (bool normalize : {true, false}) {
          CAPTURE(s.T, s.r, s.dv, s.C, range.lo, per_channel, normalize);
          // Positive features for the weighted average, signed ones for the raw read.
          const double lo = normalize ? 0.05 : -1.0;
          const auto qf = uniform<Scalar>(s.T, s.r, 1 + s.T, lo, 1.0);
          const auto kf = uniform<Scalar>(s.T, s.r, 2 + s.T, lo, 1.0);
          const auto v = random_matrix<Scalar>(s.T, s.dv, 3 + s.T);
          const Index cols = per_channel ? s.r : 1;
          const auto lg = uniform<Scalar>(s.T, cols, 4 + s.T, range.lo, range.hi);
          const auto buffer = interleave(lg, H, h, 5);
          const Normalization norm = normalize ? Normalization{} : Normalization::unnormalized();
          const auto ref = naive_gated(qf, kf, v, lg, PhiKind::identity, normalize, s.C);
          RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(s.r, s.dv);
          ColVector<Scalar> z = ColVector<Scalar>::Zero(normalize ? s.r : 0);
          RowMatrix<Scalar> y;
          if (per_channel)
            y = gated_chunks<detail::ChannelGatedChunk<Scalar>>(
                qf, kf, v, s.C,
                [&](Index first) {
                  return detail::TokenRows<Scalar>{buffer.data() + h * s.r, H * s.r}.from(first);
                },
                norm, S, z);
          else
            y = gated_chunks<detail::ScalarGatedChunk<Scalar>>(
                qf, kf, v, s.C,
                [&](Index first) {
                  return detail::TokenValues<Scalar>{buffer.data() + h, H}.from(first);
                },
                norm, S, z);
          CHECK(y.allFinite());
          CHECK(worst_ratio<Scalar>(y, ref) <= 1);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("a fixed decay (stride 0, its decays built once per call) matches the definition",
                   "[kernels][gated]", float, double) {
  using Scalar = TestType;
  const Index T = 150, r = 12, dv = 9;
  const auto qf = uniform<Scalar>(T, r, 11, 0.05, 1.0);
  const auto kf = uniform<Scalar>(T, r, 12, 0.05, 1.0);
  const auto v = random_matrix<Scalar>(T, dv, 13);
  const Scalar lg = static_cast<Scalar>(std::log(0.9));
  for (Index C : {Index(64), Index(37)}) {
    CAPTURE(C);
    const auto ref = naive_gated(qf, kf, v, RowMatrix<Scalar>::Constant(T, 1, lg),
                                 PhiKind::identity, true, C);
    RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(r, dv);
    ColVector<Scalar> z = ColVector<Scalar>::Zero(r);
    const auto y = gated_chunks<detail::ScalarGatedChunk<Scalar>>(
        qf, kf, v, C, [&](Index) { return detail::TokenValues<Scalar>{&lg, 0}; }, Normalization{},
        S, z);
    CHECK(worst_ratio<Scalar>(y, ref) <= 1);
  }
}

TEMPLATE_TEST_CASE("several query heads reading one gated chunk get single-head bits",
                   "[kernels][gated][group]", float, double) {
  using Scalar = TestType;
  const Index T = 90, r = 20, dv = 12, C = 32, G = 3;
  const auto kf = uniform<Scalar>(T, r, 21, 0.05, 1.0);
  const auto v = random_matrix<Scalar>(T, dv, 22);
  std::vector<RowMatrix<Scalar>> qf;
  for (Index g = 0; g < G; ++g) qf.push_back(uniform<Scalar>(T, r, 23 + g, 0.05, 1.0));
  for (bool per_channel : {false, true}) {
    CAPTURE(per_channel);
    const auto lg = uniform<Scalar>(T, per_channel ? r : 1, 30, -0.5, 0.0);
    const auto run = [&](auto& kernel, auto gates) {
      // Every head reads each chunk before the state absorbs it.
      RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(r, dv);
      ColVector<Scalar> z = ColVector<Scalar>::Zero(r);
      std::vector<RowMatrix<Scalar>> out(G, RowMatrix<Scalar>(T, dv));
      for (Index first = 0; first < T; first += C) {
        const Index n = std::min(C, T - first);
        kernel.prepare(n, kf.row(first).data(), r, v.row(first).data(), dv, gates.from(first));
        for (Index g = 0; g < G; ++g)
          kernel.read(qf[g].row(first).data(), r, S, z, out[g].row(first).data(), dv,
                      Normalization{}, first);
        kernel.absorb(S, z);
      }
      return out;
    };
    std::vector<RowMatrix<Scalar>> grouped;
    if (per_channel) {
      detail::ChannelGatedChunk<Scalar> kernel(C, r, dv);
      grouped = run(kernel, detail::TokenRows<Scalar>{lg.data(), r});
    } else {
      detail::ScalarGatedChunk<Scalar> kernel(C, r, dv);
      grouped = run(kernel, detail::TokenValues<Scalar>{lg.data(), 1});
    }
    for (Index g = 0; g < G; ++g) {
      RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(r, dv);
      ColVector<Scalar> z = ColVector<Scalar>::Zero(r);
      const auto single =
          per_channel
              ? gated_chunks<detail::ChannelGatedChunk<Scalar>>(
                    qf[g], kf, v, C,
                    [&](Index first) { return detail::TokenRows<Scalar>{lg.data(), r}.from(first); },
                    Normalization{}, S, z)
              : gated_chunks<detail::ScalarGatedChunk<Scalar>>(
                    qf[g], kf, v, C,
                    [&](Index first) {
                      return detail::TokenValues<Scalar>{lg.data(), 1}.from(first);
                    },
                    Normalization{}, S, z);
      CHECK(grouped[static_cast<std::size_t>(g)] == single);
    }
  }
}

TEMPLATE_TEST_CASE("a gated chunk checks every denominator before writing anything",
                   "[kernels][gated][errors]", float, double) {
  using Scalar = TestType;
  // Identity features, one channel: keys 1 then -1 with gate 0.5 give denominators 1 and
  // 0.5 - 1 < 0 (row 1), which the strict normalization rejects.
  RowMatrix<Scalar> qf(2, 1), kf(2, 1), v(2, 1);
  qf << 1, 1;
  kf << 1, -1;
  v << 3, 5;
  const Scalar lg = static_cast<Scalar>(std::log(0.5));
  for (bool per_channel : {false, true}) {
    RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(1, 1), out = RowMatrix<Scalar>::Constant(2, 1, 7);
    ColVector<Scalar> z = ColVector<Scalar>::Zero(1);
    const auto attempt = [&](auto& kernel, auto gates) {
      kernel.prepare(2, kf.data(), 1, v.data(), 1, gates);
      kernel.read(qf.data(), 1, S, z, out.data(), 1, Normalization{}, 40);
    };
    const RowMatrix<Scalar> lgs = RowMatrix<Scalar>::Constant(2, 1, lg);
    if (per_channel) {
      detail::ChannelGatedChunk<Scalar> kernel(4, 1, 1);
      CHECK_THROWS_WITH(attempt(kernel, detail::TokenRows<Scalar>{lgs.data(), 1}),
                        Catch::Matchers::Contains("row 41"));
    } else {
      detail::ScalarGatedChunk<Scalar> kernel(4, 1, 1);
      CHECK_THROWS_AS(attempt(kernel, detail::TokenValues<Scalar>{&lg, 0}), DenominatorError);
    }
    CHECK((out.array() == 7).all());
    CHECK(S(0, 0) == 0);
  }
}

TEMPLATE_TEST_CASE("the gated recurrence (scaled state, two tokens per sweep) and the decode step",
                   "[kernels][gated][recurrent]", float, double) {
  using Scalar = TestType;
  for (const Size& s : sizes) {
    for (const GateRange& range : gate_ranges) {
      for (bool per_channel : {false, true}) {
        CAPTURE(s.T, s.r, s.dv, range.lo, per_channel);
        const auto qf = uniform<Scalar>(s.T, s.r, 41 + s.T, 0.05, 1.0);
        const auto kf = uniform<Scalar>(s.T, s.r, 42 + s.T, 0.05, 1.0);
        const auto v = random_matrix<Scalar>(s.T, s.dv, 43 + s.T);
        const auto lg = uniform<Scalar>(s.T, per_channel ? s.r : 1, 44 + s.T, range.lo, range.hi);
        RowMatrix<Scalar> g(lg.rows(), lg.cols());  // gates within one rounding, as the kernels'
        for (Index i = 0; i < g.size(); ++i) g.data()[i] = std::exp(lg.data()[i]);
        const auto ref = naive_gated(qf, kf, v, lg, PhiKind::identity, true, 1);
        const Normalization norm;
        const auto token = [&](Index t, RowMatrix<Scalar>& y) {
          detail::GatedToken<Scalar> tk;
          tk.qf = qf.row(t).data();
          tk.kf = kf.row(t).data();
          tk.v = v.row(t).data();
          if (per_channel)
            tk.gates = g.row(t).data();
          else
            tk.gate = g(t, 0);
          tk.y = y.row(t).data();
          return tk;
        };
        // Pairs, then the odd last token alone (settled), as RuleAttention::recurrent does.
        RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(s.r, s.dv), y(s.T, s.dv);
        ColVector<Scalar> z = ColVector<Scalar>::Zero(s.r);
        Index tokens = 0;
        {
          detail::GatedRecurrence<Scalar> recurrence(s.r, s.dv);
          Index t = 0;
          for (; t + 1 < s.T; t += 2) {
            const detail::GatedToken<Scalar> pair[2] = {token(t, y), token(t + 1, y)};
            recurrence.pair(S, z, pair, norm, t, tokens, t + 2 >= s.T);
          }
          if (t < s.T) recurrence.single(S, z, token(t, y), norm, t, tokens, true);
          recurrence.finish(S);
        }
        CHECK(tokens == s.T);
        CHECK(worst_ratio<Scalar>(y, ref) <= 1);
        // Decode steps on the exact state; then, for grouped decode, absorb only and read with
        // the additive read-only sweep: the same bits as the step.
        RowMatrix<Scalar> S2 = RowMatrix<Scalar>::Zero(s.r, s.dv), y2(s.T, s.dv),
                          S3 = S2, y3(s.T, s.dv);
        ColVector<Scalar> z2 = ColVector<Scalar>::Zero(s.r), z3 = z2, z_next(s.r);
        Index tokens2 = 0;
        for (Index t = 0; t < s.T; ++t) {
          detail::gated_token(S2, z2, z_next, token(t, y2), norm, t, tokens2);
          const bool reverse = t % 2 != 0;
          detail::gated_absorb(S3, z3, z_next, token(t, y3), reverse);
          const Scalar den = detail::ordered_dot(qf.row(t).data(), z3.data(), s.r);
          const detail::SweepToken<Scalar> read{qf.row(t).data(), nullptr, nullptr,
                                                y3.row(t).data(), den};
          detail::sweep_tokens<1, Scalar, false>(S3.data(), s.dv, s.r, s.dv, &read, true,
                                                 reverse);
        }
        CHECK(worst_ratio<Scalar>(y2, ref) <= 1);
        CHECK(y3 == y2);
        CHECK(S3 == S2);
        CHECK(z3 == z2);
        // The recurrence's settled state is the steps' state to rounding. Each entry of S is a
        // sum over at most T tokens of kf v times a product of at most T gates: per term at
        // most T gate roundings, T multiplications, T additions and a few more (the
        // recurrence's scales and settling), under (4 T + 4) u relative to the same sum with
        // |v| (M below, in double); the two paths differ by at most twice that.
        MatrixXdR M = MatrixXdR::Zero(s.r, s.dv);
        for (Index t = 0; t < s.T; ++t)
          for (Index i = 0; i < s.r; ++i)
            M.row(i) = double(per_channel ? g(t, i) : g(t, 0)) * M.row(i) +
                       double(kf(t, i)) * v.row(t).template cast<double>().cwiseAbs();
        const double u = linattn_test::unit_roundoff<Scalar>();
        CHECK(((S - S2).template cast<double>().cwiseAbs().array() <=
               2.0 * (4.0 * double(s.T) + 4.0) * u * M.array() +
                   std::numeric_limits<Scalar>::min())
                  .all());
      }
    }
  }
}

TEMPLATE_TEST_CASE("the gated recurrence: a rejected second denominator absorbs the first",
                   "[kernels][gated][errors]", float, double) {
  using Scalar = TestType;
  // Identity features, one channel, gate 0.5: keys 1 then -1, denominators 1 then -0.5.
  RowMatrix<Scalar> qf(2, 1), kf(2, 1), v(2, 1), y = RowMatrix<Scalar>::Constant(2, 1, 7);
  qf << 1, 1;
  kf << 1, -1;
  v << 3, 5;
  RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(1, 1);
  ColVector<Scalar> z = ColVector<Scalar>::Zero(1);
  Index tokens = 0;
  detail::GatedToken<Scalar> pair[2];
  for (Index t = 0; t < 2; ++t) {
    pair[t].qf = qf.row(t).data();
    pair[t].kf = kf.row(t).data();
    pair[t].v = v.row(t).data();
    pair[t].gate = Scalar(0.5);
    pair[t].y = y.row(t).data();
  }
  detail::GatedRecurrence<Scalar> recurrence(1, 1);
  CHECK_THROWS_AS(recurrence.pair(S, z, pair, Normalization{}, 0, tokens, false),
                  DenominatorError);
  recurrence.finish(S);
  CHECK(tokens == 1);
  CHECK(y(0, 0) == 3);
  CHECK(y(1, 0) == 7);
  CHECK(S(0, 0) == 3);
  CHECK(z(0) == 1);
}

TEMPLATE_TEST_CASE("delta chunks (WY form, blocked solve) against the recurrence",
                   "[kernels][delta]", float, double) {
  using Scalar = TestType;
  const Index H = 4, h = 2;
  const std::vector<GateRange> alphas{{-0.3, 0.0}, {-1e-4, 0.0}, {-30.0, -20.0}};
  for (const Size& s : sizes) {
    for (int beta_kind = 0; beta_kind < kBetaKinds; ++beta_kind) {
      for (int a = -1; a < static_cast<int>(alphas.size()); ++a) {  // -1: Delta (no alpha)
        CAPTURE(s.T, s.r, s.dv, s.C, beta_kind, a);
        const auto qf = unit_rows(random_matrix<Scalar>(s.T, s.r, 51 + s.T));
        const auto kf = unit_rows(random_matrix<Scalar>(s.T, s.r, 52 + s.T));
        const auto v = random_matrix<Scalar>(s.T, s.dv, 53 + s.T);
        const RowMatrix<Scalar> beta = betas_of_kind<Scalar>(beta_kind, s.T, 54 + s.T);
        const ColVector<Scalar> la =
            a < 0 ? ColVector<Scalar>()
                  : ColVector<Scalar>(uniform<Scalar>(s.T, 1, 55 + s.T, alphas[a].lo, alphas[a].hi));
        const auto beta_buffer = interleave(beta, H, h, 56);
        const auto la_buffer = a < 0 ? RowMatrix<Scalar>() : interleave(RowMatrix<Scalar>(la), H, h, 57);
        const auto ref = naive_delta(qf, kf, v, beta.col(0), la, PhiKind::identity, s.C);
        RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(s.r, s.dv), y(s.T, s.dv);
        detail::DeltaChunk<Scalar> kernel(s.C, s.r, s.dv);
        for (Index first = 0; first < s.T; first += s.C) {
          const Index n = std::min(s.C, s.T - first);
          kernel.prepare(n, kf.row(first).data(), s.r, v.row(first).data(), s.dv,
                         detail::TokenValues<Scalar>{beta_buffer.data() + h, H}.from(first),
                         a < 0 ? detail::TokenValues<Scalar>{}
                               : detail::TokenValues<Scalar>{la_buffer.data() + h, H}.from(first),
                         S);
          kernel.read(qf.row(first).data(), s.r, S, y.row(first).data(), s.dv);
          kernel.absorb(S);
        }
        CHECK(y.allFinite());
        CHECK(worst_ratio<Scalar>(y, ref) <= 1);
        if (beta_kind == 1) CHECK(S.isZero(0));  // beta = 0 writes nothing
      }
    }
  }
}

TEMPLATE_TEST_CASE("several query heads reading one delta chunk get single-head bits",
                   "[kernels][delta][group]", float, double) {
  using Scalar = TestType;
  const Index T = 75, r = 16, dv = 10, C = 32, G = 3;
  const auto kf = unit_rows(random_matrix<Scalar>(T, r, 61));
  const auto v = random_matrix<Scalar>(T, dv, 62);
  const auto beta = uniform<Scalar>(T, 1, 63, 0.0, 1.0);
  const auto la = uniform<Scalar>(T, 1, 64, -0.2, 0.0);
  std::vector<RowMatrix<Scalar>> qf;
  for (Index g = 0; g < G; ++g) qf.push_back(unit_rows(random_matrix<Scalar>(T, r, 65 + g)));
  const auto run = [&](Index heads, Index only) {
    RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(r, dv);
    std::vector<RowMatrix<Scalar>> out(static_cast<std::size_t>(heads), RowMatrix<Scalar>(T, dv));
    detail::DeltaChunk<Scalar> kernel(C, r, dv);
    for (Index first = 0; first < T; first += C) {
      const Index n = std::min(C, T - first);
      kernel.prepare(n, kf.row(first).data(), r, v.row(first).data(), dv,
                     detail::TokenValues<Scalar>{beta.data(), 1}.from(first),
                     detail::TokenValues<Scalar>{la.data(), 1}.from(first), S);
      for (Index g = 0; g < heads; ++g) {
        const auto& q = qf[static_cast<std::size_t>(heads == 1 ? only : g)];
        kernel.read(q.row(first).data(), r, S, out[static_cast<std::size_t>(g)].row(first).data(),
                    dv);
      }
      kernel.absorb(S);
    }
    return out;
  };
  const auto grouped = run(G, 0);
  for (Index g = 0; g < G; ++g) CHECK(grouped[static_cast<std::size_t>(g)] == run(1, g)[0]);
}

TEMPLATE_TEST_CASE("the delta recurrence (update carried into the next sweep) and decode steps",
                   "[kernels][delta][recurrent]", float, double) {
  using Scalar = TestType;
  for (const Size& s : sizes) {
    for (bool gated : {false, true}) {
      for (int beta_kind = 0; beta_kind < kBetaKinds; ++beta_kind) {
        CAPTURE(s.T, s.r, s.dv, gated, beta_kind);
        const auto qf = unit_rows(random_matrix<Scalar>(s.T, s.r, 71 + s.T));
        const auto kf = unit_rows(random_matrix<Scalar>(s.T, s.r, 72 + s.T));
        const auto v = random_matrix<Scalar>(s.T, s.dv, 73 + s.T);
        const ColVector<Scalar> beta = betas_of_kind<Scalar>(beta_kind, s.T, 74 + s.T).col(0);
        const ColVector<Scalar> la =
            gated ? ColVector<Scalar>(uniform<Scalar>(s.T, 1, 75 + s.T, -0.3, 0.0))
                  : ColVector<Scalar>();
        const auto alpha = [&](Index t) { return gated ? std::exp(la(t)) : Scalar(1); };
        const auto ref = naive_delta(qf, kf, v, beta, la, PhiKind::identity, 1);
        RowMatrix<Scalar> S = RowMatrix<Scalar>::Zero(s.r, s.dv), y(s.T, s.dv);
        {
          detail::DeltaRecurrence<Scalar> recurrence(s.r, s.dv);
          Index t = 0;
          for (; t + 1 < s.T; t += 2) {
            const Scalar* const q[2] = {qf.row(t).data(), qf.row(t + 1).data()};
            const Scalar* const k[2] = {kf.row(t).data(), kf.row(t + 1).data()};
            const Scalar* const vs[2] = {v.row(t).data(), v.row(t + 1).data()};
            const Scalar b[2] = {beta(t), beta(t + 1)}, a[2] = {alpha(t), alpha(t + 1)};
            Scalar* const out[2] = {y.row(t).data(), y.row(t + 1).data()};
            recurrence.pair(S, q, k, vs, b, a, out, (t / 2) % 2 != 0);
          }
          if (t < s.T)
            recurrence.single(S, qf.row(t).data(), kf.row(t).data(), v.row(t).data(), beta(t),
                              alpha(t), y.row(t).data(), false);
          recurrence.finish(S, true);
        }
        CHECK(worst_ratio<Scalar>(y, ref) <= 1);
        if (beta_kind == 1) CHECK(S.isZero(0));
        // Decode steps, and absorb-then-read (grouped decode) against the same reference.
        RowMatrix<Scalar> S2 = RowMatrix<Scalar>::Zero(s.r, s.dv), y2(s.T, s.dv), S3 = S2,
                          y3(s.T, s.dv);
        RowVector<Scalar> scratch(s.dv);
        for (Index t = 0; t < s.T; ++t) {
          detail::delta_token(S2, scratch.data(), qf.row(t).data(), kf.row(t).data(),
                              v.row(t).data(), beta(t), alpha(t), y2.row(t).data(), t % 2 != 0);
          detail::delta_absorb(S3, scratch.data(), kf.row(t).data(), v.row(t).data(), beta(t),
                               alpha(t), t % 2 != 0);
          const detail::SweepToken<Scalar> read{qf.row(t).data(), nullptr, nullptr,
                                                y3.row(t).data(), Scalar(1)};
          detail::sweep_tokens<1, Scalar, false>(S3.data(), s.dv, s.r, s.dv, &read, false, false);
        }
        CHECK(worst_ratio<Scalar>(y2, ref) <= 1);
        CHECK(worst_ratio<Scalar>(y3, ref) <= 1);
        CHECK(S3 == S2);  // the same sweeps update S in both
      }
    }
  }
}

TEMPLATE_TEST_CASE("rule_gemm: the register kernel and the fallback agree with a plain product",
                   "[kernels][gemm]", float, double) {
  using Scalar = TestType;
  // n a multiple of the packet width (register kernel) and not (fallback); every triangle.
  for (Index n : {Index(16), Index(13)}) {
    for (auto triangle : {detail::Triangle::none, detail::Triangle::lower_lhs,
                          detail::Triangle::lower_result}) {
      const Index m = 11, depth = 11;
      CAPTURE(n, static_cast<int>(triangle));
      RowMatrix<Scalar> A = random_matrix<Scalar>(m, depth, 81);
      if (triangle == detail::Triangle::lower_lhs)
        A.template triangularView<Eigen::StrictlyUpper>().setZero();
      const RowMatrix<Scalar> B = random_matrix<Scalar>(depth, n, 82);
      const RowMatrix<Scalar> C0 = random_matrix<Scalar>(m, n, 83);
      const ColVector<Scalar> scale = uniform<Scalar>(m, 1, 84, 0.5, 2.0);
      RowMatrix<Scalar> C = C0;
      detail::rule_gemm<Scalar, true>(m, n, depth, A.data(), depth, B.data(), n, C.data(), n,
                                      triangle, scale.data());
      const RowMatrix<double> expect =
          scale.template cast<double>().asDiagonal() *
          (C0.template cast<double>() + A.template cast<double>() * B.template cast<double>());
      // Each entry is a sum of depth + 1 products and a scale: (depth + 3) u relative to the
      // sum of magnitudes.
      const RowMatrix<double> magnitude =
          scale.template cast<double>().cwiseAbs().asDiagonal() *
          (C0.template cast<double>().cwiseAbs() +
           A.template cast<double>().cwiseAbs() * B.template cast<double>().cwiseAbs());
      const double u = linattn_test::unit_roundoff<Scalar>();
      for (Index i = 0; i < m; ++i)
        for (Index j = 0; j < n; ++j) {
          if (triangle == detail::Triangle::lower_result && j > i) continue;
          CHECK(std::abs(double(C(i, j)) - expect(i, j)) <= double(depth + 3) * u * magnitude(i, j));
        }
    }
  }
}

TEMPLATE_TEST_CASE("a diagonal row's decayed scores: the query held in registers gives the "
                   "key-by-key functions' bits",
                   "[kernels][gated]", float, double) {
  using Scalar = TestType;
  constexpr Index N = detail::sweep_packet_size<Scalar>;
  // 1 to kHeldRowPackets + 1 whole packets (held in registers up to kHeldRowPackets, then
  // the fallback), a packet and a tail, and fewer features than a packet.
  std::vector<Index> widths;
  for (Index p = 1; p <= detail::kHeldRowPackets + 1; ++p) widths.push_back(p * N);
  widths.push_back(2 * N + 3);
  widths.push_back(3);
  const Index rows = 16, ld = (detail::kHeldRowPackets + 1) * N + 5;  // every width fits
  for (Index n : widths) {
    CAPTURE(n);
    const auto q = uniform<Scalar>(rows, ld, 91, -1.0, 1.0);
    const auto k = uniform<Scalar>(rows, ld, 92, -1.0, 1.0);
    const auto g = uniform<Scalar>(rows, ld, 93, 0.2, 1.0);
    for (Index j0 : {Index(0), Index(5)})
      for (Index i = j0; i < rows; ++i) {
        std::vector<Scalar> got(rows, Scalar(-7)), scratch(static_cast<std::size_t>(n));
        detail::decayed_row_scores(q.row(i).data(), g.data(), ld, k.data(), ld, n, j0, i,
                                   got.data(), scratch.data());
        std::vector<Scalar> expect(rows, Scalar(-7)), x(q.row(i).data(), q.row(i).data() + n);
        expect[std::size_t(i)] = detail::ordered_dot(q.row(i).data(), k.row(i).data(), n);
        for (Index j = i - 1; j >= j0; --j)
          expect[std::size_t(j)] =
              detail::scale_then_dot(x.data(), g.row(j + 1).data(), k.row(j).data(), n);
        CHECK(got == expect);  // the same bits, and nothing written outside [j0, i]
      }
  }
}

TEMPLATE_TEST_CASE("gates_add_dot: the per-channel running normalizer and its denominator",
                   "[kernels][gated]", float, double) {
  using Scalar = TestType;
  constexpr Index N = detail::sweep_packet_size<Scalar>;
  const double u = linattn_test::unit_roundoff<Scalar>();
  for (Index n : {Index(3), N, 2 * N + 3, 5 * N}) {
    CAPTURE(n);
    const auto z0 = uniform<Scalar>(1, n, 94, 0.0, 2.0);
    const auto g = uniform<Scalar>(1, n, 95, 0.0, 1.0);
    const auto kf = uniform<Scalar>(1, n, 96, 0.0, 1.0);
    const auto q = uniform<Scalar>(1, n, 97, -1.0, 1.0);
    RowMatrix<Scalar> z = z0;
    const Scalar den = detail::gates_add_dot(z.data(), g.data(), kf.data(), q.data(), n);
    double exact_den = 0, magnitude = 0;
    for (Index m = 0; m < n; ++m) {
      const double exact = double(g(m)) * double(z0(m)) + double(kf(m));
      // g z + kf: one rounding with a fused multiply-add, two without; both within 2 u of
      // |g z| + |kf| (all terms >= 0 here).
      CHECK(std::abs(double(z(m)) - exact) <= 2 * u * exact);
      exact_den += double(q(m)) * exact;
      magnitude += std::abs(double(q(m))) * exact;
    }
    // A sum of n products of values each within 2 u: (n + 2) u relative to the magnitudes
    // (n roundings of the sum and products, 2 from z), to first order.
    CHECK(std::abs(double(den) - exact_den) <= double(n + 3) * u * magnitude);
    // The denominator is the dot product with the z it stored, in ordered_dot's order.
    CHECK(den == detail::ordered_dot(q.data(), z.data(), n));
  }
}

TEMPLATE_TEST_CASE("accumulate_rows: a row of the triangular solve against the rows before it",
                   "[kernels][delta]", float, double) {
  using Scalar = TestType;
  constexpr Index N = detail::sweep_packet_size<Scalar>;
  const double u = linattn_test::unit_roundoff<Scalar>();
  // Whole packets up to kHeldRowPackets (held in registers) and past it, a tail, and fewer
  // values than a packet; no terms, one, and a block's worth.
  for (Index n : {Index(3), N, 2 * N + 3, detail::kHeldRowPackets * N,
                  (detail::kHeldRowPackets + 1) * N}) {
    for (Index m : {Index(0), Index(1), Index(15)}) {
      CAPTURE(n, m);
      const Index ld = n + 5;
      const auto x = uniform<Scalar>(std::max<Index>(m, 1), ld, 98, -1.0, 1.0);
      const auto a = uniform<Scalar>(1, std::max<Index>(m, 1), 99, -1.0, 1.0);
      const auto y0 = uniform<Scalar>(1, n + 1, 100, -1.0, 1.0);
      RowMatrix<Scalar> y = y0;
      detail::accumulate_rows(y.data(), a.data(), x.data(), ld, m, n);
      for (Index k = 0; k < n; ++k) {
        double exact = double(y0(k)), magnitude = std::abs(double(y0(k)));
        for (Index j = 0; j < m; ++j) {
          exact += double(a(j)) * double(x(j, k));
          magnitude += std::abs(double(a(j)) * double(x(j, k)));
        }
        // m steps of y + a x, each one rounding with a fused multiply-add or two without:
        // 2 m u of the magnitudes, to first order.
        CHECK(std::abs(double(y(k)) - exact) <= 2 * double(m) * u * magnitude);
      }
      CHECK(y(n) == y0(n));  // nothing written past n
    }
  }
}

TEMPLATE_TEST_CASE("gated_horner: the per-channel backward's decayed sums, forwards and backwards",
                   "[kernels][gated]", float, double) {
  using Scalar = TestType;
  constexpr Index N = detail::sweep_packet_size<Scalar>;
  constexpr Index H = detail::kHeldRowPackets * N;
  const double u = linattn_test::unit_roundoff<Scalar>();
  // Fewer values than a packet, whole packets, a tail; one block held in registers, then more
  // than one (blocks of columns, then fewer packets, then a tail).
  for (Index n : {Index(3), N, 2 * N + 3, H, H + N + 1, 2 * H + 2 * N + 3}) {
    for (Index m : {Index(1), Index(2), Index(16)}) {
      for (const bool upwards : {false, true}) {
        CAPTURE(n, m, upwards);
        const Index ld = n + 5, ld_scores = m + 3;
        const auto x = uniform<Scalar>(m, ld, 101, -1.0, 1.0);
        const auto g = uniform<Scalar>(m, ld, 102, 0.5, 1.0);
        const auto scores = uniform<Scalar>(m, ld_scores, 103, -1.0, 1.0);
        const auto out0 = uniform<Scalar>(1, n + 1, 104, -1.0, 1.0);
        // Term t: coefficient scores(t, 0), row x(t), gate row g(t - 1); or, upwards, from
        // the last row back (coefficient scores(m - 1 - t, 0), row x(m - 1 - t), gate row
        // g(m - t)), as the key terms read a column of dA.
        const auto term = [&](Index t) { return upwards ? m - 1 - t : t; };
        const auto gate = [&](Index t) { return upwards ? m - t : t - 1; };
        RowMatrix<Scalar> out = out0;
        if (upwards)
          detail::gated_horner(out.data(), &scores(m - 1, 0), -ld_scores, &x(m - 1, 0), -ld,
                               g.data() + (m - 1) * ld, -ld, m, n);
        else
          detail::gated_horner(out.data(), scores.data(), ld_scores, x.data(), ld, g.data(), ld,
                               m, n);
        for (Index k = 0; k < n; ++k) {
          double exact = double(out0(k)), magnitude = std::abs(double(out0(k)));
          for (Index t = 0; t < m; ++t) {
            double value = double(scores(term(t), 0)) * double(x(term(t), k));
            for (Index s = t + 1; s < m; ++s) value *= double(g(gate(s), k));
            exact += value;
            magnitude += std::abs(value);
          }
          // Each term: one rounding for c x, then one per later step (a fused multiply-add;
          // two without FMA), then the final addition into out: (2 m + 1) u of the
          // magnitudes, to first order.
          CHECK(std::abs(double(out(k)) - exact) <= (2 * double(m) + 1) * u * magnitude);
        }
        CHECK(out(n) == out0(n));  // nothing written past n
      }
    }
  }
}

}  // namespace rule_kernels_test
