// Sequence-parallel prefill over MPI: one sequence of T tokens, H heads of dimension d, split
// across the ranks of MPI_COMM_WORLD (linattn/mpi.hpp), against a single-process prefill of
// the whole sequence. Run it under mpirun with 1 rank (the baseline, and the split call on one
// rank) and with 2 or more; scripts/bench_mpi.sh does both and prints the speed-up.
//
//   mpirun -np 2 bench_mpi [--tokens 65536] [--heads 8] [--dim 128] [--rule additive]
//                          [--split even|balanced] [--carry-cost 0.35] [--repeat 3]
//                          [--schedule automatic|summaries|pipeline|hybrid] [--stage 1|0]
//                          [--backward 1] [--workspace 1|0] [--documents N]
//
// Rules: additive, decay, gated, delta, gated_delta. Every rank holds only its slice of the
// [1, T, H, d] buffers (distinct random data per head and token). A timed call is the slowest
// rank's wall time between two barriers (the states' reset to zero before it is not timed); the best of --repeat calls is reported. One line per
// measurement on rank 0:
//   bench_mpi rule=additive ranks=2 split=balanced T=65536 H=8 d=128 ... schedule=summaries ...
// with the schedule that ran (--schedule automatic: the one Carry's default picks), the one
// Schedule::automatic picks for this call and split (automatic=), what each rank exchanged
// (ExchangeStats) and each rank's own time.
// --backward 1 times the layer's backward instead (mpi::prefill_backward_into, linattn/
// mpi_gradients.hpp; schedules automatic, summaries or pipeline) against the single-process layer
// backward (multihead_gradients.hpp), both from the states before the sequence (zero) with dY
// given and no final-state gradient: lines "bench_mpi_backward rule=... call=... schedule=...".
// Each keeps one BackwardWorkspace across its calls, as a training loop keeps one per layer
// (--workspace 0: none, each call allocates its buffers).
// --documents N (N > 0) packs N documents of uneven lengths (0.5 to 1.5 times T / N, from a
// fixed hash) into the T tokens: both calls (forward or backward) take
// SequenceLayout::packed(offsets), and a document may lie on one rank or cross into the next.
// This is not a Google Benchmark program: the timing must span processes.

#include <linattn/mpi.hpp>
#include <linattn/mpi_gradients.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace linattn;

namespace {

struct Config {
  Index tokens = 65536, heads = 8, dim = 128;
  std::string rule = "additive", split = "even", schedule = "automatic";
  double carry_cost = 0.35;
  int repeat = 3;
  bool stage = true;  // Carry::stage_token_major
  bool backward = false;
  bool workspace = true;  // --backward: one BackwardWorkspace kept across the calls
  Index documents = 0;  // > 0: a packed layout of this many documents
};

// The packed layout's offsets: `documents` lengths of 0.5 to 1.5 times T / documents from a
// fixed hash, scaled to sum to T (the same on every rank).
std::vector<Index> document_offsets(Index T, Index documents) {
  std::vector<double> weight(static_cast<std::size_t>(documents));
  double sum = 0;
  for (Index i = 0; i < documents; ++i) {
    std::uint64_t x = std::uint64_t(i + 1) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 29;
    sum += weight[std::size_t(i)] = 0.5 + double(x >> 11) * 0x1.0p-53;
  }
  std::vector<Index> offsets{0};
  double at = 0;
  for (Index i = 0; i < documents; ++i) {
    at += weight[std::size_t(i)];
    offsets.push_back(i + 1 == documents ? T : static_cast<Index>(double(T) * at / sum));
  }
  return offsets;
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--tokens") c.tokens = std::atol(value.c_str());
    else if (key == "--heads") c.heads = std::atol(value.c_str());
    else if (key == "--dim") c.dim = std::atol(value.c_str());
    else if (key == "--rule") c.rule = value;
    else if (key == "--split") c.split = value;
    else if (key == "--carry-cost") c.carry_cost = std::atof(value.c_str());
    else if (key == "--repeat") c.repeat = std::atoi(value.c_str());
    else if (key == "--schedule") c.schedule = value;
    else if (key == "--stage") c.stage = value != "0";
    else if (key == "--backward") c.backward = value != "0";
    else if (key == "--workspace") c.workspace = value != "0";
    else if (key == "--documents") c.documents = std::atol(value.c_str());
    else throw std::invalid_argument("bench_mpi: unknown option " + key);
  }
  return c;
}

