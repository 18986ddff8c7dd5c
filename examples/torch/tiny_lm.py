#!/usr/bin/env python3
"""A small PyTorch language model on CPU whose token mixing is linattn.torch's ops: embedding,
per layer q/k/v/gate projections, one fla-style op (chunk_gated_delta_rule in the first layer,
chunk_simple_gla in the second), an output projection and an MLP. The gated delta layer is laid
out as Qwen3-Next's: 4 value heads reading 2 query/key heads (grouped value heads), and betas
2 sigmoid(x) in (0, 2) (fla's allow_neg_eigval: negative eigenvalues). It prefills a prompt with
the chunked ops, keeps each layer's final state, then decodes token by token with the
fused_recurrent_* ops continuing those states (each step writes its state over the last one:
inplace_final_state, no allocation per step), and checks that decoding reproduces the logits
of one prefill over the whole text (to float32 rounding).

    PYTHONPATH=build/test/python python3 examples/torch/tiny_lm.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import linattn.torch as lt


class Mixer(nn.Module):
    """One linear-attention token mixer: `heads` value heads of dimension D reading `qk_heads`
    query/key heads (fewer: grouped value heads, value head h reading query/key head
    h // (heads // qk_heads)); neg_eigval: betas in (0, 2) instead of (0, 1)."""

    def __init__(self, width, heads, rule, qk_heads=None, neg_eigval=False):
        super().__init__()
        self.heads, self.qk_heads = heads, qk_heads or heads
        self.dim, self.rule, self.neg_eigval = width // heads, rule, neg_eigval
        self.qkv = nn.Linear(width, (2 * self.qk_heads + heads) * self.dim, bias=False)
        self.gates = nn.Linear(width, 2 * heads)  # log-decay and beta per value head
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x, state=None, decode=False):
        B, T, _ = x.shape
        # q, k, v are strided slices of one projection: linattn reads them in place.
        qk, v = self.qkv(x).split([2 * self.qk_heads * self.dim, self.heads * self.dim], dim=-1)
        q, k = qk.view(B, T, 2, self.qk_heads, self.dim).unbind(2)
        v = v.view(B, T, self.heads, self.dim)
        a, b = self.gates(x).view(B, T, 2, self.heads).unbind(2)
        g = F.logsigmoid(a + 3)  # log-gates <= 0, mostly close to 0
        beta = torch.sigmoid(b) * (2 if self.neg_eigval else 1)
        # Decoding (under no_grad) updates the carried state tensor in place.
        step = dict(inplace_final_state=True) if decode else {}
        if self.rule == "gated_delta_rule":
            op = lt.fused_recurrent_gated_delta_rule if decode else lt.chunk_gated_delta_rule
            o, state = op(q, k, v, g, beta, initial_state=state,
                          output_final_state=True, use_qk_l2norm_in_kernel=True, **step)
        else:
            op = lt.fused_recurrent_simple_gla if decode else lt.chunk_simple_gla
            o, state = op(q, k, v, g, initial_state=state, output_final_state=True, **step)
        return self.out(o.reshape(B, T, -1)), state


class TinyLM(nn.Module):
    def __init__(self, vocab=256, width=128, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mixers = nn.ModuleList([Mixer(width, heads, "gated_delta_rule", qk_heads=heads // 2,
                                           neg_eigval=True),
                                     Mixer(width, heads, "simple_gla")])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                 nn.Linear(4 * width, width)) for _ in self.mixers])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(2 * len(self.mixers))])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, states=None, decode=False):
        x = self.embed(tokens)
        states = states or [None] * len(self.mixers)
        new_states = []
        for i, (mixer, mlp) in enumerate(zip(self.mixers, self.mlps)):
            y, s = mixer(self.norms[2 * i](x), states[i], decode)
            x = x + y
            x = x + mlp(self.norms[2 * i + 1](x))
            new_states.append(s)
        return self.head(x), new_states


def main():
    torch.manual_seed(0)
    model = TinyLM().eval()
    text = torch.randint(0, 256, (2, 48))
    prompt, rest = text[:, :32], text[:, 32:]
    with torch.no_grad():
        full_logits, _ = model(text)                      # one prefill over everything
        logits, states = model(prompt)                    # prefill the prompt
        steps = []
        for t in range(rest.shape[1]):                    # decode, carrying the states
            step_logits, states = model(rest[:, t:t + 1], states, decode=True)
            steps.append(step_logits)
        decoded = torch.cat([logits] + steps, dim=1)
    err = (decoded - full_logits).abs().max().item()
    print(f"prefill 32 + decode 16 tokens vs one prefill of 48: max |logit difference| = {err:.2e}")
    print("state shapes:", [tuple(s.shape) for s in states])
    assert err < 1e-3, "decoding must reproduce the prefill's logits"
    # Greedy generation from the carried states.
    with torch.no_grad():
        logits, states = model(text)
        token, out = logits[:, -1:].argmax(-1), []
        for _ in range(8):
            out.append(token)
            step_logits, states = model(token, states, decode=True)
            token = step_logits[:, -1:].argmax(-1)
    print("greedy continuation:", torch.cat(out, dim=1).tolist())


if __name__ == "__main__":
    main()
