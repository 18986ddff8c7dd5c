#pragma once
// The cost model that Schedule::automatic reads (linattn/mpi.hpp, detail/mpi_prefill.hpp): the
// modelled time of each schedule of a sequence-parallel prefill on the actual slice lengths,
// and the hybrid's start-up fills. Pure arithmetic on values every rank agreed on (the gathered
// slice lengths, the item count, the rule), so every rank reaches the same verdict; no MPI.
//
// Time is counted in token-times of one item: a rank's prefill of its slice of one item costs
// L_p (its slice length), reading a carry into those outputs c L_p (carry_cost_of).
//   summaries  every rank runs all its items at once, then reads the carries:
//              n max_p L_p (1 + c [slice p reads a carry]).
//   pipeline   the wavefront: rank p starts item i when it has finished item i-1 and rank p-1
//              has sent item i, and sends it on L_p later.
//   hybrid     the same, but rank p > 0 first runs its last k_p items from a zero carry (one
//              slot L_p each, while it would wait for item 0), pipelines the others, and for a
//              filled item sends the state on as soon as the item arrives, then reads the
//              carry (c L_p). k_p: rank p's wait for item 0 in slots of L_p, rounded down or
//              up, whichever the simulation finishes rank p sooner with (min(p, n) for even
//              slices). For the delta rules a fill is an extended prefill of about two slots:
//              k_p = 0, the hybrid is the pipeline.
// The simulation is O(P n). It ignores transfer times (one state per item and rank, a few
// microseconds on one node) and a layer's executor (the summaries run a rank's items on it in
// parallel; the wavefront runs them in order).

#include <linattn/types.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace linattn::detail {

/// How the ranks carry the state between their slices (CallConfig::schedule, as given; the
/// values of mpi::Schedule).
enum class ScheduleCode : std::int32_t { automatic = 0, summaries = 1, pipeline = 2, hybrid = 3 };

/// c of the cost model: what reading the carry costs a rank under the summaries schedule,
/// relative to the prefill of its slice. Decayed rules: the read of the carried state, one
/// [T_p, r] x [r, dv] product per query head (0.35 measured for Additive, r = dv = 128; by
/// flops 2 r dv / (4 r dv + C (r + dv)) = 0.44). Delta rules: the zero-carry pass runs the
/// extended state [A | B] of r + dv columns, about a second prefill, plus the read: 1.
template <class Rule>
constexpr double carry_cost_of() {
  return Rule::keeps_normalizer ? 0.35 : 1.0;
}

/// Whether the hybrid fills idle slots for this rule: a zero-carry pass must cost about one
/// prefill (the decayed rules), not two (the delta rules' extended state).
template <class Rule>
constexpr bool hybrid_fills() {
  return Rule::keeps_normalizer;
}

/// The modelled times of the three schedules (token-times, see the file comment), the hybrid's
/// k_p per rank, and automatic's choice.
struct ScheduleModel {
  double summaries = 0, pipeline = 0, hybrid = 0;
  std::vector<Index> fills;  // k_p: rank p's items run from a zero carry (its last ones)
  ScheduleCode pick = ScheduleCode::summaries;
};

/// One rank's part of the wavefront: item i reaches it at `times[i]` (when rank p-1 sent it).
/// The rank first fills its last `fills` items (L each), then takes the items in order, each
/// once it has arrived and the one before is done: a pipelined item costs L and leaves at its
/// end, a filled one leaves at its start (the state after the slice is one scan step) and
/// costs c L. Leaves in `times` when the rank sends each item on; returns when it is done.
inline double wavefront_rank(std::vector<double>& times, Index L, Index fills, double carry_cost) {
  const auto n = static_cast<Index>(times.size());
  double t = double(fills) * double(L);
  for (Index i = 0; i < n; ++i) {
    const double start = std::max(t, times[std::size_t(i)]);
    const bool filled = i >= n - fills;
    t = start + (filled ? carry_cost : 1.0) * double(L);
    times[std::size_t(i)] = filled ? start : t;
  }
  return t;
}

/// The model of a call with `items` items on slices `lengths` (in rank order); `starts_empty`:
/// the states before the call are zero (rank 0 then reads no carry under the summaries);
/// `may_fill`: hybrid_fills<Rule>(). automatic takes the smallest time, ties going to the
/// summaries, then the pipeline; calls with one item or fewer items than ranks keep the
/// summaries (the model agrees for even slices: the hybrid's last rank fills every item there,
/// n (1 + c) slots, the summaries' time; the wavefront leaves most ranks idle). O(P n).
inline ScheduleModel model_schedules(Index items, const std::vector<Index>& lengths,
                                     bool starts_empty, double carry_cost, bool may_fill) {
  const auto P = static_cast<Index>(lengths.size());
  const Index n = std::max<Index>(items, 0);
  ScheduleModel m;
  m.fills.assign(std::size_t(P), 0);
  double slot = 0;
  Index offset = 0;
  for (const Index L : lengths) {
    const bool reads_carry = !(starts_empty && offset == 0);
    slot = std::max(slot, double(L) * (1 + (reads_carry ? carry_cost : 0.0)));
    offset += L;
  }
  m.summaries = double(n) * slot;
  if (n == 0) return m;

  // The pipeline: no fills.
  std::vector<double> sent(std::size_t(n), 0.0), trial, other;
  for (const Index L : lengths)
    m.pipeline = std::max(m.pipeline, wavefront_rank(sent, L, 0, carry_cost));

  // The hybrid: rank p fills the floor or the ceiling of its wait for item 0, in slots,
  // whichever ends rank p sooner (the smaller on a tie: less work).
  std::fill(sent.begin(), sent.end(), 0.0);
  for (Index p = 0; p < P; ++p) {
    const Index L = lengths[std::size_t(p)];
    trial = sent;
    double done = wavefront_rank(trial, L, 0, carry_cost);
    if (may_fill && p > 0 && L > 0) {
      const double wait = std::min(double(n), sent.front() / double(L));
      const auto low = static_cast<Index>(std::floor(wait));
      const auto high = static_cast<Index>(std::ceil(wait));
      Index chosen = 0;
      for (const Index k : {low, high}) {
        if (k == chosen) continue;
        other = sent;
        const double t = wavefront_rank(other, L, k, carry_cost);
        if (t < done) {
          done = t;
          chosen = k;
          trial.swap(other);
        }
      }
      m.fills[std::size_t(p)] = chosen;
    }
    sent.swap(trial);
    m.hybrid = std::max(m.hybrid, done);
  }

  if (n < 2 || n < P)
    m.pick = ScheduleCode::summaries;
  else if (m.pipeline < m.summaries && m.pipeline <= m.hybrid)
    m.pick = ScheduleCode::pipeline;
  else if (m.hybrid < m.summaries && m.hybrid < m.pipeline)
    m.pick = ScheduleCode::hybrid;
  return m;
}

}  // namespace linattn::detail
