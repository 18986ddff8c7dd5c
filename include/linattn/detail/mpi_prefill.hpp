#pragma once
// The flow of one sequence-parallel prefill over MPI, shared by the single-head and the
// multi-head entry points of linattn/mpi.hpp. On every rank, in this order:
//   1. prepare: bind and check this rank's inputs (nothing changes yet); any exception is
//      recorded, not thrown.
//   2. MPI_Allgather of one record per rank (configuration, slice length, initial-state facts,
//      error): every rank reads the same records and either goes on or returns the same
//      failure.
//   3. MPI_Bcast of the initial state from its holder, only where it is not zero.
//   4. run_local for every item (state head), then MPI_Allgather of the packed summaries (a
//      status word, then items x SummaryLayout::scalars() values).
//   5. For every item, the summaries of the ranks before this one composed in rank order
//      (CarryScan): the carry, applied to this rank's outputs; then this rank's own summary
//      (or every rank's, with broadcast_final): the state after the slice.
//   6. MPI_Allgather of the records again, for errors of steps 4 and 5; then, only if no rank
//      failed, the states are assigned. So a call either succeeds on every rank or fails on
//      every rank with the same exception, and then no rank's state has changed.
// Bytes a rank puts into the exchange are independent of the slice length: two records, one
// summary per item and, on the holder of a non-zero initial state, that state.
// That is the summaries schedule. After step 2 every rank makes the same choice of schedule
// (Carry::schedule, or the model of schedule_model.hpp for automatic); the pipeline and the
// hybrid (mpi_pipeline.hpp) replace steps 3 to 6.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/mpi_pipeline.hpp>
#include <linattn/detail/schedule_model.hpp>
#include <linattn/detail/slice_runner.hpp>
#include <linattn/detail/slice_summary.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/executor.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

namespace linattn::detail {

/// This rank's part of a call: its items (state heads, each with its query heads) and the
/// state each item continues, filled and checked by the entry point's `prepare`. Kept by
/// SequenceParallel between calls, so that the items' buffers are reused.
template <class Attention>
struct RankWork {
  using Scalar = typename Attention::scalar_type;
  std::vector<SliceItem<Scalar>> items;
  std::vector<typename Attention::State*> states;
  Index tokens = 0;  // this rank's slice length
  // Where the items' sequences lie in the concatenation of the ranks' slices (rows [start_p,
  // start_p + T_p) are rank p's): item i's rows are [extent_begin[i], extent_end[i]). Empty for
  // the batch layout, where every item spans every rank's rows. A packed layout's sequence s
  // is [offsets[s], offsets[s+1]); a padded one's entry b is [0, lengths[b]).
  std::vector<Index> extent_begin, extent_end;
  PipelineBuffers<Scalar> pipeline;  // the pipeline schedule's messages
  // The summaries schedule's buffers (kept: a packed layout's summaries, one per sequence and
  // state head, reach tens of MiB, whose first touch costs more than the exchange).
  std::vector<Scalar> summaries_sent, summaries_all;
  std::vector<RowMatrix<Scalar>> end_S;
  std::vector<ColVector<Scalar>> end_z;

  /// Item i's rows among rows [start, start + length) of the concatenation.
  [[nodiscard]] Index rows_in(Index i, Index start, Index length) const noexcept {
    if (extent_begin.empty()) return length;
    const Index lo = std::max(start, extent_begin[std::size_t(i)]),
                hi = std::min(start + length, extent_end[std::size_t(i)]);
    return std::max<Index>(0, hi - lo);
  }
  /// Which row of item i's sequence row `start` of the concatenation is (0 before it begins).
  [[nodiscard]] Index row_in_sequence(Index i, Index start) const noexcept {
    if (extent_begin.empty()) return start;
    return std::max<Index>(0, start - extent_begin[std::size_t(i)]);
  }

