"""flash-linear-attention's operations on CPU tensors, computed by linattn.

Every function takes fla's arguments with fla's names and defaults and returns fla's
``(o, final_state)``: q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` (``head_first=True``: ``[B, H,
T, D]``), float32, float64, bfloat16 or float16; ``scale=None`` means ``K ** -0.5``;
``initial_state`` / ``final_state`` ``[N, H, K, V]`` (float32, float64 for float64 inputs);
grouped value heads as in fla: v ``[B, T, HV, V]`` with HV a multiple of H, value head h reading
query/key head ``h // (HV // H)``, and then o, gates, betas and states have HV heads;
``cu_seqlens`` packs N sequences along T with B = 1. See docs/pytorch.md for the formulas and
where linattn's semantics differ from fla's. The fused_recurrent_* ops also take
``inplace_final_state=True`` (as vLLM's fla ops do): the final state is written over
``initial_state`` instead of a new tensor, for decoding without a state allocation per step.

Autograd: every op has gradients (linattn's chunked backward, O(T K V) per sequence and head)
for q, k, v, the gates g (and g_gamma, through the sum), beta, initial_state (and z), with the
final state's gradient carried in when the loss uses it; through the in-kernel L2 norm of
use_qk_l2norm_in_kernel too. Gradients are computed in float32 (float64 for float64 inputs) and
returned in each input's dtype. Double backward is not supported.

Saved forward: when autograd will need the gradients (grad mode on, an input requiring grad), a
chunk_* op keeps its chunk-boundary states for the backward, which then skips the sweep that
rebuilds them (the same gradients, bit for bit; a training step costs less). They cost about
(K V + K) / 32 scalars per token and head (2 KiB at K = V = 128 in float32; 5 KiB for the delta
rules) until the backward has run, which frees them. ``set_saved_forward(False)`` turns this off
(the backward then rebuilds the states, as the fused_recurrent_* ops' backward always does).
"""

from typing import Optional, Tuple, Union

import torch

from . import _ext

__all__ = [
    "set_saved_forward", "saved_forward_enabled",
    "chunk_linear_attn", "fused_recurrent_linear_attn",
    "chunk_simple_gla", "fused_recurrent_simple_gla",
    "chunk_retention", "fused_recurrent_retention",
    "chunk_gla", "fused_recurrent_gla",
    "chunk_delta_rule", "fused_recurrent_delta_rule",
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_kda", "fused_recurrent_kda",
]

_Tensor = torch.Tensor
_State = Union[_Tensor, Tuple[_Tensor, _Tensor]]


_saving = True


def set_saved_forward(enabled: bool) -> bool:
    """Whether chunk_* ops keep their chunk states for the backward (the default, True) or let
    the backward rebuild them (False: less memory between forward and backward, a slower
    backward); returns the previous setting. The gradients are the same either way."""
    global _saving
    previous, _saving = _saving, bool(enabled)
    return previous


def saved_forward_enabled() -> bool:
    """The setting of set_saved_forward."""
    return _saving


class _Spec:
    """The non-tensor arguments of one call (kept on the autograd context)."""

    def __init__(self, rule, scale, chunked, output_final_state, normalize, qk_l2norm,
                 head_first, save):
        self.rule = rule
        self.scale = scale
        self.chunked = chunked
        self.output_final_state = output_final_state
        self.normalize = normalize
        self.qk_l2norm = qk_l2norm
        self.head_first = head_first
        self.save = save  # keep the chunk states for the backward


def _cast(grad, like):
    return None if grad is None or like is None else grad.to(like.dtype)


