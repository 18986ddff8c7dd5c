#pragma once
// How the public entry points read their trailing arguments. Every call takes its per-token
// inputs (gates, betas; as many as the write rule needs) followed by one last argument (the
// mask of a stateless parallel call, or the output of an *_into call). A variadic list can
// only be deduced at the end of a parameter list, so the entry points take them as one pack
// and split off the last here.

#include <linattn/types.hpp>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// f(tuple of all but the last argument (as references), last argument).
template <class F, class... Args>
decltype(auto) with_last(F&& f, Args&&... args) {
  static_assert(sizeof...(Args) >= 1, "the call needs a last argument (mask or output)");
  auto all = std::forward_as_tuple(std::forward<Args>(args)...);
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return std::forward<F>(f)(std::forward_as_tuple(std::get<I>(std::move(all))...),
                              std::get<sizeof...(Args) - 1>(std::move(all)));
  }(std::make_index_sequence<sizeof...(Args) - 1>{});
}

/// f(tuple of all but the last two arguments, second to last, last).
template <class F, class... Args>
decltype(auto) with_last_two(F&& f, Args&&... args) {
  static_assert(sizeof...(Args) >= 2, "the call needs a mask and an output");
  auto all = std::forward_as_tuple(std::forward<Args>(args)...);
  constexpr std::size_t n = sizeof...(Args);
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return std::forward<F>(f)(std::forward_as_tuple(std::get<I>(std::move(all))...),
                              std::get<n - 2>(std::move(all)), std::get<n - 1>(std::move(all)));
  }(std::make_index_sequence<n - 2>{});
}

/// True for the types a mask argument may have: Mask (chosen at run time), or the types of
/// Mask::none and Mask::causal (known at compile time).
template <class M>
concept MaskArgument = std::same_as<std::remove_cvref_t<M>, Mask> ||
                       std::same_as<std::remove_cvref_t<M>, Mask::Constant<Mask::Kind::none>> ||
                       std::same_as<std::remove_cvref_t<M>, CausalMask>;

/// True when the mask argument's type says Mask::causal at compile time.
template <class M>
inline constexpr bool is_causal_constant = std::same_as<std::remove_cvref_t<M>, CausalMask>;

}  // namespace linattn::detail
