// linattn/mpi.hpp across real MPI processes (ctest runs this program under mpiexec with 2, 3
// and 4 ranks; every rank runs every test case in the same order). Each rank holds the whole
// sequence (the same seeds everywhere), passes its slice to SequenceParallel, and compares its
// rows and states with a single-process prefill of the whole sequence, to the bounds derived in
// tests/slice_reference.hpp; a second call gives the same bits; the multi-head layer equals
// one-head calls of each head bit for bit (both layouts, grouped heads, slots, a thread pool);
// bytes exchanged do not depend on T; bad input makes every rank throw the same exception and
// the next call still works (nothing hangs: ctest's timeout would fail the test).
// `mpi_tests --digest` prints one hash of a fixed workload's outputs and states, which
// digest_check.cmake compares between runs and MPI allgather algorithms.

#include <catch2/catch.hpp>

#include <linattn/mpi.hpp>
#include <linattn/thread_pool.hpp>

#include "mpi_main.hpp"  // print_digest
#include "mpi_support.hpp"
#include "slice_reference.hpp"
#include "test_support.hpp"

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace mpi_test {  // this file's own names: the three files build as one program

using namespace linattn;
using namespace linattn_test;

// ---- one head ------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("one head, every rule and slicing: rows and states equal one prefill to "
                   "rounding, a second call the same bits, broadcast states equal everywhere",
                   "[mpi]", float, double) {
  using Scalar = TestType;
  const World w = world();
  const Index T = 101, dk = 12, dv = 7, P = w.size;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 2100);
  for_each_rule<Scalar>(T, dk, 2200, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    constexpr bool delta = !Attention::rule_type::keeps_normalizer;
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    auto shapes = slicings_to_test(T, P);  // and the whole-chunk slicing below
    if (P > 1) {
      std::vector<Index> whole_chunks(std::size_t(P), (T - C) / (P - 1));
      whole_chunks[0] = C;  // a first slice of whole chunks: a single process's bits
      whole_chunks.back() += T - C - (P - 1) * ((T - C) / (P - 1));
      shapes.push_back(whole_chunks);
    }
    for (const auto& lengths : shapes) {
      const Slice my = slice_of(lengths, w.rank);
      INFO(name << ", rank " << w.rank << " of " << P << ", rows " << my.offset << " + " << my.length);
      mpi::SequenceParallel<Attention> split(attention, MPI_COMM_WORLD);
      const auto run = [&](auto& state) {
        RowMatrix<Scalar> out(my.length, dv);
        const auto cut = rows_of(my.offset, my.length, in...);
        std::apply([&](const auto&... x) {
          split.prefill_into(state, qkv.Q.middleRows(my.offset, my.length),
                             qkv.K.middleRows(my.offset, my.length),
                             qkv.V.middleRows(my.offset, my.length), x..., out);
        }, cut);
        return out;
      };
      auto state = attention.make_state(dk, dv);
      const RowMatrix<Scalar> out = run(state);
      // The single-process state after this rank's slice.
      const Index end = my.offset + my.length;
      auto prefix = attention.make_state(dk, dv);
      RowMatrix<Scalar> unused(end, dv);
      attention.prefill_into(prefix, qkv.Q.topRows(end), qkv.K.topRows(end), qkv.V.topRows(end),
                             in.topRows(end)..., unused);
      CHECK(state.tokens() == end);
      const MatrixXdR Yd = Y.middleRows(my.offset, my.length).template cast<double>();
      if constexpr (delta) {
        const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, lengths);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index) {
                return bound.outputs(my.offset + i);
              }) <= 1.0);
        CHECK((state.S() - prefix.S()).template cast<double>().norm() <=
              unit_roundoff<Scalar>() * bound.states[std::size_t(w.rank)]);
      } else {
        const bool normalize = attention.options().normalization.divides();
        const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, P);
        CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index c) {
                return bound(my.offset + i, c);
              }) <= 1.0);
        const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, end, C, P);
        CHECK(worst_ratio_of<Scalar>(state.S(), prefix.S().template cast<double>(),
                                     [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
        CHECK(worst_ratio_of<Scalar>(state.z(), prefix.z().template cast<double>(),
                                     [&](Index i, Index) { return sb.row(i).maxCoeff(); }) <= 1.0);
      }
      if (my.offset == 0 && my.length > 0 && my.length % C == 0)
        CHECK(same_bits(out, Y.topRows(my.length)));
      // The same call again: the same bits.
      auto again = attention.make_state(dk, dv);
      CHECK(same_bits(run(again), out));
      CHECK(same_bits(again.S(), state.S()));
      // broadcast_final: every rank holds the last rank's final state, bit for bit.
      mpi::SequenceParallel<Attention> everywhere(attention, MPI_COMM_WORLD, {mpi::kLastRank, true});
      auto final_state = attention.make_state(dk, dv);
      {
        RowMatrix<Scalar> out2(my.length, dv);
        const auto cut = rows_of(my.offset, my.length, in...);
        std::apply([&](const auto&... x) {
          everywhere.prefill_into(final_state, qkv.Q.middleRows(my.offset, my.length),
                                  qkv.K.middleRows(my.offset, my.length),
                                  qkv.V.middleRows(my.offset, my.length), x..., out2);
        }, cut);
        CHECK(same_bits(out2, out));
      }
      CHECK(final_state.tokens() == T);
      CHECK(same_on_every_rank(digest(final_state.S())));
      if (w.rank == P - 1) CHECK(same_bits(final_state.S(), state.S()));
    }
  });
}

