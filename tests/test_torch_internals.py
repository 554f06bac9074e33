"""Pins of the private torch API zeropp relies on, all of it in zeropp/_torch_internals.py, and the rule that
nothing else in zeropp touches torch's private API.

Each pin checks the behaviour zeropp relies on, not just that a name exists, and says on failure what changed and
where zeropp uses it, so that a torch upgrade that breaks one fails here rather than in a user's training run.
"""

from __future__ import annotations

import ast
import functools
import inspect
import subprocess
import sys
import typing
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from zeropp import _torch_internals
from zeropp._torch_internals import FSDPAllGather, FSDPReduceScatter, in_backward, tree_leaves
from zeropp.fsdp.all_gather import ZeroppAllGather
from zeropp.fsdp.reduce_scatter import ZeroppReduceScatter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "comm"))

from comm_launch import launch  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# in_backward: torch._C._current_graph_task_id()

HOOKS_USE = ("zeropp.engine.hooks uses in_backward() so that a stage-3 unit's forward post-hook does not free "
             "the unit's parameters while autograd's backward still needs them")


def test_in_backward_is_true_only_while_autograd_runs_a_backward() -> None:
    seen: list[bool] = []
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: seen.append(in_backward()))
    assert not in_backward(), (
        f"in_backward() is True outside any backward: torch._C._current_graph_task_id() is no longer -1 there. "
        f"{HOOKS_USE}"
    )
    y.backward()
    z = (x * 3).sum()
    z.register_hook(lambda g: seen.append(in_backward()))
    torch.autograd.grad(z, x)
    assert seen == [True, True], (
        f"in_backward() was {seen} inside gradient hooks: torch._C._current_graph_task_id() no longer returns a "
        f"graph task id (!= -1) while autograd executes a backward. {HOOKS_USE}"
    )
    assert not in_backward(), f"in_backward() stays True after backward returned. {HOOKS_USE}"


def test_in_backward_during_reentrant_checkpoint_recomputation() -> None:
    """A reentrant activation checkpoint runs its forward under no_grad, then again inside backward with grad on:
    zeropp's post-forward hook must see the second one as inside backward (and not free the unit)."""
    layer = nn.Linear(3, 3)
    seen: list[tuple[bool, bool]] = []
    layer.register_forward_hook(lambda m, a, o: seen.append((torch.is_grad_enabled(), in_backward())))
    x = torch.randn(2, 3, requires_grad=True)
    checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert seen == [(False, False), (True, True)], (
        f"forward hooks under a reentrant checkpoint saw (grad enabled, in_backward()) = {seen}; expected the "
        f"forward (False, False) then its recomputation inside backward (True, True). {HOOKS_USE}"
    )


# ---------------------------------------------------------------------------------------------------------------
# tree_leaves: torch.utils._pytree.tree_leaves

TREE_USE = ("zeropp.engine.hooks uses tree_leaves() to find the tensors in a stage-3 unit's inputs and outputs, "
            "on which it registers the gradient hooks that gather the unit for its backward")


def test_tree_leaves_walks_containers_in_order() -> None:
    Pair = namedtuple("Pair", "first second")

    class Opaque:
        pass

    t = [torch.full((1,), float(i)) for i in range(7)]
    opaque = Opaque()
    tree = (t[0], [t[1], {"b": t[2], "a": t[3]}], Pair(t[4], OrderedDict(z=t[5], y=None)), None, opaque, 7, t[6])
    got = tree_leaves(tree)
    # dicts in insertion order; None, an unregistered object and an int are leaves
    want = [t[0], t[1], t[2], t[3], t[4], t[5], None, None, opaque, 7, t[6]]
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (
        f"torch.utils._pytree.tree_leaves flattened {tree!r} into {got!r}, expected {want!r}. {TREE_USE}"
    )


def test_tree_leaves_walks_types_registered_with_torchs_pytree() -> None:
    """Hugging Face registers its ``ModelOutput`` classes with ``torch.utils._pytree.register_pytree_node``; their
    tensors must be found the same way."""
    from torch.utils import _pytree

    class Output:
        def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
            self.logits, self.hidden = logits, hidden

    _pytree.register_pytree_node(
        Output, lambda o: ([o.logits, o.hidden], None), lambda values, _: Output(*values),
        serialized_type_name=f"{__name__}.Output",
    )
    a, b = torch.zeros(1), torch.ones(1)
    got = tree_leaves({"out": Output(a, b)})
    assert len(got) == 2 and got[0] is a and got[1] is b, (
        f"a type registered with torch.utils._pytree.register_pytree_node was not walked (leaves {got!r}): "
        f"Hugging Face ModelOutput tensors would be missed. {TREE_USE}"
    )


