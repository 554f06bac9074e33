"""zeropp.engine.policy: units of a model and the owner of each parameter (single process, no communication)."""

from __future__ import annotations

import pytest
from torch import nn

from zeropp.engine import default_unit_modules, plan_units, units_of_type
from zeropp.models import GPT, GPTConfig
from zeropp.models.gpt import Block


def names(plan):
    return [n for n, _ in plan.params]


def test_gpt_default_units():
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    assert default_unit_modules(model) == list(model.blocks)
    plans = plan_units(model)
    assert [p.name for p in plans] == ["", "blocks.0", "blocks.1"]
    root = plans[0]
    assert root.module is model
    # the head is tied to the token embedding: one parameter, in the root unit, under its first name
    assert names(root) == ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    assert names(plans[1])[0] == "blocks.0.ln_1.weight" and all(n.startswith("blocks.0.") for n in names(plans[1]))
    # every trainable parameter in exactly one unit
    owned = [id(p) for plan in plans for _, p in plan.params]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


def test_policy_by_type_and_frozen():
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    model.wpe.weight.requires_grad_(False)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    plans = plan_units(model, units_of_type(Block, nn.LayerNorm))
    # nested units: block 0's LayerNorms are units of their own; a fully frozen block is a unit of frozen parameters
    assert [p.name for p in plans] == ["", "blocks.0", "blocks.0.ln_1", "blocks.0.ln_2", "blocks.1", "blocks.1.ln_1",
                                       "blocks.1.ln_2", "ln_f"]
    assert names(plans[0]) == ["wte.weight"]
    assert [n for n, _ in plans[0].frozen] == ["wpe.weight"]
    assert "blocks.0.ln_1.weight" not in names(plans[1]) and "blocks.0.attn.c_attn.weight" in names(plans[1])
    frozen_block = plans[4]
    assert frozen_block.params == [] and [n for n, _ in frozen_block.frozen] == [
        n for n, _ in model.blocks[1].named_parameters(prefix="blocks.1") if ".ln_" not in n]
    # every parameter, trainable or frozen, in exactly one unit
    owned = [id(p) for plan in plans for _, p in plan.params + plan.frozen]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())
    with pytest.raises(ValueError, match="at least one"):
        units_of_type()


class Shared(nn.Module):
    """Two ModuleList children sharing one Linear, and a nested ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(2, 2)
        self.layers = nn.ModuleList([nn.Sequential(shared, nn.Linear(2, 2)), nn.Sequential(shared)])
        self.layers[0].append(nn.ModuleList([nn.Linear(2, 2)]))
        self.out = nn.Linear(2, 1)


def test_shared_across_units_goes_to_root_and_nested_lists_stay_inside():
    model = Shared()
    assert default_unit_modules(model) == list(model.layers)  # the nested ModuleList is inside layers.0
    plans = plan_units(model)
    assert [p.name for p in plans] == ["", "layers.0"]  # layers.1 holds only the shared Linear
    assert names(plans[0]) == ["layers.0.0.weight", "layers.0.0.bias", "out.weight", "out.bias"]
    assert names(plans[1]) == ["layers.0.1.weight", "layers.0.1.bias", "layers.0.2.0.weight", "layers.0.2.0.bias"]


def test_bad_policy():
    model = Shared()
    with pytest.raises(ValueError, match="not a submodule"):
        plan_units(model, lambda m: [nn.Linear(1, 1)])
    with pytest.raises(TypeError, match="not an nn.Module"):
        plan_units(model, lambda m: ["layers"])
