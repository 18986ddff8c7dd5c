#pragma once
/// \file head_config.hpp
/// HeadConfig: the head counts and per-head dimensions of a multi-head attention layer.

#include <linattn/types.hpp>

namespace linattn {

/// Head counts and per-head dimensions of a multi-head attention layer. Two groupings:
///   grouped queries (GQA, MQA): H_q = G H_kv query heads, key head g read by query heads
///     g G ... g G + G - 1, values as keys (value_heads 0 or H_kv);
///   grouped values (Qwen3-Next's Gated DeltaNet, fla's HV > H): H_v = G_v H_kv value heads,
///     value head h reading query and key head h / G_v (then H_q = H_kv).
/// One head's state belongs to each value head, so the outputs have max(H_q, H_v) heads.
struct HeadConfig {
  /// H_q, the number of query heads (and of output heads unless value_heads is larger).
  Index q_heads = 1;
  /// H_kv, the number of key heads, and of value heads unless value_heads says otherwise;
  /// H_q must be a multiple of it (grouped-query attention when H_kv < H_q, multi-query when
  /// H_kv = 1).
  Index kv_heads = 1;
  /// dk, the query/key dimension of one head.
  Index key_dim = 0;
  /// dv, the value/output dimension of one head.
  Index value_dim = 0;
  /// H_v, the number of value heads: 0 (the default) means H_kv. Above H_kv (a multiple of it,
  /// with H_q = H_kv): grouped value heads, each with its own state, output head, and per-token
  /// inputs (the write rules' gates and betas have one entry per value head).
  Index value_heads = 0;

  /// H_v: value_heads, or H_kv when it is 0.
  [[nodiscard]] constexpr Index v_heads() const noexcept {
    return value_heads > 0 ? value_heads : kv_heads;
  }
  /// The output heads: max(H_q, H_v).
  [[nodiscard]] constexpr Index out_heads() const noexcept {
    return v_heads() > q_heads ? v_heads() : q_heads;
  }
};

}  // namespace linattn
