// libFuzzer target: the public API over shapes and special values. The input chooses T, dk,
// dv (0 included), the rule, the feature map, the normalization and every value of Q, K, V
// and the per-token inputs from {ordinary, 0, subnormal, +-huge, NaN, +-Inf}. Contract (see
// docs/input_contract.md): an exception from the documented set or outputs; with a strictly
// positive map, the strict normalization and finite inputs of moderate size, outputs are
// finite; and the chunked, recurrent and step-by-step paths accept and reject the same inputs,
// at the same row. Rules: Additive (ELU + 1, identity, random features, TaylorExp), Decay,
// Gated, Delta, and GatedDelta with per-channel log_alpha.

#include "fuzz_support.hpp"

#include <vector>

using namespace linattn;
using linattn_fuzz::broken;
using linattn_fuzz::Bytes;
using linattn_fuzz::outcome;

namespace {

template <class Scalar>
RowMatrix<Scalar> matrix(Bytes& in, Index rows, Index cols) {
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = in.special<Scalar>();
  return m;
}

template <class Scalar>
bool moderate(const RowMatrix<Scalar>& m) {
  return m.allFinite() && (m.size() == 0 || m.cwiseAbs().maxCoeff() <= Scalar(1e4));
}

// A per-token input given per channel (T x r): a step takes its row, not its first value.
template <class Scalar>
struct PerChannel {
  RowMatrix<Scalar> values;
};
template <class Scalar>
const RowMatrix<Scalar>& whole(const RowMatrix<Scalar>& x) { return x; }
template <class Scalar>
const RowMatrix<Scalar>& whole(const PerChannel<Scalar>& x) { return x.values; }
template <class Scalar>
Scalar at(const RowMatrix<Scalar>& x, Index t) { return x(t, 0); }
template <class Scalar>
auto at(const PerChannel<Scalar>& x, Index t) { return x.values.row(t); }

// The three causal paths on the same inputs; per-token inputs given to each.
template <class Attention, class... In>
void check_paths(const Attention& attn, const RowMatrix<typename Attention::scalar_type>& Q,
                 const RowMatrix<typename Attention::scalar_type>& K,
                 const RowMatrix<typename Attention::scalar_type>& V, bool positive_and_moderate,
                 const In&... in) {
  using Scalar = typename Attention::scalar_type;
  RowMatrix<Scalar> chunked, recurrent;
  Index chunked_row = -1, recurrent_row = -1;
  const int a = outcome([&] { chunked = attn.parallel(Q, K, V, whole(in)..., Mask::causal); });
  const int b = outcome([&] { recurrent = attn.recurrent(Q, K, V, whole(in)...); });
  try {
    static_cast<void>(attn.parallel(Q, K, V, whole(in)..., Mask::causal));
  } catch (const DenominatorError& e) {
    chunked_row = e.row();
  } catch (...) {
  }
  try {
    static_cast<void>(attn.recurrent(Q, K, V, whole(in)...));
  } catch (const DenominatorError& e) {
    recurrent_row = e.row();
  } catch (...) {
  }
  // Step by step, when the shapes allow a state.
  int c = a;
  if (a != 2 && Q.cols() > 0 && V.cols() > 0) {
    c = outcome([&] {
      auto state = attn.make_state(Q.cols(), V.cols());
      for (Index t = 0; t < Q.rows(); ++t) {
        if constexpr (sizeof...(In) == 0) static_cast<void>(attn.step(state, Q.row(t), K.row(t), V.row(t)));
        else static_cast<void>(attn.step(state, Q.row(t), K.row(t), V.row(t), at(in, t)...));
      }
    });
  }
  if (a == 2 || b == 2) {
    if (a != b) broken("the chunked and recurrent paths disagree on a shape or input error");
    return;
  }
  if (!positive_and_moderate) return;
  if (a != b || a != c) broken("the paths disagree on accepting the inputs");
  if (a == 1 && chunked_row != recurrent_row) broken("the paths reject different rows");
  if (a == 0 && (!chunked.allFinite() || !recurrent.allFinite())) broken("non-finite outputs from finite moderate inputs");
}

template <class Scalar>
void run(Bytes& in) {
  const Index T = in.u8() % 40, dk = in.u8() % 6, dv = in.u8() % 7;
  const std::uint8_t choice = in.u8();
  const auto Q = matrix<Scalar>(in, T, dk), K = matrix<Scalar>(in, T, dk), V = matrix<Scalar>(in, T, dv);
  Options options;
  options.chunk_size = 1 + in.u8() % 9;
  const bool moderate_inputs = moderate(Q) && moderate(K) && moderate(V);
  switch (choice % 8) {
    case 0: {
      const LinearAttention<EluPlusOne, Scalar> attn(EluPlusOne{}, options);
      check_paths(attn, Q, K, V, moderate_inputs);
      outcome([&] { static_cast<void>(attn.parallel(Q, K, V, Mask::none)); });
      break;
    }
    case 1: {
      options.normalization = (choice / 6) % 2 ? Normalization::clamped(1e-6) : Normalization::unnormalized();
      check_paths(LinearAttention<Identity, Scalar>(Identity{}, options), Q, K, V, false);
      break;
    }
    case 2: {
      const auto gates = matrix<Scalar>(in, T, 1);
      check_paths(RuleAttention<EluPlusOne, Gated, Scalar>(EluPlusOne{}, options), Q, K, V,
                  moderate_inputs && gates.allFinite() && (gates.array() <= 0).all() && (gates.array() >= -30).all(), gates);
      break;
    }
    case 3: {
      RowMatrix<Scalar> beta = matrix<Scalar>(in, T, 1);
      options.normalization = Normalization::unnormalized();
      check_paths(RuleAttention<L2Normalize, Delta, Scalar>(L2Normalize{}, options), Q, K, V, false, beta);
      break;
    }
    case 4: {
      const RuleAttention<EluPlusOne, Decay, Scalar> attn(EluPlusOne{}, Decay(0.5), options);
      check_paths(attn, Q, K, V, moderate_inputs);
      break;
    }
    case 5: {
      if (dk == 0) break;
      const PositiveRandomFeatures<Scalar> phi(dk, 4, 7);
      check_paths(LinearAttention<PositiveRandomFeatures<Scalar>, Scalar>(phi, options), Q, K, V, false);
      break;
    }
    case 7: {
      // GatedDelta with per-channel log_alpha (Kimi Delta Attention; L2Normalize: r = dk).
      RowMatrix<Scalar> beta = matrix<Scalar>(in, T, 1);
      const PerChannel<Scalar> log_alpha{matrix<Scalar>(in, T, dk)};
      options.normalization = Normalization::unnormalized();
      check_paths(RuleAttention<L2Normalize, GatedDelta, Scalar>(L2Normalize{}, options), Q, K,
                  V, false, beta, log_alpha);
      break;
    }
    default: {
      // The kernel 1 + s + s^2 / 2 >= 1/2 keeps exact denominators positive, but the features
      // are signed and large inputs cancel in rounding: no finiteness claim, only the contract.
      check_paths(LinearAttention<TaylorExp, Scalar>(TaylorExp{}, options), Q, K, V, false);
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  if (in.u8() % 2 == 0)
    run<float>(in);
  else
    run<double>(in);
  return 0;
}
