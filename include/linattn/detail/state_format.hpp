#pragma once
// The byte format of saved states (see serialize.hpp for the layout): writing and reading the
// envelope (magic, version, size, checksum), a state's identity and dims, and one head state,
// with every value a state could not hold refused. Every integer is unsigned little-endian;
// every scalar IEEE-754 binary32 or binary64, little-endian, whatever the host's order.

#include <linattn/detail/bytes.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/errors.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/state.hpp>
#include <linattn/types.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace linattn::detail {

inline constexpr std::string_view state_magic = "LNATTNST";
inline constexpr std::uint32_t state_format_version = 4;
/// What a version-4 blob holds.
enum class BlobKind : std::uint32_t { head = 1, batch = 2 };
/// The largest decode block a blob may carry (Options allows up to 4096).
inline constexpr std::uint64_t kMaxDecodeBlock = 4096;

template <class Scalar>
constexpr std::uint32_t scalar_code() {
  return std::is_same_v<Scalar, float> ? 1u : 2u;
}
inline const char* scalar_code_name(std::uint32_t code) {
  return code == 1 ? "float (binary32)" : code == 2 ? "double (binary64)" : "unknown";
}

[[noreturn]] inline void format_error(StateFormatError::Reason reason, const std::string& what) {
  throw StateFormatError(reason, what);
}

// ---- writing --------------------------------------------------------------------------------

/// Magic, version, scalar code and a size placeholder; returns the placeholder's offset.
template <class Scalar>
std::size_t begin_blob(ByteWriter& w) {
  w.put_bytes(state_magic);
  w.put_u32(state_format_version);
  w.put_u32(scalar_code<Scalar>());
  const std::size_t size_at = w.size();
  w.put_u64(0);
  return size_at;
}

/// Patches the total size and appends the FNV-1a checksum of everything before it.
inline void end_blob(std::vector<std::byte>& out, ByteWriter& w, std::size_t size_at) {
  w.patch_u64(size_at, static_cast<std::uint64_t>(out.size() + 8));
  w.put_u64(fnv1a64(out));
}

/// The identity (map name and fingerprint, rule name and parameter) and dims (r, dk, dv).
template <class State>
void write_identity(ByteWriter& w, const State& s) {
  const StateIdentity& id = s.identity();
  const std::string_view map = id.map_name, rule = id.rule_name;
  w.put_u64(id.map_fingerprint);
  w.put_u32(static_cast<std::uint32_t>(map.size()));
  w.put_bytes(map);
  w.put_u32(static_cast<std::uint32_t>(rule.size()));
  w.put_bytes(rule);
  w.put_scalar(id.rule_parameter);
  for (Index v : {s.feature_dim(), s.key_dim(), s.value_dim()}) w.put_u64(static_cast<std::uint64_t>(v));
}

/// One head: u64 tokens, u64 decode block B, u64 pending p, scalar log-scale M, the stored S
/// (r x dv row-major), z (r, if the rule keeps one), then p pending tokens (key features r,
/// value dv each). Only the additive state has B, p and M other than 0.
template <class State>
void write_head(ByteWriter& w, const State& s) {
  using Scalar = typename State::scalar_type;
  w.put_u64(static_cast<std::uint64_t>(s.tokens()));
  auto& st = const_cast<State&>(s);  // read only
  if constexpr (std::is_same_v<State, AttentionState<Scalar>>) {
    w.put_u64(static_cast<std::uint64_t>(s.decode_block()));
    w.put_u64(static_cast<std::uint64_t>(s.pending_tokens()));
    w.put_scalar(s.log_scale());
  } else {
    w.put_u64(0);
    w.put_u64(0);
    w.put_scalar(Scalar(0));
  }
  const auto& S = StateAccess::S(st);  // the stored S, without pending tokens
  for (Index i = 0; i < S.size(); ++i) w.put_scalar(S.data()[i]);
  const auto& z = StateAccess::z(st);
  for (Index i = 0; i < z.size(); ++i) w.put_scalar(z(i));
  if constexpr (std::is_same_v<State, AttentionState<Scalar>>) {
    const auto keys = s.pending_key_features();
    const auto values = s.pending_values();
    for (Index p = 0; p < s.pending_tokens(); ++p) {
      for (Index i = 0; i < keys.cols(); ++i) w.put_scalar(keys(p, i));
      for (Index j = 0; j < values.cols(); ++j) w.put_scalar(values(p, j));
    }
  }
}

// ---- reading --------------------------------------------------------------------------------

