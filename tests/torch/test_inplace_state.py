"""inplace_final_state: the fused_recurrent_* ops writing the final state over initial_state.

The in-place step must give the bits of the step that returns a new tensor (it is the same
arithmetic; only the destination of the final state differs), in every layout of the state
and for packed sequences; it must tell autograd about the write, and refuse the states it
cannot write over safely.
"""

import pytest
import torch

import linattn.torch as lt
from ops_support import RULES, call, random_inputs

torch.manual_seed(0)
torch.set_num_threads(2)

B, H, K, V = 2, 3, 8, 5
STEPS = 4


def inputs(rule, dtype, Tn, Bn=B, seed=0):
    """q, k, v, g, beta of ops_support.random_inputs and a float64 h0."""
    x = random_inputs(rule, Bn, Tn, H, K, V, 300 + 10 * RULES.index(rule) + seed, dtype)
    return x[:5], x[5]


def token(x, t):
    return None if x is None else x[:, t:t + 1]


def layouts(state):
    """`state` copied into three memory layouts: contiguous, rows with padding, column-major."""
    wide = torch.zeros(*state.shape[:-1], state.shape[-1] + 3, dtype=state.dtype)
    wide[..., :state.shape[-1]] = state
    column_major = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    return {"contiguous": state.clone(), "padded rows": wide[..., :state.shape[-1]],
            "column-major": column_major}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_inplace_decode_gives_the_bits_of_new_state_tensors(rule, dtype):
    (q, k, v, g, beta), h0 = inputs(rule, dtype, STEPS)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    h0 = h0.to(compute)
    for name, state in layouts(h0).items():
        h_new = h0
        address, version = state.data_ptr(), state._version
        with torch.no_grad():
            for t in range(STEPS):
                step = [token(x, t) for x in (q, k, v, g, beta)]
                o_new, h_new = call(rule, "recurrent", *step, initial_state=h_new,
                                    output_final_state=True)
                o_in, h_in = call(rule, "recurrent", *step, initial_state=state,
                                  output_final_state=True, inplace_final_state=True)
                assert h_in is state, f"{name}: the final state is initial_state itself"
                assert torch.equal(o_in, o_new), f"{name}, step {t}: o differs"
                assert torch.equal(state, h_new), f"{name}, step {t}: the state differs"
        assert state.data_ptr() == address and state._version > version, name


@pytest.mark.parametrize("rule", RULES)
def test_inplace_packed_sequences_and_a_prefill(rule):
    # cu_seqlens packs three sequences of 2, 0 and 3 tokens; the chunked form (a prefill) may
    # write in place too, and an empty sequence leaves its state as it was.
    (q, k, v, g, beta), h0 = inputs(rule, torch.float32, 5, Bn=1)
    h0 = torch.cat([h0, h0.flip(1), 2 * h0]).float()  # [3, H, K, V]
    cu = torch.tensor([0, 2, 2, 5])
    for kind in ("recurrent", "chunk"):
        o_new, h_new = call(rule, kind, q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                            output_final_state=True)
        state = h0.clone()
        if kind == "chunk":  # the chunk ops keep fla's signatures; the engine's flag reaches them
            o_in, _ = lt._run(rule, q, k, v, g=g, beta=beta, initial_state=state,
                              cu_seqlens=cu, chunked=True, inplace_final_state=True)
        else:
            o_in, _ = call(rule, kind, q, k, v, g, beta, initial_state=state, cu_seqlens=cu,
                           inplace_final_state=True)
        assert torch.equal(o_in, o_new) and torch.equal(state, h_new), kind
        assert torch.equal(state[1], h0[1]), "the empty sequence keeps its state"