TEST_CASE("consecutive calls continue each other; an initial state held by rank 0", "[mpi]") {
  using Scalar = float;
  const World w = world();
  const Index T = 120, T1 = 47, dk = 8, dv = 6, P = w.size;
  const auto qkv = random_qkv<Scalar>(T, dk, dv, 2300);
  for_each_rule<Scalar>(T, dk, 2400, [&](const char* name, const auto& attention, Phi phi,
                                         const MatrixXdR& lg, const MatrixXdR& beta,
                                         const MatrixXdR& log_alpha, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    INFO(name << ", rank " << w.rank << " of " << P);
    const Index C = attention.chunk_size(attention.feature_dim(dk), dv);
    auto whole = attention.make_state(dk, dv);
    RowMatrix<Scalar> Y(T, dv);
    attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, in..., Y);
    // Tokens [0, T1) over the ranks evenly, then [T1, T) with rank 1 (or 0) empty: 2 P slices.
    const auto first = slicings(T1, P).front(), second = slicings(T - T1, P).back();
    std::vector<Index> all_lengths = first;
    all_lengths.insert(all_lengths.end(), second.begin(), second.end());
    mpi::SequenceParallel<Attention> split(attention, MPI_COMM_WORLD);
    auto state = attention.make_state(dk, dv);
    RowMatrix<Scalar> out(0, dv);
    for (int call = 0; call < 2; ++call) {
      const Slice my = slice_of(call == 0 ? first : second, w.rank);
      const Index base = call == 0 ? 0 : T1;
      out.resize(my.length, dv);
      const auto cut = rows_of(base + my.offset, my.length, in...);
      std::apply([&](const auto&... x) {
        split.prefill_into(state, qkv.Q.middleRows(base + my.offset, my.length),
                           qkv.K.middleRows(base + my.offset, my.length),
                           qkv.V.middleRows(base + my.offset, my.length), x..., out);
      }, cut);
      if (call == 1) {
        const Index row0 = base + my.offset;
        const MatrixXdR Yd = Y.middleRows(row0, my.length).template cast<double>();
        if constexpr (!Attention::rule_type::keeps_normalizer) {
          const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, all_lengths);
          CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index) { return bound.outputs(row0 + i); }) <= 1.0);
          if (w.rank == P - 1)
            CHECK((state.S() - whole.S()).template cast<double>().norm() <=
                  unit_roundoff<Scalar>() * bound.states.back());
        } else {
          const bool normalize = attention.options().normalization.divides();
          const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, lg, phi, normalize, C, 2 * P);
          CHECK(worst_ratio_of<Scalar>(out, Yd, [&](Index i, Index c) { return bound(row0 + i, c); }) <= 1.0);
          if (w.rank == P - 1) {
            const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, T, C, 2 * P);
            CHECK(worst_ratio_of<Scalar>(state.S(), whole.S().template cast<double>(),
                                         [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
          }
        }
        if (w.rank == P - 1) CHECK(state.tokens() == T);
      }
    }
    // Rank 0 prefilled [0, T1) alone; the ranks continue from its state and all end with the
    // final state (the same bits everywhere).
    auto held = attention.make_state(dk, dv);
    if (w.rank == 0) {
      RowMatrix<Scalar> unused(T1, dv);
      attention.prefill_into(held, qkv.Q.topRows(T1), qkv.K.topRows(T1), qkv.V.topRows(T1),
                             in.topRows(T1)..., unused);
    }
    mpi::SequenceParallel<Attention> from_rank0(attention, MPI_COMM_WORLD, {0, true});
    const Slice my = slice_of(second, w.rank);
    RowMatrix<Scalar> out2(my.length, dv);
    const auto cut = rows_of(T1 + my.offset, my.length, in...);
    const auto stats = std::apply([&](const auto&... x) {
      return from_rank0.prefill_into(held, qkv.Q.middleRows(T1 + my.offset, my.length),
                                     qkv.K.middleRows(T1 + my.offset, my.length),
                                     qkv.V.middleRows(T1 + my.offset, my.length), x..., out2);
    }, cut);
    CHECK(held.tokens() == T);
    CHECK(same_on_every_rank(digest(held.S())));
    // Rank 0 sent the initial state; the summaries did not grow with it.
    CHECK((stats.initial_state_bytes > 0) == (w.rank == 0));
    if constexpr (!Attention::rule_type::keeps_normalizer) {
      const auto bound = split_delta_bound(qkv.Q, qkv.K, qkv.V, beta, log_alpha, phi, C, all_lengths);
      CHECK((held.S() - whole.S()).template cast<double>().norm() <=
            unit_roundoff<Scalar>() * bound.states.back());
    } else {
      const MatrixXdR sb = split_gated_state_bound(qkv.K, qkv.V, lg, phi, T, C, 2 * P);
      CHECK(worst_ratio_of<Scalar>(held.S(), whole.S().template cast<double>(),
                                   [&](Index i, Index c) { return sb(i, c); }) <= 1.0);
    }
  });
}

// ---- the multi-head layer ------------------------------------------------------------------

