// The pipeline schedule of linattn/mpi.hpp (detail/mpi_pipeline.hpp) across real MPI processes
// (ctest runs this program under mpiexec with 2, 3 and 4 ranks). Every rank holds the whole
// sequence (the same seeds everywhere), passes its slice, and compares its rows and states
// with a single-process prefill of the whole sequence to the bounds of tests/slice_reference.hpp
// (derived for the summaries schedule; they hold for the pipeline: see below), and with the
// summaries schedule. A second call gives the same bits, slices of whole chunks the single
// process's bits; a failure on one rank in the middle of the wavefront makes every rank throw
// the same exception and changes no state (nothing hangs: ctest's timeout would fail the test).
// The multi-head layer under the pipeline equals one-head calls bit for bit: mpi_test.cpp.

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <linattn/mpi.hpp>

#include "mpi_support.hpp"
#include "slice_reference.hpp"
#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

using namespace linattn;
using namespace linattn_test;

int main(int argc, char** argv) {
  return run_mpi_tests(argc, argv, nullptr, [] { return 0; });
}

namespace {

constexpr mpi::Carry kPipeline{mpi::kLastRank, false, mpi::Schedule::pipeline};
constexpr mpi::Carry kSummaries{mpi::kLastRank, false, mpi::Schedule::summaries};

// This rank's slice of a one-head call with `attention` over rows [base + offset, + length),
// into a fresh output; returns the output and the stats.
template <class Attention, class Scalar, class... In>
RowMatrix<Scalar> one_head_call(mpi::SequenceParallel<Attention>& split, typename Attention::State& state,
                                const QKV<Scalar>& qkv, Index first, Index n, mpi::ExchangeStats* stats,
                                const In&... in) {
  RowMatrix<Scalar> out(n, qkv.V.cols());
  const mpi::ExchangeStats s =
      split.prefill_into(state, qkv.Q.middleRows(first, n), qkv.K.middleRows(first, n),
                         qkv.V.middleRows(first, n), RowMatrix<typename In::Scalar>(in.middleRows(first, n))...,
                         out);
  if (stats != nullptr) *stats = s;
  return out;
}

}  // namespace

