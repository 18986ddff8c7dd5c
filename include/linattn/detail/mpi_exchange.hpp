#pragma once
// What the ranks of a sequence-parallel call exchange besides the summaries, and how they
// agree: one fixed-size record per rank, gathered on every rank (MPI_Allgather), that carries
// the call's configuration, the rank's slice length and initial-state facts, and the first
// error the rank met. Every rank then reads the same P records and so reaches the same verdict:
// it either goes on with the others or throws the same exception (same type, same message).
// No rank ever waits in a collective that another rank skipped.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace linattn::detail {

/// The configuration every rank must agree on (only the slice length may differ).
struct CallConfig {
  std::int32_t call = 0;  // 1: one head, 2: a layer, 3, 4: one head's backward, 5: a layer's
  std::int32_t scalar_bytes = 0;
  std::int32_t normalization = 0;  // Normalization::Kind
  std::int32_t initial_rank = 0;   // Carry::initial_rank as given
  std::int32_t broadcast_final = 0;
  std::int32_t schedule = 0;  // mpi::Schedule as given (ScheduleCode)
  std::int32_t layout = 0;    // SequenceLayout::Kind of a layer's call
  std::uint64_t layout_hash = 0;  // fnv1a64 of the layout's offsets or lengths
  double rule_parameter = 0;
  double normalization_epsilon = 0;
  std::uint64_t feature_map_fingerprint = 0;
  std::int64_t key_dim = 0, value_dim = 0, feature_dim = 0;
  std::int64_t sequences = 0, q_heads = 0, kv_heads = 0, value_heads = 0;
  char rule[24] = {};
  char feature_map[40] = {};
};

/// Why a rank failed: the exception type every rank rethrows.
enum class FailureKind : std::int32_t {
  none = 0,
  shape,           // ShapeError
  state_mismatch,  // StateMismatchError
  invalid_argument,
  denominator,     // DenominatorError (row and value kept)
  domain,
  out_of_range,
  out_of_memory,
  rank_mismatch,   // the ranks disagree on the configuration
  other            // std::runtime_error
};

/// One rank's record; exchanged as bytes, so it holds only fixed-size trivially copyable data.
struct RankRecord {
  static constexpr std::uint64_t kMagic = 0x6c696e6174746e31ULL;  // "linattn1"
  static constexpr std::size_t kMessageBytes = 512;
  std::uint64_t magic = kMagic;
  FailureKind failure = FailureKind::none;
  std::int32_t initial_nonzero = 0;  // its states are not all zero with one token count
  std::int32_t final_gradients = 0;  // a backward's: it has final states' gradients
  std::int64_t tokens = 0;           // the length of its slice
  std::int64_t initial_tokens = 0;   // the token count its states hold (when uniform)
  std::int64_t failure_row = 0;
  double failure_value = 0;
  CallConfig config;
  char message[kMessageBytes] = {};
};

/// An error every rank agrees to throw.
struct Failure {
  FailureKind kind = FailureKind::none;
  std::string message;
  Index row = 0;
  double value = 0;
};

/// Copies `text` into a fixed buffer of N chars, cut (with "...") to fit and 0-terminated.
template <std::size_t N>
void copy_text(char (&to)[N], const std::string& text) {
  std::string t = text.size() < N ? text : text.substr(0, N - 4) + "...";
  std::memcpy(to, t.c_str(), t.size() + 1);
}

/// Records the exception being handled (call inside a catch block) in `record`.
inline void record_failure(RankRecord& record) noexcept {
  const auto set = [&](FailureKind kind, const char* what) {
    record.failure = kind;
    copy_text(record.message, what);
  };
  try {
    throw;
  } catch (const DenominatorError& e) {
    set(FailureKind::denominator, e.what());
    record.failure_row = e.row();
    record.failure_value = e.value();
  } catch (const StateMismatchError& e) {
    set(FailureKind::state_mismatch, e.what());
  } catch (const ShapeError& e) {
    set(FailureKind::shape, e.what());
  } catch (const std::invalid_argument& e) {
    set(FailureKind::invalid_argument, e.what());
  } catch (const std::domain_error& e) {
    set(FailureKind::domain, e.what());
  } catch (const std::out_of_range& e) {
    set(FailureKind::out_of_range, e.what());
  } catch (const std::bad_alloc&) {
    set(FailureKind::out_of_memory, "out of memory");
  } catch (const std::exception& e) {
    set(FailureKind::other, e.what());
  } catch (...) {
    set(FailureKind::other, "an exception of unknown type");
  }
}

/// Bytes this rank put into the exchange and took out of it (see mpi::ExchangeStats).
struct ExchangeCounts {
  int ranks = 1, rank = 0;
  std::int32_t schedule = 1;  // the schedule that ran (ScheduleCode, never automatic)
  std::size_t record_bytes = 0, summary_bytes = 0, state_bytes = 0, initial_state_bytes = 0,
              received_bytes = 0;
};