  /// `count` items, keeping the existing ones (and their buffers) when the count repeats; their
  /// views and inputs are for the caller to set again.
  void reset(Index count) {
    if (static_cast<Index>(items.size()) != count)
      items = std::vector<SliceItem<Scalar>>(static_cast<std::size_t>(count));
    for (auto& item : items) {
      item.queries.clear();
      item.outputs.clear();
      item.direct = false;
    }
    states.clear();
    tokens = 0;
    extent_begin.clear();
    extent_end.clear();
  }
};

/// Throws std::logic_error unless MPI is initialized and not finalized (before any MPI call).
inline void require_mpi() {
  int initialized = 0, finalized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized");
  if (!initialized || finalized)
    throw std::logic_error("linattn::mpi: MPI is not initialized (or already finalized)");
}

struct SequenceParallelResult {
  ExchangeCounts counts;
  std::optional<Failure> failure;  // the same on every rank
};

/// Notes `state`, one of a call's initial states (`first`: the first of them), in `record`:
/// its token count (the first's) and whether the states are not all zero with that one count
/// (RankRecord::initial_nonzero, initial_tokens).
template <class Rule, class State>
void note_initial_state(RankRecord& record, const State& state, bool first) {
  if (first) record.initial_tokens = state.tokens();
  bool zero = state.S().isZero(0);  // |x| <= 0: exactly zero (NaN is not)
  if constexpr (Rule::keeps_normalizer) zero = zero && state.z().isZero(0);
  if (!zero || state.tokens() != record.initial_tokens) record.initial_nonzero = 1;
}

/// The fields of CallConfig that follow from the attention.
template <class Attention>
void describe_attention(const Attention& attention, Index dk, Index dv, CallConfig& config) {
  const StateIdentity& id = attention.state_identity();
  config.scalar_bytes = sizeof(typename Attention::scalar_type);
  config.normalization = static_cast<std::int32_t>(attention.options().normalization.kind());
  config.normalization_epsilon = attention.options().normalization.epsilon();
  config.rule_parameter = id.rule_parameter;
  config.feature_map_fingerprint = id.map_fingerprint;
  config.key_dim = dk;
  config.value_dim = dv;
  config.feature_dim = attention.feature_dim(dk);
  copy_text(config.rule, id.rule_name);
  copy_text(config.feature_map, id.map_name);
}

/// Steps 1 to 6 of the file comment. `prepare(work)` fills the items and states (after
/// work.reset(count)). A layer's call with a layout other than batch() (config.layout != 0)
/// binds the items' rows only once the ranks agree, as they follow from this rank's first row
/// in the whole sequence: `bind(work, start, total)`, then one more gather of the records so
/// that an error there (a rank's bad per-token input, a layout that does not fit) is thrown on
/// every rank. `work` is the caller's, reused from call to call.
template <class Attention, class Prepare, class Bind>
SequenceParallelResult run_sequence_parallel(MPI_Comm comm, const Attention& attention, Index dk,
                                             Index dv, const CallConfig& config,
                                             Executor* executor, RankWork<Attention>& work,
                                             Prepare&& prepare, Bind&& bind) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  require_mpi();
  SequenceParallelResult result;
  ExchangeCounts& counts = result.counts;
  check_mpi(MPI_Comm_rank(comm, &counts.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &counts.ranks), "MPI_Comm_size");
  const int rank = counts.rank, P = counts.ranks;

  // 1, 2: prepare, then agree.
  RankRecord mine;
  mine.config = config;
  try {
    prepare(work);
    mine.tokens = work.tokens;
    for (std::size_t i = 0; i < work.states.size(); ++i)
      note_initial_state<Rule>(mine, *work.states[i], i == 0);
  } catch (...) {
    record_failure(mine);
  }
  counts.record_bytes = 2 * sizeof(RankRecord);
  counts.received_bytes = 2 * std::size_t(P - 1) * sizeof(RankRecord);
  const std::vector<RankRecord> records = gather_records(comm, mine, P);
  if ((result.failure = first_failure(records))) return result;
  if ((result.failure = first_disagreement(records))) return result;
  if (config.initial_rank < -1 || config.initial_rank >= P) {
    result.failure = Failure{FailureKind::invalid_argument,
                             "linattn::mpi: Carry::initial_rank is " +
                                 std::to_string(config.initial_rank) + ", outside [-1, " +
                                 std::to_string(P) + ") for a communicator of " +
                                 std::to_string(P) + " ranks"};
    return result;
  }
  if (config.schedule < 0 || config.schedule > 3) {
    result.failure = Failure{FailureKind::invalid_argument,
                             "linattn::mpi: Carry::schedule is " + std::to_string(config.schedule) +
                                 ", not automatic (0), summaries (1), pipeline (2) or hybrid (3)"};
    return result;
  }
  const int holder = config.initial_rank == -1 ? P - 1 : config.initial_rank;
  std::vector<Index> lengths(std::size_t(P), 0), offsets(std::size_t(P) + 1, 0);
  for (int q = 0; q < P; ++q) {
    lengths[std::size_t(q)] = records[std::size_t(q)].tokens;
    offsets[std::size_t(q) + 1] = offsets[std::size_t(q)] + lengths[std::size_t(q)];
  }
  const Index total = offsets.back(), items = static_cast<Index>(work.items.size());
  if (config.layout != 0) {  // the same on every rank (agreed)
    RankRecord bound;
    try {
      bind(work, offsets[std::size_t(rank)], total);
    } catch (...) {
      record_failure(bound);
    }
    counts.record_bytes += sizeof(RankRecord);
    counts.received_bytes += std::size_t(P - 1) * sizeof(RankRecord);
    if ((result.failure = first_failure(gather_records(comm, bound, P)))) return result;
  }
  SliceRunner<Attention> runner(attention, dk, dv);
  const SummaryLayout layout = runner.layout();
  const Index m = layout.scalars(), per_state = layout.a_offset();
  if (records[std::size_t(holder)].initial_tokens > kMaxTokens - total ||
      1 + items * m > Index{2147483647} || items * per_state > Index{2147483647}) {
    result.failure = Failure{FailureKind::shape,
                             "linattn::mpi: the call is too large: " + std::to_string(total) +
                                 " tokens after " +
                                 std::to_string(records[std::size_t(holder)].initial_tokens) +
                                 ", or summaries of more than 2^31 values"};
    return result;
  }

