// The sequence-parallel algorithm without MPI (detail/slice_runner.hpp, detail/slice_summary.hpp):
// a sequence split into slices, each slice run from a zero carry with its summary, the
// summaries composed in order and the carries applied, equals one prefill of the whole
// sequence to the derived rounding bound (tests/slice_reference.hpp), for every write rule,
// slices of every shape (empty ones included) and a non-zero starting state; a first slice of
// whole chunks is bit-identical; the transposed step of the scan is the adjoint of the
// forward step. The head-major copies of token-major slices (detail/head_major_stage.hpp) copy
// exactly, small or streamed. The cost model that picks the schedule
// (detail/schedule_model.hpp) on slices whose times are worked out by hand below.
// tests/mpi/ runs the same algorithm across real processes.

#include <linattn/attention.hpp>
#include <linattn/detail/flush_subnormals.hpp>
#include <linattn/detail/head_major_stage.hpp>
#include <linattn/detail/schedule_model.hpp>
#include <linattn/detail/slice_runner.hpp>
#include <linattn/detail/slice_summary.hpp>

#include <catch2/catch.hpp>

#include "slice_reference.hpp"
#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <cstdint>
#include <string>
#include <vector>

namespace slice_runner_test {  // this file's own names: tests/CMakeLists.txt compiles test files together

using namespace linattn;
using namespace linattn_test;

namespace {

template <class Scalar>
struct SplitResult {
  RowMatrix<Scalar> Y;                    // outputs of every slice, in sequence order
  std::vector<RowMatrix<Scalar>> states;  // S after each slice
  std::vector<detail::SliceItem<Scalar>> items;  // each slice's item after apply_carry (reads)
  std::vector<Scalar> summaries;                 // each slice's packed summary, in order
  detail::SummaryLayout layout;
};

// The slices of Q, K, V (rows `first` on, `lengths` long) run as detail::SliceRunner runs them
// on separate processes, continuing (S0, z0) (zero when `from_zero`).
template <class Attention, class... In>
SplitResult<typename Attention::scalar_type> split_prefill(
    const Attention& attention, const RowMatrix<typename Attention::scalar_type>& Q,
    const RowMatrix<typename Attention::scalar_type>& K,
    const RowMatrix<typename Attention::scalar_type>& V, Index first,
    const std::vector<Index>& lengths, const typename Attention::State* initial, const In&... in) {
  using Scalar = typename Attention::scalar_type;
  using detail::RowsSpec;
  const Index dk = K.cols(), dv = V.cols(), P = Index(lengths.size());
  Index T = 0;
  for (Index n : lengths) T += n;
  detail::SliceRunner<Attention> runner(attention, dk, dv);
  const Index m = runner.layout().scalars();
  std::vector<Scalar> summaries(std::size_t(P * m));
  std::vector<detail::SliceItem<Scalar>> items(static_cast<std::size_t>(P));
  SplitResult<Scalar> out;
  out.Y = RowMatrix<Scalar>::Zero(T, dv);
  std::vector<Index> offsets{0};
  for (Index p = 0; p < P; ++p) {
    const Index off = offsets.back(), n = lengths[std::size_t(p)];
    auto& item = items[std::size_t(p)];
    item.queries.push_back(RowsSpec<const Scalar>::of(Q.middleRows(first + off, n)));
    item.outputs.push_back(RowsSpec<Scalar>::of(out.Y.middleRows(off, n)));
    item.keys = RowsSpec<const Scalar>::of(K.middleRows(first + off, n));
    item.values = RowsSpec<const Scalar>::of(V.middleRows(first + off, n));
    detail::bind_token_inputs<Scalar>(attention.rule(), std::make_tuple(in.middleRows(first + off, n)...),
                                      n, attention.feature_dim(dk), item.inputs);
    item.direct = initial == nullptr && off == 0;
    runner.run_local(item, summaries.data() + p * m);
    offsets.push_back(off + n);
  }
  for (Index p = 0; p < P; ++p) {
    detail::CarryScan<Scalar> scan(runner.layout());
    if (initial == nullptr) {
      scan.start(RowMatrix<Scalar>(), ColVector<Scalar>(), true);
    } else {
      ColVector<Scalar> z0;
      if constexpr (Attention::rule_type::keeps_normalizer) z0 = initial->z();
      scan.start(initial->S(), z0, false);
    }
    for (Index q = 0; q <= p; ++q) {
      if (q == p) runner.apply_carry(items[std::size_t(p)], scan.S(), scan.z(), offsets[std::size_t(p)]);
      scan.advance(summaries.data() + q * m, lengths[std::size_t(q)]);
    }
    out.states.push_back(scan.S());
  }
  out.items = std::move(items);
  out.summaries = std::move(summaries);
  out.layout = runner.layout();
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("slices run apart and composed in order equal one prefill, every rule",
                   "[slices]", float, double) {
  using Scalar = TestType;
  const Index T = 97, dk = 12, dv = 7;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 1200);
  for_each_rule<Scalar>(T, dk, 1300, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    constexpr bool delta = !Attention::rule_type::keeps_normalizer;
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    for (Index P : {Index{1}, Index{2}, Index{3}, Index{5}}) {
      auto shapes = slicings(T, P);
      if (P == 2) shapes.push_back({2 * C, T - 2 * C});  // a first slice of whole chunks
      for (const auto& lengths : shapes) {
        INFO(name << ", " << P << " slices, first " << lengths.front() << ", last "
                  << lengths.back());
        const auto split = split_prefill(attention, qkv.Q, qkv.K, qkv.V, 0, lengths, nullptr, in...);
        Index off = 0;
        if constexpr (delta) {
          const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, lengths);
          CHECK(worst_ratio_of<Scalar>(split.Y, Y.template cast<double>(), [&](Index i, Index) {
                  return bound.outputs(i);
                }) <= 1.0);
          for (Index p = 0; p < P; ++p) {
            off += lengths[std::size_t(p)];
            auto prefix = attention.make_state(dk, dv);
            RowMatrix<Scalar> unused(off, dv);
            attention.prefill_into(prefix, qkv.Q.topRows(off), qkv.K.topRows(off),
                                   qkv.V.topRows(off), in.topRows(off)..., unused);
            const double diff = (split.states[std::size_t(p)] - prefix.S()).template cast<double>().norm();
            CHECK(diff <= unit_roundoff<Scalar>() * bound.states[std::size_t(p)] + 1e-300);
          }
        } else {
          const bool normalize = attention.options().normalization.divides();
          const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, P);
          CHECK(worst_ratio_of<Scalar>(split.Y, Y.template cast<double>(),
                                       [&](Index i, Index c) { return bound(i, c); }) <= 1.0);
          for (Index p = 0; p < P; ++p) {
            off += lengths[std::size_t(p)];
            auto prefix = attention.make_state(dk, dv);
            RowMatrix<Scalar> unused(off, dv);
            attention.prefill_into(prefix, qkv.Q.topRows(off), qkv.K.topRows(off),
                                   qkv.V.topRows(off), in.topRows(off)..., unused);
            const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, off, C, P);
            CHECK(worst_ratio_of<Scalar>(split.states[std::size_t(p)], prefix.S().template cast<double>(),
                                         [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
          }
        }
        // The first non-empty slice starts from the known-zero state: the attention's own
        // prefill of those rows, so where it holds whole chunks (the same chunks as one
        // prefill) the same bits. (A shorter last chunk may take another product kernel.)
        Index first = 0;
        while (lengths[std::size_t(first)] == 0) ++first;
        const Index n = lengths[std::size_t(first)];
        if (n % C == 0)
          CHECK(linattn_test::same_bits(split.Y.topRows(n), Y.topRows(n)));
      }
    }
  });
}

TEMPLATE_TEST_CASE("slices continuing a non-zero state equal one prefill, every rule", "[slices]",
                   float, double) {
  using Scalar = TestType;
  const Index T = 90, T0 = 23, dk = 8, dv = 5;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 1400);
  for_each_rule<Scalar>(T, dk, 1500, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    INFO(name);
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    // The first T0 tokens in one piece give the initial state; the rest in 3 slices.
    auto initial = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y0(T0, dv);
    attention.prefill_into(initial, qkv.Q.topRows(T0), qkv.K.topRows(T0), qkv.V.topRows(T0),
                           in.topRows(T0)..., Y0);
    const std::vector<Index> lengths{30, 0, T - T0 - 30};
    const auto split = split_prefill(attention, qkv.Q, qkv.K, qkv.V, T0, lengths, &initial, in...);
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    const std::vector<Index> all_lengths{T0, 30, 0, T - T0 - 30};
    RowMatrix<Scalar> Yall(T, dv);
    Yall << Y0, split.Y;
    if constexpr (!Attention::rule_type::keeps_normalizer) {
      const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, all_lengths);
      CHECK(worst_ratio_of<Scalar>(Yall, Y.template cast<double>(),
                                   [&](Index i, Index) { return bound.outputs(i); }) <= 1.0);
      CHECK((split.states.back() - whole.S()).template cast<double>().norm() <=
            unit_roundoff<Scalar>() * bound.states.back());
    } else {
      const bool normalize = attention.options().normalization.divides();
      const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, 4);
      CHECK(worst_ratio_of<Scalar>(Yall, Y.template cast<double>(),
                                   [&](Index i, Index c) { return bound(i, c); }) <= 1.0);
      const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, T, C, 4);
      CHECK(worst_ratio_of<Scalar>(split.states.back(), whole.S().template cast<double>(),
                                   [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
    }
  });
}