namespace {

// The layer split across the ranks equals, for every output head, the one-head split call on
// that head's rows (cut out of the buffers), bit for bit, under the same schedule; its states
// equal the one-head states. Grouped query heads (4 over 2 key/value heads), or with
// `value_group` G_v > 1 grouped value heads (2 G_v over 2 query/key heads, head o reading query
// and key head o / G_v).
template <class Attention, std::size_t N>
void check_layer(const char* name, const Attention& attention, const std::array<InputSpec, N>& specs,
                 Layout layout, bool threads, mpi::Schedule schedule, Index value_group = 1) {
  using Scalar = typename Attention::scalar_type;
  const World w = world();
  const Index B = 2, Hkv = 2, Hq = value_group > 1 ? 2 : 4, Hv = Hkv * value_group,
              Ho = std::max(Hq, Hv), dk = 8, dv = 6, T = 61;
  // Output head o reads query head q_of(o), key head o / (Ho / Hkv) and value head v_of(o).
  const auto q_of = [&](Index o) { return value_group > 1 ? o / value_group : o; };
  const auto v_of = [&](Index o) { return value_group > 1 ? o : o / (Hq / Hkv); };
  MultiHeadAttention<Attention> layer({Hq, Hkv, dk, dv, Hv}, attention);
  ThreadPool pool(2);
  if (threads) layer.set_executor(&pool);
  const Index r = layer.feature_dim();
  const Buffer<Scalar> q(layout, B, T, Hq, dk, random_matrix<Scalar>(1, B * T * Hq * dk, 2500));
  const Buffer<Scalar> k(layout, B, T, Hkv, dk, random_matrix<Scalar>(1, B * T * Hkv * dk, 2501));
  const Buffer<Scalar> v(layout, B, T, Hv, dv, random_matrix<Scalar>(1, B * T * Hv * dv, 2502));
  std::vector<Buffer<Scalar>> in;
  for (std::size_t i = 0; i < N; ++i) {
    const Index c = specs[i].per_channel ? r : 1;
    in.emplace_back(layout, B, T, Hv, c,
                    uniform_matrix<Scalar>(1, B * T * Hv * c, 2503 + i, specs[i].lo, specs[i].hi));
  }
  const auto shapes = slicings(T, w.size);
  for (const auto& lengths : {shapes[std::min<std::size_t>(1, shapes.size() - 1)], shapes.back()}) {
    const Slice my = slice_of(lengths, w.rank);
    INFO(name << (layout == Layout::batch_first ? ", batch-first" : ", head-first")
              << (threads ? ", thread pool" : "") << ", rank " << w.rank << ", rows "
              << my.offset << " + " << my.length << ", schedule " << int(schedule));
    Buffer<Scalar> out(layout, B, T, Ho, dv, RowMatrix<Scalar>::Zero(1, B * T * Ho * dv));
    auto state = layer.make_state(2);
    const std::array<Index, 2> slots{1, 0};
    const mpi::Carry carry{mpi::kLastRank, false, schedule};
    mpi::SequenceParallel<MultiHeadAttention<Attention>> split(layer, MPI_COMM_WORLD, carry);
    const mpi::ExchangeStats stats = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return split.prefill_into(state, q.rows(my.offset, my.length), k.rows(my.offset, my.length),
                         v.rows(my.offset, my.length), in[I].rows(my.offset, my.length)...,
                         out.out_rows(my.offset, my.length), std::span<const Index>(slots));
    }(std::make_index_sequence<N>{});
    CHECK(stats.schedule == schedule);
    // Only this rank's rows of the output are written (batch-first buffers are staged
    // head-major and copied back: Carry::stage_token_major).
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Ho; ++h) {
        const RowMatrix<Scalar> all_rows = out.cut(b, h, 0, T);
        CHECK(all_rows.topRows(my.offset).isZero(0));
        CHECK(all_rows.bottomRows(T - my.offset - my.length).isZero(0));
      }
    if (layout == Layout::batch_first && !threads) {
      // Staged or read in place: the same bits, outputs and states.
      Buffer<Scalar> out_in_place(layout, B, T, Ho, dv, RowMatrix<Scalar>::Zero(1, B * T * Ho * dv));
      auto state_in_place = layer.make_state(2);
      mpi::Carry in_place = carry;
      in_place.stage_token_major = false;
      mpi::SequenceParallel<MultiHeadAttention<Attention>> unstaged(layer, MPI_COMM_WORLD, in_place);
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        unstaged.prefill_into(state_in_place, q.rows(my.offset, my.length),
                              k.rows(my.offset, my.length), v.rows(my.offset, my.length),
                              in[I].rows(my.offset, my.length)...,
                              out_in_place.out_rows(my.offset, my.length),
                              std::span<const Index>(slots));
      }(std::make_index_sequence<N>{});
      CHECK(std::memcmp(out_in_place.data.data(), out.data.data(), out.data.size() * sizeof(Scalar)) == 0);
      for (Index b = 0; b < B; ++b)
        for (Index g = 0; g < Hv; ++g)
          CHECK(same_bits(state_in_place.sequence(b).head(g).S(), state.sequence(b).head(g).S()));
    }
    mpi::SequenceParallel<Attention> one(attention, MPI_COMM_WORLD, carry);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Ho; ++h) {
        const Index g = h / (Ho / Hkv), vh = v_of(h);
        auto head_state = attention.make_state(dk, dv);
        RowMatrix<Scalar> y(my.length, dv);
        [&]<std::size_t... I>(std::index_sequence<I...>) {
          one.prefill_into(head_state, q.cut(b, q_of(h), my.offset, my.length),
                           k.cut(b, g, my.offset, my.length), v.cut(b, vh, my.offset, my.length),
                           in[I].cut(b, vh, my.offset, my.length)..., y);
        }(std::make_index_sequence<N>{});
        CHECK(same_bits(out.cut(b, h, my.offset, my.length), y));
        const auto& layer_head = state.sequence(slots[std::size_t(b)]).head(vh);
        CHECK(same_bits(layer_head.S(), head_state.S()));
        CHECK(layer_head.tokens() == my.offset + my.length);
      }
  }
}

}  // namespace

TEST_CASE("multi-head layer, both schedules, every rule, both layouts, grouped query or value heads, slots, "
          "threads: each head equals the one-head split call bit for bit, staged or not",
          "[mpi][multihead]") {
  for (mpi::Schedule s : {mpi::Schedule::summaries, mpi::Schedule::pipeline})
    for (Layout layout : {Layout::batch_first, Layout::head_first})
      for (bool threads : {false, true}) {
        check_layer("additive", LinearAttention<EluPlusOne>(), std::array<InputSpec, 0>{}, layout,
                    threads, s);
        check_layer("decay", RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9)),
                    std::array<InputSpec, 0>{}, layout, threads, s);
        check_layer("gated (scalar gates)", RuleAttention<EluPlusOne, Gated>(),
                    std::array<InputSpec, 1>{InputSpec{false, -0.3, 0.0}}, layout, threads, s);
        check_layer("gated (per-channel gates)", RuleAttention<EluPlusOne, Gated>(),
                    std::array<InputSpec, 1>{InputSpec{true, -0.3, 0.0}}, layout, threads, s);
        check_layer("delta", RuleAttention<L2Normalize, Delta>(),
                    std::array<InputSpec, 1>{InputSpec{false, 0.0, 1.0}}, layout, threads, s);
        check_layer("gated_delta", RuleAttention<L2Normalize, GatedDelta>(),
                    std::array<InputSpec, 2>{InputSpec{false, 0.0, 1.0}, InputSpec{false, -0.2, 0.0}},
                    layout, threads, s);
        check_layer("gated_delta (per-channel log_alpha)", RuleAttention<L2Normalize, GatedDelta>(),
                    std::array<InputSpec, 2>{InputSpec{false, 0.0, 1.0}, InputSpec{true, -0.2, 0.0}},
                    layout, threads, s);
        check_layer("gated_delta, grouped value heads", RuleAttention<L2Normalize, GatedDelta>(),
                    std::array<InputSpec, 2>{InputSpec{false, 0.0, 2.0}, InputSpec{false, -0.2, 0.0}},
                    layout, threads, s, 2);
        check_layer("additive, grouped value heads", LinearAttention<EluPlusOne>(),
                    std::array<InputSpec, 0>{}, layout, threads, s, 3);
      }
}

