"""``zeropp.engine.placement``: the pure rule that places each unit's optimizer side in device, CPU or NVMe memory
from the sizes and the room per tier (``memory_budget``), checked against hand-computed plans; and the tier moves
of ``OptimizerOffload.migrate`` keep every value. The multi-rank runs are in ``test_offload.py``."""

from __future__ import annotations

import pytest
import torch

from zeropp.config import ConfigError
from zeropp.engine.placement import PlacementError, UnitStates, place, rooms, usage
from zeropp.offload.swap import BUFFER_SIZE

MB = 1 << 20


def _units(*mb: int) -> list[UnitStates]:
    """Adam units of ``mb`` MiB of gradient shard each: master and two moments ``3 * mb`` swapped."""
    return [UnitStates(swapped=3 * m * MB, grad=m * MB) for m in mb]


def _staging(units: list[UnitStates], buffers: int) -> int:
    largest = sorted((u.swapped for u in units), reverse=True)[:buffers]
    return sum(largest) + buffers * min(BUFFER_SIZE, max(u.grad for u in units))


def test_all_fits_on_the_device() -> None:
    units = _units(1, 2, 3)
    tiers = place(units, farthest="nvme", room={"device": 24 * MB, "cpu": 0}, buffer_count=2, shared=False)
    assert tiers == ("device",) * 3
    assert usage(tiers, units, buffer_count=2, shared=False) == {"device": 24 * MB, "cpu": 0, "nvme": 0}


def test_spills_to_the_cpu_in_unit_order_first_fit() -> None:
    units = _units(2, 4, 1, 1)  # 8, 16, 4, 4 MiB
    tiers = place(units, farthest="cpu", room={"device": 13 * MB, "cpu": 100 * MB}, buffer_count=4, shared=False)
    # unit 0 (8) fits on the device, unit 1 (16) does not, unit 2 (4) does, unit 3 would make 16 > 13
    assert tiers == ("device", "cpu", "device", "cpu")
    used = usage(tiers, units, buffer_count=4, shared=False)
    assert used == {"device": 12 * MB, "cpu": 20 * MB, "nvme": 0}


def test_spills_to_nvme_counting_the_gradient_shards_and_the_staging() -> None:
    units = _units(4, 4, 4, 4)  # 16 MiB each, 12 swapped
    buffers = 1
    # device: one unit; cpu: the NVMe units' gradients (4 each) and the staging of one unit (12 + 4 buffer) + 1 unit
    room = {"device": 20 * MB, "cpu": 16 * MB + 2 * 4 * MB + 16 * MB}
    tiers = place(units, farthest="nvme", room=room, buffer_count=buffers, shared=False)
    assert tiers == ("device", "cpu", "nvme", "nvme")
    nvme = [units[2], units[3]]
    assert usage(tiers, units, buffer_count=buffers, shared=False) == {
        "device": 16 * MB, "cpu": 16 * MB + 8 * MB + _staging(nvme, buffers), "nvme": 24 * MB}
    assert _staging(nvme, buffers) == 16 * MB
    # one byte less of CPU room: the second unit goes to NVMe too (3 NVMe units: gradients 12, staging 16)
    room["cpu"] -= 1
    assert place(units, farthest="nvme", room=room, buffer_count=buffers, shared=False) == (
        "device", "nvme", "nvme", "nvme")


def test_states_that_fit_nowhere_are_an_error_naming_the_bytes() -> None:
    units = _units(4, 4)
    with pytest.raises(PlacementError) as info:
        place(units, farthest="cpu", room={"device": 16 * MB, "cpu": 10 * MB}, buffer_count=1, shared=False)
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert f"take {16 * MB} bytes per rank of host memory, which has room for {10 * MB}" in message, message
    assert "offload_optimizer.device='cpu'" in message and "raise zero_optimization.zeropp.memory_budget.cpu" in message
    assert 'device="nvme"' in message
    # NVMe takes the states but not their host side: gradients 8 + staging 12 + 4 = 24 MiB
    with pytest.raises(PlacementError, match=f"take {24 * MB} bytes per rank of host memory, which has room for {MB}"):
        place(units, farthest="nvme", room={"device": 0, "cpu": MB}, buffer_count=1, shared=False)


