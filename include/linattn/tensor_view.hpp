#pragma once
/// \file tensor_view.hpp
/// TensorView<Element>: a non-owning pointer + shape + strides view of a rank-4 activation
/// buffer, so attention reads and writes a model's own memory with no copy.
///
/// A view has four logical axes in a fixed order, (batch, time, head, feature), whatever the
/// memory order; the strides say where they live. One type therefore covers both common
/// layouts of a row-major buffer:
///   batch-first [B, T, H, d]: strides (T*H*d, H*d, d, 1)   (PyTorch modules, fla)
///   head-first  [B, H, T, d]: strides (H*T*d, d, T*d, 1)
/// and any slice of them (e.g. the q part of a fused qkv projection, via the general
/// constructor). The feature axis must be contiguous (stride 1): each head of each token is a
/// contiguous row, which is what lets one head be an Eigen::Map with an outer stride. Per-token
/// inputs of the write rules use the same type: [B, T, H] gates or betas are a view with d = 1,
/// [B, T, H, r] per-channel gates one with d = r.
///
/// Cost: a view is 9 words; building one is O(1) and touches no element.
/// Throws: ShapeError for negative extents or strides, a feature stride other than 1, a null
/// pointer over a non-empty shape, or an extent whose last element's offset does not fit an
/// Index.

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
  /// Rows of one head: T x d, row-major, rows `stride(time)` elements apart.
  using HeadMatrix = std::conditional_t<std::is_const_v<Element>, ConstRowsView<value_type>,
                                        RowsView<value_type>>;

  /// The logical axes, in the order of Extents.
  enum Axis : int { batch = 0, time = 1, head = 2, feature = 3 };

  /// An empty view (all extents 0).
  TensorView() = default;

  /// A view of `data` with `shape` and `strides` (elements) along (batch, time, head, feature).
  TensorView(Element* data, Extents shape, Extents strides)
      : data_(data), shape_(shape), strides_(strides) {
    for (int a = 0; a < 4; ++a)
      if (shape_[a] < 0 || strides_[a] < 0)
        detail::throw_shape_error("tensor view ", describe(), " has a negative extent or stride");
    if (strides_[feature] != 1 && shape_[feature] > 1)
      detail::throw_shape_error("tensor view ", describe(),
                                " needs a contiguous feature axis (stride 1)");
    if (size() == 0) return;
    if (data_ == nullptr)
      detail::throw_shape_error("tensor view ", describe(), " has a null data pointer");
    Index last = 0;  // offset of the last element
    for (int a = 0; a < 4; ++a)
      last = detail::checked_sum(
          last, detail::checked_product(shape_[a] - 1, strides_[a], "a tensor view's extent"),
          "a tensor view's last offset");
  }

  /// A contiguous row-major [B, T, H, d] buffer.
  [[nodiscard]] static TensorView batch_first(Element* data, Index B, Index T, Index H, Index d) {
    const Index hd = detail::checked_product(H, d, "H x d");
    const Index thd = detail::checked_product(T, hd, "T x H x d");
    return TensorView(data, {B, T, H, d}, {thd, hd, d, 1});
  }

  /// A contiguous row-major [B, H, T, d] buffer.
  [[nodiscard]] static TensorView head_first(Element* data, Index B, Index H, Index T, Index d) {
    const Index td = detail::checked_product(T, d, "T x d");
    const Index htd = detail::checked_product(H, td, "H x T x d");
    return TensorView(data, {B, T, H, d}, {htd, d, td, 1});
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
  /// Number of elements the view addresses, B*T*H*d (0 if any extent is 0).
  [[nodiscard]] Index size() const noexcept {
    for (Index e : shape_)
      if (e == 0) return 0;
    return shape_[0] * shape_[1] * shape_[2] * shape_[3];
  }

  /// Element (b, t, h, c). O(1); no bounds check.
  [[nodiscard]] Element& operator()(Index b, Index t, Index h, Index c) const noexcept {
    return data_[b * strides_[batch] + t * strides_[time] + h * strides_[head] + c];
  }

  /// Rows [first, first + n) of head h of batch entry b, as an n x d Eigen::Map over the buffer
  /// (no copy). O(1). Throws ShapeError when (b, h) or the rows are out of range.
  [[nodiscard]] HeadMatrix head_rows(Index b, Index h, Index first, Index n) const {
    if (b < 0 || b >= batches() || h < 0 || h >= heads() || first < 0 || n < 0 ||
        first > times() - n)
      detail::throw_shape_error("rows [", first, ", ", first + n, ") of head (batch ", b,
                                ", head ", h, ") are outside tensor view ", describe());
    Element* p = data_;
    if (n > 0 && dim() > 0)
      p += b * strides_[batch] + h * strides_[head] + first * strides_[time];
    return HeadMatrix(p, n, dim(), Eigen::OuterStride<>(strides_[time]));
  }

  /// Head h of batch entry b: all T rows (head_rows(b, h, 0, T)).
  [[nodiscard]] HeadMatrix head_matrix(Index b, Index h) const { return head_rows(b, h, 0, times()); }

  /// The view of rows [first, first + n) and heads [first_head, first_head + heads) of batch
  /// entry b: B = 1, T = n, H = heads. O(1). Throws ShapeError when out of range.
  [[nodiscard]] TensorView slice(Index b, Index first, Index n, Index first_head, Index heads) const {
    if (b < 0 || b >= batches() || first < 0 || n < 0 || first > times() - n ||
        first_head < 0 || heads < 0 || first_head > this->heads() - heads)
      detail::throw_shape_error("slice (batch ", b, ", rows [", first, ", ", first + n,
                                "), heads [", first_head, ", ", first_head + heads,
                                ")) is outside tensor view ", describe());
    Element* p = data_;
    if (n > 0 && heads > 0 && dim() > 0)
      p += b * strides_[batch] + first * strides_[time] + first_head * strides_[head];
    return TensorView(p, {1, n, heads, dim()}, {0, strides_[time], strides_[head], 1});
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