namespace {

// The layer over a packed or padded layout of the whole sequence, split across the ranks:
// every sequence's rows equal, bit for bit, the one-head split call of that sequence alone (each
// rank passing the rows of it that its slice holds, possibly none) for each query head, under
// the same schedule; so do the states each rank keeps and their token counts. Twice: the
// second call continues the first's states (held by the last rank, the default). Padded rows
// of the outputs are zero. Sequences cross ranks, lie on one rank, or are empty.
template <class Attention, std::size_t N>
void check_layer_layout(const char* name, const Attention& attention,
                        const std::array<InputSpec, N>& specs, SequenceLayout::Kind kind,
                        mpi::Schedule schedule) {
  using Scalar = typename Attention::scalar_type;
  const World w = world();
  const bool packed = kind == SequenceLayout::Kind::packed;
  const Index Hq = 4, Hkv = 2, G = Hq / Hkv, dk = 8, dv = 6, T = 61, B = packed ? 1 : 3;
  const std::vector<Index> values =
      packed ? std::vector<Index>{0, 5, 5, 30, 44, 61} : std::vector<Index>{61, 23, 0};
  const SequenceLayout layout =
      packed ? SequenceLayout::packed(values) : SequenceLayout::padded(values);
  const Index S = layout.count(B);
  MultiHeadAttention<Attention> layer({Hq, Hkv, dk, dv}, attention);
  const Index r = layer.feature_dim();
  const Layout buffers = Layout::batch_first;
  Buffer<Scalar> q(buffers, B, T, Hq, dk, random_matrix<Scalar>(1, B * T * Hq * dk, 2600));
  Buffer<Scalar> k(buffers, B, T, Hkv, dk, random_matrix<Scalar>(1, B * T * Hkv * dk, 2601));
  Buffer<Scalar> v(buffers, B, T, Hkv, dv, random_matrix<Scalar>(1, B * T * Hkv * dv, 2602));
  std::vector<Buffer<Scalar>> in;
  for (std::size_t i = 0; i < N; ++i) {
    const Index c = specs[i].per_channel ? r : 1;
    in.emplace_back(buffers, B, T, Hkv, c,
                    uniform_matrix<Scalar>(1, B * T * Hkv * c, 2603 + i, specs[i].lo, specs[i].hi));
  }
  // Padding holds NaN everywhere (queries, keys, values, per-token inputs): never read, never
  // checked (a per-token input there would fail its check), as in a single-process call.
  const auto poison = [&](Buffer<Scalar>& x) {
    const auto view = x.template view<Scalar>(x.data.data());
    for (Index b = 0; b < B; ++b)
      for (Index t = values[std::size_t(b)]; t < T; ++t)
        for (Index h = 0; h < x.H; ++h)
          for (Index c = 0; c < x.d; ++c) view(b, t, h, c) = std::numeric_limits<Scalar>::quiet_NaN();
  };
  if (!packed) {
    poison(q);
    poison(k);
    poison(v);
    for (auto& x : in) poison(x);
  }
  // The slots are reversed: sequence s continues position S - 1 - s.
  std::vector<Index> slots(static_cast<std::size_t>(S));
  for (Index s = 0; s < S; ++s) slots[std::size_t(s)] = S - 1 - s;
  for (const auto& lengths : slicings_to_test(T, w.size)) {
    const Slice my = slice_of(lengths, w.rank);
    INFO(name << (packed ? ", packed" : ", padded") << ", rank " << w.rank << ", rows "
              << my.offset << " + " << my.length << ", schedule " << int(schedule));
    const mpi::Carry carry{mpi::kLastRank, false, schedule};
    mpi::SequenceParallel<MultiHeadAttention<Attention>> split(layer, MPI_COMM_WORLD, carry);
    auto state = layer.make_state(S);
    std::vector<typename Attention::State> head_states;
    for (Index i = 0; i < S * Hq; ++i) head_states.push_back(attention.make_state(dk, dv));
    for (int call = 0; call < 2; ++call) {
      Buffer<Scalar> out(buffers, B, T, Hq, dv, RowMatrix<Scalar>::Constant(1, B * T * Hq * dv, 7));
      const mpi::ExchangeStats stats = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return split.prefill_into(state, q.rows(my.offset, my.length),
                                  k.rows(my.offset, my.length), v.rows(my.offset, my.length),
                                  in[I].rows(my.offset, my.length)...,
                                  out.out_rows(my.offset, my.length), layout,
                                  std::span<const Index>(slots));
      }(std::make_index_sequence<N>{});
      if (schedule != mpi::Schedule::automatic)
        CHECK(stats.schedule == schedule);
      else if (packed)  // a packed layout's automatic is the summaries
        CHECK(stats.schedule == mpi::Schedule::summaries);
      mpi::SequenceParallel<Attention> one(attention, MPI_COMM_WORLD,
                                           mpi::Carry{mpi::kLastRank, false, stats.schedule});
      for (Index s = 0; s < S; ++s) {
        // Sequence s: rows [begin, end) of entry b of the whole sequence; this rank's part.
        const Index b = layout.batch_entry(s), begin = layout.first_row(s),
                    end = begin + layout.length(s, T);
        const Index lo = std::clamp(begin, my.offset, my.offset + my.length),
                    hi = std::clamp(end, my.offset, my.offset + my.length);
        for (Index h = 0; h < Hq; ++h) {
          const Index g = h / G;
          auto& head_state = head_states[std::size_t(s * Hq + h)];
          RowMatrix<Scalar> y(hi - lo, dv);
          [&]<std::size_t... I>(std::index_sequence<I...>) {
            one.prefill_into(head_state, q.cut(b, h, lo, hi - lo), k.cut(b, g, lo, hi - lo),
                             v.cut(b, g, lo, hi - lo), in[I].cut(b, g, lo, hi - lo)..., y);
          }(std::make_index_sequence<N>{});
          CHECK(same_bits(out.cut(b, h, lo, hi - lo), y));
          const auto& layer_head = state.sequence(slots[std::size_t(s)]).head(g);
          CHECK(same_bits(layer_head.S(), head_state.S()));
          CHECK(layer_head.tokens() == head_state.tokens());
          if (!packed) {  // padding on this rank: zero; other ranks' rows: not written
            const RowMatrix<Scalar> pad = out.cut(b, h, hi, my.offset + my.length - hi);
            CHECK(pad.isZero(0));
          }
          CHECK((out.cut(b, h, 0, my.offset).array() == Scalar(7)).all());
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("multi-head layer over a packed or padded layout of the whole sequence: each "
          "sequence equals its own one-head split call bit for bit, twice in a row",
          "[mpi][multihead][layout]") {
  for (const auto kind : {SequenceLayout::Kind::packed, SequenceLayout::Kind::padded})
    for (mpi::Schedule s :
         {mpi::Schedule::automatic, mpi::Schedule::summaries, mpi::Schedule::pipeline}) {
      // The automatic schedule of a padded layout may be the hybrid, whose filled items have
      // other bits than a one-head call; the packed layout's is the summaries.
      if (s == mpi::Schedule::automatic && kind == SequenceLayout::Kind::padded) continue;
      check_layer_layout("additive", LinearAttention<EluPlusOne>(), std::array<InputSpec, 0>{},
                         kind, s);
      check_layer_layout("decay", RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9)),
                         std::array<InputSpec, 0>{}, kind, s);
      check_layer_layout("gated (per-channel gates)", RuleAttention<EluPlusOne, Gated>(),
                         std::array<InputSpec, 1>{InputSpec{true, -0.3, 0.0}}, kind, s);
      check_layer_layout("gated_delta", RuleAttention<L2Normalize, GatedDelta>(),
                         std::array<InputSpec, 2>{InputSpec{false, 0.0, 1.0},
                                                  InputSpec{false, -0.2, 0.0}},
                         kind, s);
    }
}

TEST_CASE("layer objects that share a StageMemory hold its copies once and give the bits of "
          "objects with their own", "[mpi][multihead]") {
  // Two "layers" (objects) called one after the other on batch-first buffers (which stage):
  // the second, sharing the first's memory, allocates nothing and writes the same bits as an
  // object with its own memory; release() frees the memory and the next call allocates it again.
  const World w = world();
  using Attention = RuleAttention<EluPlusOne, Decay>;
  const Attention attention(EluPlusOne{}, Decay(0.9));
  const Index B = 1, H = 3, dk = 8, dv = 6, T = 70;
  MultiHeadAttention<Attention> layer({H, H, dk, dv}, attention);
  const Buffer<float> q(Layout::batch_first, B, T, H, dk, random_matrix<float>(1, B * T * H * dk, 2700));
  const Buffer<float> k(Layout::batch_first, B, T, H, dk, random_matrix<float>(1, B * T * H * dk, 2701));
  const Buffer<float> v(Layout::batch_first, B, T, H, dv, random_matrix<float>(1, B * T * H * dv, 2702));
  const Slice my = slice_of(slicings(T, w.size).back(), w.rank);
  const mpi::Carry carry{mpi::kLastRank, false, mpi::Schedule::pipeline};
  using Split = mpi::SequenceParallel<MultiHeadAttention<Attention>>;
  const auto call = [&](Split& split) {
    Buffer<float> out(Layout::batch_first, B, T, H, dv, RowMatrix<float>::Zero(1, B * T * H * dv));
    auto state = layer.make_state(B);
    split.prefill_into(state, q.rows(my.offset, my.length), k.rows(my.offset, my.length),
                       v.rows(my.offset, my.length), out.out_rows(my.offset, my.length));
    return out.data;
  };
  Split first(layer, MPI_COMM_WORLD, carry);
  const auto shared = first.stage_memory();
  REQUIRE(shared != nullptr);
  CHECK(shared->bytes() == 0);  // nothing until a call stages
  Split second(layer, MPI_COMM_WORLD, carry, shared), own(layer, MPI_COMM_WORLD, carry);
  CHECK(second.stage_memory() == shared);
  CHECK(own.stage_memory() != shared);
  const auto out_first = call(first);
  const std::size_t held = shared->bytes();
  // Every rank's slice is 0 to T rows; one with rows holds at least its Q, K, V and out.
  CHECK(held >= std::size_t(my.length * H * (2 * dk + 2 * dv)) * sizeof(float));
  const auto out_second = call(second);
  CHECK(shared->bytes() == held);  // the second layer reused the first's blocks
  const auto out_own = call(own);
  CHECK(own.stage_memory()->bytes() == held);
  CHECK(out_second == out_first);
  CHECK(out_own == out_first);
  shared->release();
  CHECK(shared->bytes() == 0);
  CHECK(call(second) == out_first);
  CHECK(shared->bytes() == held);
  // A move takes the sharing along.
  Split moved = std::move(second);
  CHECK(moved.stage_memory() == shared);
  CHECK(call(moved) == out_first);
  CHECK(shared->bytes() == held);
}

// ---- what is exchanged -----------------------------------------------------------------------

namespace {

// Runs a layer of 2 key/value heads (4 query heads) with `per_rank` tokens on every rank under
// `schedule` and returns what this rank exchanged.
template <class Attention>
mpi::ExchangeStats layer_exchange(const Attention& attention, Index per_rank, mpi::Schedule schedule) {
  const Index Hq = 4, Hkv = 2, dk = 16, dv = 16, T = per_rank;
  MultiHeadAttention<Attention> layer({Hq, Hkv, dk, dv}, attention);
  const RowMatrix<float> q = random_matrix<float>(T, Hq * dk, 2600), k = random_matrix<float>(T, Hkv * dk, 2601),
                         v = random_matrix<float>(T, Hkv * dv, 2602);
  const RowMatrix<float> gates = uniform_matrix<float>(T, Hkv, 2603, -0.1, 0.0);
  const RowMatrix<float> beta = uniform_matrix<float>(T, Hkv, 2604, 0.0, 1.0);
  RowMatrix<float> out(T, Hq * dv);
  auto state = layer.make_state(1);
  mpi::SequenceParallel<MultiHeadAttention<Attention>> split(layer, MPI_COMM_WORLD,
                                                            {mpi::kLastRank, false, schedule});
  const auto Q = TensorView<const float>::batch_first(q.data(), 1, T, Hq, dk);
  const auto K = TensorView<const float>::batch_first(k.data(), 1, T, Hkv, dk);
  const auto V = TensorView<const float>::batch_first(v.data(), 1, T, Hkv, dv);
  const auto O = TensorView<float>::batch_first(out.data(), 1, T, Hq, dv);
  const auto G = TensorView<const float>::batch_first(gates.data(), 1, T, Hkv, 1);
  const auto Bv = TensorView<const float>::batch_first(beta.data(), 1, T, Hkv, 1);
  if constexpr (Attention::rule_type::token_inputs == 0)
    return split.prefill_into(state, Q, K, V, O);
  else if constexpr (Attention::rule_type::token_inputs == 1)
    return split.prefill_into(state, Q, K, V, Attention::rule_type::kind == WriteKind::gated ? G : Bv, O);
  else
    return split.prefill_into(state, Q, K, V, Bv, G, O);
}

}  // namespace

TEST_CASE("bytes exchanged per rank do not depend on T: one summary per state head, or one "
          "state per state head to the next rank (pipeline)", "[mpi][bytes]") {
  const World w = world();
  const std::size_t P = std::size_t(w.size), r = 16, dv = 16, heads = 2, record = 2 * sizeof(detail::RankRecord);
  const auto check = [&](const char* name, const auto& attention, std::size_t per_head, std::size_t state) {
    INFO(name);
    const auto summaries = mpi::Schedule::summaries;
    const mpi::ExchangeStats short_call = layer_exchange(attention, 8, summaries);
    const mpi::ExchangeStats long_call = layer_exchange(attention, 300, summaries);
    const std::size_t summary = (1 + heads * per_head) * sizeof(float);  // status word + heads
    CHECK(short_call.summary_bytes == summary);
    CHECK(long_call.summary_bytes == summary);
    CHECK(long_call.record_bytes == record);
    CHECK(long_call.initial_state_bytes == 0);
    CHECK(long_call.state_bytes == 0);
    CHECK(long_call.schedule == summaries);
    CHECK(long_call.sent_bytes() == record + summary);
    CHECK(long_call.received_bytes == (P - 1) * (record + summary));
    CHECK(long_call.ranks == w.size);
    // Pipeline: every rank but the last sends each item's state (a 16-byte header, S and z) to
    // the next rank only; every rank but the first receives them.
    const std::size_t message = 16 + state * sizeof(float);
    const bool last = w.rank == w.size - 1, first = w.rank == 0;
    // The hybrid sends the same messages (the delta rules run it as the pipeline).
    const bool fills = linattn::detail::hybrid_fills<typename std::decay_t<decltype(attention)>::rule_type>();
    for (const mpi::Schedule schedule : {mpi::Schedule::pipeline, mpi::Schedule::hybrid})
      for (Index T : {Index{8}, Index{300}}) {
        const mpi::ExchangeStats piped = layer_exchange(attention, T, schedule);
        CHECK(piped.schedule == (fills ? schedule : mpi::Schedule::pipeline));
        CHECK(piped.summary_bytes == 0);
        CHECK(piped.state_bytes == (last ? 0 : heads * message));
        CHECK(piped.sent_bytes() == record + (last ? 0 : heads * message));
        CHECK(piped.received_bytes == (P - 1) * record + (first ? 0 : heads * message));
      }
  };
  check("additive", LinearAttention<EluPlusOne>(), r * dv + r, r * dv + r);
  check("decay", RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9)), r * dv + r + 1, r * dv + r);
  check("gated", RuleAttention<EluPlusOne, Gated>(), r * dv + 2 * r, r * dv + r);
  check("delta", RuleAttention<L2Normalize, Delta>(), r * dv + r * r, r * dv);
  check("gated_delta", RuleAttention<L2Normalize, GatedDelta>(), r * dv + r * r, r * dv);
}

TEST_CASE("balanced_slices: contiguous lengths that sum to T, rank 0 with 1 + c shares", "[mpi]") {
  CHECK(mpi::balanced_slices(100, 4, 0.0) == std::vector<Index>{25, 25, 25, 25});
  CHECK(mpi::balanced_slices(10, 3, 0.0) == std::vector<Index>{4, 3, 3});
  // 65536 tokens, 2 ranks, c = 0.5: rank 1 gets 65536 / 2.5 = 26214, rank 0 the rest.
  CHECK(mpi::balanced_slices(65536, 2, 0.5) == std::vector<Index>{39322, 26214});
  CHECK(mpi::balanced_slices(0, 3, 0.3) == std::vector<Index>{0, 0, 0});
  CHECK(mpi::balanced_slices(5, 1, 0.3) == std::vector<Index>{5});
  CHECK_THROWS_AS(mpi::balanced_slices(-1, 2, 0.0), std::invalid_argument);
  CHECK_THROWS_AS(mpi::balanced_slices(10, 0, 0.0), std::invalid_argument);
  CHECK_THROWS_AS(mpi::balanced_slices(10, 2, -0.1), std::invalid_argument);
}

// ---- bad input --------------------------------------------------------------------------------

namespace {

constexpr Index kBadT = 40, kBadDk = 8, kBadDv = 6;

// A good call after a failed one: every rank is back in step, and the result is right.
void good_call() {
  const World w = world();
  const auto qkv = random_qkv<float>(kBadT, kBadDk, kBadDv, 2900);
  const LinearAttention<EluPlusOne> attention;
  RowMatrix<float> Y(kBadT, kBadDv);
  auto whole = attention.make_state(kBadDk, kBadDv);
  attention.prefill_into(whole, qkv.Q, qkv.K, qkv.V, Y);
  const auto lengths = slicings(kBadT, w.size).front();
  const Slice my = slice_of(lengths, w.rank);
  auto state = attention.make_state(kBadDk, kBadDv);
  mpi::SequenceParallel<LinearAttention<EluPlusOne>> split(attention, MPI_COMM_WORLD);
  const RowMatrix<float> out = split.prefill(state, qkv.Q.middleRows(my.offset, my.length),
                                             qkv.K.middleRows(my.offset, my.length),
                                             qkv.V.middleRows(my.offset, my.length));
  const MatrixXdR bound = split_gated_output_bound(qkv.Q, qkv.K, qkv.V, MatrixXdR::Zero(kBadT, 1),
                                                   Phi::elu_plus_one, true, 32, w.size);
  CHECK(worst_ratio_of<float>(out, Y.middleRows(my.offset, my.length).cast<double>(),
                              [&](Index i, Index c) { return bound(my.offset + i, c); }) <= 1.0);
}

// This rank's slice of a one-head additive call on T tokens with dims dk, dv.
template <class Attention>
void slice_call(const Attention& attention, Index dk, Index dv, mpi::Carry carry = {}) {
  using Scalar = typename Attention::scalar_type;
  const World w = world();
  const auto qkv = random_qkv<Scalar>(kBadT, dk, dv, 3000);
  const Slice my = slice_of(slicings(kBadT, w.size).front(), w.rank);
  auto state = attention.make_state(dk, dv);
  mpi::SequenceParallel<Attention> split(attention, MPI_COMM_WORLD, carry);
  static_cast<void>(split.prefill(state, qkv.Q.middleRows(my.offset, my.length),
                                  qkv.K.middleRows(my.offset, my.length),
                                  qkv.V.middleRows(my.offset, my.length)));
}

}  // namespace

TEST_CASE("ranks that disagree on the configuration all throw the same RankMismatchError",
          "[mpi][errors]") {
  const World w = world();
  const LinearAttention<EluPlusOne> additive;
  std::string m = every_rank_throws<mpi::RankMismatchError>(
      [&] { slice_call(additive, kBadDk, w.rank == 1 ? kBadDv - 1 : kBadDv); });
  CHECK_THAT(m, Catch::Contains("value dim dv: rank 0 has 6, rank 1 has 5"));
  good_call();
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    slice_call(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(w.rank == w.size - 1 ? 0.8 : 0.95)),
               kBadDk, kBadDv);
  });
  CHECK_THAT(m, Catch::Contains("the write rule's parameter"));
  good_call();
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    if (w.rank == 1)
      slice_call(RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.9)), kBadDk, kBadDv);
    else
      slice_call(additive, kBadDk, kBadDv);
  });
  CHECK_THAT(m, Catch::Contains("the write rule: rank 0 has additive, rank 1 has decay"));
  good_call();
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    if (w.rank == 0)
      slice_call(LinearAttention<EluPlusOne, double>(), kBadDk, kBadDv);
    else
      slice_call(additive, kBadDk, kBadDv);
  });
  CHECK_THAT(m, Catch::Contains("the scalar type (bytes): rank 0 has 8, rank 1 has 4"));
  good_call();
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    slice_call(additive, kBadDk, kBadDv, {mpi::kLastRank, w.rank == 0});
  });
  CHECK_THAT(m, Catch::Contains("Carry::broadcast_final"));
  good_call();
  // Heads of a multi-head layer.
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    const Index Hq = w.rank == w.size - 1 ? 2 : 4, T = 5;
    MultiHeadAttention<LinearAttention<EluPlusOne>> layer({Hq, 2, 4, 4}, additive);
    const RowMatrix<float> q = random_matrix<float>(T, Hq * 4, 1), kv = random_matrix<float>(T, 8, 2);
    RowMatrix<float> out(T, Hq * 4);
    auto state = layer.make_state(1);
    mpi::SequenceParallel<MultiHeadAttention<LinearAttention<EluPlusOne>>>(layer, MPI_COMM_WORLD)
        .prefill_into(state, TensorView<const float>::batch_first(q.data(), 1, T, Hq, 4),
                      TensorView<const float>::batch_first(kv.data(), 1, T, 2, 4),
                      TensorView<const float>::batch_first(kv.data(), 1, T, 2, 4),
                      TensorView<float>::batch_first(out.data(), 1, T, Hq, 4));
  });
  CHECK_THAT(m, Catch::Contains("the number of query heads"));
  good_call();
  // A layer's sequence layout: ranks that pass other offsets, or another kind, disagree; a
  // layout that does not fit the whole sequence (T = 5 rows per rank) fails on every rank.
  const auto layer_call = [&](const SequenceLayout& layout) {
    const Index T = 5, B = layout.kind() == SequenceLayout::Kind::padded ? Index(layout.values().size()) : 1;
    MultiHeadAttention<LinearAttention<EluPlusOne>> layer({2, 2, 4, 4}, additive);
    const RowMatrix<float> x = random_matrix<float>(B * T, 8, 3);
    RowMatrix<float> out(B * T, 8);
    auto state = layer.make_state(layout.count(B));
    const auto in = TensorView<const float>::batch_first(x.data(), B, T, 2, 4);
    mpi::SequenceParallel<MultiHeadAttention<LinearAttention<EluPlusOne>>>(layer, MPI_COMM_WORLD)
        .prefill_into(state, in, in, in, TensorView<float>::batch_first(out.data(), B, T, 2, 4),
                      layout);
  };
  const Index whole = 5 * w.size;
  const std::vector<Index> offsets{0, 2, whole}, other{0, 3, whole}, lengths{whole, 1};
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    layer_call(SequenceLayout::packed(w.rank == w.size - 1 ? other : offsets));
  });
  CHECK_THAT(m, Catch::Contains("the sequence layout's offsets or lengths"));
  good_call();
  m = every_rank_throws<mpi::RankMismatchError>([&] {
    layer_call(w.rank == 1 ? SequenceLayout::padded(lengths) : SequenceLayout::packed(offsets));
  });
  CHECK_THAT(m, Catch::Contains("the sequence layout (0: batch, 1: packed, 2: padded): rank 0 has 1, rank 1 has 2"));
  good_call();
  const std::vector<Index> short_offsets{0, 2, whole - 1}, long_lengths{whole + 1, 1};
  m = every_rank_throws<ShapeError>([&] { layer_call(SequenceLayout::packed(short_offsets)); });
  CHECK_THAT(m, Catch::Contains("packed offsets must start at 0 and end at T=" + std::to_string(whole)));
  good_call();
  m = every_rank_throws<ShapeError>([&] { layer_call(SequenceLayout::padded(long_lengths)); });
  CHECK_THAT(m, Catch::Contains("padded length " + std::to_string(whole + 1)));
  good_call();
  layer_call(SequenceLayout::packed(offsets));  // and the next call runs
  // A bad per-token input on the last rank, found once the items are bound (after the ranks
  // agreed on the layout): every rank throws it.
  m = every_rank_throws<std::invalid_argument>([&] {
    const Index T = 5;
    using DeltaAttention = RuleAttention<L2Normalize, Delta>;
    MultiHeadAttention<DeltaAttention> layer({2, 2, 4, 4}, DeltaAttention());
    const RowMatrix<float> x = random_matrix<float>(T, 8, 3);
    RowMatrix<float> beta = RowMatrix<float>::Constant(T, 2, 0.5f), out(T, 8);
    if (w.rank == w.size - 1) beta(3, 1) = 2.5f;
    auto state = layer.make_state(2);
    const auto in = TensorView<const float>::batch_first(x.data(), 1, T, 2, 4);
    mpi::SequenceParallel<MultiHeadAttention<DeltaAttention>>(layer, MPI_COMM_WORLD)
        .prefill_into(state, in, in, in, TensorView<const float>::batch_first(beta.data(), 1, T, 2, 1),
                      TensorView<float>::batch_first(out.data(), 1, T, 2, 4),
                      SequenceLayout::packed(offsets));
  });
  CHECK_THAT(m, Catch::Contains("rank " + std::to_string(w.size - 1) + " of " +
                                std::to_string(w.size) + " failed: linattn: beta must lie in [0, 2], got 2.5"));
  good_call();
  m = every_rank_throws<std::invalid_argument>(
      [&] { slice_call(additive, kBadDk, kBadDv, {w.size, false}); });
  CHECK_THAT(m, Catch::Contains("Carry::initial_rank is " + std::to_string(w.size)));
  good_call();
}

