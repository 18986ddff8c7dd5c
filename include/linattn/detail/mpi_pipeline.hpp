#pragma once
// The pipeline and hybrid schedules of a sequence-parallel prefill (linattn/mpi.hpp); the cost
// model that chooses between them and the summaries schedule is detail/schedule_model.hpp.
//
// A call with several items (an item: one state head of one sequence; a layer call has
// B * H_kv) runs as a wavefront over the items. Rank p, for item i = 0, 1, ...:
//   - takes the state after rank p-1's slice of item i from rank p-1 (MPI_Recv; rank 0 starts
//     from the call's initial state: zero, its own, or one message per item from the holder);
//   - runs its slice of item i as the attention's own prefill from that state (no carry read,
//     no extended state: outputs final, for every rule), or forwards the state unchanged where
//     its slice is empty;
//   - sends the state after its slice on to rank p+1 (MPI_Isend) and goes on with item i+1.
// Time ~ (items + P - 1) slots of T/P tokens against items * P slots in one process.
//
// The hybrid (plan.fills = k_p > 0, only on ranks p > 0 and for the decayed rules): before
// its first receive, while rank p would wait for item 0, it runs its last k_p items as the
// summaries schedule does, from a zero carry with their summaries (SliceRunner::run_local);
// then it takes the items in order as above, except that for a filled item it forms the state
// after its slice from the carried one with one scan step (CarryScan: S = A S_c + B), sends it
// on at once, and then reads the carry into the item's outputs (SliceRunner::apply_carry).
// Every rank still receives and sends the items in the order 0, 1, ..., n-1 whatever its k_p
// and its neighbours' (each message is handled when it arrives), so the receiver needs no
// knowledge of the sender's fills and the messages match in order (MPI does not reorder
// messages of one sender, tag and communicator).
//
// Errors: a rank that fails on item i (or hears of a failure upstream) still receives every
// message from rank p-1 and sends rank p+1 one message per item, with a 'failed' status and no
// state, so no rank waits for a message that never comes; it computes nothing more. Then the
// ranks gather the records once more (mpi_exchange.hpp), all throw the lowest failing rank's
// error, and no state changes. The same P and slices give the same bits whatever MPI does:
// states travel as exact copies, each rank computes its items in order.
//
// A message: a header of two int64 (status: 0 ok, 1 failed; the token count after the slice),
// then S (r x dv, row-major) and z (r, the rules that keep it). Tag kCarryTag (rank p-1 to p)
// and kInitialTag (the initial state, holder to rank 0) on the caller's communicator.

#include <linattn/detail/eigen_utils.hpp>
#include <linattn/detail/mpi_exchange.hpp>
#include <linattn/detail/slice_runner.hpp>
#include <linattn/detail/slice_summary.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>

#include <Eigen/Core>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace linattn::detail {

/// Tags of the pipeline's point-to-point messages.
inline constexpr int kCarryTag = 0x4c41;    // "LA": the state after a slice, to the next rank
inline constexpr int kInitialTag = 0x4c42;  // the state before the call, to rank 0

/// A pipeline call's facts every rank agreed on (from the gathered records).
struct PipelinePlan {
  int rank = 0, ranks = 1, holder = 0;
  bool broadcast_final = false;
  bool initial_nonzero = false;      // the holder's states are not all zero with one count
  std::int64_t initial_tokens = 0;   // their token count where !initial_nonzero
  Index fills = 0;                   // the hybrid's k_p: this rank's last items from zero
};

/// Buffers of the pipeline, kept by SequenceParallel from call to call (no new memory when
/// the shape repeats).
template <class Scalar>
struct PipelineBuffers {
  std::vector<Scalar> incoming;   // one message
  std::vector<Scalar> outgoing;   // one message per item: the states after this rank's slice
  std::vector<Scalar> initial;    // the holder's: one message per item, the states before
  std::vector<Scalar> summaries;  // the hybrid's: one summary per filled item
  std::vector<MPI_Request> requests;
};

/// One message's layout in units of Scalar, for a rule that keeps z (KeepsZ) or not.
template <class Scalar, bool KeepsZ>
struct CarryMessage {
  static constexpr Index header = Index(2 * sizeof(std::int64_t) / sizeof(Scalar));
  Index r = 0, dv = 0, z = 0;  // z: r where KeepsZ, else 0