// The bounds: under the pipeline a key j of slice q reaches row i of slice p through the
// state, which slices q..p-1 each carry through the attention's own chunked prefill (each
// chunk adds its sum and applies its decay, as one piece does over the same tokens) and pass
// on exactly (the messages copy bits). Against one piece the differences are the chunk grid,
// cut at P - 1 more places: at most P more additions and decay multiplications per term,
// within the summaries' allowance of 3 P + 6 extra units (slice_reference.hpp), and for the
// delta rules within E(t) plus the split terms (the pipeline runs no extended state: its error
// is that of one piece with P - 1 more chunk boundaries, each step a contraction).
TEMPLATE_TEST_CASE("pipeline, one head, every rule and slicing: rows and states equal one "
                   "prefill to rounding and the summaries schedule to twice that, a second call "
                   "the same bits, whole-chunk slices the single process's bits",
                   "[mpi][pipeline]", float, double) {
  using Scalar = TestType;
  const World w = world();
  const Index T = 101, dk = 12, dv = 7, P = w.size;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 4100);
  for_each_rule<Scalar>(T, dk, 4200, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    constexpr bool delta = !Attention::rule_type::keeps_normalizer;
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    auto shapes = slicings(T, P);
    {
      // Slices of whole chunks (the last takes the rest): the chunk grid of one piece.
      std::vector<Index> chunks(std::size_t(P), C);
      chunks.back() = T - (P - 1) * C;
      if (chunks.back() >= 0) shapes.push_back(chunks);
    }
    mpi::SequenceParallel<Attention> piped(attention, MPI_COMM_WORLD, kPipeline);
    mpi::SequenceParallel<Attention> summed(attention, MPI_COMM_WORLD, kSummaries);
    mpi::SequenceParallel<Attention> everywhere(attention, MPI_COMM_WORLD,
                                                {mpi::kLastRank, true, mpi::Schedule::pipeline});
    for (const auto& lengths : shapes) {
      const Slice my = slice_of(lengths, w.rank);
      INFO(name << ", rank " << w.rank << " of " << P << ", rows " << my.offset << " + " << my.length);
      auto state = attention.make_state(dk, dv);
      mpi::ExchangeStats stats;
      const RowMatrix<Scalar> out = one_head_call(piped, state, qkv, my.offset, my.length, &stats, in...);
      CHECK(stats.schedule == mpi::Schedule::pipeline);
      const Index end = my.offset + my.length;
      CHECK(state.tokens() == end);
      // The single-process state after this rank's slice.
      auto prefix = attention.make_state(dk, dv);
      RowMatrix<Scalar> unused(end, dv);
      attention.prefill_into(prefix, qkv.Q.topRows(end), qkv.K.topRows(end), qkv.V.topRows(end),
                             in.topRows(end)..., unused);
      auto summed_state = attention.make_state(dk, dv);
      const RowMatrix<Scalar> summed_out =
          one_head_call(summed, summed_state, qkv, my.offset, my.length, nullptr, in...);
      const MatrixXdR Yd = Y.middleRows(my.offset, my.length).template cast<double>();
      const MatrixXdR Sd = summed_out.template cast<double>();
      if constexpr (delta) {
        const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, lengths);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index) { return bound.outputs(my.offset + i); }) <= 1.0);
        // Both schedules are within the bound of one piece: within twice it of each other.
        CHECK(worst_ratio_of<Scalar>(out, Sd, [&](Index i, Index) { return 2 * bound.outputs(my.offset + i); }) <= 1.0);
        CHECK((state.S() - prefix.S()).template cast<double>().norm() <=
              unit_roundoff<Scalar>() * bound.states[std::size_t(w.rank)]);
      } else {
        const bool normalize = attention.options().normalization.divides();
        const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, P);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index c) { return bound(my.offset + i, c); }) <= 1.0);
        CHECK(worst_ratio_of<Scalar>(out, Sd, [&](Index i, Index c) { return 2 * bound(my.offset + i, c); }) <= 1.0);
        const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, end, C, P);
        CHECK(worst_ratio_of<Scalar>(state.S(), prefix.S().template cast<double>(),
                                     [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
        CHECK(worst_ratio_of<Scalar>(state.z(), prefix.z().template cast<double>(),
                                     [&](Index i, Index) { return sb.row(i).maxCoeff(); }) <= 1.0);
      }
      // Every slice up to this one starts on the chunk grid and holds at least one chunk, and
      // this one ends on it or with the sequence: the same operations on buffers of the same
      // sizes as one piece, so the same bits, on every rank. (Shorter buffers change Eigen's
      // alignment peeling, and a partial chunk inside the sequence its block sizes: Additive's
      // products then round differently.)
      bool on_grid = (end == T || end % C == 0) && my.length >= std::min(C, T);
      for (int p = 0; p < w.rank; ++p) on_grid = on_grid && lengths[std::size_t(p)] >= C;
      for (int p = 0; p <= w.rank; ++p) on_grid = on_grid && slice_of(lengths, p).offset % C == 0;
      if (on_grid) {
        CHECK(same_bits(out, Y.middleRows(my.offset, my.length)));
        CHECK(same_bits(state.S(), end == T ? whole.S() : prefix.S()));
      }
      // The same call again: the same bits.
      auto again = attention.make_state(dk, dv);
      CHECK(same_bits(one_head_call(piped, again, qkv, my.offset, my.length, nullptr, in...), out));
      CHECK(same_bits(again.S(), state.S()));
      // broadcast_final: every rank holds the last rank's final state, bit for bit.
      auto final_state = attention.make_state(dk, dv);
      CHECK(same_bits(one_head_call(everywhere, final_state, qkv, my.offset, my.length, nullptr, in...), out));
      CHECK(final_state.tokens() == T);
      CHECK(same_on_every_rank(digest(final_state.S())));
      if (w.rank == P - 1) CHECK(same_bits(final_state.S(), state.S()));
    }
  });
}