// Uniform values in [lo, hi) from a counter-based hash: each element depends only on its
// position in the whole sequence, so every split sees the same data.
void fill(std::vector<float>& v, Index first_element, std::uint64_t stream, float lo, float hi) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint64_t x = (std::uint64_t(first_element) + i) * 0x9E3779B97F4A7C15ULL + stream;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 29;
    v[i] = lo + (hi - lo) * float(x >> 40) * 0x1.0p-24f;
  }
}

struct Timing {
  double seconds = 0;                // slowest rank
  std::vector<double> rank_seconds;  // each rank's own, in the best call
  std::vector<double> calls;         // every call's, slowest rank, in order (the first allocates)
  mpi::ExchangeStats stats;
};

// Best of `repeat` calls of `call()`, each between barriers, each after an untimed `setup()`.
template <class Call, class Setup = void (*)()>
Timing best_of(int repeat, Call&& call, Setup&& setup = [] {}) {
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Timing best;
  best.seconds = 1e300;
  std::vector<double> calls;
  for (int i = 0; i < repeat; ++i) {
    setup();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    const mpi::ExchangeStats stats = call();
    double mine = MPI_Wtime() - t0, slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    std::vector<double> all(static_cast<std::size_t>(ranks));
    MPI_Allgather(&mine, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
    if (slowest < best.seconds) best = {slowest, all, {}, stats};
    calls.push_back(slowest);
  }
  best.calls = calls;
  return best;
}

// The layer's backward: the single process (one rank) and the sequence-parallel one, each the
// best of c.repeat calls. B and Gt: the per-token inputs (beta, log-gates) as in run().
template <class Layer>
void run_backward(const Config& c, const Layer& layer, int rank, int ranks,
                  const std::vector<Index>& lengths, const TensorView<const float>& Q,
                  const TensorView<const float>& K, const TensorView<const float>& V,
                  const TensorView<const float>& B, const TensorView<const float>& Gt,
                  const SequenceLayout& layout) {
  using Rule = typename Layer::attention_type::rule_type;
  constexpr int inputs = Rule::token_inputs;
  const Index H = c.heads, d = c.dim, T = Q.times();
  std::vector<float> dy(std::size_t(T * H * d)), dq(dy.size()), dk(dy.size()), dv(dy.size()),
      db(std::size_t(T * H)), dg(db.size());
  Index first = 0;
  for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
  fill(dy, first * H * d, 6, -1, 1);
  const auto view = [&](std::vector<float>& x, Index width) {
    return TensorView<float>::batch_first(x.data(), 1, T, H, width);
  };
  const GradientViews<float> grads{view(dq, d), view(dk, d), view(dv, d)};
  const auto dY = TensorView<const float>::batch_first(dy.data(), 1, T, H, d);
  const auto dB = view(db, 1), dGt = view(dg, 1);
  const auto state = layer.make_state(std::max<Index>(1, c.documents));
  BatchStateGradient<float> initial(state);
  mpi::Schedule schedule = mpi::Schedule::automatic;
  if (c.schedule == "summaries") schedule = mpi::Schedule::summaries;
  else if (c.schedule == "pipeline") schedule = mpi::Schedule::pipeline;
  else if (c.schedule != "automatic")
    throw std::invalid_argument("bench_mpi --backward: schedule automatic, summaries or pipeline");
  constexpr bool gated = Rule::kind == WriteKind::gated;
  const auto print = [&](const char* what, const char* ran, const Timing& t) {
    if (rank != 0) return;
    std::printf("bench_mpi_backward rule=%s ranks=%d T=%ld H=%ld d=%ld documents=%ld call=%s "
                "schedule=%s workspace=%d seconds=%.4f call_seconds=",
                c.rule.c_str(), ranks, long(c.tokens), long(H), long(d), long(c.documents), what,
                ran, c.workspace ? 1 : 0, t.seconds);
    for (std::size_t i = 0; i < t.calls.size(); ++i) std::printf("%s%.4f", i ? "," : "", t.calls[i]);
    std::printf("\n");
    std::fflush(stdout);
  };
  BackwardWorkspace<float> single_kept, split_kept;
  BackwardWorkspace<float>* single_ws = c.workspace ? &single_kept : nullptr;
  BackwardWorkspace<float>* split_ws = c.workspace ? &split_kept : nullptr;
  if (ranks == 1) {
    print("single_process", "none", best_of(c.repeat, [&] {
      if constexpr (inputs == 0)
        prefill_backward_into(layer, state, Q, K, V, dY, nullptr, grads, initial, layout,
                              single_ws);
      else if constexpr (inputs == 1)
        prefill_backward_into(layer, state, Q, K, V, gated ? Gt : B, dY, nullptr, grads,
                              gated ? dGt : dB, initial, layout, single_ws);
      else
        prefill_backward_into(layer, state, Q, K, V, B, Gt, dY, nullptr, grads, dB, dGt, initial,
                              layout, single_ws);
      return mpi::ExchangeStats{};
    }));
  }
  const bool piped =
      schedule == mpi::Schedule::pipeline ||
      (schedule == mpi::Schedule::automatic &&
       (layout.kind() != SequenceLayout::Kind::batch ||
        linattn::detail::backward_pipeline_pays(H, ranks, linattn::detail::backward_costs<Rule>())));
  print("sequence_parallel", piped ? "pipeline" : "summaries", best_of(c.repeat, [&] {
    if constexpr (inputs == 0)
      mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state, Q, K, V, dY, nullptr, grads, initial,
                                 layout, schedule, split_ws);
    else if constexpr (inputs == 1)
      mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state, Q, K, V, gated ? Gt : B, dY, nullptr,
                                 grads, gated ? dGt : dB, initial, layout, schedule, split_ws);
    else
      mpi::prefill_backward_into(MPI_COMM_WORLD, layer, state, Q, K, V, B, Gt, dY, nullptr, grads,
                                 dB, dGt, initial, layout, schedule, split_ws);
    return mpi::ExchangeStats{};
  }));
}