// Over a long slice the decays and the delta rules' products of contractions take the carry's
// reads (qf_t .* d_t, or qf_t^T A_t) and the maps A_p through the subnormal range on their way
// to zero: those values are flushed to zero (detail/flush_subnormals.hpp; on Intel cores
// subnormals made the delta rules' summaries up to 24 x slower), and the results still agree
// with one prefill to the derived bounds. Float only: double's subnormal range (below 2^-1022)
// would take slices of over 10^4 tokens.
TEST_CASE("long slices' maps and carry reads hold no subnormals, and still equal one prefill",
          "[slices]") {
  using Scalar = float;
  const Index T0 = 64, T1 = 2400, T = T0 + T1, dk = 4, dv = 3;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 1600);
  const std::vector<Index> lengths{T0, T1};
  for_each_rule<Scalar>(T, dk, 1700, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    using Rule = typename Attention::rule_type;
    if constexpr (Rule::kind != WriteKind::additive) {  // Additive: nothing decays
      INFO(name);
      auto whole = attention.make_state(dk, dv);
      RowMatrix<Scalar> Y(T, dv);
      attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
      auto split = split_prefill(attention, qkv.Q, qkv.K, qkv.V, 0, lengths, nullptr, in...);
      const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
      if constexpr (!Rule::keeps_normalizer) {
        const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, lengths);
        CHECK(worst_ratio_of<Scalar>(split.Y, Y.template cast<double>(),
                                     [&](Index i, Index) { return bound.outputs(i); }) <= 1.0);
      } else {
        const bool normalize = attention.options().normalization.divides();
        const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, 2);
        CHECK(worst_ratio_of<Scalar>(split.Y, Y.template cast<double>(),
                                     [&](Index i, Index c) { return bound(i, c); }) <= 1.0);
      }
      // The second slice's reads: normal at its start, below the normal range by its end (the
      // decay passed 2^-126), and where subnormals are flushed, zero there and none in between.
      const RowMatrix<Scalar>& read = split.items[1].reads.at(0);
      REQUIRE(read.rows() == T1);
      CHECK(read.row(0).cwiseAbs().maxCoeff() >= std::numeric_limits<Scalar>::min());
      CHECK(read.row(T1 - 1).cwiseAbs().maxCoeff() < std::numeric_limits<Scalar>::min());
      const auto subnormals = [](const auto& m) {
        Index n = 0;
        for (Index i = 0; i < m.rows(); ++i)
          for (Index j = 0; j < m.cols(); ++j) n += std::fpclassify(m(i, j)) == FP_SUBNORMAL;
        return n;
      };
      const detail::SummaryRef<Scalar> last{split.summaries.data() + split.layout.scalars(),
                                            split.layout};
      if constexpr (detail::kFlushesSubnormals) {
        CHECK(read.row(T1 - 1).cwiseAbs().maxCoeff() == Scalar(0));
        CHECK(subnormals(read) == 0);
        if constexpr (!Rule::keeps_normalizer) CHECK(subnormals(last.A()) == 0);
      } else {
        WARN("this target keeps subnormals (detail::kFlushesSubnormals is false): not checked");
      }
    }
  });
}

