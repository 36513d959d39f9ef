"""Replica synchronisation strategies (`layerpar.parallel.sync`) and the Lion optimizer.

One process: Lion against a reference written out here, its state_dict, the slow-link
model and byte meter, argument checks, Lion Cub's packing and vote of -1/0/+1 signs
and the bytes it counts.  Two processes: Lion Cub with the same batch on both replicas
= Lion.  Four processes (worker `workers/lp_sync.py`, one job per launcher): DASO
(S = 1) = all-reduce on 2x2 and 4x1, Lion Cub = Lion on one replica and with the same
batch on two, its majority vote on two, DASO's two merges against a hand computation,
checkpoints resumed on 2x2 and 4x1, and a NaN in one replica raising on every process
under each strategy.
"""
from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi_util import describe, run_mpi, run_torchrun
from tolerances import F64

import layerpar
from layerpar.mgrit.transport import SerialTransport
from layerpar.parallel import DASO, Lion, LionCub, SlowLink
from layerpar.parallel.sync import Metered, _all_finite, majority_bits, pack_signs, unpack_vote

WORKERS = Path(__file__).parent / "workers"
# a report is `RANK <r> <Type>[: ]<detail>`; mpiexec may glue two reports together
LINE = re.compile(r"RANK (\d+) (\S+?)[: ](.*?)(?=RANK \d+ |$)", re.MULTILINE)


def reference_lion(params, grads_per_step, lr, betas, wd):
    """Lion as in Chen et al. 2023, Algorithm 2, written out."""
    b1, b2 = betas
    ps = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            c = b1 * ms[i] + (1 - b1) * g
            ps[i] = ps[i] - lr * (torch.sign(c) + wd * ps[i])
            ms[i] = b2 * ms[i] + (1 - b2) * g
    return ps


def test_lion_equals_reference_and_resumes_from_state_dict() -> None:
    torch.manual_seed(0)
    shapes = [(3, 4), (4,), (2, 2, 2)]
    p0 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, dtype=torch.float64) for s in shapes] for _ in range(6)]
    lr, betas, wd = 0.03, (0.8, 0.95), 0.2
    ref = reference_lion(p0, grads, lr, betas, wd)

    def run(steps, params, opt):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()

    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = Lion(params, lr=lr, betas=betas, weight_decay=wd)
    run(grads[:3], params, opt)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    run(grads[3:], params, opt)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=F64.ops)
    # resume: parameters after 3 steps (replayed) + the saved state
    again = [torch.nn.Parameter(p.clone()) for p in p0]
    o2 = Lion(again, lr=lr, betas=betas, weight_decay=wd)
    run(grads[:3], again, o2)
    o3 = Lion(again, lr=1.0)
    o3.load_state_dict(saved)
    assert o3.param_groups[0]["lr"] == lr and o3.param_groups[0]["betas"] == betas
    run(grads[3:], again, o3)
    for got, want in zip(again, ref):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=F64.ops)


@pytest.mark.parametrize("kw, err, text", [
    ({"lr": 0}, ValueError, "`lr` must be a finite number > 0"),
    ({"betas": (0.9, 1.0)}, ValueError, "`betas` must be two numbers"),
    ({"weight_decay": -1}, ValueError, "`weight_decay` must be"),
])
def test_lion_arguments_are_checked(kw: dict, err: type, text: str) -> None:
    with pytest.raises(err, match=re.escape(text)):
        Lion([torch.nn.Parameter(torch.zeros(2))], **kw)


@pytest.mark.parametrize("kw, err, text", [
    ({"sync": "ring"}, ValueError, "`sync` must be one of"),
    ({"nodes": 0}, ValueError, "`nodes` must be a positive int"),
    ({"link": "1Gbit"}, TypeError, "`link` must be a SlowLink"),
])
def test_grid_sync_arguments_are_checked(kw: dict, err: type, text: str) -> None:
    with pytest.raises(err, match=re.escape(text)):
        layerpar.ProcessGrid(None, **kw)


