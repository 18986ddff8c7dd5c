// The Python extension behind linattn.torch: linattn/torch.hpp's run() and backward() for the
// package's autograd functions. The only translation unit that includes torch's headers (they
// take a minute and gigabytes to compile).

#include <linattn/torch.hpp>

#include <torch/extension.h>

#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>

namespace {

using linattn::fla::Op;
using OptTensor = std::optional<at::Tensor>;

Op op_from_name(const std::string& name) {
  if (name == "linear_attn") return Op::linear_attn;
  if (name == "simple_gla") return Op::simple_gla;
  if (name == "gla") return Op::gla;
  if (name == "delta_rule") return Op::delta_rule;
  if (name == "gated_delta_rule") return Op::gated_delta_rule;
  if (name == "kda") return Op::kda;
  TORCH_CHECK_VALUE(false, "linattn: unknown op '", name, "'");
}

using Saved = std::shared_ptr<linattn::fla::SavedForwards>;

// (o, final_state, final_z, saved): saved holds the chunk states for backward when `save` is set
// and the forward is chunked, else None; inplace_final_state writes the final states over
// initial_state and initial_z (then returned as final_state and final_z when asked for).
std::tuple<at::Tensor, OptTensor, OptTensor, std::optional<Saved>> forward(
    const std::string& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptTensor& g, const OptTensor& beta, const OptTensor& initial_state,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, std::optional<double> scale,
    bool chunked, bool output_final_state, bool normalize, bool qk_l2norm, bool head_first,
    bool save, bool inplace_final_state) {
  const linattn::fla::Settings settings{scale,     chunked,    output_final_state, normalize,
                                        qk_l2norm, head_first, inplace_final_state};
  const linattn::fla::Inputs inputs{q, k, v, g, beta, initial_state, initial_z, cu_seqlens};
  linattn::fla::Result r;
  Saved saved = save ? std::make_shared<linattn::fla::SavedForwards>() : nullptr;
  {
    pybind11::gil_scoped_release no_gil;  // the run touches no Python object
    r = saved ? linattn::fla::run(op_from_name(op), inputs, settings, *saved)
              : linattn::fla::run(op_from_name(op), inputs, settings);
  }
  std::optional<Saved> kept;
  if (saved && !saved->empty()) kept = std::move(saved);
  return {r.o, r.final_state, r.final_z, kept};
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, OptTensor, OptTensor, OptTensor, OptTensor>;

Grads backward(const std::string& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const OptTensor& g, const OptTensor& beta, const OptTensor& initial_state,
               const OptTensor& initial_z, const OptTensor& cu_seqlens, std::optional<double> scale,
               bool normalize, bool qk_l2norm, bool head_first, const at::Tensor& d_o,
               const OptTensor& d_final_state, const OptTensor& d_final_z,
               const std::optional<Saved>& saved) {
  const linattn::fla::Settings settings{scale, true, false, normalize, qk_l2norm, head_first, false};
  const linattn::fla::Inputs inputs{q, k, v, g, beta, initial_state, initial_z, cu_seqlens};
  linattn::fla::Gradients r;
  {
    pybind11::gil_scoped_release no_gil;
    r = saved && *saved
            ? linattn::fla::backward(op_from_name(op), inputs, settings, **saved, d_o,
                                     d_final_state, d_final_z)
            : linattn::fla::backward(op_from_name(op), inputs, settings, d_o, d_final_state,
                                     d_final_z);
  }
  return {r.dq, r.dk, r.dv, r.dg, r.dbeta, r.d_initial_state, r.d_initial_z};
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "linattn's CPU kernels for linattn.torch (use the functions of linattn.torch)";
  pybind11::class_<linattn::fla::SavedForwards, Saved>(
      m, "SavedForwards", "the chunk states a forward kept for its backward (opaque)")
      .def_property_readonly("bytes", &linattn::fla::SavedForwards::bytes,
                             "bytes the saved states hold");
  m.def("forward", &forward,
        "run an fla-style op; returns (o, final_state, final_z, saved): saved (SavedForwards) "
        "holds the chunk states for backward when save is set and the forward is chunked, else None",
        pybind11::arg("op"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("g"), pybind11::arg("beta"), pybind11::arg("initial_state"),
        pybind11::arg("initial_z"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"),
        pybind11::arg("chunked"), pybind11::arg("output_final_state"), pybind11::arg("normalize"),
        pybind11::arg("qk_l2norm"), pybind11::arg("head_first"), pybind11::arg("save") = false,
        pybind11::arg("inplace_final_state") = false);
  m.def("backward", &backward,
        "gradients of an fla-style op (from the forward's SavedForwards when given); returns (dq, dk, dv, dg, dbeta, d_initial_state, d_initial_z)",
        pybind11::arg("op"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("g"), pybind11::arg("beta"), pybind11::arg("initial_state"),
        pybind11::arg("initial_z"), pybind11::arg("cu_seqlens"), pybind11::arg("scale"),
        pybind11::arg("normalize"), pybind11::arg("qk_l2norm"), pybind11::arg("head_first"),
        pybind11::arg("d_o"), pybind11::arg("d_final_state"), pybind11::arg("d_final_z"),
        pybind11::arg("saved") = pybind11::none());
}

// linattn::fla::tensor_view is for libtorch code; instantiated here so the build checks it.
template linattn::TensorView<const float> linattn::fla::tensor_view<const float>(const at::Tensor&, bool);
template linattn::TensorView<double> linattn::fla::tensor_view<double>(const at::Tensor&, bool);
