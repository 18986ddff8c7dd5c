"""What test_ops.py and test_autograd.py share: the ops by (rule, kind), one way to call them
with fla's positional arguments, and reproducible random inputs."""

import torch
import torch.nn.functional as F

import linattn.torch as lt

DELTA = {"delta_rule", "gated_delta_rule", "kda"}
RULES = ["linear_attn", "simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda"]
CHUNK = {"linear_attn": lt.chunk_linear_attn, "simple_gla": lt.chunk_simple_gla,
         "gla": lt.chunk_gla, "delta_rule": lt.chunk_delta_rule,
         "gated_delta_rule": lt.chunk_gated_delta_rule, "kda": lt.chunk_kda}
RECURRENT = {"linear_attn": lt.fused_recurrent_linear_attn,
             "simple_gla": lt.fused_recurrent_simple_gla, "gla": lt.fused_recurrent_gla,
             "delta_rule": lt.fused_recurrent_delta_rule,
             "gated_delta_rule": lt.fused_recurrent_gated_delta_rule,
             "kda": lt.fused_recurrent_kda}
OPS = [(r, kind) for r in RULES for kind in ("chunk", "recurrent")]


def call(rule, kind, q, k, v, g, beta, **kw):
    """The op of (rule, kind) with fla's positional arguments (linear_attn unnormalized unless
    kw says otherwise); returns (o, final_state)."""
    fn = (CHUNK if kind == "chunk" else RECURRENT)[rule]
    if rule == "linear_attn":
        kw.setdefault("normalize", False)
        return fn(q, k, v, **kw)
    if rule == "simple_gla":
        return fn(q, k, v, g, **kw)
    if rule == "gla":
        return fn(q, k, v, g, **kw) if kind == "chunk" else fn(q, k, v, gk=g, **kw)
    if rule == "delta_rule":
        return fn(q, k, v, beta, **kw)
    return fn(q, k, v, g, beta, **kw)


def random_inputs(rule, Bn, Tn, H, K, V, seed, dtype=torch.float64, l2norm=False,
                  positive=False):
    """q, k, v, g, beta (None where the rule takes none) and h0 [B, H, K, V], in the logical
    [B, T, H, D] layout, drawn in float64 from `seed` and cast to dtype. The delta rules get
    unit keys (their write is then a contraction, as fla's users have it) unless the op
    normalizes them itself (l2norm); positive draws |x| for q, k, v (positive features)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.abs() if positive else x

    q, k, v = rnd(Bn, Tn, H, K), rnd(Bn, Tn, H, K), rnd(Bn, Tn, H, V)
    if rule in DELTA and not l2norm:
        k = F.normalize(k, dim=-1)
    g = beta = None
    if rule in ("simple_gla", "gated_delta_rule"):
        g = F.logsigmoid(rnd(Bn, Tn, H) + 2)
    elif rule in ("gla", "kda"):
        g = F.logsigmoid(rnd(Bn, Tn, H, K) + 2)
    if rule in DELTA:
        beta = torch.sigmoid(rnd(Bn, Tn, H))
    h0 = 0.5 * rnd(Bn, H, K, V)
    return [None if x is None else x.to(dtype) for x in (q, k, v, g, beta, h0)]