@pytest.mark.parametrize("make, text", [
    (lambda: DASO(cycle=()), "`cycle` must be a non-empty"),
    (lambda: DASO(warmup=-1), "`warmup` must be an int"),
    (lambda: DASO(cooldown=2), "`cooldown` needs `total_batches`"),
    (lambda: DASO(merge="mean"), "`merge` must be one of ('progress', 'weighted')"),
    (lambda: LionCub(momentum_every=-1), "`momentum_every` must be"),
    (lambda: SlowLink(bandwidth=0), "`bandwidth` must be > 0"),
])
def test_strategy_arguments_are_checked(make, text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(text)):
        make()


def test_lioncub_needs_lion() -> None:
    grid = layerpar.ProcessGrid(None, sync="lioncub")
    torch.manual_seed(0)
    net = layerpar.ODENet(open=torch.nn.Linear(3, 4),
                          steps=lambda k: layerpar.ode.blocks.Dense(4), n_steps=4,
                          t_final=1.0, close=torch.nn.Linear(4, 2))
    model = layerpar.LayerParallel(net, grid=grid)
    with pytest.raises(TypeError, match="needs a layerpar Lion optimizer, got SGD"):
        grid.sync.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    grid.sync.attach(model, Lion(model.parameters()))
    grid.close()


def test_meter_counts_bytes_and_slow_link_delays() -> None:
    meter: dict = {}
    link = SlowLink(bandwidth=8e6, latency=0.01)  # 1 MB/s: 20 kB take 20 ms + 10 ms
    assert link.seconds(20_000) == pytest.approx(0.03)
    m = Metered(SerialTransport(), meter, "internode", link)
    m.size = 2  # as if over 2 processes: a ring all-reduce or all-gather sends the payload
    t = torch.zeros(5000, dtype=torch.float32)
    t0 = time.perf_counter()
    m.allreduce_start(t).wait()
    assert time.perf_counter() - t0 >= 0.03
    out = torch.empty(1, 5000)
    t0 = time.perf_counter()
    a, b = m.allgather_start(t, out), m.allreduce_start(t)  # one after the other
    a.wait()
    b.wait()
    assert time.perf_counter() - t0 >= 0.06
    assert meter == {"internode": 60_000}
    Metered(SerialTransport(), meter, "data").allreduce_start(t[:10]).wait()
    assert meter == {"internode": 60_000, "data": 40}
    m.size = 4  # 4 processes: all-reduce 1.5, all-gather 3 payloads on the link
    link = m.link = SlowLink(bandwidth=8e6, latency=0.0)
    t0 = time.perf_counter()
    a = m.allreduce_start(t)
    b = m.allgather_start(t, torch.empty(4, 5000))
    assert link._free_at - t0 == pytest.approx(0.03 + 0.06, abs=5e-3)
    a.wait()
    b.wait()


def _vote(rows: np.ndarray) -> np.ndarray:
    """Lion Cub's vote over P replicas' sign rows (P x n of -1, 0, +1), through the
    packed bits: each row packed, the packed rows voted, the vote unpacked."""
    packed = np.stack([pack_signs([torch.from_numpy(r)]).numpy() for r in rows])
    pos, neg = majority_bits(packed.reshape(len(rows), 2, -1))
    return unpack_vote(pos, neg, rows.shape[1]).astype(int)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pack_signs_keeps_zero(dtype: torch.dtype) -> None:
    """Two bit planes, > 0 and < 0, of 2 x ceil(n / 8) bytes over all the tensors:
    a 0 sets neither bit (one bit per entry sent 0 as +1)."""
    a = torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.0, 1.0]], dtype=dtype)
    b = torch.tensor([-1.0, 0.0, 0.0, 1.0, 1.0, -1.0, 0.0, 1.0, 0.0, -1.0], dtype=dtype)
    packed = pack_signs([a, b])
    assert packed.dtype == torch.uint8 and packed.numel() == 2 * 2  # n = 16: 2 bytes
    planes = np.unpackbits(packed.numpy().reshape(2, 2), axis=1, count=16)
    s = torch.cat([a.reshape(-1), b]).float().numpy()
    assert (planes[0] == (s > 0)).all() and (planes[1] == (s < 0)).all()
    assert pack_signs([b[:9]]).numel() == 2 * 2  # 9 entries: 2 bytes per plane
    buf = torch.ones((2, 16), dtype=torch.bool)  # a kept buffer is overwritten
    assert torch.equal(pack_signs([a, b], buf), packed)
    with pytest.raises(ValueError, match=re.escape("`planes` must be a bool tensor of "
                                                   "shape (2, 16)")):
        pack_signs([a, b], torch.ones((2, 15), dtype=torch.bool))