# ---------------------------------------------------------------------------------------------------------------
# FSDPAllGather / FSDPReduceScatter: torch.distributed.fsdp._fully_shard._fsdp_api

FSDP_USE = ("zeropp.fsdp.all_gather.ZeroppAllGather and zeropp.fsdp.reduce_scatter.ZeroppReduceScatter subclass "
            "these interfaces and are installed with FSDPModule.set_custom_all_gather / set_custom_reduce_scatter")


def _parameters(fn: typing.Callable) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("interface, ours, setter", [
    (FSDPAllGather, ZeroppAllGather, FSDPModule.set_custom_all_gather),
    (FSDPReduceScatter, ZeroppReduceScatter, FSDPModule.set_custom_reduce_scatter),
])
def test_fsdp_comm_interfaces_are_what_zeropp_implements(interface: type, ours: type, setter: typing.Callable) -> None:
    where = f"{interface.__module__}.{interface.__qualname__}"
    assert typing.get_type_hints(setter).get("comm") is interface, (
        f"FSDPModule.{setter.__name__} no longer takes {where} (its hints: {typing.get_type_hints(setter)}). "
        f"{FSDP_USE}"
    )
    assert interface.__abstractmethods__ == {"allocate", "__call__"}, (
        f"{where} now has the abstract methods {sorted(interface.__abstractmethods__)}; zeropp implements "
        f"allocate and __call__. {FSDP_USE}"
    )
    assert not inspect.isabstract(ours), f"{ours.__qualname__} leaves {sorted(ours.__abstractmethods__)} abstract"
    for method in ("allocate", "__call__"):
        theirs, mine = _parameters(getattr(interface, method)), _parameters(getattr(ours, method))
        assert theirs == mine, (
            f"{where}.{method} now takes {theirs}; {ours.__qualname__}.{method} implements {mine} "
            f"(FSDP2 calls it with keywords). {FSDP_USE}"
        )


def test_fsdp_interfaces_resolve_on_access() -> None:
    """zeropp.comm and zeropp.engine import zeropp._torch_internals; importing it must not bind FSDP2's private
    classes (a torch that moves them should break zeropp.fsdp only): they are looked up on access."""
    assert not {"FSDPAllGather", "FSDPReduceScatter"} & vars(_torch_internals).keys()
    assert FSDPAllGather.__name__ == "AllGather" and FSDPReduceScatter.__name__ == "ReduceScatter"
    with pytest.raises(AttributeError, match="no attribute 'AllGather'"):
        _torch_internals.AllGather