TEST_CASE("one rank's bad input makes every rank throw its error, naming the rank",
          "[mpi][errors]") {
  const World w = world();
  const auto qkv = random_qkv<float>(kBadT, kBadDk, kBadDv, 3100);
  const Slice my = slice_of(slicings(kBadT, w.size).front(), w.rank);
  const auto rows = [&](const RowMatrix<float>& X) { return RowMatrix<float>(X.middleRows(my.offset, my.length)); };
  // A shape error on rank 1 only.
  std::string m = every_rank_throws<ShapeError>([&] {
    const LinearAttention<EluPlusOne> attention;
    auto state = attention.make_state(kBadDk, kBadDv);
    RowMatrix<float> out(my.length + (w.rank == 1 ? 1 : 0), kBadDv);
    mpi::SequenceParallel<LinearAttention<EluPlusOne>>(attention, MPI_COMM_WORLD)
        .prefill_into(state, rows(qkv.Q), rows(qkv.K), rows(qkv.V), out);
  });
  CHECK_THAT(m, Catch::Contains("rank 1 of " + std::to_string(w.size) + " failed: linattn: output is"));
  good_call();
  // A beta outside [0, 2] on rank 0.
  m = every_rank_throws<std::invalid_argument>([&] {
    const RuleAttention<L2Normalize, Delta> attention;
    auto state = attention.make_state(kBadDk, kBadDv);
    Eigen::VectorXf beta = Eigen::VectorXf::Constant(my.length, 0.5f);
    if (w.rank == 0) beta(3) = 3.0f;
    static_cast<void>(mpi::SequenceParallel<RuleAttention<L2Normalize, Delta>>(attention, MPI_COMM_WORLD)
                          .prefill(state, rows(qkv.Q), rows(qkv.K), rows(qkv.V), beta));
  });
  CHECK_THAT(m, Catch::Contains("rank 0 of") && Catch::Contains("beta must lie in [0, 2], got 3 at token 3"));
  good_call();
  // A state made by another attention on the last rank.
  m = every_rank_throws<StateMismatchError>([&] {
    const RuleAttention<EluPlusOne, Decay> attention(EluPlusOne{}, Decay(0.95));
    const RuleAttention<EluPlusOne, Decay> other(EluPlusOne{}, Decay(0.9));
    auto state = (w.rank == w.size - 1 ? other : attention).make_state(kBadDk, kBadDv);
    static_cast<void>(mpi::SequenceParallel<RuleAttention<EluPlusOne, Decay>>(attention, MPI_COMM_WORLD)
                          .prefill(state, rows(qkv.Q), rows(qkv.K), rows(qkv.V)));
  });
  CHECK_THAT(m, Catch::Contains("rank " + std::to_string(w.size - 1) + " of"));
  good_call();
}

