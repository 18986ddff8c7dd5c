#pragma once
/// \file serialize.hpp
/// Saving a state to bytes and restoring it, so a server can park a conversation and resume it
/// later with bit-identical outputs: one head's state (AttentionState or RuleState) on its own,
/// or a multi-head layer's BatchState (all sequences, or one).
///
/// Format, version 4 (integers unsigned little-endian, scalars IEEE-754 little-endian):
///   0   8  magic "LNATTNST"           12  4  scalar type: 1 = binary32, 2 = binary64
///   8   4  format version (4)         16  8  total blob size in bytes, checksum included
///   24  4  kind: 1 = one head state, 2 = a batch
///   identity: u64 feature-map fingerprint, u32 n + n bytes of the map's name, u32 n + n bytes
///             of the rule's name, binary64 rule parameter (Decay's gamma, else 0);
///             u64 r, dk, dv
///   batch only: u64 H_q, H_kv, H_s (state heads per sequence), N (sequences)
///   head blocks (one, or N * H_s sequence-major): u64 tokens, u64 decode block B, u64 p
///             (pending tokens), scalar log-scale M, the stored S (r x dv row-major), z (r; not
///             for the delta rules), then p pending tokens, each key features (r) then value (dv)
///   end-8  8  FNV-1a 64 checksum of every byte before it
/// Everything that decides later bits is recorded, the decode block B included: a restored
/// state keeps the B it was saved with (whatever the restoring attention's Options say), so it
/// continues bit-identically.
///
/// Versions 1 to 3 (batches of the additive rule, written before states owned their format)
/// still load into batches: they record no B, so their states take the restoring layer's;
/// versions 1 and 2 keep a block per query head, merged into one per key/value head when the
/// G heads of each group agree (else shape_mismatch).
///
/// A blob is checked in this order before anything is modified: length and magic, version,
/// stored size, checksum, scalar type, kind, feature map, rule, dimensions, then every value
/// (finite S, z and pending tokens; a token count a state can still increment; a log-scale the
/// state can hold). Any failure throws StateFormatError (strong guarantee). The checksum catches
/// accidental damage, not deliberate tampering: a blob with a recomputed checksum is still
/// validated value by value, but one that encodes another valid state is restored as that state.
///
/// Cost: O(heads r dv) time; about (r dv + r + 3) sizeof(Scalar) + 32 bytes per head state.

#include <linattn/batch_state.hpp>
#include <linattn/detail/batch_format.hpp>
#include <linattn/detail/bytes.hpp>
#include <linattn/detail/state_format.hpp>
#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace linattn {

/// One head's state as bytes (format above). O(r dv).
template <class State>
  requires requires(const State& s) { s.identity(); }
[[nodiscard]] std::vector<std::byte> save_state(const State& state) {
  std::vector<std::byte> out;
  detail::ByteWriter w(out);
  const std::size_t size_at = detail::begin_blob<typename State::scalar_type>(w);
  w.put_u32(static_cast<std::uint32_t>(detail::BlobKind::head));
  detail::write_identity(w, state);
  detail::write_head(w, state);
  detail::end_blob(out, w, size_at);
  return out;
}

/// Replaces `state` by the state saved in `blob`. `state` must have been made by an attention
/// like the one that saved it (same feature map and draw, rule and parameter, scalar type and
/// dims; its own decode block does not matter). Strong guarantee. Throws StateFormatError.
template <class State>
  requires requires(const State& s) { s.identity(); }
void restore_state(State& state, std::span<const std::byte> blob) {
  using R = StateFormatError::Reason;
  auto [version, rd] = detail::open_blob<typename State::scalar_type>(blob, 4);
  std::uint32_t kind = 0;
  detail::need(rd.get_uint(kind), "the kind field");
  if (kind != static_cast<std::uint32_t>(detail::BlobKind::head))
    detail::format_error(R::shape_mismatch, "the blob holds a batch of sequences, not one head "
                                            "state (restore it with restore_sequences)");
  detail::read_identity(rd, state);
  State loaded = detail::read_head(rd, state, detail::HeadFields{});
  if (rd.remaining() != 0)
    detail::format_error(R::size_mismatch, std::to_string(rd.remaining()) + " bytes follow the state");
  state = std::move(loaded);
  static_cast<void>(version);
}

/// Every sequence of `state`, in batch order, as bytes (format above). Throws ShapeError or
/// StateMismatchError if the state is not `layer`'s.
template <class Layer, class HeadState>
[[nodiscard]] std::vector<std::byte> save_state(const Layer& layer, const BatchState<HeadState>& state) {
  return detail::save_sequences(layer, state, 0, state.size());
}

/// Sequence `id` of `state` alone, as bytes. Throws std::out_of_range for an unknown id.
template <class Layer, class HeadState>
[[nodiscard]] std::vector<std::byte> save_sequence(const Layer& layer,
                                                   const BatchState<HeadState>& state,
                                                   SequenceId id) {
  return detail::save_sequences(layer, state, state.index_of(id), 1);
}

/// Appends every sequence of `blob` to `state`, in the saved order, and returns their new ids.
/// Strong guarantee: the blob is fully checked and decoded before `state` changes.
/// Throws StateFormatError (see the file comment), ShapeError if `state` is not `layer`'s.
template <class Layer, class HeadState>
std::vector<SequenceId> restore_sequences(const Layer& layer, BatchState<HeadState>& state,
                                          std::span<const std::byte> blob) {
  auto loaded = detail::read_sequences(layer, state, blob);
  std::vector<SequenceId> ids;
  ids.reserve(loaded.size());
  for (auto& seq : loaded) ids.push_back(state.add_sequence(std::move(seq)));
  return ids;
}

/// A new batch state of `layer` holding the sequences of `blob`. Throws as restore_sequences().
template <class Layer>
[[nodiscard]] auto load_state(const Layer& layer, std::span<const std::byte> blob) {
  auto state = layer.make_state();
  static_cast<void>(restore_sequences(layer, state, blob));
  return state;
}

}  // namespace linattn