@pytest.mark.parametrize("rows, want", [
    ([[0, 0, 0]], [0, 0, 0]),  # one replica: its own signs, 0 included
    ([[1, 0, -1]], [1, 0, -1]),
    ([[0, 0, 0], [0, 0, 0]], [0, 0, 0]),  # all zero: no step
    ([[0, 0, 0]] * 4, [0, 0, 0]),
    ([[1, 0, -1], [1, 0, -1]], [1, 0, -1]),  # identical: that vote
    ([[-1, 0, 1]] * 3, [-1, 0, 1]),
    ([[1, -1, 1], [-1, 1, 0]], [0, 0, 1]),  # ties give 0, a zero abstains
    ([[1, -1, 0], [-1, 1, 0], [0, 0, 0]], [0, 0, 0]),  # +, -, 0: a tie
    ([[1, 1, -1], [1, -1, -1], [-1, -1, 0], [-1, 0, 0]], [0, -1, -1]),
    ([[-1, 1, 0], [0, 0, 0], [0, 1, 0]], [-1, 1, 0]),  # one voice against abstentions
])
def test_majority_vote_by_hand(rows: list, want: list) -> None:
    """The vote is sign(#(+1) - #(-1)): identical votes give that vote, all-zero votes
    0, a tie 0, and a 0 abstains."""
    assert _vote(np.array(rows, dtype=np.float32)).tolist() == want


def test_majority_vote_on_packed_bits() -> None:
    """The vote on the packed bits = the sign of the sum of the replicas' signs, for
    1 to 9 replicas, signs -1, 0, +1 (many ties at every P), on a length that is not a
    multiple of 8; with no zeros it is the majority of the replicas."""
    rng = np.random.default_rng(1)
    n = 1003
    for P in range(1, 10):
        s = rng.integers(-1, 2, (P, n)).astype(np.float64)
        assert (_vote(s) == np.sign(s.sum(0))).all(), P
        b = rng.integers(0, 2, (P, n))
        assert (_vote(2.0 * b - 1) == np.sign(2 * b.sum(0) - P)).all(), P


class _FakeReplicas:
    """A data group of P replicas on one process: this replica's row of the all-gather
    is row 0, the others' are given."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.size, self.group_rank, self.others = len(others) + 1, 0, others

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor, what: str = "") -> object:
        out[0].copy_(t)
        for row, o in zip(out[1:], self.others):
            row.copy_(o)
        return type("Done", (), {"wait": lambda self: None})()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_lioncub_vote_keeps_zero_and_counts_its_bytes(P: int) -> None:
    """Lion Cub's vote in place of the optimizer's signs, on one process: with P
    replicas holding the same signs (0 among them), the signs come back unchanged,
    and the meter counts the two bit planes sent, 2 x ceil(n / 8) bytes per step;
    with a replica against it, ties give 0."""
    params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(4))]
    for p in params:
        p.grad = torch.zeros_like(p)
    signs = [torch.tensor([[1.0, 0, -1, 0, 1], [0, 0, 0, -1, -1], [1, 1, 0, 0, 0]]),
             torch.tensor([0.0, -1, 1, 0])]
    n = 19
    mine = pack_signs(signs)
    lc, meter = LionCub(), {}
    lc.data = Metered(_FakeReplicas([mine] * (P - 1)), meter, "data")  # type: ignore
    got = [s.clone() for s in signs]
    lc._vote_here(list(zip(params, got)))
    assert all(torch.equal(g, s) for g, s in zip(got, signs))
    assert meter == {"data": 2 * ((n + 7) // 8)} == {"data": 6}
    against = pack_signs([-s for s in signs])  # every nonzero vote opposed
    lc.data = Metered(_FakeReplicas([against] * (P - 1)), meter, "data")  # type: ignore
    got = [s.clone() for s in signs]
    lc._vote_here(list(zip(params, got)))
    factor = {1: 1.0, 2: 0.0, 3: -1.0}[P]  # one voice, a tie, outvoted
    assert all(torch.equal(g, factor * s) for g, s in zip(got, signs))
    assert meter == {"data": 12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_check_finds_every_nan_and_infinity(dtype: torch.dtype) -> None:
    """The replicas' check (least and greatest element of each tensor) finds one NaN,
    +inf or -inf anywhere, in any tensor of the list; empty tensors and lists pass."""
    def tensors() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return [torch.randn(shape, generator=g).to(dtype) for shape in
                [(7, 5), (0,), (13,), (2, 3, 4)]]

    assert _all_finite(tensors()) and _all_finite([]) and _all_finite([torch.zeros(0)])
    big = tensors()
    big[0][3, 2] = torch.finfo(dtype).max  # finite, however large
    assert _all_finite(big)
    for which, index in ((0, (6, 4)), (2, (0,)), (3, (1, 2, 3))):
        for bad in (float("nan"), float("inf"), -float("inf")):
            ts = tensors()
            ts[which][index] = bad
            assert not _all_finite(ts), (which, bad)
            assert not _all_finite(iter(ts)), (which, bad)  # any iterable


class _FakeGlobal:
    """A global group of P leaders for `DASO` on one process: this leader's part is
    row 0 of the all-gather, the other leaders' are given; what was sent is kept."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.size, self.others, self.sent = len(others) + 1, others, []

    def allgather_start(self, t: torch.Tensor, out: torch.Tensor, what: str = "") -> object:
        self.sent.append(t.clone())
        out[0].copy_(t)
        for row, o in zip(out[1:], self.others):
            row.copy_(o)
        return type("Done", (), {"wait": lambda self: None})()