TEST_CASE("the flush scope flushes subnormals inside and restores the caller's mode after",
          "[slices]") {
  // volatile: computed at run time, under the mode in force, not folded by the compiler.
  volatile float smallest = std::numeric_limits<float>::min(), half = 0.5f;
  const auto halved = [&] { return smallest * half; };  // 2^-127: subnormal unless flushed
  REQUIRE(std::fpclassify(halved()) == FP_SUBNORMAL);
  {
    const detail::FlushSubnormalsScope flush;
    if constexpr (detail::kFlushesSubnormals) {
      CHECK(halved() == 0.0f);
      volatile float subnormal_input = std::numeric_limits<float>::denorm_min();
      CHECK(subnormal_input * 2.0f == 0.0f);  // read as zero (DAZ)
    } else {
      CHECK(std::fpclassify(halved()) == FP_SUBNORMAL);
    }
  }
  CHECK(std::fpclassify(halved()) == FP_SUBNORMAL);  // the mode is back
  try {
    const detail::FlushSubnormalsScope flush;
    throw std::runtime_error("leaving by an exception");
  } catch (const std::runtime_error&) {
  }
  CHECK(std::fpclassify(halved()) == FP_SUBNORMAL);
}

TEST_CASE("summary sizes: r dv + r, + 1, + 2 r, r dv + r r per state head", "[slices]") {
  const Index r = 16, dv = 8;
  CHECK(detail::SummaryLayout::of<Additive>(r, dv).scalars() == r * dv + r);
  CHECK(detail::SummaryLayout::of<Decay>(r, dv).scalars() == r * dv + r + 1);
  CHECK(detail::SummaryLayout::of<Gated>(r, dv).scalars() == r * dv + 2 * r);
  CHECK(detail::SummaryLayout::of<Delta>(r, dv).scalars() == r * dv + r * r);
  CHECK(detail::SummaryLayout::of<GatedDelta>(r, dv).scalars() == r * dv + r * r);
}

