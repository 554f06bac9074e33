"""Worker for qgZ with stochastic rounding (``reduce_scatter(seed=)``), run by test_stochastic_rounding.py.

References are independent of zeropp.comm's two-hop code: the same packs are built in this process from every
rank's input with the format spec's ops (``quantize_chunks``, ``reduce_requantize``, ``reduce_dequantize``) and
the seeds of ``comm.hop_seed``; the statistics compare with float64 sums.
"""

from __future__ import annotations

import torch
from comm_workers import make_input, padded_inputs

from zeropp import comm
from zeropp.comm import Topology
from zeropp.quant import (
    BlockFormat,
    quantize_chunks,
    reduce_dequantize,
    reduce_dequantize_rotated,
    reduce_requantize,
    rotate_slices,
    rotated_numel,
)

BLOCK = 64


def composition(topo: Topology, numel: int, intra: int, inter: int, seed: int, data_seed: int,
                rot: int | None) -> torch.Tensor:
    """This rank's slice of the mean, composed in this process: rank ``g``'s slices packed in ``intra`` bits with
    ``hop_seed(seed, 1, g)``; the rank ``p`` of each node with this rank's local index sums its node's runs and
    requantizes them to ``inter`` bits with ``hop_seed(seed, 2, p)`` (this rank's slice is pack ``m`` of its run,
    ``m`` this rank's position in its inter-node group, whose noise indices start at ``m * S``); the node sums
    are added and divided by the world size."""
    world, r = topo.world_size, topo.rank
    s = -(-numel // world)
    width = rotated_numel(s, rot) if rot else s
    f1, f2 = BlockFormat(intra, BLOCK), BlockFormat(inter, BLOCK)
    b1 = f1.packed_bytes(width)
    inter_ranks = topo.inter_ranks

    packs = {}  # rank g's packs of every slice
    for g in topo.ranks:
        x = make_input(g, numel, torch.float32, data_seed)
        packs[g] = quantize_chunks(rotate_slices(x, world, rot) if rot else x, f1, world,
                                   seed=comm.hop_seed(seed, 1, g))

    def pack(g: int, q: int) -> torch.Tensor:
        return packs[g][q * b1 : (q + 1) * b1]

    m = inter_ranks.index(r)
    node_sums = []
    for p in inter_ranks:
        node = next(nd for nd in topo.nodes if p in nd)
        run = torch.cat([pack(g, q) for g in node for q in inter_ranks])
        mid = reduce_requantize(run, f1, len(node), len(inter_ranks), width, out_fmt=f2,
                                seed=comm.hop_seed(seed, 2, p))
        node_sums.append(mid.view(len(inter_ranks), -1)[m])
    start, stop = comm.shard_range(numel, world, r)
    expect = torch.empty(stop - start)
    buf = torch.cat(node_sums)
    if rot:
        reduce_dequantize_rotated(buf, f2, len(node_sums), s, expect, rot, divisor=world)
    else:
        reduce_dequantize(buf, f2, len(node_sums), s, expect, divisor=world)
    return expect


def rounding(rank: int, world: int, seeds: int) -> dict:
    """World 4 as 2 nodes of 2: (1) seeded qgZ (int8 in the node and int4 across, plain and rotated) is
    bit-identical to ``composition``, the same again on a second call, different with another seed, and with error
    feedback reproducible too; (2) unbiasedness: int4 on both hops, the mean of ``seeds`` seeded reductions of one
    input against the float64 mean, element-wise within 6 standard deviations of the bound derived below, and its
    RMS error well below round-to-nearest's. Returns the RMS errors of (2)."""
    topo = Topology(ranks_per_node=2)
    numel = 256 * world + 13
    x = make_input(rank, numel, torch.float32, 5)
    for rot in (None, 32):
        out = comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, intra_bits=8, rotation=rot, seed=77)
        expect = composition(topo, numel, 8, 4, 77, 5, rot)
        assert torch.equal(out, expect), (rot, float((out - expect).abs().max()))
        again = comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, intra_bits=8, rotation=rot, seed=77)
        assert torch.equal(out, again), rot
        other = comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, intra_bits=8, rotation=rot, seed=78)
        assert not torch.equal(out, other), rot
    runs = []
    for _ in range(2):
        ef = comm.ErrorFeedback()
        runs.append([comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, error_feedback=ef, seed=step)
                     for step in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))

    # (2) Each stochastic code is unbiased given what it codes, so by linearity E[out] is the exact mean (up to
    # the float32 roundings of the sums and the 2**-23 grid of the noise: < 1e-6 relative, far below the bound).
    # Per element, a code of scale c errs by B * c, B a centred Bernoulli: variance <= c**2 / 4. The hop-1 scale of
    # rank q is c1_q = absmax(q's block) / 7; the hop-2 scale of node N is at most c2_N = (absmax of the block of the
    # true partial sum + sum of its ranks' c1_q) / 7 (each hop-1 error is below one scale). The errors are
    # uncorrelated (independent noise given the earlier hops), so Var(out) <= (sum_q c1_q**2 + sum_N c2_N**2) / 4
    # / P**2, and the mean of K seeds has a standard deviation of at most sqrt(Var / K).
    xs = padded_inputs(world, numel, torch.float32, 5)
    s = xs.shape[1] // world
    start, stop = comm.shard_range(numel, world, topo.rank)
    mine = slice(topo.rank * s, topo.rank * s + stop - start)

    def block_absmax(v: torch.Tensor) -> torch.Tensor:  # per element of a slice-aligned padded row
        b = v.view(world, -1, BLOCK).abs().amax(2, keepdim=True).expand(-1, -1, BLOCK)
        return b.reshape(-1)[: v.numel()]

    pad = -(-s // BLOCK) * BLOCK - s

    def padded(v: torch.Tensor) -> torch.Tensor:  # each slice padded to whole blocks
        return torch.nn.functional.pad(v.view(world, s), (0, pad)).reshape(-1)

    def unpadded(v: torch.Tensor) -> torch.Tensor:
        return v.view(world, s + pad)[:, :s].reshape(-1)

    c1 = torch.stack([unpadded(block_absmax(padded(xs[q]))) / 7 for q in range(world)])
    var = c1.square().sum(0)
    for node in topo.nodes:
        c2 = (unpadded(block_absmax(padded(xs[node].sum(0)))) + unpadded(block_absmax(padded(c1[node].sum(0))))) / 7
        var += c2.square()
    sd = (var / 4 / seeds).sqrt()[mine] / world
    true = xs.sum(0)[mine] / world
    mean = torch.zeros(stop - start, dtype=torch.float64)
    for k in range(seeds):
        mean += comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, seed=1000 + k).double()
    mean /= seeds
    err = (mean - true).abs()
    assert bool((err <= 6 * sd + 1e-6 * true.abs()).all()), float((err / sd).max())
    nearest = comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK).double()
    rms = lambda v: float(v.square().mean().sqrt())  # noqa: E731
    return {"stochastic_mean": rms(mean - true), "nearest": rms(nearest - true), "bound": rms(sd)}