  for (Index i = 0; i < items; ++i)
    work.items[std::size_t(i)].first_row = work.row_in_sequence(i, offsets[std::size_t(rank)]);

  // The schedule, the same on every rank (agreed inputs only). The delta rules' hybrid is the
  // pipeline (schedule_model.hpp: no fills). A packed layout's automatic is the summaries: its
  // sequences lie mostly on one rank each, where they run as a single process runs them, and
  // only a sequence that crosses into a rank's slice reads a carry there; a wavefront would
  // make each rank wait for the sequence that ends the previous rank's slice, its last item.
  const bool initial_nonzero = records[std::size_t(holder)].initial_nonzero != 0;
  auto schedule = static_cast<ScheduleCode>(config.schedule);
  const bool packed = config.layout == static_cast<std::int32_t>(SequenceLayout::Kind::packed);
  if (packed && schedule == ScheduleCode::automatic) schedule = ScheduleCode::summaries;
  Index fills = 0;  // the hybrid's k_p for this rank
  if (schedule == ScheduleCode::automatic || schedule == ScheduleCode::hybrid) {
    const ScheduleModel model = model_schedules(items, lengths, !initial_nonzero,
                                                carry_cost_of<Rule>(), hybrid_fills<Rule>());
    if (schedule == ScheduleCode::automatic) schedule = model.pick;
    fills = model.fills[std::size_t(rank)];
  }
  if (schedule == ScheduleCode::hybrid && !hybrid_fills<Rule>()) schedule = ScheduleCode::pipeline;
  if (schedule != ScheduleCode::summaries) {
    counts.schedule = static_cast<std::int32_t>(schedule);
    PipelinePlan plan;
    plan.rank = rank;
    plan.ranks = P;
    plan.holder = holder;
    plan.broadcast_final = config.broadcast_final != 0;
    plan.initial_nonzero = initial_nonzero;
    plan.initial_tokens = records[std::size_t(holder)].initial_tokens;
    plan.fills = schedule == ScheduleCode::hybrid ? fills : 0;
    result.failure = run_pipeline(comm, attention, dk, dv, plan, work.items, work.states,
                                  work.pipeline, counts);
    return result;
  }

  // 3: the initial state, from its holder, where it is not zero.
  std::vector<Scalar> initial;
  std::vector<std::int64_t> initial_tokens(std::size_t(items),
                                           records[std::size_t(holder)].initial_tokens);
  std::vector<char> initial_zero(std::size_t(items), 1);
  if (initial_nonzero) {
    initial.resize(std::size_t(items * per_state));
    if (rank == holder) {
      for (Index i = 0; i < items; ++i) {
        const auto& state = *work.states[std::size_t(i)];
        Eigen::Map<RowMatrix<Scalar>>(initial.data() + i * per_state, layout.r, layout.dv) =
            state.S();
        if constexpr (Rule::keeps_normalizer)
          Eigen::Map<ColVector<Scalar>>(initial.data() + i * per_state + layout.z_offset(),
                                        layout.r) = state.z();
        initial_tokens[std::size_t(i)] = state.tokens();
      }
    }
    check_mpi(MPI_Bcast(initial.data(), static_cast<int>(items * per_state), mpi_type<Scalar>(),
                        holder, comm),
              "MPI_Bcast (initial state)");
    check_mpi(MPI_Bcast(initial_tokens.data(), static_cast<int>(items), MPI_INT64_T, holder, comm),
              "MPI_Bcast (initial token counts)");
    const std::size_t bytes = initial.size() * sizeof(Scalar) + initial_tokens.size() * 8;
    (rank == holder ? counts.initial_state_bytes : counts.received_bytes) += bytes;
    for (Index i = 0; i < items; ++i) {
      const Scalar* p = initial.data() + i * per_state;
      initial_zero[std::size_t(i)] = std::all_of(p, p + per_state, [](Scalar x) { return x == 0; });
    }
  }