TEST_CASE("carry_back is the adjoint of a scan step: <A X, Y> = <X, A^T Y>", "[slices]") {
  // A from real slices (the decay of a gated slice, the product of a gated delta slice), X and
  // Y random; both sides in double, so they agree to a few units of roundoff of an r-term sum.
  const Index T = 40, dk = 6, dv = 4;
  const auto qkv = random_qkv<double>(T, dk, dv, 1600);
  for_each_rule<double>(T, dk, 1700, [&](const char* name, const auto& attention, Phi,
                                         const MatrixXdR&, const MatrixXdR&, const MatrixXdR&,
                                         const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    INFO(name);
    detail::SliceRunner<Attention> runner(attention, dk, dv);
    const detail::SummaryLayout layout = runner.layout();
    std::vector<double> summary(std::size_t(layout.scalars()));
    RowMatrix<double> Y(T, dv);
    detail::SliceItem<double> item;
    item.queries.push_back(detail::RowsSpec<const double>::of(qkv.Q));
    item.outputs.push_back(detail::RowsSpec<double>::of(Y));
    item.keys = detail::RowsSpec<const double>::of(qkv.K);
    item.values = detail::RowsSpec<const double>::of(qkv.V);
    detail::bind_token_inputs<double>(attention.rule(), std::forward_as_tuple(in...), T, dk, item.inputs);
    runner.run_local(item, summary.data());  // not direct: A is computed
    // Forward step with B = 0 is X -> A X; compare with the transposed step.
    std::vector<double> no_b = summary;
    detail::SummaryRef<double>{no_b.data(), layout}.B().setZero();
    detail::SummaryRef<double>{no_b.data(), layout}.b().setZero();
    const RowMatrix<double> X = random_matrix<double>(dk, dv, 1800), G = random_matrix<double>(dk, dv, 1801);
    const ColVector<double> x = random_matrix<double>(dk, 1, 1802), g = random_matrix<double>(dk, 1, 1803);
    detail::CarryScan<double> scan(layout);
    scan.start(X, x, false);
    scan.advance(no_b.data(), T);
    RowMatrix<double> dS = G, scratch(dk, dv);
    ColVector<double> dz = layout.keeps_z ? g : ColVector<double>();
    detail::carry_back(no_b.data(), layout, dS, dz, scratch);
    const double lhs = (scan.S().array() * G.array()).sum(), rhs = (X.array() * dS.array()).sum();
    const double scale = (scan.S().cwiseAbs().array() * G.cwiseAbs().array()).sum() +
                         (X.cwiseAbs().array() * dS.cwiseAbs().array()).sum();
    // Two r-term products and one dk dv-term sum each side: (r + dk dv + 2) u of the scale.
    CHECK(std::abs(lhs - rhs) <= double(2 * dk + dk * dv + 2) * unit_roundoff<double>() * scale);
    if (layout.keeps_z) {
      CHECK(std::abs(scan.z().dot(g) - x.dot(dz)) <=
            double(dk + 2) * unit_roundoff<double>() *
                (scan.z().cwiseAbs().dot(g.cwiseAbs()) + x.cwiseAbs().dot(dz.cwiseAbs())));
    }
  });
}