def test_the_offload_blocks_device_is_the_farthest_tier() -> None:
    units = _units(1, 1, 1)
    plenty = {"device": 0, "cpu": 1 << 40}
    assert place(units, farthest="nvme", room=plenty, buffer_count=1, shared=False) == ("cpu",) * 3
    assert place(units, farthest="cpu", room={"device": 8 * MB, "cpu": 1 << 40}, buffer_count=1,
                 shared=False) == ("device", "device", "cpu")
    assert place(units, farthest="device", room={"device": 12 * MB, "cpu": 0}, buffer_count=1,
                 shared=False) == ("device",) * 3
    with pytest.raises(PlacementError, match="bytes per rank of device memory"):
        place(units, farthest="device", room={"device": 12 * MB - 1, "cpu": 1 << 40}, buffer_count=1, shared=False)


def test_a_cpu_compute_device_is_one_pool() -> None:
    """On a CPU compute device "cpu" is the device's memory: units go to "device" or NVMe, and the NVMe units' host
    side is charged to the same pool."""
    units = _units(2, 2, 2)  # 8 MiB each, 6 swapped
    pool = 8 * MB + 2 * 2 * MB + _staging(units[1:], 1)
    tiers = place(units, farthest="nvme", room={"device": pool}, buffer_count=1, shared=True)
    assert tiers == ("device", "nvme", "nvme")
    assert usage(tiers, units, buffer_count=1, shared=True) == {"device": pool, "cpu": 0, "nvme": 12 * MB}
    assert place(units, farthest="cpu", room={"device": 24 * MB}, buffer_count=1, shared=True) == ("device",) * 3


def test_rooms_take_the_budget_less_the_parameter_shards_or_the_measured_free_memory() -> None:
    room, sources = rooms({"device": 100, "cpu": None}, fixed={"device": 30}, free={"device": 7, "cpu": 50},
                          shared=False)
    assert room == {"device": 70, "cpu": 50} and sources == {"device": "budget", "cpu": "measured"}
    room, sources = rooms({"device": 100, "cpu": 80}, fixed={"cpu": 30}, free={"device": 0, "cpu": 0}, shared=True)
    assert room == {"device": 50} and sources == {"device": "budget"}
    room, sources = rooms({"device": None, "cpu": None}, fixed={"cpu": 30}, free={"device": 9, "cpu": 0},
                          shared=True)
    assert room == {"device": 9} and sources == {"device": "measured"}


class _FakeUnit:
    def __init__(self, master: torch.Tensor, grad: torch.Tensor) -> None:
        self.master, self.grad_shard = master, grad


def test_migrate_from_nvme_keeps_every_value_and_deletes_the_regions(tmp_path) -> None:
    from zeropp.config import AioConfig, OffloadOptimizerConfig
    from zeropp.engine.offload import OptimizerOffload

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    sizes = [int(n) for n in torch.randint(1, 3000, (4,), generator=gen)]
    units = [_FakeUnit(torch.randn(n, generator=gen), torch.randn(n, generator=gen)) for n in sizes]
    state = {k: [torch.randn(n, generator=gen) for n in sizes] for k in ("exp_avg", "exp_avg_sq")}
    want = [[u.master.clone(), u.grad_shard.clone(), *(state[k][i].clone() for k in state)]
            for i, u in enumerate(units)]
    config = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), pin_memory=False, buffer_count=2)
    off = OptimizerOffload(config, AioConfig(), device=torch.device("cpu"), numels=sizes, rank=0)
    off.open(sizes, list(state))
    off.attach(units, state)
    off.migrate(units, state, ["device", "nvme", "cpu", "nvme"])
    assert off.tiers == ["device", "nvme", "cpu", "nvme"]
    assert sorted(off.swap.regions) == sorted(f"unit{u}.{k}" for u in (1, 3) for k in ("master", *state))
    with off.resident(units, write=False):
        for i, u in enumerate(units):
            for t, w in zip([u.master, u.grad_shard, *(state[k][i] for k in state)], want[i]):
                assert torch.equal(t, w), i
    assert units[0].master.untyped_storage().nbytes() and not units[1].master.untyped_storage().nbytes()
    seen = list(off.stream(units, write=True))
    assert seen == [0, 1, 2, 3] and units[2].master.untyped_storage().nbytes()
    with pytest.raises(ValueError, match="away from the device"):
        off.migrate(units, state, ["nvme", "nvme", "cpu", "nvme"])
    off.close()