class _Op(torch.autograd.Function):
    """One op as an autograd node: forward and backward are linattn's kernels (_ext)."""

    @staticmethod
    def forward(ctx, spec, q, k, v, g, beta, h0, z0, cu_seqlens):
        o, ht, zt, saved = _ext.forward(spec.rule, q, k, v, g, beta, h0, z0, cu_seqlens,
                                        spec.scale, spec.chunked, spec.output_final_state,
                                        spec.normalize, spec.qk_l2norm, spec.head_first,
                                        spec.save)
        ctx.spec = spec
        ctx.saved_forwards = saved  # the chunk states (_ext.SavedForwards) or None
        ctx.save_for_backward(q, k, v, g, beta, h0, z0, cu_seqlens)
        return o, ht, zt

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht, dzt):
        """Gradients of (spec, q, k, v, g, beta, initial_state, initial_z, cu_seqlens), each in
        its input's dtype; dht and dzt (the final states' gradients) are None when unused."""
        q, k, v, g, beta, h0, z0, cu_seqlens = ctx.saved_tensors
        s = ctx.spec
        # The saved states are used once and freed here: the node (and so the context) may
        # live on after the backward, e.g. while the caller holds o. A second backward through
        # a retained graph rebuilds the states (the same gradients).
        saved, ctx.saved_forwards = ctx.saved_forwards, None
        dq, dk, dv, dg, dbeta, dh0, dz0 = _ext.backward(
            s.rule, q, k, v, g, beta, h0, z0, cu_seqlens, s.scale, s.normalize, s.qk_l2norm,
            s.head_first, do, dht, dzt, saved)
        return (None, _cast(dq, q), _cast(dk, k), _cast(dv, v), _cast(dg, g), _cast(dbeta, beta),
                _cast(dh0, h0), _cast(dz0, z0), None)


def _run(rule, q, k, v, g=None, beta=None, scale=None, initial_state=None,
         output_final_state=False, normalize=False, qk_l2norm=False, cu_seqlens=None,
         head_first=False, chunked=True, reverse=False, inplace_final_state=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linattn.torch: {name} must be a torch.Tensor, got {type(t).__name__}")
    if reverse:
        # Each sequence read from its last token to its first: the op on the sequences flipped
        # along T (one gather, differentiable by PyTorch), its output flipped back.
        time_dim = 2 if head_first else 1
        order = _reversed_order(q.shape[time_dim] if q.dim() == 4 else 0, cu_seqlens)
        flip = lambda x: None if x is None else x.index_select(time_dim, order)  # noqa: E731
        o, state = _run(rule, flip(q), flip(k), flip(v), flip(g), flip(beta), scale,
                        initial_state, output_final_state, normalize, qk_l2norm, cu_seqlens,
                        head_first, chunked, inplace_final_state=inplace_final_state)
        return flip(o), state
    h0, z0 = initial_state, None
    if isinstance(initial_state, (tuple, list)):
        if not normalize or len(initial_state) != 2:
            raise ValueError("linattn.torch: a (kv_state, z_state) initial_state is for "
                             "linear_attn with normalize=True")
        h0, z0 = initial_state
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if inplace_final_state:
        return _run_inplace(rule, q, k, v, g, beta, h0, z0, cu_seqlens, float(scale), chunked,
                            output_final_state, normalize, qk_l2norm, head_first)
    # Keep the chunk states only when autograd will call the backward.
    save = (_saving and chunked and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad
                    for t in (q, k, v, g, beta, h0, z0)))
    spec = _Spec(rule, float(scale), chunked, bool(output_final_state), normalize, qk_l2norm,
                 head_first, save)
    o, ht, zt = _Op.apply(spec, q, k, v, g, beta, h0, z0, cu_seqlens)
    if not output_final_state:
        return o, None
    return o, ((ht, zt) if normalize else ht)