// ---- the cost model of the schedules (no MPI) -------------------------------------------------

// Times in token-times of one item (schedule_model.hpp): L per pipelined or filled slice, c L
// per carry read. Each expected time below is worked out by hand from the schedule's order.
TEST_CASE("schedule model: the three schedules' times on the actual slices, the hybrid's fills "
          "and automatic's choice",
          "[slices][schedule]") {
  using detail::ScheduleCode;
  const double c = 0.35;
  const auto model = [&](Index items, const std::vector<Index>& lengths, bool starts_empty = true,
                         double cost = 0.35, bool fills = true) {
    return detail::model_schedules(items, lengths, starts_empty, cost, fills);
  };
  // Sums of a few multiples of 0.35 and integers: exact to a few units in the last place.
  const auto same = [](double x) { return Approx(x).epsilon(1e-12); };
  {
    // 8 items, 2 even slices of L = 100. Summaries: 8 (1 + c) L (rank 1 reads the carries).
    // Pipeline: (8 + 1) L. Hybrid: rank 1 fills item 7 while item 0 comes (slot 0), pipelines
    // items 0..6 in slots 1..7, and at 8 L, when item 7 arrives, reads its carry: (8 + c) L.
    const auto m = model(8, {100, 100});
    CHECK(m.summaries == same(8 * 135.0));
    CHECK(m.pipeline == same(900.0));
    CHECK(m.hybrid == same(835.0));
    CHECK(m.fills == std::vector<Index>{0, 1});
    CHECK(m.pick == ScheduleCode::hybrid);
  }
  {
    // 4 ranks of 50: rank p waits p slots for item 0 and fills its last p items; rank 3 ends
    // at (8 + 3 c) 50 = 452.5 (its three carries read one after the other from 8 slots on).
    // Pipeline (8 + 3) 50, summaries 8 (1.35) 50.
    const auto m = model(8, {50, 50, 50, 50});
    CHECK(m.summaries == same(540.0));
    CHECK(m.pipeline == same(550.0));
    CHECK(m.hybrid == same(452.5));
    CHECK(m.fills == std::vector<Index>{0, 1, 2, 3});
    CHECK(m.pick == ScheduleCode::hybrid);
  }
  {
    // The delta rules fill nothing (a fill is an extended prefill of two slots): the hybrid is
    // the pipeline, which automatic picks (c = 1: summaries 8 x 2 L).
    const auto m = model(8, {100, 100}, true, 1.0, false);
    CHECK(m.fills == std::vector<Index>{0, 0});
    CHECK(m.hybrid == same(m.pipeline));
    CHECK(m.pipeline == same(900.0));
    CHECK(m.summaries == same(1600.0));
    CHECK(m.pick == ScheduleCode::pipeline);
    CHECK(detail::carry_cost_of<Delta>() == 1.0);
    CHECK_FALSE(detail::hybrid_fills<Delta>());
    CHECK_FALSE(detail::hybrid_fills<GatedDelta>());
    CHECK(detail::carry_cost_of<Additive>() == c);
    CHECK(detail::hybrid_fills<Additive>());
    CHECK(detail::hybrid_fills<Decay>());
    CHECK(detail::hybrid_fills<Gated>());
  }
  {
    // n = P = 2: rank 1 fills item 1, pipelines item 0 in slot 1, reads item 1's carry at 2 L:
    // 2.35 L against the summaries' 2.7 L and the pipeline's 3 L.
    const auto m = model(2, {100, 100});
    CHECK(m.hybrid == same(235.0));
    CHECK(m.summaries == same(270.0));
    CHECK(m.pipeline == same(300.0));
    CHECK(m.pick == ScheduleCode::hybrid);
  }
  {
    // One item: the hybrid is the summaries' order (rank 1 fills it, reads the carry at L):
    // 1.35 L both, the pipeline 2 L; automatic keeps the summaries.
    const auto m = model(1, {100, 100});
    CHECK(m.fills == std::vector<Index>{0, 1});
    CHECK(m.hybrid == same(135.0));
    CHECK(m.summaries == same(135.0));
    CHECK(m.pick == ScheduleCode::summaries);
    // Fewer items than ranks: 3 items on 4 ranks of 50; rank 3 fills all three (3 slots) and
    // reads their carries from slot 3 on: 3 (1 + c) 50 = 202.5, the summaries' time.
    const auto f = model(3, {50, 50, 50, 50});
    CHECK(f.fills == std::vector<Index>{0, 1, 2, 3});
    CHECK(f.hybrid == same(202.5));
    CHECK(f.summaries == same(202.5));
    CHECK(f.pipeline == same(300.0));
    CHECK(f.pick == ScheduleCode::summaries);
    // A single item on uneven slices, where the pipeline would be the fastest by a little
    // (50 + 150 = 200 against 150 x 1.35 = 202.5): automatic still keeps the summaries.
    const auto u = model(1, {50, 150});
    CHECK(u.pipeline == same(200.0));
    CHECK(u.summaries == same(202.5));
    CHECK(u.pick == ScheduleCode::summaries);
  }
  {
    // The summaries' balanced split (rank 0 with 1 + c shares: 114 / 86), 8 items: summaries
    // 8 x 86 x 1.35 = 928.8; pipeline 200 + 7 x 114 = 998; hybrid: rank 1 waits 114 = 1.33
    // slots, fills 1 (2 ends no sooner: both wait for rank 0, whose items leave every 114),
    // and reads item 7's carry when it arrives at 912: 942.1. The summaries stay.
    const auto m = model(8, {114, 86});
    CHECK(m.summaries == same(928.8));
    CHECK(m.pipeline == same(998.0));
    CHECK(m.hybrid == same(942.1));
    CHECK(m.fills == std::vector<Index>{0, 1});
    CHECK(m.pick == ScheduleCode::summaries);
  }
  {
    // A long last slice: rank 2 (L = 1000) gets item 0 at 200 (rank 1 fills item 7 first);
    // filling one item would make it start at 1000 and end at 8000 + 350, not filling ends at
    // 200 + 8000: it fills nothing, and the hybrid is the pipeline (a tie goes to the pipeline).
    const auto m = model(8, {100, 100, 1000});
    CHECK(m.fills == std::vector<Index>{0, 1, 0});
    CHECK(m.hybrid == same(8200.0));
    CHECK(m.pipeline == same(8200.0));
    CHECK(m.pick == ScheduleCode::pipeline);
  }
  {
    // Empty slices: rank 0 empty, rank 1 gets every item at once and fills nothing; the
    // summaries (rank 1 then starts from zero and reads no carry) tie and are kept.
    const auto m = model(8, {0, 200});
    CHECK(m.fills == std::vector<Index>{0, 0});
    CHECK(m.summaries == same(1600.0));
    CHECK(m.pipeline == same(1600.0));
    CHECK(m.hybrid == same(1600.0));
    CHECK(m.pick == ScheduleCode::summaries);
    const auto last = model(8, {200, 0});
    CHECK(last.fills == std::vector<Index>{0, 0});
    CHECK(last.pick == ScheduleCode::summaries);
  }
  {
    // A carried initial state: rank 0 reads a carry under the summaries too (3 x 135 = 405);
    // the pipeline 400; the hybrid (rank 1 fills item 2, pipelines 0 and 1, reads item 2's
    // carry at 300) 335.
    const auto m = model(3, {100, 100}, false);
    CHECK(m.summaries == same(405.0));
    CHECK(m.pipeline == same(400.0));
    CHECK(m.hybrid == same(335.0));
    CHECK(m.pick == ScheduleCode::hybrid);
  }
  {
    // No items: nothing to do, the summaries.
    const auto m = model(0, {10, 10});
    CHECK(m.summaries == 0.0);
    CHECK(m.pick == ScheduleCode::summaries);
  }
}

