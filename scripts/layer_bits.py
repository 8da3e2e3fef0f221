#!/usr/bin/env python3
"""The layer's outputs and gradients through ``blazecore_torch.moe_ffn`` on fixed problems, saved to a file, or
compared bit for bit with such a file: run it once under one version of the package and once under another to
show that a kernel change left every bit alone.

Usage: python3 scripts/layer_bits.py save FILE      (or: compare FILE)
Problems: every activation, bf16 and fp16, with and without biases, checkpoint "ab" and "none". Needs a CUDA GPU.
"""

from __future__ import annotations

import sys


def run_all(torch, ops) -> dict:
    out = {}
    acts = ("swiglu", "geglu", "gelu", "silu", "relu2", "swiglu_oai")
    for dt in (torch.bfloat16, torch.float16):
        for act in acts:
            for bias in (False, True):
                for ck in ("ab", "none"):
                    g = torch.Generator(device="cuda").manual_seed(7)
                    L, d, h, E, K = 700, 384, 320, 8, 2
                    R = 2 * h if act in ("swiglu", "geglu", "swiglu_oai") else h
                    x = (torch.randn(L, d, device="cuda", generator=g) * 0.5).to(dt).requires_grad_()
                    w13 = (torch.randn(E, R, d, device="cuda", generator=g) / d ** 0.5).to(dt).requires_grad_()
                    w2 = (torch.randn(E, d, h, device="cuda", generator=g) / h ** 0.5).to(dt).requires_grad_()
                    ids = torch.rand(L, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
                    gates = torch.softmax(torch.randn(L, K, device="cuda", generator=g), 1).requires_grad_()
                    kw = {}
                    if bias:
                        kw["b13"] = (torch.randn(E, R, device="cuda", generator=g) * 0.1).to(dt).requires_grad_()
                        kw["b2"] = (torch.randn(E, d, device="cuda", generator=g) * 0.1).to(dt).requires_grad_()
                    dy = (torch.randn(L, d, device="cuda", generator=g) * 0.5).to(dt)
                    y = ops.moe_ffn(x, w13, w2, gates, ids, activation=act, checkpoint=ck, **kw)
                    leaves = [x, w13, w2, gates, *kw.values()]
                    grads = torch.autograd.grad(y, leaves, dy)
                    key = f"{str(dt)[6:]}/{act}/{'bias' if bias else 'nobias'}/{ck}"
                    out[key] = [y.detach().cpu()] + [t.cpu() for t in grads]
    return out


def main(argv) -> int:
    import blazecore_torch as ops
    import torch

    mode, path = argv[1], argv[2]
    got = run_all(torch, ops)
    if mode == "save":
        torch.save(got, path)
        print(f"saved {len(got)} problems to {path}")
        return 0
    ref = torch.load(path)
    bad = [k for k in ref if any(not torch.equal(a, b) for a, b in zip(ref[k], got[k], strict=True))]
    print(f"{len(ref) - len(bad)} of {len(ref)} problems bit-identical")
    for k in bad:
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(ref[k], got[k], strict=True)]
        print("  differs:", k, "max |diff| of y, grads:", ", ".join(f"{v:.3g}" for v in diffs))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