TEST_CASE("pipeline: consecutive calls continue each other; the initial state on rank 0, a "
          "middle rank or the last",
          "[mpi][pipeline]") {
  using Scalar = float;
  const World w = world();
  const Index T = 120, T1 = 47, dk = 8, dv = 6, P = w.size;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 4300);
  for_each_rule<Scalar>(T, dk, 4400, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    // Tokens [0, T1) over the ranks, then [T1, T) with one rank empty: 2 P slices in all.
    const auto first = slicings(T1, P).front(), second = slicings(T - T1, P).back();
    std::vector<Index> all_lengths = first;
    all_lengths.insert(all_lengths.end(), second.begin(), second.end());
    const auto check_final = [&](const auto& state) {
      if constexpr (!Attention::rule_type::keeps_normalizer) {
        const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, all_lengths);
        CHECK((state.S() - whole.S()).template cast<double>().norm() <=
              unit_roundoff<Scalar>() * bound.states.back());
      } else {
        const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, T, C, 2 * P);
        CHECK(worst_ratio_of<Scalar>(state.S(), whole.S().template cast<double>(),
                                     [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
      }
      CHECK(state.tokens() == T);
    };
    for (int holder : {mpi::kLastRank, 0, int(P / 2)}) {
      INFO(name << ", rank " << w.rank << " of " << P << ", holder " << holder);
      // The first call leaves each rank the state after its own slice; the holder's is the one
      // the second call continues (the last rank's: the state after [0, T1)).
      mpi::SequenceParallel<Attention> split(attention, MPI_COMM_WORLD,
                                             {mpi::kLastRank, false, mpi::Schedule::pipeline});
      auto state = attention.make_state(dk, dv);
      const Slice a = slice_of(first, w.rank);
      static_cast<void>(one_head_call(split, state, qkv, a.offset, a.length, nullptr, in...));
      if (holder != mpi::kLastRank) {
        // Hand the state after [0, T1) to the holder (as a user would, e.g. restored from disk).
        auto held = attention.make_state(dk, dv);
        RowMatrix<Scalar> unused(T1, dv);
        if (w.rank == holder)
          attention.prefill_into(held, qkv.Q.topRows(T1), qkv.K.topRows(T1), qkv.V.topRows(T1),
                                 in.topRows(T1)..., unused);
        state = held;
      }
      mpi::SequenceParallel<Attention> next(attention, MPI_COMM_WORLD,
                                            {holder, true, mpi::Schedule::pipeline});
      const Slice b = slice_of(second, w.rank);
      mpi::ExchangeStats stats;
      const RowMatrix<Scalar> out = one_head_call(next, state, qkv, T1 + b.offset, b.length, &stats, in...);
      const int from = holder == mpi::kLastRank ? int(P) - 1 : holder;
      CHECK((stats.initial_state_bytes > 0) == (w.rank == from && from != 0));
      CHECK(same_on_every_rank(digest(state.S())));
      check_final(state);
      const Index row0 = T1 + b.offset;
      const MatrixXdR Yd = Y.middleRows(row0, b.length).template cast<double>();
      if constexpr (!Attention::rule_type::keeps_normalizer) {
        const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, all_lengths);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index) { return bound.outputs(row0 + i); }) <= 1.0);
      } else {
        const bool normalize = attention.options().normalization.divides();
        const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, 2 * P);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index c) { return bound(row0 + i, c); }) <= 1.0);
      }
    }
  });
}

// ---- the automatic choice --------------------------------------------------------------------

TEST_CASE("automatic: the pipeline where c items > P - 1 (even slices), never for one item or "
          "fewer items than ranks",
          "[mpi][pipeline]") {
  using detail::pipeline_pays;
  const std::vector<Index> two{100, 100}, four{50, 50, 50, 50};
  // Additive, c = 0.35, 2 ranks: 2 items 0.7 < 1, 3 items 1.05 > 1.
  CHECK_FALSE(pipeline_pays(1, two, true, 0.35));
  CHECK_FALSE(pipeline_pays(2, two, true, 0.35));
  CHECK(pipeline_pays(3, two, true, 0.35));
  CHECK(pipeline_pays(8, two, true, 0.35));
  // 4 ranks: c items > 3 from 9 items on.
  CHECK_FALSE(pipeline_pays(8, four, true, 0.35));
  CHECK(pipeline_pays(9, four, true, 0.35));
  // Delta rules, c = 1: from P items on.
  CHECK(pipeline_pays(2, two, true, 1.0));
  CHECK_FALSE(pipeline_pays(3, four, true, 1.0));
  CHECK(pipeline_pays(5, four, true, 1.0));
  // The balanced split of the summaries (rank 0 with 1 + c shares) is the summaries' best case:
  // 8 items on 2 ranks, c = 0.35, split 114 / 86: summaries 8 x 116.1 = 929, pipeline
  // 200 + 7 x 114 = 998; with 20 items 2322 against 2366 still; the pipeline wants even slices.
  CHECK_FALSE(pipeline_pays(8, {114, 86}, true, 0.35));
  CHECK_FALSE(pipeline_pays(20, {114, 86}, true, 0.35));
  // Against an even split (the pipeline's best), the summaries' own best split loses from
  // 8 items: 8 x 116.1 = 929 > 200 + 7 x 100 = 900.
  CHECK(pipeline_pays(8, two, true, 0.35));
  // A carried initial state: rank 0 reads a carry too, so the summaries' slot is longer.
  CHECK(pipeline_pays(3, {100, 100}, false, 0.35));
  CHECK(detail::carry_cost_of<Additive>() == 0.35);
  CHECK(detail::carry_cost_of<Delta>() == 1.0);

  // A layer call reports the schedule the model picked: 8 state heads, additive.
  const World w = world();
  const Index H = 8, d = 4, T = 6 * w.size;
  MultiHeadAttention<LinearAttention<EluPlusOne>> layer({H, H, d, d});
  const RowMatrix<float> q = random_matrix<float>(T, H * d, 4500);
  RowMatrix<float> out(T / w.size, H * d);
  auto state = layer.make_state(1);
  const Slice my = slice_of(slicings(T, w.size).front(), w.rank);
  const auto rows = TensorView<const float>::batch_first(q.data() + my.offset * H * d, 1, my.length, H, d);
  const mpi::ExchangeStats stats =
      mpi::SequenceParallel<MultiHeadAttention<LinearAttention<EluPlusOne>>>(layer, MPI_COMM_WORLD)
          .prefill_into(state, rows, rows, rows, TensorView<float>::batch_first(out.data(), 1, my.length, H, d));
  CHECK(stats.schedule == (0.35 * double(H) > double(w.size - 1) ? mpi::Schedule::pipeline
                                                                   : mpi::Schedule::summaries));
}

