"""The partitioned optimizer's step against torch.optim on whole parameters, bit for bit.

The engine steps each unit's master shard: a run of the flat buffer that cuts parameters wherever the ranks' shards
fall. Here the shards of P ranks (P = 2, 3, 5: cuts at odd offsets, parameters of odd sizes) are built as the engine
builds them (``Unit``, with a stand-in for the collectives: building a unit and stepping its shard communicate
nothing), each stepped by its own ``PartitionedOptimizer`` over 4 steps with two parameter groups, and the shards put
back together. The reference is ``torch.optim.AdamW/Adam(fused=True)`` and ``SGD(foreach=False)`` (torch's single-
tensor arithmetic) on the whole parameters.

* Adam/AdamW through the native step (``zeropp.optim.native``, the CPU path): bit-identical. torch's own fused step
  on a piece of a tensor rounds the piece's last ``numel % 8`` elements as its scalar tail, so stepping shards with it
  differs from the whole-tensor step in about 1% of the elements by rounding (the last test); the native step is
  given each piece's share of its parameter's tail.
* SGD through torch's foreach step: bit-identical (no position-dependent rounding).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zeropp.config import OptimizerConfig
from zeropp.engine import optimizer as zopt
from zeropp.engine.unit import Unit
from zeropp.optim import native

SIZES = [(37, 5), (1,), (1023,), (64, 3), (4099,), (7, 7)]
GROUP_HYPER = [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0}]
KINDS = {
    "AdamW": ({"type": "AdamW", "params": {"betas": (0.9, 0.95), "eps": 1e-8}}, torch.optim.AdamW, {"fused": True}),
    "Adam": ({"type": "Adam", "params": {"betas": (0.8, 0.999), "eps": 1e-6, "adam_w_mode": False}},
             torch.optim.Adam, {"fused": True}),
    "SGD": ({"type": "SGD", "params": {"momentum": 0.9, "dampening": 0.1}}, torch.optim.SGD, {"foreach": False}),
    "SGDNesterov": ({"type": "SGD", "params": {"momentum": 0.5, "nesterov": True}}, torch.optim.SGD,
                    {"foreach": False}),
}


def _comm(world: int, rank: int) -> SimpleNamespace:
    """What ``Unit`` reads of ``Collectives`` when it is built without a broadcast and stepped."""
    return SimpleNamespace(world_size=world, rank=rank, alignment=1, hpz=1, error_feedback=False, weight_bits=None)


def _run(kind: str, world: int, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the engine's whole masters after 4 steps, torch.optim's whole parameters after the same 4 steps)."""
    config, torch_class, torch_flags = KINDS[kind]
    whole = [torch.randn(*shape, generator=gen) for shape in SIZES]
    grads = [[10 * torch.randn(*shape, generator=gen) for shape in SIZES] for _ in range(4)]
    ref = [nn.Parameter(w.clone()) for w in whole]
    group_of = [i % 2 for i in range(len(SIZES))]
    params = {key: value for key, value in config["params"].items() if key != "adam_w_mode"}
    ref_opt = torch_class([{"params": [p for p, g in zip(ref, group_of) if g == k], **GROUP_HYPER[k]}
                           for k in range(2)], **params, **torch_flags)
    for step in range(4):
        for p, g in zip(ref, grads[step]):
            p.grad = g.clone()
        ref_opt.step()
    masters = [torch.empty(w.numel()) for w in whole]
    for rank in range(world):
        model = [nn.Parameter(w.clone()) for w in whole]
        unit = Unit("", [(f"p{i}", p) for i, p in enumerate(model)], _comm(world, rank), sharded=False,
                    broadcast=False)
        opt = zopt.PartitionedOptimizer(
            OptimizerConfig(type=config["type"], params={**zopt_defaults(config["type"]), **config["params"]}),
            [unit], [{"params": [p for p, g in zip(model, group_of) if g == k], **GROUP_HYPER[k]} for k in range(2)])
        for step in range(4):
            unit.grad_shard.zero_()
            for i, a, b in unit.param_ranges():
                lo = unit.start + a - unit.offsets[i]
                unit.grad_shard[a:b] = grads[step][i].reshape(-1)[lo : lo + b - a]
            opt.step(after=Unit.publish_shard)
        for i, a, b in unit.param_ranges():
            lo = unit.start + a - unit.offsets[i]
            masters[i][lo : lo + b - a] = unit.master[a:b]
            assert torch.equal(unit.shard[a:b], unit.master[a:b]), "the compute shard was not published"
    return [m.view(w.shape) for m, w in zip(masters, whole)], [p.detach() for p in ref]


def zopt_defaults(kind: str) -> dict:
    return {"AdamW": {"weight_decay": 0.0}, "Adam": {"weight_decay": 0.0},
            "SGD": {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}}[kind] | (
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "adam_w_mode": True} if kind != "SGD" else {"lr": 1e-3})


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("kind", list(KINDS))
def test_sharded_steps_are_bit_identical_to_torch_optim_on_whole_parameters(kind: str, world: int) -> None:
    if kind.startswith("Adam") and not native.available():
        pytest.skip(f"native CPU library not built: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    got, want = _run(kind, world, gen)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (kind, world, SIZES[i], (g - w).abs().max().item())


def test_torch_fused_on_pieces_is_not_the_whole_tensor_step() -> None:
    """Why the engine steps Adam natively on the CPU: torch's fused step on pieces of a tensor differs from its step on
    the whole tensor (the pieces' own scalar tails), here measured on random cuts; the native step with
    ``tail_in_piece`` does not (test above). Without a native library the engine uses torch's step on its pieces,
    which differs from the whole-tensor step by rounding (an ulp of an element's update) where it does."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    n = 100_003
    p, m, v = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)
    grad = 10 * torch.randn(n, generator=gen)

    def step(cuts: list[int]) -> torch.Tensor:
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        pieces = list(zip([0, *cuts], [*cuts, n]))
        zopt._adam([pp[a:b] for a, b in pieces], [grad[a:b] for a, b in pieces], [mm[a:b] for a, b in pieces],
                   [vv[a:b] for a, b in pieces], {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8,
                                                  "weight_decay": 0.1}, 3, True)
        return pp

    whole = step([])
    cut = step(sorted(torch.randperm(n - 1, generator=gen)[:2000].add(1).tolist()))
    differ = (cut != whole).sum().item()
    assert 0 < differ < 0.05 * n, differ
    assert (cut - whole).abs().max() <= 2**-20 * whole.abs().max()  # rounding-level: an ulp of the update