TEST_CASE("a denominator rejected on one rank: every rank throws it with the sequence's row, "
          "and no state changes",
          "[mpi][errors]") {
  // Identity features with the strict read: positive queries and keys everywhere except one
  // query row, all negative, so its denominator q . z < 0. On the last rank (a carried state:
  // rejected while the carry is applied) and on rank 0's first row (its own prefill).
  const World w = world();
  const Index T = 64, dk = 4, dv = 3;
  const auto lengths = slicings(T, w.size).front();
  const Slice my = slice_of(lengths, w.rank);
  const LinearAttention<Identity> attention;
  mpi::SequenceParallel<LinearAttention<Identity>> split(attention, MPI_COMM_WORLD);
  const RowMatrix<float> K = uniform_matrix<float>(T, dk, 3200, 0.1, 1.0), V = random_matrix<float>(T, dv, 3201);
  for (Index bad_row : {T - lengths.back(), Index{0}}) {
    RowMatrix<float> Q = uniform_matrix<float>(T, dk, 3202, 0.1, 1.0);
    Q.row(bad_row).setConstant(-1.0f);
    // A state from an earlier good call, to see that it does not change.
    auto state = attention.make_state(dk, dv);
    RowMatrix<float> out(my.length, dv);
    split.prefill_into(state, K.middleRows(my.offset, my.length), K.middleRows(my.offset, my.length),
                       V.middleRows(my.offset, my.length), out);
    const std::uint64_t before = digest(state.S());
    const Index tokens = state.tokens();
    bool caught = false;
    Index row = -1;
    std::string message;
    try {
      split.prefill_into(state, Q.middleRows(my.offset, my.length), K.middleRows(my.offset, my.length),
                         V.middleRows(my.offset, my.length), out);
    } catch (const DenominatorError& e) {
      caught = true;
      row = e.row();
      message = e.what();
    }
    CHECK(caught);
    CHECK(row == bad_row);
    CHECK(same_on_every_rank(message));
    CHECK_THAT(message, Catch::Contains("at query row " + std::to_string(bad_row)));
    CHECK(digest(state.S()) == before);
    CHECK(state.tokens() == tokens);
    good_call();
  }
}

