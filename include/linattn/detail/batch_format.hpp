#pragma once
// The batch part of the state format (serialize.hpp): writing a BatchState's sequences and
// reading them back, from version 4 and from the versions 1 to 3 that batches of the additive
// rule were saved in before the states owned their format.

#include <linattn/batch_state.hpp>
#include <linattn/detail/bytes.hpp>
#include <linattn/detail/state_format.hpp>
#include <linattn/errors.hpp>
#include <linattn/head_config.hpp>
#include <linattn/types.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn::detail {

template <class Layer, class HeadState>
void check_batch_of(const Layer& layer, const BatchState<HeadState>& state) {
  const HeadConfig& h = layer.heads();
  if (state.heads() != layer.state_heads() || state.feature_dim() != layer.feature_dim() ||
      state.key_dim() != h.key_dim || state.value_dim() != h.value_dim)
    throw_shape_error("batch state has heads=", state.heads(), " r=", state.feature_dim(),
                      " dk=", state.key_dim(), " dv=", state.value_dim(),
                      ": it is not this layer's (heads=", layer.state_heads(), " r=",
                      layer.feature_dim(), " dk=", h.key_dim, " dv=", h.value_dim, ")");
  state.empty_head().check_identity(layer.attention().state_identity());
}

template <class Layer, class HeadState>
std::vector<std::byte> save_sequences(const Layer& layer, const BatchState<HeadState>& state,
                                      Index first, Index count) {
  check_batch_of(layer, state);
  std::vector<std::byte> out;
  ByteWriter w(out);
  const std::size_t size_at = begin_blob<typename HeadState::scalar_type>(w);
  w.put_u32(static_cast<std::uint32_t>(BlobKind::batch));
  write_identity(w, state.empty_head());
  const HeadConfig& h = layer.heads();
  for (Index v : {h.q_heads, h.kv_heads, state.heads(), count}) w.put_u64(static_cast<std::uint64_t>(v));
  for (Index s = first; s < first + count; ++s)
    for (Index head = 0; head < state.heads(); ++head) {
      const HeadState& st = state.sequence(s).head(head);
      state.empty_head().check_like(st);  // a head replaced through sequence().head() must fit
      write_head(w, st);
    }
  end_blob(out, w, size_at);
  return out;
}