def _run_inplace(rule, q, k, v, g, beta, h0, z0, cu_seqlens, scale, chunked, output_final_state,
                 normalize, qk_l2norm, head_first):
    """The forward writing its final state over initial_state (a decode step that allocates no
    state tensor): outside autograd, since the write destroys what a backward would read."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v, g, beta, h0, z0)):
        raise ValueError("linattn.torch: inplace_final_state is for inference: call it under "
                         "torch.no_grad() or torch.inference_mode(), or with inputs that do not "
                         "require grad")
    o, ht, zt, _ = _ext.forward(rule, q, k, v, g, beta, h0, z0, cu_seqlens, scale, chunked,
                                output_final_state, normalize, qk_l2norm, head_first,
                                inplace_final_state=True)
    if not output_final_state:
        return o, None
    return o, ((h0, z0) if normalize else h0)  # ht and zt are these tensors


def _reversed_order(T, cu_seqlens):
    """Indices along T that reverse every sequence in place (all of T without cu_seqlens);
    checks cu_seqlens as the kernels do, since the order is built before they see it."""
    if cu_seqlens is None:
        return torch.arange(T - 1, -1, -1)
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1
            or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2):
        raise ValueError("linattn: cu_seqlens must be a 1-D int32/int64 CPU tensor with at least "
                         "2 entries")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"linattn: cu_seqlens must start at 0 and end at T={T}, got "
                         f"{bounds[0]} ... {bounds[-1]}")
    if any(a > e for a, e in zip(bounds[:-1], bounds[1:])):
        raise ValueError("linattn: cu_seqlens must not decrease")
    return torch.cat([torch.arange(e - 1, a - 1, -1) for a, e in zip(bounds[:-1], bounds[1:])])


def chunk_linear_attn(q: _Tensor, k: _Tensor, v: _Tensor, scale: Optional[float] = None,
                      initial_state: Optional[_State] = None, output_final_state: bool = False,
                      normalize: bool = True, cu_seqlens: Optional[_Tensor] = None,
                      head_first: bool = False):
    """o_t = scale q_t^T S_t, S_t = S_{t-1} + k_t v_t^T; normalize: o_t = q_t^T S_t / (q_t^T z_t
    + 1e-10 / scale), z_t = z_{t-1} + k_t, and states are (S, z) tuples ([N, 1, H, K] for z)."""
    return _run("linear_attn", q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, normalize=normalize,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=True)


def fused_recurrent_linear_attn(q: _Tensor, k: _Tensor, v: _Tensor, scale: Optional[float] = None,
                                initial_state: Optional[_State] = None,
                                output_final_state: bool = False, reverse: bool = False,
                                normalize: bool = False, cu_seqlens: Optional[_Tensor] = None,
                                head_first: bool = False, inplace_final_state: bool = False):
    """chunk_linear_attn token by token (normalize defaults to False, as in fla); reverse=True
    reads every sequence from its last token to its first (o_t then covers tokens t..end, and
    the final state is the one after the first token).
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    return _run("linear_attn", q, k, v, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, normalize=normalize,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=False, reverse=reverse,
                inplace_final_state=inplace_final_state)


def _simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
                head_first, chunked, reverse=False, inplace_final_state=False):
    if g_gamma is not None:
        H = v.shape[1] if head_first else v.shape[2]  # one per value head
        if g_gamma.shape != (H,):
            raise ValueError(f"linattn.torch: g_gamma must have shape [HV] = [{H}] (one per "
                             f"value head), got {list(g_gamma.shape)}")
        gamma = g_gamma.view(1, H, 1) if head_first else g_gamma.view(1, 1, H)
        g = gamma.expand(*v.shape[:3]) if g is None else g + gamma
    if g is None:  # no gate: fla's simple_gla is then unnormalized linear attention
        return _run("linear_attn", q, k, v, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    head_first=head_first, chunked=chunked, reverse=reverse,
                    inplace_final_state=inplace_final_state)
    return _run("simple_gla", q, k, v, g=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                head_first=head_first, chunked=chunked, reverse=reverse,
                inplace_final_state=inplace_final_state)


def chunk_simple_gla(q: _Tensor, k: _Tensor, v: _Tensor, g: Optional[_Tensor] = None,
                     g_gamma: Optional[_Tensor] = None, scale: Optional[float] = None,
                     initial_state: Optional[_Tensor] = None, output_final_state: bool = False,
                     cu_seqlens: Optional[_Tensor] = None, head_first: bool = False):
    """S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale q_t^T S_t; g [B, T, H] log-gates <= 0,
    g_gamma [H] a constant log-gate per head (added to g)."""
    return _simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, head_first, True)


