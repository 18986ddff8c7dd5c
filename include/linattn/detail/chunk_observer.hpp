#pragma once
// The hook through which the chunked causal kernels (chunked.hpp, log_domain.hpp) show the
// chunk-boundary states to a caller that keeps them.

namespace linattn::detail {

/// The default observer of the chunked causal kernels: does nothing. An observer is called as
/// before_chunk(first, S, z) (log-domain kernel: before_chunk(first, S, z, M)) with the state
/// before the chunk that starts at row `first`, before that chunk is read or absorbed; the
/// saving forward (linattn/saved_forward.hpp) copies the chunk-boundary states there.
struct NoChunkObserver {
  template <class... Args>
  void operator()(const Args&...) const noexcept {}
};

}  // namespace linattn::detail