/// Reads the sequences of a batch blob of any version into new sequence states shaped like
/// `state`'s (checked against `layer`); nothing in `state` changes.
template <class Layer, class HeadState>
std::vector<SequenceState<HeadState>> read_sequences(const Layer& layer,
                                                     const BatchState<HeadState>& state,
                                                     std::span<const std::byte> blob) {
  using R = StateFormatError::Reason;
  using Scalar = typename HeadState::scalar_type;
  check_batch_of(layer, state);
  const HeadState& target = state.empty_head();
  auto [version, rd] = open_blob<Scalar>(blob, 1);
  const HeadConfig& h = layer.heads();
  std::uint64_t q_heads = 0, kv_heads = 0, blocks = 0, count = 0;
  HeadFields fields;
  if (version >= 4) {
    std::uint32_t kind = 0;
    need(rd.get_uint(kind), "the kind field");
    if (kind != static_cast<std::uint32_t>(BlobKind::batch))
      format_error(R::shape_mismatch, "the blob holds one head state, not a batch (restore it "
                                      "with restore_state)");
    read_identity(rd, target);
    need(rd.get_uint(q_heads) && rd.get_uint(kv_heads) && rd.get_uint(blocks) && rd.get_uint(count),
         "the head counts");
  } else {
    // Versions 1 to 3: u64 fingerprint, u32 n + name, then H_q, H_kv, dk, r, dv, N (and H_s
    // from version 3); additive rule only.
    std::uint64_t fingerprint = 0;
    std::uint32_t name_len = 0;
    std::string name;
    need(rd.get_uint(fingerprint) && rd.get_uint(name_len) && rd.get_bytes(name_len, name),
         "the feature-map field");
    const StateIdentity& id = target.identity();
    if (name != id.map_name || fingerprint != id.map_fingerprint)
      format_error(R::feature_map_mismatch,
                   "saved with feature map \"" + name + "\" (fingerprint " +
                       std::to_string(fingerprint) + "), this layer uses \"" + id.map_name +
                       "\" (fingerprint " + std::to_string(id.map_fingerprint) + ")");
    if (std::string(id.rule_name) != "additive")
      format_error(R::rule_mismatch, "a version " + std::to_string(version) +
                                         " blob holds additive states, this layer's rule is " +
                                         id.rule_name);
    std::uint64_t dk = 0, r = 0, dv = 0;
    need(rd.get_uint(q_heads) && rd.get_uint(kv_heads) && rd.get_uint(dk) && rd.get_uint(r) &&
             rd.get_uint(dv) && rd.get_uint(count),
         "the dimension fields");
    blocks = q_heads;
    if (version >= 3) need(rd.get_uint(blocks), "the dimension fields");
    if (dk != std::uint64_t(target.key_dim()) || r != std::uint64_t(target.feature_dim()) ||
        dv != std::uint64_t(target.value_dim()))
      format_error(R::shape_mismatch, "saved with dk=" + std::to_string(dk) + " r=" +
                                          std::to_string(r) + " dv=" + std::to_string(dv) +
                                          ", this layer has dk=" + std::to_string(target.key_dim()) +
                                          " r=" + std::to_string(target.feature_dim()) +
                                          " dv=" + std::to_string(target.value_dim()));
    fields = HeadFields{false, version >= 2, true};
  }
  const auto state_heads = static_cast<std::uint64_t>(layer.state_heads());
  // Versions 1 and 2 keep one block per query head, merged below.
  constexpr bool additive = std::is_same_v<HeadState, AttentionState<Scalar>>;
  // (Grouped value heads came after version 4: such a layer reads only its own blocks.)
  const bool per_query_head =
      additive && version < 4 && blocks == q_heads && h.v_heads() == h.kv_heads;
  if (q_heads != std::uint64_t(h.q_heads) || kv_heads != std::uint64_t(h.kv_heads) ||
      !(blocks == state_heads || per_query_head))
    format_error(R::shape_mismatch, "saved with H_q=" + std::to_string(q_heads) + " H_kv=" +
                                        std::to_string(kv_heads) + " and " + std::to_string(blocks) +
                                        " state heads, this layer has H_q=" +
                                        std::to_string(h.q_heads) + " H_kv=" +
                                        std::to_string(h.kv_heads) + " H_v=" +
                                        std::to_string(h.v_heads()) + " and keeps " +
                                        std::to_string(state_heads));
  // Every head block holds at least S and z: bound the count by the bytes present before
  // anything is allocated.
  const std::uint64_t min_block = static_cast<std::uint64_t>(target.scalar_count()) * sizeof(Scalar);
  if (blocks > 0 && min_block > 0 && count > rd.remaining() / (blocks * min_block))
    format_error(R::size_mismatch, std::to_string(count) + " sequences do not fit the " +
                                       std::to_string(rd.remaining()) + " bytes of payload");
  const Index group = static_cast<Index>(blocks / state_heads);
  std::vector<SequenceState<HeadState>> loaded;
  loaded.reserve(static_cast<std::size_t>(count));
  for (std::uint64_t s = 0; s < count; ++s) {
    SequenceState<HeadState> seq(static_cast<Index>(blocks), target);
    for (Index head = 0; head < static_cast<Index>(blocks); ++head)
      seq.head(head) = read_head(rd, target, fields);
    if constexpr (additive) {
      if (group > 1) {
      // One block per query head: the heads of each key/value head must agree.
      SequenceState<HeadState> merged(static_cast<Index>(state_heads), target);
      for (Index g = 0; g < static_cast<Index>(state_heads); ++g) {
        for (Index i = 1; i < group; ++i)
          if (!same_state(seq.head(g * group), seq.head(g * group + i)))
            format_error(R::shape_mismatch,
                         "sequence " + std::to_string(s) + " keeps query heads " +
                             std::to_string(g * group) + " and " + std::to_string(g * group + i) +
                             " of key/value head " + std::to_string(g) +
                             " with different states; this layer keeps one state per key/value head");
        merged.head(g) = std::move(seq.head(g * group));
      }
      seq = std::move(merged);
      }
    }
    loaded.push_back(std::move(seq));
  }
  if (rd.remaining() != 0)
    format_error(R::size_mismatch, std::to_string(rd.remaining()) + " bytes follow the last sequence");
  return loaded;
}

}  // namespace linattn::detail