/// Checks length, magic, version, stored size and checksum, in that order, and the scalar
/// type; returns the version and a reader positioned after the fixed 24-byte header, over the
/// body (the checksum excluded).
template <class Scalar>
std::pair<std::uint32_t, ByteReader> open_blob(std::span<const std::byte> blob,
                                               std::uint32_t oldest_version) {
  using R = StateFormatError::Reason;
  constexpr std::size_t fixed = 8 + 4 + 4 + 8;
  if (blob.size() < fixed + 8)
    format_error(R::truncated, "blob of " + std::to_string(blob.size()) +
                                   " bytes is shorter than the fixed header");
  ByteReader in(blob);
  std::string magic;
  std::uint32_t version = 0, scalar = 0;
  std::uint64_t total = 0;
  static_cast<void>(in.get_bytes(8, magic));
  if (magic != state_magic) format_error(R::bad_magic, "the blob does not start with \"LNATTNST\"");
  static_cast<void>(in.get_uint(version));
  if (version < oldest_version || version > state_format_version)
    format_error(R::unsupported_version,
                 "format version " + std::to_string(version) + ", this build reads versions " +
                     std::to_string(oldest_version) + " to " + std::to_string(state_format_version) +
                     " here");
  static_cast<void>(in.get_uint(scalar));
  static_cast<void>(in.get_uint(total));
  if (total > blob.size())
    format_error(R::truncated, "the header says " + std::to_string(total) + " bytes, got " +
                                   std::to_string(blob.size()));
  if (total < blob.size() || total < fixed + 8)
    format_error(R::size_mismatch, "the header says " + std::to_string(total) + " bytes, got " +
                                       std::to_string(blob.size()));
  const auto body = blob.first(blob.size() - 8);
  std::uint64_t stored_sum = 0;
  {
    ByteReader tail(blob.last(8));
    static_cast<void>(tail.get_uint(stored_sum));
  }
  if (fnv1a64(body) != stored_sum)
    format_error(R::checksum_mismatch, "checksum mismatch: the bytes were changed or damaged");
  if (scalar != scalar_code<Scalar>())
    format_error(R::scalar_type_mismatch, std::string("the blob holds ") + scalar_code_name(scalar) +
                                              " scalars, the state computes in " +
                                              scalar_code_name(scalar_code<Scalar>()));
  ByteReader rd(body);
  std::string skip;
  static_cast<void>(rd.get_bytes(fixed, skip));
  return {version, rd};
}

inline void need(bool ok, const char* what) {
  if (!ok) format_error(StateFormatError::Reason::size_mismatch, std::string(what) + " runs past the end");
}

/// Reads an identity and dims block and checks them against `target` (a state of the
/// restoring attention).
template <class State>
void read_identity(ByteReader& rd, const State& target) {
  using R = StateFormatError::Reason;
  std::uint64_t fingerprint = 0;
  std::uint32_t map_len = 0, rule_len = 0;
  std::string map, rule;
  double parameter = 0;
  need(rd.get_uint(fingerprint) && rd.get_uint(map_len) && rd.get_bytes(map_len, map) &&
           rd.get_uint(rule_len) && rd.get_bytes(rule_len, rule) && rd.get_scalar(parameter),
       "the identity field");
  const StateIdentity& id = target.identity();
  if (map != id.map_name || fingerprint != id.map_fingerprint)
    format_error(R::feature_map_mismatch, "saved with feature map \"" + map + "\" (fingerprint " +
                                              std::to_string(fingerprint) + "), this state uses \"" +
                                              id.map_name + "\" (fingerprint " +
                                              std::to_string(id.map_fingerprint) + ")");
  // Bits, not ==: -0.0 == 0.0, but a blob whose parameter is -0.0 would save back as +0.0.
  if (rule != id.rule_name ||
      std::bit_cast<std::uint64_t>(parameter) != std::bit_cast<std::uint64_t>(id.rule_parameter))
    format_error(R::rule_mismatch, "saved with rule \"" + rule + "\" (parameter " +
                                       std::to_string(parameter) + "), this state uses \"" +
                                       id.rule_name + "\" (parameter " +
                                       std::to_string(id.rule_parameter) + ")");
  std::uint64_t dims[3] = {};
  for (auto& d : dims) need(rd.get_uint(d), "the dimension fields");
  const std::uint64_t want[3] = {static_cast<std::uint64_t>(target.feature_dim()),
                                 static_cast<std::uint64_t>(target.key_dim()),
                                 static_cast<std::uint64_t>(target.value_dim())};
  if (dims[0] != want[0] || dims[1] != want[1] || dims[2] != want[2])
    format_error(R::shape_mismatch, "saved with r=" + std::to_string(dims[0]) + " dk=" +
                                        std::to_string(dims[1]) + " dv=" + std::to_string(dims[2]) +
                                        ", this state has r=" + std::to_string(want[0]) + " dk=" +
                                        std::to_string(want[1]) + " dv=" + std::to_string(want[2]));
}

/// Reads `n` scalars into `dst`, refusing NaN and Inf (no state holds them).
template <class Scalar>
void read_finite(ByteReader& rd, Scalar* dst, Index n, const char* what) {
  for (Index i = 0; i < n; ++i) {
    need(rd.get_scalar(dst[i]), what);
    if (!std::isfinite(dst[i]))
      format_error(StateFormatError::Reason::bad_value,
                   std::string(what) + " holds a non-finite value at index " + std::to_string(i));
  }
}