def _padded_shard_numel(rows: int, cols: int, world: int) -> int:
    """Per-rank elements of a Linear(cols, rows)'s padded weight and bias shards (dim-0 sharding)."""
    per_rank = -(-rows // world)
    return per_rank * cols + per_rank


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 2-rank launch of tests/torch_internals_workers.py's ``custom_comms`` for the FSDP2 pins."""
    return launch("torch_internals_workers:custom_comms", 2, tmp_path_factory.mktemp("fsdp"), worker_dirs=[HERE])


def test_fsdp2_calls_the_custom_comms(fsdp_runs: list[dict]) -> None:
    """A real 2-rank FSDP2 run over gloo (tests/torch_internals_workers.py): Linear(4, 8) and Linear(8, 3), each
    ``fully_shard``-ed, their comms replaced by recording ones that run FSDP2's default collectives."""
    world = 2
    runs = fsdp_runs
    first, second = _padded_shard_numel(8, 4, world), _padded_shard_numel(3, 8, world)
    for rank, r in enumerate(runs):
        assert r["same_as_plain"], (
            f"rank {rank}: FSDP2 with the recording comms trained differently from plain FSDP2: it no longer uses "
            f"what the custom comms produce. {FSDP_USE}"
        )
        gathers = [(c["phase"], c["input_numel"]) for c in r["all_gather"]]
        # forward gathers each layer; reshard_after_forward=True re-gathers each in backward, last layer first
        assert gathers == [("forward", first), ("forward", second), ("backward", second), ("backward", first)], (
            f"rank {rank}: FSDP2 called the custom all-gather as (phase, input numel) {gathers}. {FSDP_USE}"
        )
        for c in r["all_gather"]:
            assert c["output_allocated"] and c["output_numel"] == world * c["input_numel"], (rank, c, FSDP_USE)
            # ZeroppAllGather quantizes the input before writing the output because the input is a view of it
            assert c["input_shares_output"] and c["input_offset"] == rank * c["input_numel"], (
                f"rank {rank}: FSDP2's all-gather input is no longer the view of output[rank * n:(rank + 1) * n] "
                f"({c}); zeropp.fsdp.all_gather relies on it. {FSDP_USE}"
            )
            assert c["group_ranks"] == [0, 1], (rank, c)
        scatters = [(c["phase"], c["output_numel"]) for c in r["reduce_scatter"]]
        assert scatters == [("backward", second), ("backward", first)], (
            f"rank {rank}: FSDP2 called the custom reduce-scatter as (phase, output numel) {scatters}. {FSDP_USE}"
        )
        for c in r["reduce_scatter"]:
            assert c["input_allocated"] and c["input_numel"] == world * c["output_numel"], (rank, c, FSDP_USE)
            assert c["op"] == str(dist.ReduceOp.AVG) and c["group_ranks"] == [0, 1], (
                f"rank {rank}: FSDP2 reduce-scatters fp32 gradients with {c['op']} (zeropp.fsdp.reduce_scatter "
                f"maps AVG and SUM only). {FSDP_USE}"
            )
        assert r["force_sum_ops"] == [str(dist.ReduceOp.SUM)] * 2, (
            f"rank {rank}: with set_force_sum_reduction_for_comms(True) FSDP2 passed {r['force_sum_ops']}; "
            f"zeropp.fsdp.reduce_scatter tells users to set it to get SUM. {FSDP_USE}"
        )


def test_fsdp_group_modules_names_one_fully_shard_calls_modules(fsdp_runs: list[dict]) -> None:
    """``fully_shard([second, first])``: both modules report the group ``(second, first)``, a module wrapped alone
    reports itself, and FSDP2's one all-gather input for the group holds the second's shards, then the first's."""
    use = ("zeropp.fsdp.segments lays out a fully_shard group's flat all-gather input (one qwZ block run per "
           "parameter) from fsdp_group_modules(): FSDPModule._get_fsdp_state()._modules")
    for rank, r in enumerate(fsdp_runs):
        g = r["group"]
        assert g["first"] == g["second"] == g["want"] and g["root"] == g["want_root"], (
            f"rank {rank}: fsdp_group_modules() no longer gives the modules of the fully_shard call in the order "
            f"given ({g}). {use}"
        )
        assert g["input_order"], (
            f"rank {rank}: FSDP2's all-gather input for fully_shard([second, first]) is no longer second's "
            f"parameter shards then first's. {use}"
        )


# ---------------------------------------------------------------------------------------------------------------
# group_timeout: ProcessGroup._device_types, ProcessGroup._get_backend(device).options._timeout

TIMEOUT_USE = ("zeropp.comm.Topology uses group_timeout(dist.group.WORLD) to give the groups it creates the "
               "timeout the user gave init_process_group (torch's new_group would give them 30 minutes)")

_TIMEOUT_CHILD = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from zeropp._torch_internals import group_timeout

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=1234.5))
print("world", group_timeout(dist.group.WORLD).total_seconds())
print("new_group", group_timeout(dist.new_group([0], timeout=timedelta(seconds=77))).total_seconds())
print("untimed", group_timeout(dist.new_group([0])).total_seconds())
both = dist.new_group([0], backend="cpu:gloo,cuda:gloo", timeout=timedelta(seconds=5))
print("two backends", group_timeout(both).total_seconds())
dist.destroy_process_group()
"""


def test_group_timeout_reads_the_timeout_given_to_torch(tmp_path: Path) -> None:
    """In a child process (it initializes torch.distributed): the timeouts set through torch's public API."""
    proc = subprocess.run([sys.executable, "-c", _TIMEOUT_CHILD, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, (
        f"group_timeout failed: torch no longer keeps a group's timeout in ProcessGroup._get_backend(device)"
        f".options._timeout for each of ProcessGroup._device_types. {TIMEOUT_USE}\n{proc.stdout}{proc.stderr}"
    )
    got = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())
    want = {"world": "1234.5", "new_group": "77.0", "two backends": "5.0",
            # what Topology's docstring says torch's new_group gives without a timeout: the backend's default
            "untimed": str(dist.default_pg_timeout.total_seconds())}
    assert got == want, (
        f"group_timeout read {got} for groups made with the timeouts {want}: the backend options' _timeout no "
        f"longer holds the timeout given to init_process_group / new_group. {TIMEOUT_USE}"
    )


# ---------------------------------------------------------------------------------------------------------------
# The rule: no private torch name outside zeropp/_torch_internals.py

PACKAGE = ROOT / "zeropp"
ALLOWED = {
    "_torch_internals.py": "the one module for torch's private API, every use pinned above",
}


@functools.cache
def _torch_private_members() -> frozenset[str]:
    """Private member names of the torch classes zeropp works with (``x._parameters``, ``p._local_tensor``,
    ``m._get_fsdp_state()``): their instances cannot be told apart statically, so the names are refused anywhere."""
    classes = [torch.Tensor, nn.Parameter, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
               torch.autograd.Function, FSDPModule, DTensor, DeviceMesh, dist.ProcessGroup, dist.Work]
    p = nn.Parameter(torch.zeros(1))
    instances = [torch.zeros(1), p, nn.Linear(1, 1), torch.optim.SGD([p], lr=0.1)]
    names = {n for obj in [*classes, *instances] for n in dir(obj)}
    names |= {n for c in classes for k in c.__mro__ for n in getattr(k, "__annotations__", {})}
    return frozenset(n for n in names if _private(n))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every use of torch's private API in ``source``: an import of a private torch module or
    name, a private attribute reached from a name imported from torch (``torch._C``, ``dist._x``), ``getattr`` of
    a private name on one, and any access to a private member of torch's classes (``_torch_private_members``),
    except ``self._x`` in a class that assigns ``self._x`` itself (its own attribute of the same name)."""
    tree = ast.parse(source)
    scan = _Scan()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scan.imported(node)
    scan.visit(tree)
    return sorted(set(scan.found))


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.torch_names: set[str] = set()  # local names bound to torch modules or objects
        self.found: list[tuple[int, str]] = []
        self.own: list[set[str]] = [set()]  # per enclosing class: the attributes it assigns on self
        self.members = _torch_private_members()

    def imported(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    self.torch_names.add(alias.asname or "torch")
                    if any(map(_private, alias.name.split("."))):
                        self.found.append((node.lineno, f"import {alias.name}"))
        elif node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                self.torch_names.add(alias.asname or alias.name)
                if any(map(_private, (node.module or "").split("."))) or _private(alias.name):
                    self.found.append((node.lineno, f"from {node.module} import {alias.name}"))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.own.append({n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                         and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self"})
        self.generic_visit(node)
        self.own.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root: ast.expr = node
        while isinstance(root, ast.Attribute):
            root = root.value
        from_torch = isinstance(root, ast.Name) and root.id in self.torch_names
        own = isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.own[-1]
        if (from_torch and _private(node.attr)) or (node.attr in self.members and not own):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            name, target = node.args[1].value, node.args[0]
            if (_private(name) and isinstance(target, ast.Name) and target.id in self.torch_names
                    or name in self.members):
                self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def test_the_scan_finds_each_kind_of_private_use() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch._dynamo\n"
        "from torch.utils import _pytree as pytree\nfrom torch.distributed.distributed_c10d import _get_default_group\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "a = torch._C._current_graph_task_id()\nb = dist.distributed_c10d._world\nc = getattr(dist, '_backend')\n"
        "d = module._get_fsdp_state()\ne = self._parameters\nf = FSDPModule.__init__\ng = torch.__version__\n"
        "h = self._mine\ni = dist.ReduceOp.AVG\n"
        "class Pool:\n    def __init__(self):\n        self._buffers = []\n    def give(self):\n"
        "        return self._buffers, self._modules\n"
    )
    assert private_torch_uses(source) == [
        (3, "import torch._dynamo"), (4, "from torch.utils import _pytree"),
        (5, "from torch.distributed.distributed_c10d import _get_default_group"),
        (7, "torch._C"), (7, "torch._C._current_graph_task_id"), (8, "dist.distributed_c10d._world"),
        (9, "getattr(dist, '_backend')"), (10, "module._get_fsdp_state"), (11, "self._parameters"),
        (20, "self._modules"),  # not self._buffers: Pool assigns its own
    ]


def test_no_private_torch_api_outside_torch_internals() -> None:
    uses = {path.relative_to(PACKAGE).as_posix(): private_torch_uses(path.read_text())
            for path in sorted(PACKAGE.rglob("*.py"))}
    stale = [rel for rel in ALLOWED if rel != "_torch_internals.py" and not uses.get(rel)]
    assert not stale, f"{stale} no longer use torch's private API (or are gone): remove them from ALLOWED in {__file__}"
    outside = {rel: found for rel, found in uses.items() if found and rel not in ALLOWED}
    assert not outside, (
        "torch's private API used outside zeropp/_torch_internals.py (a torch upgrade could break it unnoticed): "
        + "; ".join(f"zeropp/{rel}: " + ", ".join(f"line {n} {what}" for n, what in found)
                    for rel, found in outside.items())
        + ". Add a small function to zeropp/_torch_internals.py and a test here that pins its behaviour."
    )


def test_torch_internals_is_a_leaf() -> None:
    tree = ast.parse((PACKAGE / "_torch_internals.py").read_text())
    imported = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    imported |= {(n.module or ".").split(".")[0] if n.level == 0 else "." for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)}
    assert imported - {"torch"} <= set(sys.stdlib_module_names), f"zeropp/_torch_internals.py imports {imported}"


# ---------------------------------------------------------------------------------------------------------------
# fsdp_hsdp_mesh / route_hsdp_all_reduce / fsdp_requires_all_reduce / fsdp_all_reduce_hook: FSDP2's param groups'
# mesh_info and all-reduce hook

HSDP_USE = ("zeropp.fsdp.hsdp routes FSDP2's HSDP all-reduce to its set_all_reduce_hook hook by giving each param "
            "group a plain FSDPMeshInfo (tests/fsdp/test_fsdp_hsdp.py checks the result bit for bit)")


def test_fsdp_hsdp_mesh_info_is_what_zeropp_rewrites() -> None:
    import dataclasses

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo

    assert issubclass(HSDPMeshInfo, FSDPMeshInfo) and issubclass(HSDPMeshInfo, DDPMeshInfo), HSDP_USE
    assert not issubclass(FSDPMeshInfo, DDPMeshInfo), HSDP_USE
    fields = {f.name for f in dataclasses.fields(FSDPMeshInfo)}
    assert {"mesh", "shard_mesh_dim", "replicate_mesh_dim", "dp_mesh_dims", "spmd_mesh"} <= fields, (
        f"FSDPMeshInfo's fields are now {sorted(fields)}. {HSDP_USE}")
    # the all-reduce group goes to foreach_reduce only for DDP/HSDP mesh infos; the hook runs without one
    post_backward = inspect.getsource(_fsdp_param_group.FSDPParamGroup.post_backward)
    assert "isinstance(self.mesh_info, DDPMeshInfo)" in post_backward and "self._all_reduce_hook" in post_backward, (
        f"FSDPParamGroup.post_backward no longer picks the all-reduce group by mesh_info's type. {HSDP_USE}")
    init = inspect.getsource(_fsdp_param_group.FSDPParamGroup.__init__)
    for attr in ("self.mesh_info", "self.post_forward_mesh_info", "self.all_reduce_grads", "self._all_reduce_hook"):
        assert attr in init, f"FSDPParamGroup no longer sets {attr}. {HSDP_USE}"
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    setter = inspect.getsource(FSDPModule.set_all_reduce_hook)
    assert "_all_reduce_hook = hook" in setter, (
        f"FSDPModule.set_all_reduce_hook no longer stores the hook where fsdp_all_reduce_hook reads it. {HSDP_USE}")
    params = inspect.signature(_fsdp_collectives.foreach_reduce).parameters
    assert {"all_reduce_group", "all_reduce_hook", "all_reduce_grads"} <= params.keys(), HSDP_USE