TEST_CASE("head-major staging copies token-major rows exactly and writes back only the outputs",
          "[slices]") {
  // Three state heads of a [T, H, d] buffer, d = 5 floats (rows neither line-sized nor
  // aligned), two query heads per state head; T large enough that the copy of the inputs
  // (3 * (2 + 2) * 5 * T floats) passes detail::kStreamStageBytes and streams, and small.
  for (const Index T : {Index{37}, Index{220000}}) {
    CAPTURE(T);
    const Index H = 3, G = 2, d = 5;
    const std::size_t input_bytes = std::size_t(H * (G + 2) * d * T) * sizeof(float);
    const bool streams = input_bytes > detail::kStreamStageBytes;
    CHECK(streams == (T > 1000));
    std::vector<float> q(std::size_t(T * H * G * d)), k(std::size_t(T * H * d)), v(k.size());
    std::vector<float> out(q.size(), -1.0f);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(i % 1009) + 0.25f;
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = -float(i % 997);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(i % 991) * 0.5f;
    std::vector<detail::SliceItem<float>> items(static_cast<std::size_t>(H));
    for (Index h = 0; h < H; ++h) {
      auto& item = items[std::size_t(h)];
      for (Index g = h * G; g < (h + 1) * G; ++g) {
        item.queries.push_back({q.data() + g * d, T, d, H * G * d});
        item.outputs.push_back({out.data() + g * d, T, d, H * G * d});
      }
      item.keys = {k.data() + h * d, T, d, H * d};
      item.values = {v.data() + h * d, T, d, H * d};
    }
    REQUIRE(detail::worth_staging(items));
    detail::HeadMajorStage<float> stage;
    stage.stage(items);
    REQUIRE(stage.active);
    bool inputs_equal = true;
    for (Index h = 0; h < H; ++h) {
      const auto& item = items[std::size_t(h)];
      CHECK(item.keys.stride == d);
      for (Index t = 0; t < T; ++t)
        for (Index c = 0; c < d; ++c) {
          const auto at = std::size_t((t * H + h) * d + c);
          inputs_equal = inputs_equal && item.keys.data[t * d + c] == k[at] &&
                         item.values.data[t * d + c] == v[at];
          for (Index g = 0; g < G; ++g)
            inputs_equal = inputs_equal && item.queries[std::size_t(g)].data[t * d + c] ==
                                               q[std::size_t((t * H * G + h * G + g) * d + c)];
        }
      // The call writes its outputs into the staged rows: a value naming (t, head, column).
      for (Index g = 0; g < G; ++g)
        for (Index t = 0; t < T; ++t)
          for (Index c = 0; c < d; ++c)
            item.outputs[std::size_t(g)].data[t * d + c] = float((t * H * G + h * G + g) * d + c);
    }
    CHECK(inputs_equal);
    CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));  // not yet
    stage.finish();
    bool outputs_equal = true;
    for (std::size_t i = 0; i < out.size(); ++i)
      outputs_equal = outputs_equal && out[i] == float(i);
    CHECK(outputs_equal);
  }
}

