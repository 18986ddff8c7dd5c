#pragma once
/// \file tensor_view.hpp
/// TensorView<Element>: a non-owning pointer + shape + strides view of a rank-4 activation
/// buffer, so multi-head attention reads and writes a model's own memory with no copy.
///
/// A view has four logical axes in a fixed order, (batch, time, head, feature), whatever the
/// memory order; the strides say where they live. One type therefore covers both common
/// layouts of a row-major buffer:
///   batch-first [B, T, H, d]: strides (T*H*d, H*d, d, 1)   (PyTorch modules, fla)
///   head-first  [B, H, T, d]: strides (H*T*d, d, T*d, 1)
/// and any slice of them (e.g. the q part of a fused qkv projection, via the general
/// constructor). The feature axis must be contiguous (stride 1): each head of each token is a
/// contiguous row, which is what lets one head be an Eigen::Map with an outer stride.
/// std::mdspan would fit, but g++ 12 does not ship it.
///
/// Cost: a view is 9 words; building one is O(1) and touches no element.
/// Throws: ShapeError for negative extents or strides, a feature stride other than 1, or a
/// null pointer over a non-empty shape.

#include <linattn/errors.hpp>
#include <linattn/types.hpp>

#include <Eigen/Core>

#include <array>
#include <concepts>
#include <string>
#include <type_traits>

namespace linattn {

/// Non-owning rank-4 view with logical axes (batch, time, head, feature); strides in elements.
template <class Element>
class TensorView {
  static_assert(SupportedScalar<std::remove_const_t<Element>>,
                "a TensorView holds float or double (const for read-only inputs)");

 public:
  using element_type = Element;
  using value_type = std::remove_const_t<Element>;
  /// Extents or strides along (batch, time, head, feature).
  using Extents = std::array<Index, 4>;
  /// One head of one batch entry: T x d, row-major, rows `stride(time)` elements apart.
  using HeadMatrix =
      Eigen::Map<std::conditional_t<std::is_const_v<Element>, const RowMatrix<value_type>,
                                    RowMatrix<value_type>>,
                 Eigen::Unaligned, Eigen::OuterStride<>>;

  /// The logical axes, in the order of Extents.
  enum Axis : int { batch = 0, time = 1, head = 2, feature = 3 };

  /// An empty view (all extents 0).
  TensorView() = default;

  /// A view of `data` with `shape` and `strides` (elements) along (batch, time, head, feature).
  TensorView(Element* data, Extents shape, Extents strides)
      : data_(data), shape_(shape), strides_(strides) {
    for (int a = 0; a < 4; ++a)
      if (shape_[a] < 0 || strides_[a] < 0)
        detail::throw_shape_error("tensor view ", describe(),
                                  " has a negative extent or stride");
    if (strides_[feature] != 1 && shape_[feature] > 1)
      detail::throw_shape_error("tensor view ", describe(),
                                " needs a contiguous feature axis (stride 1)");
    if (data_ == nullptr && size() > 0)
      detail::throw_shape_error("tensor view ", describe(), " has a null data pointer");
  }

  /// A contiguous row-major [B, T, H, d] buffer.
  [[nodiscard]] static TensorView batch_first(Element* data, Index B, Index T, Index H, Index d) {
    return TensorView(data, {B, T, H, d}, {T * H * d, H * d, d, 1});
  }

  /// A contiguous row-major [B, H, T, d] buffer.
  [[nodiscard]] static TensorView head_first(Element* data, Index B, Index H, Index T, Index d) {
    return TensorView(data, {B, T, H, d}, {H * T * d, d, T * d, 1});
  }

  /// A mutable view converts to a read-only one.
  template <class Other>
    requires(std::is_const_v<Element> && std::same_as<const Other, Element> &&
             !std::is_const_v<Other>)
  TensorView(const TensorView<Other>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  [[nodiscard]] Element* data() const noexcept { return data_; }
  [[nodiscard]] const Extents& shape() const noexcept { return shape_; }
  [[nodiscard]] const Extents& strides() const noexcept { return strides_; }
  [[nodiscard]] Index extent(Axis a) const noexcept { return shape_[a]; }
  [[nodiscard]] Index stride(Axis a) const noexcept { return strides_[a]; }
  /// B, T, H and d.
  [[nodiscard]] Index batches() const noexcept { return shape_[batch]; }
  [[nodiscard]] Index times() const noexcept { return shape_[time]; }
  [[nodiscard]] Index heads() const noexcept { return shape_[head]; }
  [[nodiscard]] Index dim() const noexcept { return shape_[feature]; }
  /// Number of elements the view addresses, B*T*H*d.
  [[nodiscard]] Index size() const noexcept {
    return shape_[0] * shape_[1] * shape_[2] * shape_[3];
  }

  /// Element (b, t, h, c). O(1); no bounds check.
  [[nodiscard]] Element& operator()(Index b, Index t, Index h, Index c) const noexcept {
    return data_[b * strides_[batch] + t * strides_[time] + h * strides_[head] + c];
  }

  /// Head h of batch entry b as a T x d Eigen::Map over the buffer (no copy). O(1).
  /// Throws ShapeError when (b, h) is out of range.
  [[nodiscard]] HeadMatrix head_matrix(Index b, Index h) const {
    if (b < 0 || b >= batches() || h < 0 || h >= heads())
      detail::throw_shape_error("head (batch ", b, ", head ", h, ") is outside tensor view ",
                                describe());
    return HeadMatrix(data_ + b * strides_[batch] + h * strides_[head], times(), dim(),
                      Eigen::OuterStride<>(strides_[time]));
  }

  /// "[B=2, T=16, H=4, d=32] strides (2048, 128, 32, 1)", for messages.
  [[nodiscard]] std::string describe() const {
    auto s = [](Index v) { return std::to_string(v); };
    return "[B=" + s(shape_[0]) + ", T=" + s(shape_[1]) + ", H=" + s(shape_[2]) +
           ", d=" + s(shape_[3]) + "] strides (" + s(strides_[0]) + ", " + s(strides_[1]) +
           ", " + s(strides_[2]) + ", " + s(strides_[3]) + ")";
  }

 private:
  Element* data_ = nullptr;
  Extents shape_{0, 0, 0, 0};
  Extents strides_{0, 0, 0, 1};
};

}  // namespace linattn
