#pragma once
// Backward passes of the write rules other than Additive (linattn/rule_gradients.hpp):
// Decay and Gated in gated_backward.hpp, Delta and GatedDelta in delta_backward.hpp (each file
// comment has the derivation).

#include <linattn/detail/delta_backward.hpp>
#include <linattn/detail/gated_backward.hpp>
