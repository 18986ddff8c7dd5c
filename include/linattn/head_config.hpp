#pragma once
/// \file head_config.hpp
/// HeadConfig: the head counts and per-head dimensions of a multi-head attention layer.

#include <linattn/types.hpp>

namespace linattn {

/// Head counts and per-head dimensions of a multi-head attention layer.
struct HeadConfig {
  /// H_q, the number of query (and output) heads.
  Index q_heads = 1;
  /// H_kv, the number of key/value heads; H_q must be a multiple of it (grouped-query
  /// attention when H_kv < H_q, multi-query when H_kv = 1). The write rules' per-token inputs
  /// (gates, betas) have one entry per key/value head.
  Index kv_heads = 1;
  /// dk, the query/key dimension of one head.
  Index key_dim = 0;
  /// dv, the value/output dimension of one head.
  Index value_dim = 0;
};

}  // namespace linattn