def decode8(buf: torch.Tensor, numel: int, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reading of ``slices`` int8 packs of ``BLOCK`` (``numel`` elements, a whole number of blocks per
    slice): the codes (int64, ``(numel,)``) and the float32 scale of each element's block."""
    s = numel // slices
    nb = s // BLOCK
    packs = buf.view(slices, nb * BLOCK + 4 * nb)
    codes = packs[:, : nb * BLOCK].contiguous().view(torch.int8).long().reshape(-1)
    scales = packs[:, nb * BLOCK :].contiguous().view(torch.float32).repeat_interleave(BLOCK, dim=1).reshape(-1)
    return codes, scales


def quantize64(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 block quantization of float64 ``e`` (blocks of ``BLOCK``) as the format defines it: the scale
    ``absmax / 127`` rounded to float32, ``r = 1 / scale`` rounded to float32, codes ``round(e * r)`` (half to
    even, in float64); returns the codes and each element's scale."""
    absmax = e.view(-1, BLOCK).abs().amax(1, keepdim=True).expand(-1, BLOCK).reshape(-1)
    scale = (absmax / 127).float().double()
    r = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)).float().double()
    return (e * r).round().long(), scale


def loco(rank: int, world: int, steps: int, beta: float) -> dict:
    """LoCo's 8-bit error feedback (``ErrorFeedback("loco", beta)``), world 4 as 2 nodes of 2, int4 both hops:

    (1) every step, both of this rank's residuals (hop 1 and the partial sums') match a float64 plain-torch run of
    the recurrence ``e <- Q8(beta * e + (1 - beta) * (x - sent))`` from the state before the step (every rank's
    stored residuals, exchanged), with the packs of the format spec: the same codes but where the float64 value
    lies within float32 roundings of a rounding boundary (at most 1 in 1000, and one code step), the same scales
    to float32 rounding; (2) memory: ``1 + 4 / BLOCK`` bytes per residual element; (3) the accumulated error of
    ``steps`` reductions of the same gradient: no feedback, fp32 feedback, LoCo (returned)."""
    import torch.distributed as dist

    from zeropp.quant import dequantize_chunks

    topo = Topology(ranks_per_node=2)
    n, d = topo.num_nodes, topo.ranks_per_node
    s = 2 * BLOCK + BLOCK  # elements per slice: whole blocks, so the residual packs have no padding
    numel = world * s
    f4 = BlockFormat(4, BLOCK)
    ef = comm.ErrorFeedback("loco", beta)
    flips = total = 0
    for step in range(steps):
        inputs = {g: make_input(g, numel, torch.float32, 100 + step) for g in topo.ranks}
        before = [None] * world
        state = None if ef.residual is None else (ef.residual.clone(), ef.partial_residual.clone())
        dist.all_gather_object(before, state)
        comm.reduce_scatter(inputs[rank], 4, topology=topo, block_size=BLOCK, error_feedback=ef)

        def residual(g: int, partial: bool) -> torch.Tensor:  # rank g's stored residual before the step, float64
            if before[g] is None:
                return torch.zeros(n * s if partial else numel, dtype=torch.float64)
            codes, scales = decode8(before[g][partial], n * s if partial else numel, n if partial else world)
            return codes.double() * scales.double()

        def x1(g: int) -> torch.Tensor:  # hop 1's input: gradient plus residual, in float32 as the spec adds it
            return inputs[g] + residual(g, False).float()

        def sent(x: torch.Tensor, chunks: int) -> torch.Tensor:
            out = torch.empty(x.numel())
            return dequantize_chunks(quantize_chunks(x, f4, chunks), f4, chunks, x.numel() // chunks, out)

        node = next(nd for nd in topo.nodes if rank in nd)
        mine = x1(rank)
        # the partial sums this rank forwards: its node's packs of the slices of its inter-node group
        run = torch.stack([sent(x1(g), world).view(world, s)[topo.inter_ranks].reshape(-1) for g in node]).sum(0)
        partial = run + residual(rank, True).float()
        for x, chunks, is_partial in ((mine, world, False), (partial, n, True)):
            e = beta * residual(rank, is_partial) + (1 - beta) * (x.double() - sent(x, chunks).double())
            want_codes, want_scales = quantize64(e)
            stored = ef.partial_residual if is_partial else ef.residual
            codes, scales = decode8(stored, e.numel(), chunks)
            assert torch.allclose(scales.double(), want_scales, rtol=2**-22, atol=0), (step, is_partial)
            diff = (codes - want_codes).abs()
            assert int(diff.max()) <= 1, (step, is_partial, int(diff.max()))
            flips += int(diff.sum())
            total += e.numel()
    assert flips <= total // 1000, (flips, total)
    assert ef.nbytes == (numel + n * s) * (BLOCK + 4) // BLOCK, ef.nbytes
    assert comm.ErrorFeedback().nbytes == 0

    # (3) the accumulated error of reducing the same gradient 16 times
    x = make_input(rank, numel, torch.float32, 11)
    true = padded_inputs(world, numel, torch.float32, 11).sum(0)[topo.rank * s : (topo.rank + 1) * s] / world
    result = {"flips": flips}
    fp32 = comm.ErrorFeedback()
    for name, fb in (("plain", None), ("fp32", fp32), ("loco", comm.ErrorFeedback("loco", beta))):
        acc = torch.zeros(s, dtype=torch.float64)
        for _ in range(16):
            acc += comm.reduce_scatter(x, 4, topology=topo, block_size=BLOCK, error_feedback=fb).double()
        result[name] = float((acc - 16 * true).abs().max() / (16 * true.abs().max()))
    result["fp32_bytes"] = fp32.nbytes
    return result


def options(rank: int, world: int, seeds: int, steps: int, beta: float) -> dict:
    """Both checks in one process group: ``rounding`` and ``loco``."""
    return {"rounding": rounding(rank, world, seeds), "loco": loco(rank, world, steps, beta)}
