#pragma once
/// \file serialize.hpp
/// Saving a BatchState (or one of its sequences) to bytes and restoring it, so a server can
/// park a conversation and resume it later with bit-identical outputs.
///
/// Format, version 3. Every integer is unsigned little-endian; every scalar is IEEE-754
/// binary32 (float) or binary64 (double) stored little-endian, whatever the host's order.
///   offset  size  field
///   0       8     magic "LNATTNST"
///   8       4     format version (3; versions 1 and 2 still load, see below)
///   12      4     scalar type: 1 = binary32 (float), 2 = binary64 (double)
///   16      8     total blob size in bytes, checksum included
///   24      8     feature-map fingerprint: Phi::fingerprint() if Phi has one, else 0
///   32      4     n, length of the feature-map name; then n bytes of the name
///                 (Phi::name, see detail::feature_map_name)
///   ...     7*8   H_q, H_kv, dk, r, dv, N (number of sequences), H_s (state heads per
///                 sequence: MultiHeadAttention::state_heads(), H_kv or H_q)
///   ...           N * H_s head blocks, sequence-major: u64 tokens, the log-scale M (one
///                 scalar; 0 for ordinary maps, see AttentionState::log_scale()), u64 p (the
///                 pending tokens of a deferred decode, see AttentionState), then the stored
///                 S (r x dv, row-major, without the pending tokens), z (r), and p pending
///                 tokens, each its key features (r) then its value (dv).
///   end-8   8     FNV-1a 64 checksum of every byte before it
///
/// Versions 1 and 2 have no H_s field and keep one block per query head (H_s = H_q); version 1
/// has no p field and no pending tokens. A layer that keeps one state per key/value head
/// loads such a blob when the G query heads of each key/value head hold equal states (they
/// do, unless a rejected denominator stopped one of them early) and keeps one of them; a blob
/// whose heads of one group differ is rejected (shape_mismatch), as no single state stands
/// for them.
///
/// A blob is checked in this order before anything is modified: length and magic, version,
/// stored size (truncated or trailing bytes), checksum, then scalar type, feature map and
/// dimensions against the layer that restores it. Any failure throws StateFormatError; nothing
/// is restored from a blob that fails a check.
///
/// The feature map is identified by its name and, for maps with parameters (random features,
/// a learned projection), by an optional `std::uint64_t fingerprint() const` member that
/// should change whenever the parameters do. Maps without a name all read as "user".
///
/// Cost: O(N H_s r dv) time, output of 8 + sum over heads of 16 + (r dv + r + 1 + p (r + dv))
/// sizeof(Scalar) bytes plus a header of about 100 bytes. Saving the pending tokens as they
/// are, rather than adding them to S, is what makes a restored state continue bit-identically.

#include <linattn/batch_state.hpp>
#include <linattn/detail/bytes.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/multihead.hpp>
#include <linattn/types.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {

/// Thrown when a byte blob is not a state this layer can restore; what() says why and
/// reason() classifies it. A std::runtime_error: the blob is external data, not a caller's
/// shape mistake.
class StateFormatError : public std::runtime_error {
 public:
  enum class Reason {
    truncated,             ///< fewer bytes than the header or the stored size says
    bad_magic,             ///< not a linattn state blob
    unsupported_version,   ///< a format version this build does not read
    size_mismatch,         ///< bytes after the stored size, or a size that does not add up
    checksum_mismatch,     ///< the bytes were changed after writing
    scalar_type_mismatch,  ///< float state into a double layer or the reverse
    feature_map_mismatch,  ///< saved with another feature map (name or fingerprint)
    shape_mismatch         ///< heads or dims differ from the restoring layer
  };

  StateFormatError(Reason reason, const std::string& what)
      : std::runtime_error("linattn: cannot restore state: " + what), reason_(reason) {}
  [[nodiscard]] Reason reason() const noexcept { return reason_; }

 private:
  Reason reason_;
};