template <class Attention>
void run(const Config& c, const Attention& attention, int rank, int ranks) {
  using Layer = MultiHeadAttention<Attention>;
  constexpr int inputs = Attention::rule_type::token_inputs;
  const Index H = c.heads, d = c.dim;
  const std::vector<Index> lengths =
      mpi::balanced_slices(c.tokens, ranks, c.split == "balanced" ? c.carry_cost : 0.0);
  Index first = 0;
  for (int p = 0; p < rank; ++p) first += lengths[std::size_t(p)];
  const Index T = lengths[std::size_t(rank)];
  std::vector<float> q(std::size_t(T * H * d)), k(q.size()), v(q.size()), out(q.size());
  std::vector<float> beta(std::size_t(T * H)), gate(beta.size());
  fill(q, first * H * d, 1, -1, 1);
  fill(k, first * H * d, 2, -1, 1);
  fill(v, first * H * d, 3, -1, 1);
  fill(beta, first * H, 4, 0, 1);
  fill(gate, first * H, 5, -0.05f, 0);
  const auto view = [&](const std::vector<float>& x, Index n, Index width) {
    return TensorView<const float>::batch_first(x.data(), 1, n, H, width);
  };
  const auto Q = view(q, T, d), K = view(k, T, d), V = view(v, T, d);
  const auto O = TensorView<float>::batch_first(out.data(), 1, T, H, d);
  const auto B = view(beta, T, 1), Gt = view(gate, T, 1);
  const Layer layer({H, H, d, d}, attention);
  const std::vector<Index> offsets = document_offsets(c.tokens, c.documents);
  const SequenceLayout layout =
      c.documents > 0 ? SequenceLayout::packed(offsets) : SequenceLayout::batch();
  if (c.backward) {
    run_backward(c, layer, rank, ranks, lengths, Q, K, V, B, Gt, layout);
    return;
  }
  mpi::Carry carry;
  if (c.schedule == "summaries") carry.schedule = mpi::Schedule::summaries;
  else if (c.schedule == "pipeline") carry.schedule = mpi::Schedule::pipeline;
  else if (c.schedule == "hybrid") carry.schedule = mpi::Schedule::hybrid;
  else if (c.schedule != "automatic") throw std::invalid_argument("bench_mpi: unknown schedule " + c.schedule);
  carry.stage_token_major = c.stage;
  mpi::SequenceParallel<Layer> split(layer, MPI_COMM_WORLD, carry);
  auto state = layer.make_state(std::max<Index>(1, c.documents));
  const auto reset = [&] {
    for (Index s = 0; s < state.size(); ++s) state.sequence(s).reset();
  };
  const auto call_split = [&] {
    if constexpr (inputs == 0)
      return split.prefill_into(state, Q, K, V, O, layout);
    else if constexpr (inputs == 1)
      return split.prefill_into(state, Q, K, V, Attention::rule_type::kind == WriteKind::gated ? Gt : B, O, layout);
    else
      return split.prefill_into(state, Q, K, V, B, Gt, O, layout);
  };
  const auto print = [&](const char* what, const Timing& t) {
    if (rank != 0) return;
    using Rule = typename Attention::rule_type;
    const auto name = [](int code) {
      return code == int(mpi::Schedule::pipeline) ? "pipeline"
             : code == int(mpi::Schedule::hybrid) ? "hybrid"
                                                  : "summaries";
    };
    // What Schedule::automatic picks for this call (the same model the library runs).
    const auto model =
        linattn::detail::model_schedules(H, lengths, true, linattn::detail::carry_cost_of<Rule>(),
                                         linattn::detail::hybrid_fills<Rule>());
    std::printf("bench_mpi rule=%s ranks=%d split=%s stage=%d T=%ld H=%ld d=%ld documents=%ld "
                "call=%s schedule=%s automatic=%s seconds=%.4f tokens_per_second=%.0f "
                "summary_bytes=%zu state_bytes=%zu sent_bytes=%zu received_bytes=%zu rank_seconds=",
                c.rule.c_str(), ranks, c.split.c_str(), int(c.stage), long(c.tokens), long(H), long(d),
                long(c.documents), what,
                ranks == 1 && std::string(what) == "single_process" ? "none"
                                                                     : name(int(t.stats.schedule)),
                c.documents > 0 ? "summaries" : name(int(model.pick)), t.seconds,
                double(c.tokens) / t.seconds, t.stats.summary_bytes, t.stats.state_bytes,
                t.stats.sent_bytes(), t.stats.received_bytes);
    for (std::size_t p = 0; p < t.rank_seconds.size(); ++p)
      std::printf("%s%.4f", p ? "," : "", t.rank_seconds[p]);
    std::printf(" call_seconds=");
    for (std::size_t i = 0; i < t.calls.size(); ++i) std::printf("%s%.4f", i ? "," : "", t.calls[i]);
    std::printf(" slices=");
    for (std::size_t p = 0; p < lengths.size(); ++p) std::printf("%s%ld", p ? "," : "", long(lengths[p]));
    std::printf("\n");
    std::fflush(stdout);
  };
  if (ranks == 1) {
    // The baseline: the layer's own prefill of the whole sequence, no MPI in the call.
    const Timing single = best_of(c.repeat, [&] {
      if constexpr (inputs == 0)
        layer.prefill_into(state, Q, K, V, O, layout);
      else if constexpr (inputs == 1)
        layer.prefill_into(state, Q, K, V, Attention::rule_type::kind == WriteKind::gated ? Gt : B, O, layout);
      else
        layer.prefill_into(state, Q, K, V, B, Gt, O, layout);
      return mpi::ExchangeStats{};
    }, reset);
    print("single_process", single);
  }
  print("sequence_parallel", best_of(c.repeat, call_split, reset));
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int rc = 0;
  try {
    const Config c = parse(argc, argv);
    if (c.rule == "additive")
      run(c, LinearAttention<EluPlusOne>(), rank, ranks);
    else if (c.rule == "decay")
      run(c, RuleAttention<EluPlusOne, Decay>(EluPlusOne{}, Decay(0.999)), rank, ranks);
    else if (c.rule == "gated")
      run(c, RuleAttention<EluPlusOne, Gated>(), rank, ranks);
    else if (c.rule == "delta")
      run(c, RuleAttention<L2Normalize, Delta>(), rank, ranks);
    else if (c.rule == "gated_delta")
      run(c, RuleAttention<L2Normalize, GatedDelta>(), rank, ranks);
    else
      throw std::invalid_argument("bench_mpi: unknown rule " + c.rule);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_mpi (rank %d): %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