// ---- failures in the middle of the wavefront -------------------------------------------------

namespace {

// A layer of H heads with the identity feature map and the strict read: positive queries and
// keys (every denominator > 0) except where a test makes one query row negative.
struct FailingLayer {
  static constexpr Index H = 3, d = 4, T = 64;
  using Layer = MultiHeadAttention<LinearAttention<Identity>>;
  Layer layer{HeadConfig{H, H, d, d}};
  RowMatrix<float> Q = uniform_matrix<float>(T, H * d, 4600, 0.1, 1.0);
  RowMatrix<float> K = uniform_matrix<float>(T, H * d, 4601, 0.1, 1.0);
  RowMatrix<float> V = random_matrix<float>(T, H * d, 4602);

  // This rank's slice of the call under the pipeline; returns the stats.
  mpi::ExchangeStats call(Layer::State& state, const std::vector<Index>& lengths, bool broadcast) {
    const Slice my = slice_of(lengths, world().rank);
    RowMatrix<float> out(my.length, H * d);
    const auto rows = [&](const RowMatrix<float>& X) {
      return TensorView<const float>::batch_first(X.data() + my.offset * H * d, 1, my.length, H, d);
    };
    return mpi::SequenceParallel<Layer>(layer, MPI_COMM_WORLD,
                                        {mpi::kLastRank, broadcast, mpi::Schedule::pipeline})
        .prefill_into(state, rows(Q), rows(K), rows(V),
                      TensorView<float>::batch_first(out.data(), 1, my.length, H, d));
  }
};

std::uint64_t digest_of(const FailingLayer::Layer::State& state) {
  std::uint64_t h = 1469598103934665603ULL;
  for (Index h_ = 0; h_ < FailingLayer::H; ++h_) {
    const Index tokens = state.sequence(0).head(h_).tokens();
    h = fnv1a(&tokens, sizeof tokens, digest(state.sequence(0).head(h_).S(), h));
  }
  return h;
}

}  // namespace

TEST_CASE("pipeline: a denominator rejected on one rank for one head makes every rank throw it "
          "with the sequence's row; no state changes; the next call works",
          "[mpi][pipeline][errors]") {
  const World w = world();
  const std::vector<Index> lengths = slicings(FailingLayer::T, w.size).front();
  // Head 1 on the last rank (a carried state, items before and after it), head 0 on rank 0's
  // first row (where the wavefront starts), head 2 on a middle rank's last row.
  const Index last_first = FailingLayer::T - lengths.back();
  const Index middle_last = slice_of(lengths, w.size / 2).offset + lengths[std::size_t(w.size / 2)] - 1;
  for (const auto& bad : {std::pair<Index, Index>{1, last_first + 2}, {0, 0}, {2, middle_last}}) {
    const Index head = bad.first, bad_row = bad.second;
    INFO("head " << head << ", row " << bad_row << ", rank " << w.rank);
    for (bool broadcast : {false, true}) {
      FailingLayer f;
      auto state = f.layer.make_state(1);
      CHECK(f.call(state, lengths, broadcast).schedule == mpi::Schedule::pipeline);  // a good call first
      const std::uint64_t before = digest_of(state);
      f.Q.block(bad_row, head * FailingLayer::d, 1, FailingLayer::d).setConstant(-1.0f);
      Index row = -1;
      const std::string message = every_rank_throws<DenominatorError>([&] {
        try {
          f.call(state, lengths, broadcast);
        } catch (const DenominatorError& e) {
          row = e.row();
          throw;
        }
      });
      CHECK(row == bad_row);
      CHECK_THAT(message, Catch::Contains("at query row " + std::to_string(bad_row) + " "));
      CHECK(digest_of(state) == before);
      f.Q.block(bad_row, head * FailingLayer::d, 1, FailingLayer::d).setConstant(0.5f);
      CHECK_NOTHROW(f.call(state, lengths, broadcast));  // every rank back in step
    }
  }
}