  [[nodiscard]] Index scalars() const noexcept { return header + r * dv + z; }
  [[nodiscard]] int bytes(bool with_state) const {
    return mpi_count(Index(sizeof(Scalar)) * (with_state ? scalars() : header),
                     "a carried state's message (bytes)");
  }
  static std::int64_t status(const Scalar* m) { return field(m, 0); }
  static std::int64_t tokens(const Scalar* m) { return field(m, 1); }
  static void set_header(Scalar* m, std::int64_t status, std::int64_t tokens) {
    std::memcpy(m, &status, sizeof status);
    std::memcpy(reinterpret_cast<unsigned char*>(m) + sizeof status, &tokens, sizeof tokens);
  }
  [[nodiscard]] Eigen::Map<const RowMatrix<Scalar>> S(const Scalar* m) const {
    return Eigen::Map<const RowMatrix<Scalar>>(m + header, r, dv);
  }
  [[nodiscard]] Eigen::Map<const ColVector<Scalar>> zmap(const Scalar* m) const {
    return Eigen::Map<const ColVector<Scalar>>(m + header + r * dv, z);
  }
  /// The state `state` packed into message `m` (header left alone). An additive state with no
  /// pending decode tokens (a prefill leaves none) is read in place.
  template <class State>
  void pack(const State& state, Scalar* m) const {
    Eigen::Map<RowMatrix<Scalar>> S(m + header, r, dv);
    if constexpr (requires { state.stored_S(); }) {
      if (state.pending_tokens() == 0)
        S = state.stored_S();
      else
        S = state.S();
    } else {
      S = state.S();
    }
    if constexpr (KeepsZ) Eigen::Map<ColVector<Scalar>>(m + header + r * dv, z) = state.z();
  }
  /// A zero state in message `m` (header left alone).
  void clear(Scalar* m) const { std::fill(m + header, m + scalars(), Scalar(0)); }

 private:
  static std::int64_t field(const Scalar* m, int k) {
    std::int64_t v = 0;
    std::memcpy(&v, reinterpret_cast<const unsigned char*>(m) + k * sizeof v, sizeof v);
    return v;
  }
};

