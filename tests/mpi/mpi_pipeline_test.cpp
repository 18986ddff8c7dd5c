// The pipeline schedule of linattn/mpi.hpp (detail/mpi_pipeline.hpp) across real MPI processes
// (ctest runs this program under mpiexec with 2, 3 and 4 ranks). Every rank holds the whole
// sequence (the same seeds everywhere), passes its slice, and compares its rows and states
// with a single-process prefill of the whole sequence to the bounds of tests/slice_reference.hpp
// (derived for the summaries schedule; they hold for the pipeline: see below), and with the
// summaries schedule. A second call gives the same bits, slices of whole chunks the single
// process's bits; a failure on one rank in the middle of the wavefront makes every rank throw
// the same exception and changes no state (nothing hangs: ctest's timeout would fail the test).
// The multi-head layer under the pipeline equals one-head calls bit for bit: mpi_test.cpp.

#include <catch2/catch.hpp>

#include <linattn/mpi.hpp>

#include "mpi_support.hpp"
#include "slice_reference.hpp"
#include "test_support.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace mpi_pipeline_test {  // this file's own names: the three files build as one program

using namespace linattn;
using namespace linattn_test;

namespace {

constexpr mpi::Carry kPipeline{mpi::kLastRank, false, mpi::Schedule::pipeline};
constexpr mpi::Carry kSummaries{mpi::kLastRank, false, mpi::Schedule::summaries};
constexpr mpi::Carry kHybrid{mpi::kLastRank, false, mpi::Schedule::hybrid};

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
    auto shapes = slicings_to_test(T, P);  // and the whole-chunk slicing below
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

TEST_CASE("pipeline and hybrid: consecutive calls continue each other; the initial state on "
          "rank 0, a middle rank or the last",
          "[mpi][pipeline][hybrid]") {
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
    // One item: under the hybrid every rank after the first that waits a slot for it fills it
    // (reads the carried initial state as the summaries do); the bounds hold for both.
    for (const mpi::Schedule schedule : {mpi::Schedule::pipeline, mpi::Schedule::hybrid})
      for (int holder : {mpi::kLastRank, 0, int(P / 2)}) {
        INFO(name << ", rank " << w.rank << " of " << P << ", holder " << holder << ", schedule "
                  << int(schedule));
        // The first call leaves each rank the state after its own slice; the holder's is the one
        // the second call continues (the last rank's: the state after [0, T1)).
        mpi::SequenceParallel<Attention> split(attention, MPI_COMM_WORLD, {mpi::kLastRank, false, schedule});
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
        mpi::SequenceParallel<Attention> next(attention, MPI_COMM_WORLD, {holder, true, schedule});
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

// ---- the hybrid schedule ---------------------------------------------------------------------

namespace {

// One head's per-token inputs (T x c) for every batch entry and key/value head of a layer, as
// a [B, T, H, c] batch-first buffer.
template <class Scalar>
Buffer<Scalar> every_head(const RowMatrix<Scalar>& x, Index B, Index H) {
  const Index T = x.rows(), c = x.cols();
  RowMatrix<Scalar> all(1, B * T * H * c);
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t)
      for (Index h = 0; h < H; ++h)
        for (Index j = 0; j < c; ++j) all(0, ((b * T + t) * H + h) * c + j) = x(t, j);
  return Buffer<Scalar>(Layout::batch_first, B, T, H, c, all);
}

}  // namespace

// The bounds: a filled item's outputs and states are computed as the summaries compute them,
// except that the carry a rank reads was formed slice by slice by the ranks before it, each
// either continuing it through its own chunked prefill (the pipeline's step) or with one scan
// step (S = A S_c + B, the summaries' step). Per key term that is at most one addition, one
// decay multiplication and one rounded decay per slice either way, then the summaries' read:
// within the summaries' allowance of 3 P + 6 extra units (slice_reference.hpp). Items that
// every rank up to this one pipelined are the pipeline's, bit for bit (the pipeline test checks
// those against one process with the same bounds). The delta rules fill nothing: the hybrid is
// the pipeline, bit for bit.
// float only: the hybrid sends what the pipeline and the summaries send (bytes counted from
// sizeof(Scalar), MPI datatypes from detail::mpi_type), which the one-head tests above and in
// mpi_test.cpp run in double too; a double instantiation here lengthened CI's longest compiles.
TEMPLATE_TEST_CASE("hybrid: every rule, 1 to 6 items (grouped heads), every slicing: rows and "
                   "states equal one prefill to rounding, items pipelined through this rank the "
                   "pipeline's bits, a second call the same bits, broadcast_final",
                   "[mpi][hybrid]", float) {
  using Scalar = TestType;
  const World w = world();
  const Index T = 67, dk = 8, dv = 6, P = w.size;
  for_each_rule<Scalar>(T, dk, 4700, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    using Rule = typename Attention::rule_type;
    using Layer = MultiHeadAttention<Attention>;
    constexpr bool delta = !Rule::keeps_normalizer;
    constexpr std::size_t N = sizeof...(in);
    const Index r = attention.feature_dim(dk), C = attention.chunk_size(r, dv), G = 2;
    const bool normalize = attention.options().normalization.divides();
    // (B, H_kv): n = B H_kv items of G query heads each; n = 1, P, 6 and P - 1.
    // Under the sanitizers (-O0; kSanitizedBuild) n = P and n = 6 only, over the slicings of
    // slicings_to_test (the even one fills): the same code paths in a third of the time.
    std::vector<std::array<Index, 2>> shapes{{1, 1}, {1, P}, {2, 3}};
    if (P > 2) shapes.push_back({1, P - 1});
    if (kSanitizedBuild) shapes = {{1, P}, {2, 3}};
    for (const auto& shape : shapes) {
      const Index B = shape[0], Hkv = shape[1], Hq = G * Hkv, n = B * Hkv;
      const Layer layer(HeadConfig{Hq, Hkv, dk, dv}, attention);
      const Buffer<Scalar> q(Layout::batch_first, B, T, Hq, dk, random_matrix<Scalar>(1, B * T * Hq * dk, 4710));
      const Buffer<Scalar> k(Layout::batch_first, B, T, Hkv, dk, random_matrix<Scalar>(1, B * T * Hkv * dk, 4711));
      const Buffer<Scalar> v(Layout::batch_first, B, T, Hkv, dv, random_matrix<Scalar>(1, B * T * Hkv * dv, 4712));
      const std::array<Buffer<Scalar>, N> inputs{every_head(in, B, Hkv)...};
      const auto outputs = [&] {
        return Buffer<Scalar>(Layout::batch_first, B, T, Hq, dv, RowMatrix<Scalar>::Zero(1, B * T * Hq * dv));
      };
      // f(Q, K, V, inputs..., out) over rows [first, first + count) of the buffers.
      const auto over_rows = [&](Index first, Index count, Buffer<Scalar>& out, auto&& f) {
        [&]<std::size_t... I>(std::index_sequence<I...>) {
          f(q.rows(first, count), k.rows(first, count), v.rows(first, count),
            inputs[I].rows(first, count)..., out.out_rows(first, count));
        }(std::make_index_sequence<N>{});
      };
      Buffer<Scalar> Y = outputs();
      auto whole = layer.make_state(B);
      over_rows(0, T, Y, [&](const auto&... x) { layer.prefill_into(whole, x...); });
      // Per query head (b, g), against one piece (the delta rules' bound depends on the slicing).
      std::vector<MatrixXdR> output_bounds;
      if constexpr (!delta)
        for (Index b = 0; b < B; ++b)
          for (Index g = 0; g < Hq; ++g)
            output_bounds.push_back(split_gated_output_bound(q.cut(b, g, 0, T), k.cut(b, g / G, 0, T),
                                                             v.cut(b, g / G, 0, T), lg, phi, normalize, C, P));
      mpi::SequenceParallel<Layer> piped(layer, MPI_COMM_WORLD, kPipeline);
      mpi::SequenceParallel<Layer> hybrid(layer, MPI_COMM_WORLD, kHybrid);
      mpi::SequenceParallel<Layer> everywhere(layer, MPI_COMM_WORLD, {mpi::kLastRank, true, mpi::Schedule::hybrid});
      const auto all_slicings = slicings_to_test(T, P);
      for (const auto& lengths : all_slicings) {
        const Slice my = slice_of(lengths, w.rank);
        const Index end = my.offset + my.length;
        const std::vector<Index> fills =
            detail::model_schedules(n, lengths, true, detail::carry_cost_of<Rule>(), detail::hybrid_fills<Rule>())
                .fills;
        INFO(name << ", " << n << " items, rank " << w.rank << " of " << P << ", rows " << my.offset
                  << " + " << my.length << ", fills " << fills[std::size_t(w.rank)]);
        // The even slicing fills on rank 1 (it waits a slot for item 0), so filled items are
        // checked; the delta rules never fill.
        if (&lengths == &all_slicings.front() && P > 1) CHECK((fills[1] > 0) == !delta);
        Buffer<Scalar> out_p = outputs(), out_h = outputs(), again = outputs(), out_b = outputs();
        auto state_p = layer.make_state(B), state_h = layer.make_state(B), state_again = layer.make_state(B),
             state_b = layer.make_state(B);
        mpi::ExchangeStats stats;
        over_rows(my.offset, my.length, out_p, [&](const auto&... x) { piped.prefill_into(state_p, x...); });
        over_rows(my.offset, my.length, out_h, [&](const auto&... x) { stats = hybrid.prefill_into(state_h, x...); });
        CHECK(stats.schedule == (delta ? mpi::Schedule::pipeline : mpi::Schedule::hybrid));
        over_rows(my.offset, my.length, again, [&](const auto&... x) { hybrid.prefill_into(state_again, x...); });
        over_rows(my.offset, my.length, out_b, [&](const auto&... x) { everywhere.prefill_into(state_b, x...); });
        // The single process's states after this rank's slice.
        auto prefix = layer.make_state(B);
        if (end > 0) {
          Buffer<Scalar> unused = outputs();
          over_rows(0, end, unused, [&](const auto&... x) { layer.prefill_into(prefix, x...); });
        }
        std::vector<DeltaSplitBound> delta_bounds;
        if constexpr (delta)
          for (Index b = 0; b < B; ++b)
            for (Index g = 0; g < Hq; ++g)
              delta_bounds.push_back(split_delta_bound(q.cut(b, g, 0, T), k.cut(b, g / G, 0, T),
                                                       v.cut(b, g / G, 0, T), beta, log_alpha, phi, C, lengths));
        for (Index b = 0; b < B; ++b)
          for (Index h = 0; h < Hkv; ++h) {
            const Index item = b * Hkv + h;
            // Pipelined by every rank up to this one (rank 0 pipelines everything).
            bool pipelined = true;
            for (int p = 1; p <= w.rank; ++p) pipelined = pipelined && item < n - fills[std::size_t(p)];
            INFO("item " << item << (pipelined ? " (pipelined)" : " (filled here or before)"));
            const auto& mine = state_h.sequence(b).head(h);
            const auto& single = prefix.sequence(b).head(h);
            CHECK(mine.tokens() == end);
            if (pipelined) CHECK(same_bits(mine.S(), state_p.sequence(b).head(h).S()));
            if constexpr (delta) {
              CHECK((mine.S() - single.S()).template cast<double>().norm() <=
                    unit_roundoff<Scalar>() * delta_bounds[std::size_t(b * Hq + h * G)].states[std::size_t(w.rank)]);
            } else {
              const RowMatrix<Scalar> Kh = k.cut(b, h, 0, T);
              const MatrixXdR sb = split_gated_state_bound(Kh, v.cut(b, h, 0, T), lg, phi, end, C, P);
              CHECK(worst_ratio_of<Scalar>(mine.S(), single.S().template cast<double>(),
                                           [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
              // z sums the key features as S sums kf v^T: the same bound with every value 1.
              const MatrixXdR zb = split_gated_state_bound(Kh, MatrixXdR(MatrixXdR::Ones(T, 1)), lg, phi, end, C, P);
              CHECK(worst_ratio_of<Scalar>(mine.z(), single.z().template cast<double>(),
                                           [&](Index i, Index) { return zb(i, 0); }) <= 1.0);
            }
            CHECK(same_bits(state_again.sequence(b).head(h).S(), mine.S()));
            const auto& final_state = state_b.sequence(b).head(h);
            CHECK(final_state.tokens() == T);
            CHECK(same_on_every_rank(digest(final_state.S())));
            if (w.rank == P - 1) CHECK(same_bits(final_state.S(), mine.S()));
            for (Index g = h * G; g < (h + 1) * G; ++g) {
              const RowMatrix<Scalar> y = out_h.cut(b, g, my.offset, my.length);
              if (pipelined) CHECK(same_bits(y, out_p.cut(b, g, my.offset, my.length)));
              CHECK(same_bits(again.cut(b, g, my.offset, my.length), y));
              CHECK(same_bits(out_b.cut(b, g, my.offset, my.length), y));
              const MatrixXdR Yd = Y.cut(b, g, my.offset, my.length).template cast<double>();
              const std::size_t head = std::size_t(b * Hq + g);
              if constexpr (delta) {
                CHECK(worst_ratio_of<Scalar>(y, Yd, [&](Index i, Index) {
                        return delta_bounds[head].outputs(my.offset + i);
                      }) <= 1.0);
              } else {
                CHECK(worst_ratio_of<Scalar>(y, Yd, [&](Index i, Index c) {
                        return output_bounds[head](my.offset + i, c);
                      }) <= 1.0);
              }
            }
          }
      }
    }
  });
}

// ---- the automatic choice --------------------------------------------------------------------

// The model's choices on given slices: tests/slice_runner_test.cpp (no MPI needed).
TEST_CASE("automatic: a layer call runs and reports the schedule the model picks", "[mpi][pipeline]") {
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
  // Even slices, 8 items, P <= 4, c = 0.35: the hybrid's (8 + (P - 1) c) slots beat the
  // pipeline's 8 + P - 1 and the summaries' 8 (1 + c).
  CHECK(stats.schedule == mpi::Schedule::hybrid);
  // The delta rules never take the hybrid (it fills nothing for them): the pipeline's 8 + P - 1
  // slots beat the summaries' 8 x 2.
  using DeltaLayer = MultiHeadAttention<RuleAttention<L2Normalize, Delta>>;
  const DeltaLayer delta_layer({H, H, d, d});
  const RowMatrix<float> beta = uniform_matrix<float>(T, H, 4501, 0.0, 1.0);
  auto delta_state = delta_layer.make_state(1);
  const auto beta_rows = TensorView<const float>::batch_first(beta.data() + my.offset * H, 1, my.length, H, 1);
  CHECK(mpi::SequenceParallel<DeltaLayer>(delta_layer, MPI_COMM_WORLD)
            .prefill_into(delta_state, rows, rows, rows, beta_rows,
                          TensorView<float>::batch_first(out.data(), 1, my.length, H, d))
            .schedule == mpi::Schedule::pipeline);
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

  // This rank's slice of the call under `schedule`; returns the stats.
  mpi::ExchangeStats call(Layer::State& state, const std::vector<Index>& lengths, bool broadcast,
                          mpi::Schedule schedule) {
    const Slice my = slice_of(lengths, world().rank);
    RowMatrix<float> out(my.length, H * d);
    const auto rows = [&](const RowMatrix<float>& X) {
      return TensorView<const float>::batch_first(X.data() + my.offset * H * d, 1, my.length, H, d);
    };
    return mpi::SequenceParallel<Layer>(layer, MPI_COMM_WORLD,
                                        {mpi::kLastRank, broadcast, schedule})
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

TEST_CASE("pipeline and hybrid: a denominator rejected on one rank for one head makes every rank "
          "throw it with the sequence's row; no state changes; the next call works",
          "[mpi][pipeline][hybrid][errors]") {
  const World w = world();
  const std::vector<Index> lengths = slicings(FailingLayer::T, w.size).front();
  // Head 1 on the last rank (a carried state, items before and after it), head 0 on rank 0's
  // first row (where the wavefront starts), head 2 on a middle rank's last row. Under the
  // hybrid (3 items, even slices: rank p fills its last min(p, 3)) head 2 is filled on every
  // rank after the first and head 1 from rank 2 on: their rows are rejected in the carry's
  // read, after the state went on, head 0's in the wavefront.
  const Index last_first = FailingLayer::T - lengths.back();
  const Index middle_last = slice_of(lengths, w.size / 2).offset + lengths[std::size_t(w.size / 2)] - 1;
  for (const auto& bad : {std::pair<Index, Index>{1, last_first + 2}, {0, 0}, {2, middle_last}}) {
    const Index head = bad.first, bad_row = bad.second;
    for (const mpi::Schedule schedule : {mpi::Schedule::pipeline, mpi::Schedule::hybrid})
      for (bool broadcast : {false, true}) {
        INFO("head " << head << ", row " << bad_row << ", rank " << w.rank << ", schedule "
                     << int(schedule) << (broadcast ? ", broadcast_final" : ""));
        FailingLayer f;
        auto state = f.layer.make_state(1);
        CHECK(f.call(state, lengths, broadcast, schedule).schedule == schedule);  // a good call first
        const std::uint64_t before = digest_of(state);
        f.Q.block(bad_row, head * FailingLayer::d, 1, FailingLayer::d).setConstant(-1.0f);
        Index row = -1;
        const std::string message = every_rank_throws<DenominatorError>([&] {
          try {
            f.call(state, lengths, broadcast, schedule);
          } catch (const DenominatorError& e) {
            row = e.row();
            throw;
          }
        });
        CHECK(row == bad_row);
        CHECK_THAT(message, Catch::Contains("at query row " + std::to_string(bad_row) + " "));
        CHECK(digest_of(state) == before);
        f.Q.block(bad_row, head * FailingLayer::d, 1, FailingLayer::d).setConstant(0.5f);
        CHECK_NOTHROW(f.call(state, lengths, broadcast, schedule));  // every rank back in step
      }
  }
}

TEST_CASE("pipeline and hybrid: a state that overflows on rank 0 or the last rank fails "
          "downstream too; bad input and disagreeing schedules throw on every rank",
          "[mpi][pipeline][hybrid][errors]") {
  const World w = world();
  const std::vector<Index> lengths = slicings(FailingLayer::T, w.size).front();
  const Index last_first = FailingLayer::T - lengths.back();
  for (const mpi::Schedule schedule : {mpi::Schedule::pipeline, mpi::Schedule::hybrid}) {
    // An infinite value in head 2's first row on rank 0: its state after the slice is not
    // finite, so rank 0 fails on item 2 and every later rank hears of it through the messages
    // (under the hybrid the later ranks have filled item 2 already and drop it). Then on the
    // last rank, where the hybrid fills item 2: the state after the slice (one scan step from
    // a summary holding Inf) is not finite before it is sent on or read.
    for (const int bad_rank : {0, w.size - 1}) {
      INFO("schedule " << int(schedule) << ", Inf on rank " << bad_rank);
      FailingLayer f;
      auto state = f.layer.make_state(1);
      f.call(state, lengths, false, schedule);
      const std::uint64_t before = digest_of(state);
      f.V(bad_rank == 0 ? 0 : last_first, 2 * FailingLayer::d) = std::numeric_limits<float>::infinity();
      const std::string m =
          every_rank_throws<std::domain_error>([&] { f.call(state, lengths, false, schedule); });
      CHECK_THAT(m, Catch::Contains("rank " + std::to_string(bad_rank) + " of") &&
                        Catch::Contains("not finite"));
      CHECK(digest_of(state) == before);
    }
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
    m = every_rank_throws<mpi::RankMismatchError>(
        [&] { run(w.rank == 1 ? mpi::Schedule::hybrid : mpi::Schedule::pipeline); });
    CHECK_THAT(m, Catch::Contains("rank 0 has 2, rank 1 has 3"));
    m = every_rank_throws<std::invalid_argument>([&] { run(static_cast<mpi::Schedule>(7)); });
    CHECK_THAT(m, Catch::Contains("Carry::schedule is 7"));
    CHECK_NOTHROW(run(mpi::Schedule::pipeline));
    CHECK_NOTHROW(run(mpi::Schedule::hybrid));
  }
}

}  // namespace mpi_pipeline_test