TEST_CASE("pipeline: a state that overflows on rank 0 fails downstream too; bad input and "
          "disagreeing schedules throw on every rank",
          "[mpi][pipeline][errors]") {
  const World w = world();
  const std::vector<Index> lengths = slicings(FailingLayer::T, w.size).front();
  {
    // An infinite value in head 2's first row on rank 0: its state after the slice is not
    // finite, so rank 0 fails on item 2 and every later rank hears of it through the messages.
    FailingLayer f;
    auto state = f.layer.make_state(1);
    f.call(state, lengths, false);
    const std::uint64_t before = digest_of(state);
    f.V(0, 2 * FailingLayer::d) = std::numeric_limits<float>::infinity();
    const std::string m = every_rank_throws<std::domain_error>([&] { f.call(state, lengths, false); });
    CHECK_THAT(m, Catch::Contains("rank 0 of") && Catch::Contains("not finite"));
    CHECK(digest_of(state) == before);
  }
  {
    // A shape error on the last rank, found before any message moves.
    FailingLayer f;
    auto state = f.layer.make_state(w.rank == w.size - 1 ? 2 : 1);
    const std::vector<Index> slots{w.rank == w.size - 1 ? Index{5} : Index{0}};
    const Slice my = slice_of(lengths, w.rank);
    RowMatrix<float> out(my.length, FailingLayer::H * FailingLayer::d);
    const auto rows = [&](const RowMatrix<float>& X) {
      return TensorView<const float>::batch_first(X.data() + my.offset * FailingLayer::H * FailingLayer::d,
                                                  1, my.length, FailingLayer::H, FailingLayer::d);
    };
    const std::string m = every_rank_throws<ShapeError>([&] {
      mpi::SequenceParallel<FailingLayer::Layer>(f.layer, MPI_COMM_WORLD, kPipeline)
          .prefill_into(state, rows(f.Q), rows(f.K), rows(f.V),
                        TensorView<float>::batch_first(out.data(), 1, my.length, FailingLayer::H, FailingLayer::d),
                        std::span<const Index>(slots));
    });
    CHECK_THAT(m, Catch::Contains("rank " + std::to_string(w.size - 1) + " of") &&
                      Catch::Contains("slot 5 is outside"));
  }
  {
    // Ranks that disagree on the schedule; a schedule value outside the enum.
    FailingLayer f;
    auto state = f.layer.make_state(1);
    const Slice my = slice_of(lengths, w.rank);
    RowMatrix<float> out(my.length, FailingLayer::H * FailingLayer::d);
    const auto run = [&](mpi::Schedule s) {
      const auto rows = [&](const RowMatrix<float>& X) {
        return TensorView<const float>::batch_first(X.data() + my.offset * FailingLayer::H * FailingLayer::d,
                                                    1, my.length, FailingLayer::H, FailingLayer::d);
      };
      mpi::SequenceParallel<FailingLayer::Layer>(f.layer, MPI_COMM_WORLD, {mpi::kLastRank, false, s})
          .prefill_into(state, rows(f.Q), rows(f.K), rows(f.V),
                        TensorView<float>::batch_first(out.data(), 1, my.length, FailingLayer::H, FailingLayer::d));
    };
    std::string m = every_rank_throws<mpi::RankMismatchError>(
        [&] { run(w.rank == 1 ? mpi::Schedule::summaries : mpi::Schedule::pipeline); });
    CHECK_THAT(m, Catch::Contains("Carry::schedule") && Catch::Contains("rank 0 has 2, rank 1 has 1"));
    m = every_rank_throws<std::invalid_argument>([&] { run(static_cast<mpi::Schedule>(7)); });
    CHECK_THAT(m, Catch::Contains("Carry::schedule is 7"));
    CHECK_NOTHROW(run(mpi::Schedule::pipeline));
  }
}