def fused_recurrent_simple_gla(q: _Tensor, k: _Tensor, v: _Tensor, g: Optional[_Tensor] = None,
                               g_gamma: Optional[_Tensor] = None, scale: Optional[float] = None,
                               initial_state: Optional[_Tensor] = None,
                               output_final_state: bool = False, reverse: bool = False,
                               cu_seqlens: Optional[_Tensor] = None, head_first: bool = False,
                               inplace_final_state: bool = False):
    """chunk_simple_gla token by token; reverse=True reads every sequence backwards (as in
    fused_recurrent_linear_attn).
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    return _simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                       cu_seqlens, head_first, False, reverse, inplace_final_state)


def _retention_g_gamma(q, v, head_first):
    """RetNet's fixed decays, one per head as fla's retention ops take them: gamma_h =
    1 - 2^(-5 - h), as log-gates log(gamma_h) in float64 for float64 inputs, else float32."""
    H, HV = (q.shape[1], v.shape[1]) if head_first else (q.shape[2], v.shape[2])
    if HV != H:
        raise ValueError(f"linattn.torch: the retention ops have one decay per query head and "
                         f"no grouped value heads: q has {H} heads, v {HV}")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(H, dtype=dtype)))


def chunk_retention(q: _Tensor, k: _Tensor, v: _Tensor, scale: Optional[float] = None,
                    initial_state: Optional[_Tensor] = None, output_final_state: bool = False,
                    cu_seqlens: Optional[_Tensor] = None, head_first: bool = False):
    """RetNet's retention (Sun et al. 2023): S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = scale
    q_t^T S_t, with the fixed decay gamma_h = 1 - 2^(-5 - h) of head h; chunk_simple_gla with
    g_gamma = log(gamma), as in fla."""
    return _simple_gla(q, k, v, None, _retention_g_gamma(q, v, head_first), scale,
                       initial_state, output_final_state, cu_seqlens, head_first, True)


def fused_recurrent_retention(q: _Tensor, k: _Tensor, v: _Tensor, scale: Optional[float] = None,
                              initial_state: Optional[_Tensor] = None,
                              output_final_state: bool = False, reverse: bool = False,
                              cu_seqlens: Optional[_Tensor] = None, head_first: bool = False,
                              inplace_final_state: bool = False):
    """chunk_retention token by token; reverse=True reads every sequence backwards (as in
    fused_recurrent_linear_attn).
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    return _simple_gla(q, k, v, None, _retention_g_gamma(q, v, head_first), scale,
                       initial_state, output_final_state, cu_seqlens, head_first, False,
                       reverse, inplace_final_state)


def chunk_gla(q: _Tensor, k: _Tensor, v: _Tensor, g: _Tensor, scale: Optional[float] = None,
              initial_state: Optional[_Tensor] = None, output_final_state: bool = False,
              cu_seqlens: Optional[_Tensor] = None, head_first: bool = False):
    """S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale q_t^T S_t; g [B, T, H, K]
    per-key-channel log-gates <= 0."""
    return _run("gla", q, k, v, g=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                head_first=head_first, chunked=True)


def fused_recurrent_gla(q: _Tensor, k: _Tensor, v: _Tensor, gk: Optional[_Tensor] = None,
                        gv: Optional[_Tensor] = None, scale: Optional[float] = None,
                        initial_state: Optional[_Tensor] = None, output_final_state: bool = False,
                        reverse: bool = False, cu_seqlens: Optional[_Tensor] = None,
                        head_first: bool = False, inplace_final_state: bool = False):
    """chunk_gla token by token, the gates named gk as in fla; gv (value-channel gates) is not
    supported; reverse=True reads every sequence backwards (as in fused_recurrent_linear_attn).
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    if gv is not None:
        raise NotImplementedError("linattn.torch: value-channel gates gv are not supported "
                                  "(linattn gates the key channels of S)")
    if gk is None:
        return _run("linear_attn", q, k, v, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    head_first=head_first, chunked=False, reverse=reverse,
                    inplace_final_state=inplace_final_state)
    return _run("gla", q, k, v, g=gk, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                head_first=head_first, chunked=False, reverse=reverse,
                inplace_final_state=inplace_final_state)


def _ones_beta(v):
    """beta = 1 for every value head and token ([B, T, HV], or [B, HV, T] head-first)."""
    return torch.ones(v.shape[:3], dtype=v.dtype)


def chunk_delta_rule(q: _Tensor, k: _Tensor, v: _Tensor, beta: _Tensor,
                     scale: Optional[float] = None, initial_state: Optional[_Tensor] = None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                     cu_seqlens: Optional[_Tensor] = None, head_first: bool = False):
    """S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale q_t^T S_t; beta
    [B, T, H] in [0, 2] (above 1: negative eigenvalues, fla's allow_neg_eigval layers pass
    2 sigmoid(x)); use_qk_l2norm_in_kernel: q, k <- x / sqrt(|x|^2 + 1e-6) first."""
    return _run("delta_rule", q, k, v, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=True)


def fused_recurrent_delta_rule(q: _Tensor, k: _Tensor, v: _Tensor, beta: Optional[_Tensor] = None,
                               scale: Optional[float] = None,
                               initial_state: Optional[_Tensor] = None,
                               output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Optional[_Tensor] = None, head_first: bool = False,
                               inplace_final_state: bool = False):
    """chunk_delta_rule token by token; beta=None means beta = 1 (as in fla).
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    if beta is None:
        beta = _ones_beta(v)
    return _run("delta_rule", q, k, v, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=False,
                inplace_final_state=inplace_final_state)