/// Fields a head block of any version may carry.
struct HeadFields {
  bool has_block = true;    // u64 decode block (version 4)
  bool has_pending = true;  // u64 pending count and pending tokens (versions 2 to 4)
  bool scale_before_pending = false;  // version 2/3 order: tokens, M, p; version 4: tokens, B, p, M
};

/// Reads one head block into a new state shaped like `target` (its identity, dims and log
/// domain; decode block from the blob, or target's when the blob has none), validating every
/// value: a token count within kMaxTokens, finite S and z, M finite (0 for ordinary maps) or,
/// for an empty log-scaled state, -infinity, and p <= min(B, tokens) finite pending tokens.
template <class State>
State read_head(ByteReader& rd, const State& target, const HeadFields& fields) {
  using R = StateFormatError::Reason;
  using Scalar = typename State::scalar_type;
  constexpr bool additive = std::is_same_v<State, AttentionState<Scalar>>;
  std::uint64_t tokens = 0, block = 0, pending = 0;
  Scalar M = 0;
  need(rd.get_uint(tokens), "a head block");
  if (fields.scale_before_pending) need(rd.get_scalar(M), "a head block");
  if (fields.has_block) need(rd.get_uint(block), "a head block");
  if (fields.has_pending) need(rd.get_uint(pending), "a head block");
  if (!fields.scale_before_pending) need(rd.get_scalar(M), "a head block");
  if (tokens > static_cast<std::uint64_t>(kMaxTokens))
    format_error(R::bad_value, "a token count of " + std::to_string(tokens) +
                                   " is beyond what a state holds (" + std::to_string(kMaxTokens) + ")");
  // A state writes 0 (folds every token) or a block of 2 or more, and none for a log-scaled
  // map: anything else would restore as another block and save to other bytes.
  bool target_log_domain = false;
  if constexpr (additive) target_log_domain = target.log_domain();
  if (block > kMaxDecodeBlock || block == 1 || (block != 0 && target_log_domain))
    format_error(R::bad_value, "a decode block of " + std::to_string(block) +
                                   " is not one this state holds (0, or 2 to " +
                                   std::to_string(kMaxDecodeBlock) + " for ordinary maps)");
  State s = [&] {
    if constexpr (additive) {
      const Index B = fields.has_block ? static_cast<Index>(block) : target.decode_block();
      return State(target.feature_dim(), target.key_dim(), target.value_dim(), target.identity(),
                   target.log_domain(), B);
    } else {
      return State(target.feature_dim(), target.key_dim(), target.value_dim(), target.identity());
    }
  }();
  auto& S = StateAccess::S(s);
  auto& z = StateAccess::z(s);
  read_finite(rd, S.data(), S.size(), "S");
  read_finite(rd, z.data(), z.size(), "z");
  StateAccess::tokens(s) = static_cast<Index>(tokens);
  bool log_domain = false;
  if constexpr (additive) log_domain = s.log_domain();
  const bool empty = S.isZero(0) && z.isZero(0);
  // An ordinary map's log-scale is +0 exactly: -0 compares equal but would save other bytes.
  const bool plus_zero = M == 0 && !std::signbit(M);
  const bool ok_scale = std::isfinite(M) ? (log_domain || plus_zero)
                                         : (log_domain && empty && M < 0);
  if (!ok_scale)
    format_error(R::bad_value, "a log-scale of " + std::to_string(M) + " is not one this state holds");
  if constexpr (additive) {
    StateAccess::log_scale(s) = M;
    auto& p = StateAccess::pending(s);
    if (pending > static_cast<std::uint64_t>(p.capacity) || pending > tokens)
      format_error(R::bad_value, std::to_string(pending) + " pending tokens do not fit a decode "
                                 "block of " + std::to_string(p.capacity) + " after " +
                                 std::to_string(tokens) + " tokens");
    for (std::uint64_t j = 0; j < pending; ++j) {
      read_finite(rd, p.keys.row(static_cast<Index>(j)).data(), p.keys.cols(), "a pending key");
      read_finite(rd, p.values.row(static_cast<Index>(j)).data(), p.values.cols(), "a pending value");
    }
    p.count = static_cast<Index>(pending);
  } else if (pending != 0 || block != 0 || !plus_zero) {
    format_error(R::bad_value, "a state of this rule has no decode block or log-scale");
  }
  return s;
}

/// Whether two head states hold the same value (S, z, token count, log-scale, pending tokens).
template <class Scalar>
bool same_state(const AttentionState<Scalar>& a, const AttentionState<Scalar>& b) {
  return a.tokens() == b.tokens() && a.log_scale() == b.log_scale() &&
         a.pending_tokens() == b.pending_tokens() && a.stored_S() == b.stored_S() &&
         a.z() == b.z() && a.pending_key_features() == b.pending_key_features() &&
         a.pending_values() == b.pending_values();
}

}  // namespace linattn::detail