@pytest.mark.parametrize("P", [2, 3, 4])
def test_daso_exchange_arithmetic_is_exact(P: int) -> None:
    """DASO's exchanges in bfloat16 (kept buffers, each part widened before it is
    added): the difference sent is the float32 difference rounded once, the average is
    the reference plus the float32 sum of the parts over P, bitwise; and it equals a
    float32 `sum` over the gathered parts (the form it replaces).  Three exchanges in a
    row (the first sends the parameters, the next two differences: the kept buffers
    are reused), each merged by the progress rule."""
    torch.manual_seed(P)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    d = DASO(cycle=(2,))
    d.model, d.leader, d.node = model, True, None
    ref = None
    for ex in range(3):
        p0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        dt = torch.float32 if ref is None else torch.bfloat16
        others = [(p0 + torch.randn_like(p0) * 0.1 - (0 if ref is None else ref)).to(dt)
                  for _ in range(P - 1)]
        d.glob = fake = _FakeGlobal(others)
        d._start(2 * ex)
        sent = fake.sent[0]
        want_sent = p0 if ref is None else (p0 - ref).to(torch.bfloat16)
        assert sent.dtype == want_sent.dtype and torch.equal(sent, want_sent), ex
        with torch.no_grad():  # the node trains on before the merge
            for p in model.parameters():
                p.add_(0.01)
        parts = torch.stack([sent] + others)
        acc = parts[0].float()
        for r in parts[1:]:
            acc = acc + r.float()
        want = acc / P if ref is None else ref + acc / P
        assert torch.equal(want, (parts.sum(0, dtype=torch.float32) / P) if ref is None
                           else ref + parts.sum(0, dtype=torch.float32) / P)
        d._finish()
        assert torch.equal(d.ref, want), ex
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.allclose(got, want + 0.01, rtol=0, atol=1e-6), ex  # avg + progress
        ref = want.clone()


@pytest.mark.mpi
@pytest.mark.parametrize("launcher, nan", [("mpiexec", "allreduce,daso,lioncub,unattached"),
                                           ("torchrun", "daso")])