def test_inplace_normalized_linear_attn_writes_both_states():
    (q, k, v, _, _), h0 = inputs("linear_attn", torch.float64, STEPS)
    q, k, v, h0 = q.abs(), k.abs(), v.abs(), h0.abs()  # positive denominators
    z0 = torch.rand(B, 1, H, K, dtype=torch.float64)
    S, z = h0.clone(), z0.clone()
    hn, zn = h0, z0
    with torch.inference_mode():  # in-place writes are allowed there too
        for t in range(STEPS):
            step = [token(x, t) for x in (q, k, v)]
            o_new, (hn, zn) = lt.fused_recurrent_linear_attn(
                *step, initial_state=(hn, zn), output_final_state=True, normalize=True)
            o_in, (h_in, z_in) = lt.fused_recurrent_linear_attn(
                *step, initial_state=(S, z), output_final_state=True, normalize=True,
                inplace_final_state=True)
            assert h_in is S and z_in is z
            assert torch.equal(o_in, o_new) and torch.equal(S, hn) and torch.equal(z, zn)


def test_inplace_write_is_seen_by_autograd():
    # A graph that saved the state's old values must refuse its backward after the write, as
    # after any in-place op of torch (the version counter is bumped).
    (q, k, v, _, _), h0 = inputs("linear_attn", torch.float32, 1)
    state = h0.float()
    w = torch.ones_like(state, requires_grad=True)
    loss = (w * state).sum()  # saves `state` for d loss / d w
    with torch.no_grad():
        lt.fused_recurrent_linear_attn(q, k, v, initial_state=state, inplace_final_state=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_failing_step_leaves_every_head_old_or_new():
    # The documented guarantee: a head is either done (new state) or untouched (old state).
    # Sequence 1's gate at its first token is > 0, which simple_gla refuses.
    (q, k, v, g, _), h0 = inputs("simple_gla", torch.float32, 1)
    h0 = h0.float()
    _, h_new = call("simple_gla", "recurrent", q, k, v, g, None, initial_state=h0,
                    output_final_state=True)
    g = g.clone()
    g[1, 0, 1] = 0.5
    state = h0.clone()
    with pytest.raises((ValueError, RuntimeError), match="gate"):
        call("simple_gla", "recurrent", q, k, v, g, None, initial_state=state,
             inplace_final_state=True)
    for n in range(B):
        for h in range(H):
            assert torch.equal(state[n, h], h0[n, h]) or torch.equal(state[n, h], h_new[n, h])
    assert not torch.equal(state[1, 1], h_new[1, 1]), "the failing head was not written"


def bad(match, rule="linear_attn", exc=(ValueError, TypeError), **kw):
    (q, k, v, g, beta), h0 = inputs(rule, torch.float32, 1)
    kw.setdefault("initial_state", h0.float())
    with pytest.raises(exc, match=match):
        call(rule, "recurrent", q, k, v, g, beta, inplace_final_state=True, **kw)


def test_inplace_refusals():
    _, h0 = inputs("linear_attn", torch.float32, 1)
    bad("needs an initial_state", initial_state=None)
    bad("compute type Float, got Double", initial_state=h0.double())
    bad("compute type Float, got BFloat16", initial_state=h0.bfloat16())
    bad("elements sharing memory", initial_state=h0[:1, :1].float().expand(B, H, K, V))
    bad("needs initial_state as \\(kv_state, z_state\\)", normalize=True)
    with torch.inference_mode():
        frozen = torch.zeros(B, H, K, V)
    bad("inference tensor", initial_state=frozen)
    # a state that shares memory with an input
    (q, k, v, _, _), _ = inputs("linear_attn", torch.float32, 1)
    store = torch.randn(B * H * K * V + q.numel())
    state = store[:B * H * K * V].view(B, H, K, V)
    q_alias = store[B * H * K * V - 4:B * H * K * V - 4 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="shares memory"):
        lt.fused_recurrent_linear_attn(q_alias, k, v, initial_state=state, inplace_final_state=True)
    # with autograd recording, the write would destroy what the backward reads
    q.requires_grad_()
    with pytest.raises(ValueError, match="inplace_final_state is for inference"):
        lt.fused_recurrent_linear_attn(q, k, v, initial_state=h0.float(), inplace_final_state=True)