/// The pipeline or hybrid schedule for this rank's items (see the file comment). `states` are
/// the callers' states (read on the holder, assigned at the end when every rank succeeded);
/// `counts` gets the bytes. Returns the failure every rank agreed on, or nothing.
template <class Attention>
std::optional<Failure> run_pipeline(MPI_Comm comm, const Attention& attention, Index dk, Index dv,
                                    const PipelinePlan& plan,
                                    std::vector<SliceItem<typename Attention::scalar_type>>& items,
                                    const std::vector<typename Attention::State*>& states,
                                    PipelineBuffers<typename Attention::scalar_type>& buffers,
                                    ExchangeCounts& counts) {
  using Scalar = typename Attention::scalar_type;
  using Rule = typename Attention::rule_type;
  using Message = CarryMessage<Scalar, Rule::keeps_normalizer>;
  const SliceRunner<Attention> runner(attention, dk, dv);
  const Index r = attention.feature_dim(dk), n = static_cast<Index>(items.size());
  const Message message{r, dv, Rule::keeps_normalizer ? r : 0};
  const Index m = message.scalars();
  const int rank = plan.rank, P = plan.ranks;
  const bool first = rank == 0, last = rank == P - 1;
  const bool initial_from_holder = plan.initial_nonzero && plan.holder != 0;
  const auto at = [m](std::vector<Scalar>& buffer, Index i) { return buffer.data() + i * m; };
  if (Index(sizeof(Scalar)) * m > Index{2147483647})  // the same verdict on every rank
    return Failure{FailureKind::shape, "linattn::mpi: a carried state of " + std::to_string(m) +
                                           " values is more than one MPI message moves"};

  buffers.incoming.resize(std::size_t(m));
  buffers.outgoing.resize(std::size_t(n * m));
  buffers.requests.assign(std::size_t(n) * (initial_from_holder && rank == plan.holder ? 2 : 1),
                          MPI_REQUEST_NULL);
  MPI_Request* carry_sends = buffers.requests.data();
  MPI_Request* initial_sends = carry_sends + n;

  // The states before the call: packed on the holder; sent to rank 0 unless the holder is it.
  if (plan.initial_nonzero && rank == plan.holder) {
    buffers.initial.resize(std::size_t(n * m));
    for (Index i = 0; i < n; ++i) {
      Scalar* msg = at(buffers.initial, i);
      Message::set_header(msg, 0, states[std::size_t(i)]->tokens());
      message.pack(*states[std::size_t(i)], msg);
    }
    if (initial_from_holder) {
      for (Index i = 0; i < n; ++i)
        check_mpi(MPI_Isend(at(buffers.initial, i), message.bytes(true), MPI_BYTE, 0, kInitialTag,
                            comm, &initial_sends[i]),
                  "MPI_Isend (initial state)");
      counts.initial_state_bytes += std::size_t(n) * std::size_t(message.bytes(true));
    }
  }

  RankRecord late;
  bool failed = false;
  // The hybrid's fills: this rank's last `fills` items from a zero carry, before the first
  // receive (rank 0 fills nothing: it never waits for a carry).
  const Index fills = first ? 0 : std::clamp<Index>(plan.fills, 0, n), first_filled = n - fills;
  const Index summary_size = runner.layout().scalars();
  buffers.summaries.resize(std::size_t(fills * summary_size));
  const auto summary_of = [&](Index i) {
    return buffers.summaries.data() + (i - first_filled) * summary_size;
  };
  for (Index i = first_filled; i < n && !failed; ++i) {
    try {
      items[std::size_t(i)].direct = false;
      runner.run_local(items[std::size_t(i)], summary_of(i));
    } catch (...) {
      record_failure(late);
      failed = true;
    }
  }
  std::optional<CarryScan<Scalar>> scan;
  if (fills > 0) scan.emplace(runner.layout());

  auto state = attention.make_state(dk, dv);
  for (Index i = 0; i < n; ++i) {
    // Where item i starts: a message (from rank p-1, or the holder), the holder's own state
    // (rank 0 holds it), or zero.
    const Scalar* start = nullptr;
    std::int64_t start_tokens = plan.initial_tokens;
    bool upstream_ok = true;
    if (!first || initial_from_holder) {
      MPI_Status status;
      check_mpi(MPI_Recv(buffers.incoming.data(), message.bytes(true), MPI_BYTE,
                         first ? plan.holder : rank - 1, first ? kInitialTag : kCarryTag, comm,
                         &status),
                "MPI_Recv (carried state)");
      int bytes = 0;
      check_mpi(MPI_Get_count(&status, MPI_BYTE, &bytes), "MPI_Get_count");
      counts.received_bytes += std::size_t(bytes);
      start = buffers.incoming.data();
      start_tokens = Message::tokens(start);
      upstream_ok = Message::status(start) == 0;
    } else if (plan.initial_nonzero) {
      start = at(buffers.initial, i);
      start_tokens = Message::tokens(start);
    }
    Scalar* out = at(buffers.outgoing, i);
    SliceItem<Scalar>& item = items[std::size_t(i)];
    const bool filled = i >= first_filled;  // then start is rank p-1's message (p > 0)
    const bool ok = upstream_ok && !failed;
    if (ok) {
      try {
        if (filled) {
          // The state after the slice: one scan step from the carried state.
          scan->start(message.S(start), message.zmap(start), false);
          scan->advance(summary_of(i), item.keys.rows);
          message.pack(*scan, out);
        } else if (item.keys.rows == 0) {
          if (start != nullptr)
            std::copy(start + Message::header, start + m, out + Message::header);
          else
            message.clear(out);
        } else {
          if (start != nullptr)
            state.assign(message.S(start), message.zmap(start), start_tokens);
          else
            state.assign(RowMatrix<Scalar>::Zero(r, dv), ColVector<Scalar>::Zero(message.z),
                         start_tokens);
          runner.run_from(item, state, item.first_row);
          message.pack(state, out);
        }
        if (item.keys.rows > 0 &&
            !all_finite(
                Eigen::Map<const ColVector<Scalar>>(out + Message::header, m - Message::header)))
          throw std::domain_error("linattn::mpi: the state after the slice is not finite "
                                  "(an input held Inf or NaN, or the sums overflowed)");
      } catch (...) {
        record_failure(late);
        failed = true;
      }
    }
    const bool sent_ok = ok && !failed;
    Message::set_header(out, sent_ok ? 0 : 1, start_tokens + item.keys.rows);
    if (!last) {
      check_mpi(MPI_Isend(out, message.bytes(sent_ok), MPI_BYTE, rank + 1, kCarryTag, comm,
                          &carry_sends[i]),
                "MPI_Isend (carried state)");
      counts.state_bytes += std::size_t(message.bytes(sent_ok));
    }
    // A filled item's outputs read the carry once the state is on its way (the message stays
    // in `incoming` until the next receive).
    if (filled && sent_ok) {
      try {
        runner.apply_carry(item, message.S(start), message.zmap(start), item.first_row);
      } catch (...) {
        record_failure(late);
        failed = true;
      }
    }
  }
  check_mpi(MPI_Waitall(static_cast<int>(buffers.requests.size()), buffers.requests.data(),
                        MPI_STATUSES_IGNORE),
            "MPI_Waitall (carried states)");

  // Agree once more, then (broadcast_final) the last rank's states everywhere, then the states.
  if (auto failure = first_failure(gather_records(comm, late, P))) return failure;
  if (plan.broadcast_final && P > 1) {
    // In pieces of at most 2^30 bytes: an MPI count is an int.
    constexpr std::size_t kPiece = std::size_t(1) << 30;
    auto* bytes = reinterpret_cast<unsigned char*>(buffers.outgoing.data());
    const std::size_t total = buffers.outgoing.size() * sizeof(Scalar);
    for (std::size_t done = 0; done < total; done += kPiece)
      check_mpi(MPI_Bcast(bytes + done, static_cast<int>(std::min(kPiece, total - done)), MPI_BYTE,
                          P - 1, comm),
                "MPI_Bcast (final states)");
    (last ? counts.state_bytes : counts.received_bytes) += total;
  }
  for (Index i = 0; i < n; ++i) {
    const Scalar* msg = at(buffers.outgoing, i);
    states[std::size_t(i)]->assign(message.S(msg), message.zmap(msg), Message::tokens(msg));
  }
  return std::nullopt;
}

}  // namespace linattn::detail
