"""The partitioned optimizer's step against torch.optim on whole tensors, bit for bit.

The engine steps each parameter group's segments (runs of a unit's master shard, cut wherever the shards and the
parameters fall) in one call of torch's functional fused Adam/AdamW or foreach SGD. The reference here is
``torch.optim.AdamW/Adam(fused=True)`` and ``SGD(foreach=False)`` (the single-tensor arithmetic: an independent
implementation) stepping the whole tensors; the cuts are random offsets, so blocks of the kernels' vector loops land
anywhere, and several steps make the bias corrections differ.
"""

from __future__ import annotations

import pytest
import torch

from zeropp.engine import optimizer as zopt


def _cuts(n: int, pieces: int, gen: torch.Generator) -> list[int]:
    inner = torch.randperm(n - 1, generator=gen)[: pieces - 1].add(1).sort().values.tolist()
    return [0, *inner, n]


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "AdamL2", "SGD", "SGDNesterov", "SGDDampened"])
def test_segments_step_bit_identical_to_torch_optim_on_whole_tensors(kind: str) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    sizes = [1, 7, 1023, 4099, 100_003]
    groups = [{"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "adam_w_mode": True,
               "momentum": 0.9, "dampening": 0.0, "nesterov": False},
              {"lr": 1e-2, "betas": (0.8, 0.999), "eps": 1e-6, "weight_decay": 0.0, "adam_w_mode": True,
               "momentum": 0.5, "dampening": 0.0, "nesterov": False}]
    if kind == "AdamL2":
        for g in groups:
            g["adam_w_mode"], g["weight_decay"] = False, 0.05
    if kind == "SGDNesterov":
        for g in groups:
            g["nesterov"] = True
    if kind == "SGDDampened":
        for g in groups:
            g["dampening"] = 0.3
    whole = [torch.randn(n, generator=gen) for n in sizes]
    group_of = [i % 2 for i in range(len(sizes))]
    ref_params = [torch.nn.Parameter(w.clone()) for w in whole]
    ref_groups = [{"params": [p for p, g in zip(ref_params, group_of) if g == k],
                   **{h: v for h, v in groups[k].items() if h in zopt._HYPER[kind.replace("L2", "")
                                                                          .replace("Nesterov", "")
                                                                          .replace("Dampened", "")]
                      and h != "adam_w_mode"}} for k in range(2)]
    if kind == "AdamW":
        ref = torch.optim.AdamW(ref_groups, fused=True)
    elif kind in ("Adam", "AdamL2"):
        ref = torch.optim.Adam(ref_groups, fused=True, decoupled_weight_decay=kind == "Adam")
    else:
        ref = torch.optim.SGD(ref_groups, foreach=False)

    masters = [w.clone() for w in whole]
    cuts = [_cuts(n, min(n, 5), gen) for n in sizes]
    state = {k: [torch.zeros(n) for n in sizes] for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")}
    for step in range(1, 5):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        for k in range(2):
            segs = [(i, a, b) for i in range(len(sizes)) if group_of[i] == k
                    for a, b in zip(cuts[i], cuts[i][1:])]
            params = [masters[i][a:b] for i, a, b in segs]
            gs = [grads[i][a:b] for i, a, b in segs]
            view = {s: [state[s][i][a:b] for i, a, b in segs] for s in state}
            if kind.startswith("SGD"):
                zopt._sgd(params, gs, view["momentum_buffer"], groups[k], first=step == 1)
            else:
                zopt._adam(params, gs, view["exp_avg"], view["exp_avg_sq"], groups[k], step,
                           decoupled=kind != "AdamL2")
        for i, p in enumerate(ref_params):
            assert torch.equal(masters[i], p.detach()), (kind, step, sizes[i],
                                                         (masters[i] - p.detach()).abs().max().item())
    assert not torch.equal(masters[-1], whole[-1]), "the step changed nothing: the test is stale"