TEST_CASE("head-major staging of a packed layout's items: groups of different lengths, an "
          "empty item left alone",
          "[slices]") {
  // Sequences of 7, 0 and 12 rows packed into T = 19 token-major rows of H = 2 state heads
  // (G = 1): items (s, h) in sequence-major order, as the MPI layer binds them.
  const Index H = 2, d = 3, T = 19;
  const std::array<Index, 4> offsets{0, 7, 7, 19};
  std::vector<float> q(std::size_t(T * H * d)), k(q.size()), v(q.size()), out(q.size(), -1.0f);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = float(i) + 0.5f;
    k[i] = -float(i);
    v[i] = float(i) * 0.25f;
  }
  std::vector<detail::SliceItem<float>> items(std::size_t(3 * H));
  for (Index s = 0; s < 3; ++s)
    for (Index h = 0; h < H; ++h) {
      auto& item = items[std::size_t(s * H + h)];
      const Index first = offsets[std::size_t(s)], n = offsets[std::size_t(s) + 1] - first;
      item.queries.push_back({q.data() + first * H * d + h * d, n, d, H * d});
      item.outputs.push_back({out.data() + first * H * d + h * d, n, d, H * d});
      item.keys = {k.data() + first * H * d + h * d, n, d, H * d};
      item.values = {v.data() + first * H * d + h * d, n, d, H * d};
    }
  const float* empty_keys = items[2].keys.data;
  detail::HeadMajorStage<float> stage;
  stage.stage(items);
  REQUIRE(stage.active);
  CHECK(stage.groups.size() == 2);          // the empty sequence's items form no group
  CHECK(items[2].keys.data == empty_keys);  // left alone
  bool inputs_equal = true;
  for (Index s = 0; s < 3; ++s)
    for (Index h = 0; h < H; ++h) {
      const auto& item = items[std::size_t(s * H + h)];
      const Index first = offsets[std::size_t(s)];
      if (item.keys.rows > 0) CHECK(item.keys.stride == d);
      for (Index t = 0; t < item.keys.rows; ++t)
        for (Index c = 0; c < d; ++c) {
          const auto at = std::size_t(((first + t) * H + h) * d + c);
          inputs_equal = inputs_equal && item.keys.data[t * d + c] == k[at] &&
                         item.values.data[t * d + c] == v[at] &&
                         item.queries[0].data[t * d + c] == q[at];
          item.outputs[0].data[t * d + c] = float(at);
        }
    }
  CHECK(inputs_equal);
  stage.finish();
  bool outputs_equal = true;
  for (std::size_t i = 0; i < out.size(); ++i) outputs_equal = outputs_equal && out[i] == float(i);
  CHECK(outputs_equal);
}

TEST_CASE("stage buffers are aligned, grow only when asked for more, and keep their block",
          "[slices]") {
  const auto address = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p); };
  detail::StageBuffer<float> buffer;
  float* small = buffer.reserve(10);
  REQUIRE(small != nullptr);
  CHECK(address(small) % 64 == 0);
  CHECK(buffer.reserve(7) == small);  // room enough: the same block
  // A block of kHugePageAdviceBytes or more: 2 MiB aligned (whole huge pages), advised and
  // faulted in; every element writable (AddressSanitizer checks the bounds in CI).
  const Index large = Index(detail::kHugePageAdviceBytes / sizeof(float)) + 3;
  float* big = buffer.reserve(large);
  REQUIRE(big != nullptr);
  CHECK(address(big) % (std::uintptr_t(2) << 20) == 0);
  std::fill_n(big, large, 1.5f);
  CHECK(big[large - 1] == 1.5f);
  CHECK(buffer.reserve(large) == big);
  CHECK(buffer.reserve(1) == big);  // never shrinks
}

}  // namespace slice_runner_test