/// Throws std::runtime_error naming the MPI call unless rc is MPI_SUCCESS. (With MPI's default
/// error handler a failing call aborts the job before this is reached.)
inline void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw std::runtime_error(std::string("linattn::mpi: ") + call + " failed: " + text);
}

/// `mine` from every rank of `comm`, in rank order, on every rank.
inline std::vector<RankRecord> gather_records(MPI_Comm comm, const RankRecord& mine, int ranks) {
  std::vector<RankRecord> all(static_cast<std::size_t>(ranks));
  check_mpi(MPI_Allgather(&mine, sizeof(RankRecord), MPI_BYTE, all.data(), sizeof(RankRecord),
                          MPI_BYTE, comm),
            "MPI_Allgather (records)");
  return all;
}

/// The error of the lowest failing rank, the same on every rank, or nothing.
inline std::optional<Failure> first_failure(const std::vector<RankRecord>& records) {
  const auto ranks = records.size();
  for (std::size_t k = 0; k < ranks; ++k) {
    const RankRecord& rec = records[k];
    if (rec.magic != RankRecord::kMagic)
      return Failure{FailureKind::rank_mismatch,
                     "linattn::mpi: rank " + std::to_string(k) +
                         " is not in a linattn sequence-parallel call (or another linattn "
                         "version): every rank must make the same call"};
    if (rec.failure == FailureKind::none) continue;
    const auto failed = std::count_if(records.begin(), records.end(), [](const RankRecord& r) {
      return r.failure != FailureKind::none;
    });
    std::ostringstream os;
    os << "linattn::mpi: rank " << k << " of " << ranks << " failed: " << rec.message;
    if (failed > 1) os << " (" << failed << " ranks failed; the lowest is reported)";
    return Failure{rec.failure, os.str(), rec.failure_row, rec.failure_value};
  }
  return std::nullopt;
}

/// The first field of the configuration on which some rank disagrees with rank 0, the same on
/// every rank, or nothing.
inline std::optional<Failure> first_disagreement(const std::vector<RankRecord>& records) {
  std::optional<Failure> found;
  const CallConfig& c0 = records.front().config;
  for (std::size_t k = 1; k < records.size() && !found; ++k) {
    const CallConfig& ck = records[k].config;
    const auto compare = [&](const char* what, const auto& a, const auto& b) {
      if (found || a == b) return;
      std::ostringstream os;
      os << "linattn::mpi: the ranks disagree on " << what << ": rank 0 has " << a << ", rank "
         << k << " has " << b
         << " (every rank must pass the same attention or layer, dims, heads, scalar type and "
            "carry options; only the slice length may differ)";
      found = Failure{FailureKind::rank_mismatch, os.str()};
    };
    compare("the call (1: one head, 2: a multi-head layer, 3: the additive backward, 4: a write "
            "rule's backward, 5: the layer's backward)", c0.call, ck.call);
    compare("the scalar type (bytes)", c0.scalar_bytes, ck.scalar_bytes);
    compare("the write rule", std::string(c0.rule), std::string(ck.rule));
    compare("the write rule's parameter", c0.rule_parameter, ck.rule_parameter);
    compare("the feature map", std::string(c0.feature_map), std::string(ck.feature_map));
    compare("the feature map's fingerprint", c0.feature_map_fingerprint,
            ck.feature_map_fingerprint);
    compare("the normalization (kind)", c0.normalization, ck.normalization);
    compare("the normalization's epsilon", c0.normalization_epsilon, ck.normalization_epsilon);
    compare("the key dim dk", c0.key_dim, ck.key_dim);
    compare("the value dim dv", c0.value_dim, ck.value_dim);
    compare("the feature dim r", c0.feature_dim, ck.feature_dim);
    compare("the number of sequences", c0.sequences, ck.sequences);
    compare("the number of query heads", c0.q_heads, ck.q_heads);
    compare("the number of key/value heads", c0.kv_heads, ck.kv_heads);
    compare("the number of value heads", c0.value_heads, ck.value_heads);
    compare("Carry::initial_rank", c0.initial_rank, ck.initial_rank);
    compare("Carry::broadcast_final", c0.broadcast_final, ck.broadcast_final);
    compare("Carry::schedule (0: automatic, 1: summaries, 2: pipeline, 3: hybrid)", c0.schedule,
            ck.schedule);
    compare("the sequence layout (0: batch, 1: packed, 2: padded)", c0.layout, ck.layout);
    compare("the sequence layout's offsets or lengths (a hash of them)", c0.layout_hash,
            ck.layout_hash);
  }
  return found;
}

/// MPI's datatype for float or double.
template <class Scalar>
MPI_Datatype mpi_type() {
  return sizeof(Scalar) == sizeof(float) ? MPI_FLOAT : MPI_DOUBLE;
}

/// A count MPI takes (int), or ShapeError naming `what`: the same verdict on every rank, as
/// the count follows from agreed sizes.
inline int mpi_count(Index n, const char* what) {
  if (n < 0 || n > Index{2147483647})
    throw_shape_error("linattn::mpi: ", what, " of ", n, " elements is more than one MPI call moves");
  return static_cast<int>(n);
}

}  // namespace linattn::detail