// ---- digest (for digest_check.cmake) ----------------------------------------------------------

// One hash of every rule's outputs and broadcast final states under every schedule for a fixed
// workload split over this job's ranks, printed by rank 0: runs with the same number of ranks
// must print the same.
int print_digest() {
  const World w = world();
  const Index T = 150, dk = 16, dv = 8;
  const auto qkv = random_qkv<float>(T, dk, dv, 3300);
  const auto shapes = slicings(T, w.size);
  const Slice my = slice_of(shapes[std::min<std::size_t>(1, shapes.size() - 1)], w.rank);
  std::uint64_t h = 1469598103934665603ULL;
  for_each_rule<float>(T, dk, 3400, [&](const char*, const auto& attention, Phi, const MatrixXdR&,
                                        const MatrixXdR&, const MatrixXdR&, const auto&... in) {
    using Attention = std::decay_t<decltype(attention)>;
    for (mpi::Schedule schedule :
         {mpi::Schedule::summaries, mpi::Schedule::pipeline, mpi::Schedule::hybrid}) {
      auto state = attention.make_state(dk, dv);
      RowMatrix<float> out(my.length, dv);
      const auto cut = rows_of(my.offset, my.length, in...);
      std::apply([&](const auto&... x) {
        mpi::SequenceParallel<Attention>(attention, MPI_COMM_WORLD, {mpi::kLastRank, true, schedule})
            .prefill_into(state, qkv.Q.middleRows(my.offset, my.length),
                          qkv.K.middleRows(my.offset, my.length),
                          qkv.V.middleRows(my.offset, my.length), x..., out);
      }, cut);
      h = digest(state.S(), digest(out, h));
    }
  });
  std::uint64_t all = 1469598103934665603ULL;
  for (std::uint64_t x : gather(h)) all = fnv1a(&x, sizeof x, all);
  if (w.rank == 0) std::printf("linattn-mpi-digest ranks=%d %016llx\n", w.size, static_cast<unsigned long long>(all));
  return 0;
}

}  // namespace mpi_test

// The program's --digest mode (mpi_main.cpp).
int linattn_test::print_digest() { return mpi_test::print_digest(); }