def test_strategies_on_four_processes(launcher: str, nan: str) -> None:
    """See the module docstring.  Under torchrun only DASO's NaN case runs: after a
    failure a gloo process group cannot be used again, so one failure per job."""
    run = {"mpiexec": run_mpi, "torchrun": run_torchrun}[launcher]
    proc = run(WORKERS / "lp_sync.py", 4, "suite", nan, timeout=240)
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in LINE.finditer(proc.stdout)}
    assert sorted(got) == [0, 1, 2, 3] and all(v[0] == "OK" for v in got.values()), \
        describe(proc)
    for _, detail in got.values():
        assert "daso=allreduce 2x2" in detail and "resume allreduce" in detail, detail
        assert "daso merge progress:2x2" in detail and "weighted:4x1" in detail, detail
        assert "daso cooldown 2x2" in detail and "4x1" in detail, detail
        assert "lioncub zeros 2x2=lion" in detail, detail
        for name in nan.split(","):
            m = re.search(rf"{name}=(\w+)@([\d.]+)s", detail)
            assert m, detail
            # every process raises: rank 2 (poisoned) its own error or the remote one
            assert m.group(1) in ("RuntimeError" if name == "unattached" else
                                  "DivergenceError", "RemoteError"), detail
            assert float(m.group(2)) < 10.0, detail


@pytest.mark.mpi
def test_lioncub_with_equal_batches_is_lion() -> None:
    """Two replicas (2x1) given the same batch: Lion Cub is plain Lion, a dead ReLU
    unit's zero-gradient entries stay where they are (the 2x2 grid: in the suite)."""
    proc = run_mpi(WORKERS / "lp_sync.py", 2, "zeros", timeout=120)
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in LINE.finditer(proc.stdout)}
    assert sorted(got) == [0, 1] and all(v[0] == "OK" for v in got.values()), \
        describe(proc)
    assert all(v[1].startswith("lioncub zeros 2x1=lion") and v[1].endswith("dead moved 0")
               for v in got.values()), describe(proc)


def test_summary_line_reports_sync_bytes() -> None:
    from layerpar.apps.train import format_summary, parse_summary

    res = {"model": "peaks", "serial": False, "val_acc": 0.873, "train_loss": 0.321,
           "ms_per_batch": 12.34, "fwd_iters": 2.0, "fwd_res": 0.031, "bwd_iters": 1.0,
           "bwd_res": None, "ranks": 4, "data_parallel": 2, "sync_bytes": 1803.4}
    line = format_summary(res)
    assert "12.3 ms/batch | sync_bytes 1803 | fwd iters" in line
    back = parse_summary(line)
    assert back["sync_bytes"] == 1803 and back["data_parallel"] == 2


def test_replicas_note_says_what_the_summary_cannot() -> None:
    """A data-parallel run names its strategy, nodes, optimizer and bytes by kind (the
    summary's sync_bytes adds data and inter-node bytes; DASO saves inter-node ones),
    and says where DASO on one node trains as an all-reduce (a new user saw the same
    figures as --sync allreduce and no word why)."""
    from types import SimpleNamespace

    from layerpar.apps.train import _replicas_note

    def grid(nodes: int) -> SimpleNamespace:
        return SimpleNamespace(data=2, layers=2, data_node_count=lambda: nodes)

    res = SimpleNamespace(sync="daso", optimizer=None,
                          bytes_by_kind={"data": 12084.0, "internode": 0.0, "p2p": 9.6})
    one = _replicas_note(grid(1), res)  # type: ignore[arg-type]
    assert one.startswith("2 data replicas x 2 rank(s), sync daso over 1 node(s), "
                          "optimizer adam; bytes sent per process per batch: data 12084, "
                          "inter-node 0, MGRIT 10"), one
    assert "trains as an all-reduce" in one
    assert "all-reduce" not in _replicas_note(grid(2), res)  # type: ignore[arg-type]


@pytest.mark.parametrize("argv, text", [
    (["--data-parallel", "2", "--nodes", "3"], "`--nodes` must be >= 1 and divide"),
    (["--data-parallel", "2", "--sync", "lioncub", "--optimizer", "adam"],
     "`--sync lioncub` exchanges Lion updates"),
    (["--data-parallel", "2", "--slow-link", "0"], "`--slow-link` must be a positive"),
])
def test_cli_sync_options_are_checked(argv: list, text: str) -> None:
    from layerpar.apps.cli import parse_args

    with pytest.raises(ValueError, match=re.escape(text)):
        parse_args(["train", "peaks", "--np", "4", *argv])