  // 4: local passes and summaries.
  const Index count = 1 + items * m;
  std::vector<Scalar>& send = work.summaries_sent;
  std::vector<Scalar>& all = work.summaries_all;
  send.resize(std::size_t(count));
  std::fill(send.begin(), send.end(), Scalar(0));
  all.resize(std::size_t(count) * std::size_t(P));
  counts.summary_bytes = std::size_t(count) * sizeof(Scalar);
  counts.received_bytes += std::size_t(P - 1) * counts.summary_bytes;
  RankRecord late;
  // Work per item for the grain decision: its rows on this rank on average.
  Index item_rows = 0;
  for (const auto& item : work.items) item_rows += item.keys.rows;
  const double flops = 8.0 * double(layout.r) * double(dv) * double(item_rows) /
                       double(std::max<Index>(items, 1));
  try {
    parallel_for(items, executor, flops, [&](Index i) {
      auto& item = work.items[std::size_t(i)];
      item.direct = initial_zero[std::size_t(i)] && item.first_row == 0;
      runner.run_local(item, send.data() + 1 + i * m);
    });
  } catch (...) {
    record_failure(late);
    std::fill(send.begin(), send.end(), Scalar(0));
    send[0] = 1;
  }
  check_mpi(MPI_Allgather(send.data(), static_cast<int>(count), mpi_type<Scalar>(), all.data(),
                          static_cast<int>(count), mpi_type<Scalar>(), comm),
            "MPI_Allgather (summaries)");
  bool every_rank_ok = true;
  for (int q = 0; q < P; ++q) every_rank_ok = every_rank_ok && all[std::size_t(q) * std::size_t(count)] == 0;

  // 5: carries in rank order, applied; the states after the slice (or the whole sequence).
  const int through = config.broadcast_final != 0 ? P : rank + 1;
  std::vector<RowMatrix<Scalar>>& end_S = work.end_S;
  std::vector<ColVector<Scalar>>& end_z = work.end_z;
  end_S.resize(static_cast<std::size_t>(items));
  end_z.resize(static_cast<std::size_t>(items));
  if (every_rank_ok) {
    try {
      parallel_for(items, executor, flops, [&](Index i) {
        CarryScan<Scalar> scan(layout);
        const Scalar* start = initial_nonzero ? initial.data() + i * per_state : nullptr;
        if (start == nullptr || initial_zero[std::size_t(i)])
          scan.start(RowMatrix<Scalar>(), ColVector<Scalar>(), true);
        else
          scan.start(Eigen::Map<const RowMatrix<Scalar>>(start, layout.r, layout.dv),
                     Eigen::Map<const ColVector<Scalar>>(start + layout.z_offset(),
                                                         layout.keeps_z ? layout.r : 0),
                     false);
        for (int q = 0; q < through; ++q) {
          auto& item = work.items[std::size_t(i)];
          if (q == rank) runner.apply_carry(item, scan.S(), scan.z(), item.first_row);
          scan.advance(all.data() + std::size_t(q) * std::size_t(count) + 1 + i * m,
                       work.rows_in(i, offsets[std::size_t(q)], lengths[std::size_t(q)]));
        }
        if (!all_finite(scan.S()) || !all_finite(scan.z()))
          throw std::domain_error("linattn::mpi: the state after the slice is not finite "
                                  "(an input held Inf or NaN, or the sums overflowed)");
        end_S[std::size_t(i)] = scan.S();
        end_z[std::size_t(i)] = scan.z();
      });
    } catch (...) {
      record_failure(late);
    }
  }

  // 6: agree once more, then change the states.
  if ((result.failure = first_failure(gather_records(comm, late, P)))) return result;
  for (Index i = 0; i < items; ++i) {
    const Index end = through == P ? total : offsets[std::size_t(rank) + 1];
    work.states[std::size_t(i)]->assign(end_S[std::size_t(i)], end_z[std::size_t(i)],
                                        initial_tokens[std::size_t(i)] + work.rows_in(i, 0, end));
  }
  return result;
}

}  // namespace linattn::detail
