#pragma once
// The query heads (or outputs) of a grouped call, given as a span of row views or as a tensor
// view slice (B = 1, H = G heads), read through one interface. Neither form copies a head:
// element g is a Map over the caller's rows.

#include <linattn/errors.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>

namespace linattn::detail {

/// G heads of rows: Element = const Scalar for queries, Scalar for outputs.
template <class Element>
class HeadGroup {
 public:
  using View = typename TensorView<Element>::HeadMatrix;

  HeadGroup(std::span<const View> views) : views_(views), count_(static_cast<Index>(views.size())) {}  // NOLINT
  HeadGroup(const TensorView<Element>& heads) : tensor_(heads), count_(heads.heads()) {  // NOLINT
    if (heads.batches() != 1)
      throw_shape_error("a head group given as a tensor view needs batch size 1 (a slice), got ",
                        heads.describe());
    from_tensor_ = true;
  }

  [[nodiscard]] Index size() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  [[nodiscard]] View operator[](Index g) const {
    if (from_tensor_) return tensor_.head_matrix(0, g);
    return views_[static_cast<std::size_t>(g)];
  }

 private:
  std::span<const View> views_{};
  TensorView<Element> tensor_{};
  Index count_ = 0;
  bool from_tensor_ = false;
};

/// What a grouped call accepts as its query heads (span or vector of ConstRowsView, or a
/// TensorView slice) ...
template <class Q, class Scalar>
concept QueryGroup = std::convertible_to<const Q&, std::span<const ConstRowsView<Scalar>>> ||
                     std::convertible_to<const Q&, TensorView<const Scalar>>;
/// ... and as their outputs (span or vector of RowsView, or a TensorView slice).
template <class O, class Scalar>
concept OutputGroup = std::convertible_to<const O&, std::span<const RowsView<Scalar>>> ||
                      std::convertible_to<const O&, TensorView<Scalar>>;

template <class Scalar, class Q>
HeadGroup<const Scalar> query_group(const Q& q) {
  if constexpr (std::convertible_to<const Q&, std::span<const ConstRowsView<Scalar>>>)
    return HeadGroup<const Scalar>(std::span<const ConstRowsView<Scalar>>(q));
  else
    return HeadGroup<const Scalar>(TensorView<const Scalar>(q));
}

template <class Scalar, class O>
HeadGroup<Scalar> output_group(const O& o) {
  if constexpr (std::convertible_to<const O&, std::span<const RowsView<Scalar>>>)
    return HeadGroup<Scalar>(std::span<const RowsView<Scalar>>(o));
  else
    return HeadGroup<Scalar>(TensorView<Scalar>(o));
}

}  // namespace linattn::detail