namespace detail {

inline constexpr std::string_view state_magic = "LNATTNST";
inline constexpr std::uint32_t state_format_version = 3;

template <class Scalar>
constexpr std::uint32_t scalar_code() {
  return std::is_same_v<Scalar, float> ? 1u : 2u;
}

inline const char* scalar_code_name(std::uint32_t code) {
  return code == 1 ? "float (binary32)" : code == 2 ? "double (binary64)" : "unknown";
}

template <class Phi>
std::uint64_t feature_map_fingerprint(const Phi& phi) {
  if constexpr (requires {
                  { phi.fingerprint() } -> std::convertible_to<std::uint64_t>;
                }) {
    return static_cast<std::uint64_t>(phi.fingerprint());
  } else {
    static_cast<void>(phi);
    return 0;
  }
}

template <class Phi, class Scalar>
std::vector<std::byte> save_sequences(const MultiHeadAttention<Phi, Scalar>& layer,
                                      const BatchState<Scalar>& state, Index first, Index count) {
  const HeadConfig& h = layer.heads();
  const Index r = layer.feature_dim();
  const Index state_heads = layer.state_heads();
  if (state.heads() != state_heads || state.feature_dim() != r || state.key_dim() != h.key_dim ||
      state.value_dim() != h.value_dim)
    throw_shape_error("cannot save a batch state with heads=", state.heads(), " r=",
                      state.feature_dim(), " dk=", state.key_dim(), " dv=", state.value_dim(),
                      " for a layer with heads=", state_heads, " r=", r, " dk=", h.key_dim,
                      " dv=", h.value_dim);
  const std::string_view name = feature_map_name<Phi>();
  std::vector<std::byte> out;
  out.reserve(128 + static_cast<std::size_t>(count) * state.bytes_per_sequence() +
              static_cast<std::size_t>(count * state_heads) * 8);
  ByteWriter w(out);
  w.put_bytes(state_magic);
  w.put_u32(state_format_version);
  w.put_u32(scalar_code<Scalar>());
  const std::size_t size_at = w.size();
  w.put_u64(0);  // total size, patched below
  w.put_u64(feature_map_fingerprint(layer.attention().feature_map()));
  w.put_u32(static_cast<std::uint32_t>(name.size()));
  w.put_bytes(name);
  for (Index v : {h.q_heads, h.kv_heads, h.key_dim, r, h.value_dim, count, state_heads})
    w.put_u64(static_cast<std::uint64_t>(v));
  for (Index s = first; s < first + count; ++s) {
    const auto& seq = state.sequence(s);
    for (Index head = 0; head < state_heads; ++head) {
      const AttentionState<Scalar>& st = seq.head(head);
      w.put_u64(static_cast<std::uint64_t>(st.tokens()));
      w.put_scalar(st.log_scale());
      w.put_u64(static_cast<std::uint64_t>(st.pending_tokens()));
      const auto& S = st.stored_S();
      for (Index i = 0; i < S.rows(); ++i)
        for (Index j = 0; j < S.cols(); ++j) w.put_scalar(S(i, j));
      for (Index i = 0; i < st.z().size(); ++i) w.put_scalar(st.z()(i));
      const auto keys = st.pending_key_features();
      const auto values = st.pending_values();
      for (Index p = 0; p < st.pending_tokens(); ++p) {
        for (Index i = 0; i < r; ++i) w.put_scalar(keys(p, i));
        for (Index j = 0; j < h.value_dim; ++j) w.put_scalar(values(p, j));
      }
    }
  }
  w.patch_u64(size_at, static_cast<std::uint64_t>(out.size() + 8));
  w.put_u64(fnv1a64(out));
  return out;
}

[[noreturn]] inline void format_error(StateFormatError::Reason reason, const std::string& what) {
  throw StateFormatError(reason, what);
}

/// Whether two head states hold the same value (S, z, token count, log scale, pending tokens).
template <class Scalar>
bool same_state(const AttentionState<Scalar>& a, const AttentionState<Scalar>& b) {
  return a.tokens() == b.tokens() && a.log_scale() == b.log_scale() &&
         a.pending_tokens() == b.pending_tokens() && a.stored_S() == b.stored_S() &&
         a.z() == b.z() && a.pending_key_features() == b.pending_key_features() &&
         a.pending_values() == b.pending_values();
}

}  // namespace detail

/// Every sequence of `state`, in batch order, as bytes (format above). Throws ShapeError if the
/// state does not belong to `layer`'s shape.
template <class Phi, class Scalar>
[[nodiscard]] std::vector<std::byte> save_state(const MultiHeadAttention<Phi, Scalar>& layer,
                                                const BatchState<Scalar>& state) {
  return detail::save_sequences(layer, state, 0, state.size());
}

/// Sequence `id` of `state` alone, as bytes. Throws std::out_of_range for an unknown id.
template <class Phi, class Scalar>
[[nodiscard]] std::vector<std::byte> save_sequence(const MultiHeadAttention<Phi, Scalar>& layer,
                                                   const BatchState<Scalar>& state,
                                                   SequenceId id) {
  return detail::save_sequences(layer, state, state.index_of(id), 1);
}

