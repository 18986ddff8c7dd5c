// libFuzzer target: the state loader. Every input is offered as a saved state to single head
// states of several kinds and to a multi-head batch, twice: as it is (the checksum rejects
// nearly all of them) and with its size field and checksum repaired, so that the parser behind
// the checksum sees arbitrary contents. Contract: StateFormatError or success, never another
// exception or a sanitizer report; a restored state saves back to the same bytes and takes a
// decode step (whose output may overflow: a blob may hold any finite values) or refuses it
// with a DenominatorError.

#include "fuzz_support.hpp"

#include <span>
#include <vector>

using namespace linattn;
using linattn_fuzz::broken;
using linattn_fuzz::outcome;

namespace {

std::vector<std::byte> repaired(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> blob(size + 8);
  for (std::size_t i = 0; i < size; ++i) blob[i] = static_cast<std::byte>(data[i]);
  blob.resize(size);
  if (blob.size() >= 24) {
    const std::uint64_t total = blob.size() + 8;
    for (std::size_t i = 0; i < 8; ++i) blob[16 + i] = static_cast<std::byte>((total >> (8 * i)) & 0xff);
  }
  const std::uint64_t sum = detail::fnv1a64(blob);
  for (std::size_t i = 0; i < 8; ++i) blob.push_back(static_cast<std::byte>((sum >> (8 * i)) & 0xff));
  return blob;
}

template <class Attention>
void try_head(const Attention& attn, Index dk, Index dv, std::span<const std::byte> blob) {
  auto state = attn.make_state(dk, dv);
  const int r = outcome([&] { restore_state(state, blob); });
  if (r != 0 && r != 3) broken("restore_state threw outside StateFormatError");
  if (r != 0) return;
  if (save_state(state) != std::vector<std::byte>(blob.begin(), blob.end())) broken("a restored state saves to other bytes");
  using Scalar = typename Attention::scalar_type;
  const RowVector<Scalar> q = RowVector<Scalar>::Constant(dk, Scalar(0.5)), v = RowVector<Scalar>::Ones(dv);
  RowVector<Scalar> y(dv);
  const auto step = [&] {
    using Rule = typename Attention::rule_type;
    if constexpr (Rule::kind == WriteKind::gated) attn.step_into(state, q, q, v, -0.5, y);
    else if constexpr (Rule::kind == WriteKind::delta) attn.step_into(state, q, q, v, 0.5, y);
    else attn.step_into(state, q, q, v, y);
  };
  const int s = outcome(step);
  if (s == 2 && state.tokens() < detail::kMaxTokens) broken("a restored state refused a step");
}

template <class Layer>
void try_batch(const Layer& layer, std::span<const std::byte> blob) {
  auto batch = layer.make_state();
  const int r = outcome([&] { static_cast<void>(restore_sequences(layer, batch, blob)); });
  if (r != 0 && r != 3) broken("restore_sequences threw outside StateFormatError");
  if (r == 3 && batch.size() != 0) broken("a rejected blob changed the batch");
}

void try_all(std::span<const std::byte> blob) {
  try_head(LinearAttention<EluPlusOne>(), 3, 2, blob);
  Options blocked;
  blocked.decode_block = 4;
  try_head(LinearAttention<EluPlusOne>(EluPlusOne{}, blocked), 3, 2, blob);
  try_head(LinearAttention<PositiveRandomFeatures<double>, double>(PositiveRandomFeatures<double>(3, 4, 1)), 3, 2, blob);
  try_head(RuleAttention<EluPlusOne, Gated>(), 3, 2, blob);
  try_head(RuleAttention<L2Normalize, Delta, double>(), 3, 2, blob);
  try_batch(MultiHeadAttention<LinearAttention<EluPlusOne>>({2, 1, 3, 2}), blob);
  try_batch(MultiHeadAttention<LinearAttention<EluPlusOne>>({4, 2, 8, 4}), blob);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> raw(size);
  for (std::size_t i = 0; i < size; ++i) raw[i] = static_cast<std::byte>(data[i]);
  try_all(raw);
  if (size >= 8) try_all(repaired(data, size - 8));  // the input's last 8 bytes replaced
  return 0;
}
