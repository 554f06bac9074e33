"""The checkpoint format across releases (issue 20, part 4), against the committed fixture
``fixtures/checkpoint_v2``: a stage-3 checkpoint of 2 ranks written by zeropp 715c8fd (the ``ShardedTensor``
writer) with the values it must restore (``expected.pt``, taken from the engine that saved it; see
``fixtures/make_checkpoint_fixture.py``).

* Old -> new: the current code loads it at world 2 (``latest`` and the explicit older tag), 4 and 1 (one launch of
  4 gloo processes, subgroups for 2 and 1), and restores every value exactly: fp32 masters, the frozen matrix, the
  buffer, the tied alias, both Adam moments, counters, per-group steps and hyperparameters, the scheduler, the
  client state, and each saved rank's torch / Python / numpy generators (compared by their next draws).
* New -> old: a checkpoint the current code writes from that state has the fixture's DCP metadata key for key
  (type, global shape, dtype and properties, the chunks each rank wrote, DCP's flattening map), and DCP's own
  public converter ``format_utils.dcp_to_torch_save`` reads the same whole tensors from it as from the fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("numpy", reason="the fixture holds numpy's generator state and draws: pip install numpy")

from checkpoint_fixture_workers import FIXTURE  # noqa: E402
from engine_launch import launch  # noqa: E402
from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader, TensorStorageMetadata  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from zeropp.engine.checkpoint import consolidate  # noqa: E402

EXPECTED = torch.load(FIXTURE / "expected.pt", weights_only=False)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, (what, key)
        assert torch.equal(got[key], want[key]), (what, key, (got[key] - want[key]).abs().max())


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fixture")
    resave = tmp / "resave"
    return resave, launch("checkpoint_fixture_workers:loads", 4, tmp, timeout=180, resave=str(resave))


def check(got: dict, tag: str, rank: int, what: str) -> None:
    want = EXPECTED[tag]
    assert got["path"] == tag and got["client_state"] == want["client_state"], what
    assert_same(got["module"], want["module"], f"{what}: module")
    assert_same(got["optim"], want["optim"], f"{what}: optimizer state")
    assert got["engine"] == want["engine"], what
    if rank < len(want["draws"]):  # the generators of the ranks the save had
        assert got["draws"] == want["draws"][rank], what


def test_fixture_loads_at_its_world_size(job):
    _, results = job
    assert EXPECTED["global_step3"]["engine"]["global_steps"] == 3
    for rank in (0, 1):
        check(results[rank]["world2"], "global_step3", rank, f"world 2 rank {rank}")
        check(results[rank]["world2_step2"], "global_step2", rank, f"world 2 rank {rank}, tag global_step2")
    # the two tags differ, so the explicit tag was not answered from latest
    assert not torch.equal(EXPECTED["global_step2"]["module"]["embed.weight"],
                           EXPECTED["global_step3"]["module"]["embed.weight"])


def test_fixture_loads_at_other_world_sizes(job):
    _, results = job
    for rank, res in enumerate(results):
        check(res["world4"], "global_step3", rank, f"world 4 rank {rank}")
    check(results[0]["world1"], "global_step3", 0, "world 1")


def test_fixture_consolidates_offline():
    for tag in ("global_step2", "global_step3"):
        assert_same(consolidate(FIXTURE, tag), EXPECTED[tag]["module"], f"consolidate {tag}")


def whole_by_dcp(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` and ``optim.*`` tensors of a checkpoint as DCP's public converter writes them."""
    out = tmp_path / f"{checkpoint.parent.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if k.startswith(("model.", "optim."))}


def _properties(props) -> dict:
    """``TensorProperties`` as a dict, without ``strides``: torch 2.15 records the strides of a plain tensor's
    entry (``()`` for a 0-d one), which metadata written before reads back as ``None``, and a load ignores."""
    return {k: v for k, v in vars(props).items() if k != "strides"}


def test_new_checkpoint_has_the_old_format(job, tmp_path):
    resave, _ = job
    old = FileSystemReader(FIXTURE / "global_step3").read_metadata()
    new = FileSystemReader(resave / "global_step3").read_metadata()
    assert new.state_dict_metadata.keys() == old.state_dict_metadata.keys()
    tensors = 0
    for key, md in old.state_dict_metadata.items():
        got = new.state_dict_metadata[key]
        assert type(got) is type(md), key
        if isinstance(md, BytesStorageMetadata):
            continue
        assert isinstance(md, TensorStorageMetadata)
        tensors += 1
        assert (got.size, _properties(got.properties)) == (md.size, _properties(md.properties)), key
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in got.chunks) == sorted(
            (tuple(c.offsets), tuple(c.sizes)) for c in md.chunks), key
    assert tensors == 3 * 7 + 2  # masters and 2 moments of 7 parameters, the frozen matrix, the buffer
    assert new.planner_data == old.planner_data
    assert len(old.state_dict_metadata["model.embed.weight"].chunks) == 2  # pieces on both ranks

    # DCP's converter reads the same whole tensors from both, and they are the engine's exact values
    want = EXPECTED["global_step3"]
    # parameters are saved 1-D, buffers as they are; the tied head.weight is embed.weight's alias
    module = {f"model.{k}": v if k == "calls" else v.reshape(-1) for k, v in want["module"].items()
              if k != "head.weight"}
    optim = {f"optim.{k}": v.reshape(-1) for k, v in want["optim"].items()}
    for checkpoint in (FIXTURE / "global_step3", resave / "global_step3"):
        assert_same(whole_by_dcp(checkpoint, tmp_path), {**module, **optim}, str(checkpoint))