/// Appends every sequence of `blob` to `state`, in the saved order, and returns their new ids.
/// Strong guarantee: the blob is fully checked and decoded before `state` changes.
/// Throws StateFormatError (see the file comment), ShapeError if `state` is not `layer`'s.
template <class Phi, class Scalar>
std::vector<SequenceId> restore_sequences(const MultiHeadAttention<Phi, Scalar>& layer,
                                          BatchState<Scalar>& state,
                                          std::span<const std::byte> blob) {
  using R = StateFormatError::Reason;
  using detail::format_error;
  {
    const HeadConfig& h = layer.heads();
    if (state.heads() != layer.state_heads() || state.feature_dim() != layer.feature_dim() ||
        state.key_dim() != h.key_dim || state.value_dim() != h.value_dim)
      detail::throw_shape_error("cannot restore into a batch state with heads=", state.heads(),
                                " r=", state.feature_dim(), " dk=", state.key_dim(),
                                " dv=", state.value_dim(), ": it is not this layer's");
  }
  constexpr std::size_t fixed = 8 + 4 + 4 + 8;
  if (blob.size() < fixed + 8)
    format_error(R::truncated, "blob of " + std::to_string(blob.size()) +
                                   " bytes is shorter than the fixed header");
  detail::ByteReader in(blob);
  std::string magic;
  std::uint32_t version = 0, scalar = 0;
  std::uint64_t total = 0;
  static_cast<void>(in.get_bytes(8, magic));
  if (magic != detail::state_magic)
    format_error(R::bad_magic, "the blob does not start with \"LNATTNST\"");
  static_cast<void>(in.get_uint(version));
  if (version < 1 || version > detail::state_format_version)
    format_error(R::unsupported_version, "format version " + std::to_string(version) +
                                             ", this build reads versions 1 to " +
                                             std::to_string(detail::state_format_version));
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
    detail::ByteReader tail(blob.last(8));
    static_cast<void>(tail.get_uint(stored_sum));
  }
  if (detail::fnv1a64(body) != stored_sum)
    format_error(R::checksum_mismatch, "checksum mismatch: the bytes were changed or damaged");

  // The checksum holds, so what follows is what a writer wrote; still, every read is bounded.
  detail::ByteReader rd(body);
  static_cast<void>(rd.get_bytes(fixed, magic));
  if (scalar != detail::scalar_code<Scalar>())
    format_error(R::scalar_type_mismatch,
                 std::string("the blob holds ") + detail::scalar_code_name(scalar) +
                     " scalars, this layer computes in " +
                     detail::scalar_code_name(detail::scalar_code<Scalar>()));
  std::uint64_t fingerprint = 0;
  std::uint32_t name_len = 0;
  std::string name;
  if (!rd.get_uint(fingerprint) || !rd.get_uint(name_len) || !rd.get_bytes(name_len, name))
    format_error(R::size_mismatch, "the feature-map field runs past the end");
  const std::string_view want_name = detail::feature_map_name<Phi>();
  const std::uint64_t want_fp = detail::feature_map_fingerprint(layer.attention().feature_map());
  if (name != want_name || fingerprint != want_fp)
    format_error(R::feature_map_mismatch,
                 "saved with feature map \"" + name + "\" (fingerprint " +
                     std::to_string(fingerprint) + "), this layer uses \"" +
                     std::string(want_name) + "\" (fingerprint " + std::to_string(want_fp) + ")");
  // Versions 1 and 2 keep a block per query head and have no H_s field.
  std::uint64_t dims[7] = {};
  for (int i = 0; i < (version >= 3 ? 7 : 6); ++i)
    if (!rd.get_uint(dims[i]))
      format_error(R::size_mismatch, "the dimension fields run past the end");
  if (version < 3) dims[6] = dims[0];
  const HeadConfig& h = layer.heads();
  const Index r = layer.feature_dim();
  const std::uint64_t want[5] = {static_cast<std::uint64_t>(h.q_heads),
                                 static_cast<std::uint64_t>(h.kv_heads),
                                 static_cast<std::uint64_t>(h.key_dim),
                                 static_cast<std::uint64_t>(r),
                                 static_cast<std::uint64_t>(h.value_dim)};
  for (int i = 0; i < 5; ++i)
    if (dims[i] != want[i])
      format_error(R::shape_mismatch,
                   "saved with H_q=" + std::to_string(dims[0]) + " H_kv=" +
                       std::to_string(dims[1]) + " dk=" + std::to_string(dims[2]) + " r=" +
                       std::to_string(dims[3]) + " dv=" + std::to_string(dims[4]) +
                       ", this layer has H_q=" + std::to_string(want[0]) + " H_kv=" +
                       std::to_string(want[1]) + " dk=" + std::to_string(want[2]) + " r=" +
                       std::to_string(want[3]) + " dv=" + std::to_string(want[4]));
  const Index state_heads = layer.state_heads();
  if (dims[6] != static_cast<std::uint64_t>(h.q_heads) &&
      dims[6] != static_cast<std::uint64_t>(state_heads))
    format_error(R::shape_mismatch, "saved with " + std::to_string(dims[6]) +
                                        " state heads per sequence, this layer keeps " +
                                        std::to_string(state_heads));
  // Blocks per sequence in the blob: this layer's count, or one per query head (a version 1
  // or 2 blob, or H_s = H_q), merged below to one per key/value head.
  const Index blocks = static_cast<Index>(dims[6]);
  const Index group = blocks / state_heads;
  // The dims now equal this layer's, so the per-head sizes cannot overflow; the count is
  // bounded by the bytes actually present before anything is allocated, and every variable
  // part (the pending tokens) before it is read.
  const bool has_pending = version >= 2;
  const std::uint64_t fixed_per_head =
      (has_pending ? 16 : 8) + static_cast<std::uint64_t>(r * h.value_dim + r + 1) * sizeof(Scalar);
  const std::uint64_t per_token = static_cast<std::uint64_t>(r + h.value_dim) * sizeof(Scalar);
  const std::uint64_t min_per_sequence = fixed_per_head * static_cast<std::uint64_t>(blocks);
  const std::uint64_t count = dims[5];
  const auto payload_error = [&] {
    format_error(R::size_mismatch, std::to_string(count) + " sequences do not fill the " +
                                       std::to_string(rd.remaining()) + " bytes of payload");
  };
  if (min_per_sequence > 0 && count > rd.remaining() / min_per_sequence) payload_error();
  if (!has_pending && count * min_per_sequence != rd.remaining()) payload_error();

  std::vector<SequenceState<Scalar>> loaded;
  loaded.reserve(static_cast<std::size_t>(count));
  RowVector<Scalar> key_features(r), value(h.value_dim);
  for (std::uint64_t s = 0; s < count; ++s) {
    SequenceState<Scalar> seq(blocks, r, h.key_dim, h.value_dim,
                              LogScaledFeatureMap<Phi, Scalar>,
                              layer.attention().decode_block(r, h.value_dim));
    for (Index head = 0; head < blocks; ++head) {
      if (rd.remaining() < fixed_per_head) payload_error();
      AttentionState<Scalar>& st = seq.head(head);
      std::uint64_t tokens = 0, pending = 0;
      static_cast<void>(rd.get_uint(tokens));
      if (tokens > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
        format_error(R::size_mismatch, "a token count does not fit an Index");
      st.set_tokens(static_cast<Index>(tokens));
      Scalar log_scale{};
      static_cast<void>(rd.get_scalar(log_scale));
      st.set_log_scale(log_scale);
      if (has_pending) static_cast<void>(rd.get_uint(pending));
      auto S = st.mutable_S();
      for (Index i = 0; i < S.rows(); ++i)
        for (Index j = 0; j < S.cols(); ++j) static_cast<void>(rd.get_scalar(S(i, j)));
      auto z = st.mutable_z();
      for (Index i = 0; i < z.size(); ++i) static_cast<void>(rd.get_scalar(z(i)));
      if (pending > tokens || (pending > 0 && pending > rd.remaining() / per_token))
        payload_error();
      for (std::uint64_t p = 0; p < pending; ++p) {
        for (Index i = 0; i < r; ++i) static_cast<void>(rd.get_scalar(key_features(i)));
        for (Index j = 0; j < h.value_dim; ++j) static_cast<void>(rd.get_scalar(value(j)));
        st.load_pending_token(key_features, value);
      }
    }
    if (group == 1) {
      loaded.push_back(std::move(seq));
      continue;
    }
    // One block per query head: the heads of each key/value head must agree.
    SequenceState<Scalar> merged(state_heads, r, h.key_dim, h.value_dim,
                                 LogScaledFeatureMap<Phi, Scalar>,
                                 layer.attention().decode_block(r, h.value_dim));
    for (Index g = 0; g < state_heads; ++g) {
      for (Index i = 1; i < group; ++i)
        if (!detail::same_state(seq.head(g * group), seq.head(g * group + i)))
          format_error(R::shape_mismatch,
                       "sequence " + std::to_string(s) + " keeps query heads " +
                           std::to_string(g * group) + " and " + std::to_string(g * group + i) +
                           " of key/value head " + std::to_string(g) +
                           " with different states; this layer keeps one state per key/value "
                           "head");
      merged.head(g) = std::move(seq.head(g * group));
    }
    loaded.push_back(std::move(merged));
  }
  if (rd.remaining() != 0) payload_error();
  // Shapes match the layer and the state was checked against it above, so no add throws
  // a ShapeError halfway (only std::bad_alloc could).
  std::vector<SequenceId> ids;
  ids.reserve(loaded.size());
  for (auto& seq : loaded) ids.push_back(state.add_sequence(std::move(seq)));
  return ids;
}

/// A new batch state holding the sequences of `blob`. Throws as restore_sequences().
template <class Phi, class Scalar>
[[nodiscard]] BatchState<Scalar> load_state(const MultiHeadAttention<Phi, Scalar>& layer,
                                            std::span<const std::byte> blob) {
  BatchState<Scalar> state = layer.make_state();
  static_cast<void>(restore_sequences(layer, state, blob));
  return state;
}

}  // namespace linattn