def chunk_gated_delta_rule(q: _Tensor, k: _Tensor, v: _Tensor, g: _Tensor, beta: _Tensor,
                           scale: Optional[float] = None, initial_state: Optional[_Tensor] = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[_Tensor] = None, head_first: bool = False):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = scale q_t^T S_t;
    g [B, T, H] log-gates (log alpha) <= 0, beta [B, T, H] in [0, 2]."""
    return _run("gated_delta_rule", q, k, v, g=g, beta=beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                head_first=head_first, chunked=True)


def fused_recurrent_gated_delta_rule(q: _Tensor, k: _Tensor, v: _Tensor,
                                     g: Optional[_Tensor] = None, beta: Optional[_Tensor] = None,
                                     scale: Optional[float] = None,
                                     initial_state: Optional[_Tensor] = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: Optional[_Tensor] = None,
                                     head_first: bool = False, inplace_final_state: bool = False):
    """chunk_gated_delta_rule token by token; g=None means no decay, beta=None beta = 1.
    inplace_final_state=True writes the final state over initial_state (a decode step without
    a new state tensor; for inference only, see docs/pytorch.md)."""
    if beta is None:
        beta = _ones_beta(v)
    if g is None:
        return _run("delta_rule", q, k, v, beta=beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens, head_first=head_first, chunked=False,
                    inplace_final_state=inplace_final_state)
    return _run("gated_delta_rule", q, k, v, g=g, beta=beta, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state,
                qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                head_first=head_first, chunked=False, inplace_final_state=inplace_final_state)


# fla's chunk_kda options that linattn does not take, with the value that means "off".
_KDA_OFF = {"use_gate_in_kernel": False, "use_beta_sigmoid_in_kernel": False, "A_log": None,
            "dt_bias": None, "lower_bound": None, "safe_gate": False, "allow_neg_eigval": False,
            "transpose_state_layout": False, "state_v_first": False,
            "return_intermediate_states": False, "cu_seqlens_cpu": None, "cp_context": None}


def _check_kda_options(options):
    """Refuses fla's in-kernel gate and beta transforms (pass the log-gates and betas they
    would compute), other state layouts and unknown keywords; chunk_size, disable_recompute
    only tune fla's kernels and are ignored."""
    for name, value in options.items():
        if name in ("chunk_size", "disable_recompute"):
            continue
        if name not in _KDA_OFF:
            raise TypeError(f"linattn.torch: unexpected keyword argument {name!r}")
        off = _KDA_OFF[name]
        if (value is not None) if off is None else bool(value):
            raise NotImplementedError(
                f"linattn.torch: {name}={value!r} is not supported: pass g as the log-gates "
                "(<= 0, [B, T, H, K]) and beta as the write strengths ([0, 2], [B, T, H]) that "
                "fla's kernel would compute, with the state as [N, H, K, V]")


def chunk_kda(q: _Tensor, k: _Tensor, v: _Tensor, g: _Tensor, beta: _Tensor,
              scale: Optional[float] = None, initial_state: Optional[_Tensor] = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: Optional[_Tensor] = None, head_first: bool = False, **options):
    """Kimi Delta Attention: S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t
    v_t^T, o_t = scale q_t^T S_t; g [B, T, H, K] per-key-channel log-gates (log alpha) <= 0,
    beta [B, T, H] in [0, 2]. fla's in-kernel gate (use_gate_in_kernel, A_log, dt_bias,
    lower_bound) and beta sigmoid are not taken (NotImplementedError): compute them in PyTorch
    first."""
    _check_kda_options(options)
    return _run("kda", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=True)


def fused_recurrent_kda(q: _Tensor, k: _Tensor, v: _Tensor, g: _Tensor,
                        beta: Optional[_Tensor] = None, scale: Optional[float] = None,
                        initial_state: Optional[_Tensor] = None, output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = False,
                        cu_seqlens: Optional[_Tensor] = None, head_first: bool = False,
                        inplace_final_state: bool = False, **options):
    """chunk_kda token by token; beta=None means beta = 1. inplace_final_state=True writes the
    final state over initial_state (a decode step without a new state tensor; for inference
    only, see docs/pytorch.md)."""
    _check_kda_options(options)
    if beta is None:
        beta = _ones_beta(v)
    return _run("kda", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, qk_l2norm=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, head_first=head_first, chunked=False,
                inplace_final_state=inplace_final_state)
