"""``options="auto"`` as a user's own loop meets it: blocks frozen and unfrozen
mid-training and ``.to(dtype)`` reach every setting auto holds; an engine auto cannot
use is refused at construction; README's check loop (`model.accuracy.check_due`)
works whatever auto chose; without a `tune` call the bound holds for the training's
own loss; ``layerpar train --auto`` tells one consistent story.
"""
from __future__ import annotations

import pytest
from mpi_util import WORKERS, rank_lines, run_mpi
from tolerances import F32, F64


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2])
def test_freezing_and_to_dtype_under_auto(nprocs: int) -> None:
    """A block frozen before the tuning, unfrozen later, another frozen, every
    parameter of one rank frozen, then ``model.to(torch.float32)``: through auto's
    choice (the replicated batch split at 2 ranks, serial autograd at one) every step's
    output and gradients equal the serial net's (float64, then float32), frozen
    parameters get no gradient.  (The batch split fixed its trainable set when built:
    the gradients came out 12x off after a block frozen on its owner only, and a block
    frozen later failed the backward.)  An MGRIT choice moved to float32 runs there,
    with the inexactness it had in float64.  Replicated serial without the split, the
    last rank's layers all frozen: that rank's backward runs too (no graph there)."""
    proc = run_mpi(WORKERS / "lp_auto_freeze_to.py", nprocs, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), proc.stdout
    assert all(lines[r] == lines[0] for r in lines), lines
    got = lines[0]
    want = "serial (replicated, batch split)" if nprocs > 1 else "serial autograd"
    assert got[0] == f"choice {want}", got
    steps = [s.split() for s in got if s.startswith("step ")]
    ks = [1, 2, 3, 4, 5, 6, 7, 8, 9] if nprocs > 1 else [1, 2, 3, 4, 7, 8]
    assert [int(s[1]) for s in steps] == ks, got
    for s in steps:
        tol = F32.exact if s[2] == "float32" else F64.roundoff
        assert s[2] == ("float32" if int(s[1]) in (7, 8) else "float64"), s
        assert float(s[4]) <= tol and float(s[6]) <= tol and s[8] == "True", s
    if nprocs > 1:  # (step 9: replicated serial, the last rank's layers all frozen)
        assert "whole choice serial (replicated)" in got, got
    mgrit = next(s.split() for s in got if s.startswith("mgrit "))
    assert mgrit[-4] == "float32", mgrit
    assert float(mgrit[-3]) == pytest.approx(float(mgrit[-1]), rel=1e-4), mgrit


def test_auto_refuses_another_engine() -> None:
    """``options="auto"`` with ``engine="xbraid"`` is refused at construction, naming
    both (it was accepted, and the first pass failed naming `batched`, which the user
    never set); the refusal comes before the engine is needed, built or not."""
    import torch

    from layerpar.apps.nets import problem_net
    from layerpar.parallel import LayerParallel

    torch.manual_seed(0)
    net = problem_net("peaks", 8, 4).double()
    with pytest.raises(ValueError, match=r"`engine`='xbraid' with options='auto'"):
        LayerParallel(net, None, "auto", engine="xbraid")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2])
def test_check_loop_under_auto(nprocs: int) -> None:
    """The adaptive check loop (``if model.accuracy.check_due(batch):
    model.check_gradients(...)``) runs under auto before the first tuning and after
    each choice (forced by a fake clock): MGRIT is checked, an exact setting (exact
    propagation or serial autograd, replicated serial) has nothing due and says it
    runs exactly (`model.accuracy` was None there: AttributeError).  ``engine="xbraid"``
    with auto is refused on every rank at construction."""
    proc = run_mpi(WORKERS / "lp_auto_check_loop.py", nprocs, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), proc.stdout
    assert all(lines[r] == lines[0] for r in lines), lines
    loops = {x.split(" | ")[0].split()[1]: x.split(" | ") for x in lines[0]
             if x.startswith("loop ")}
    want = {"mgrit": "L2 cf4 1/1 batched",
            "exact": "exact propagation" if nprocs > 1 else "serial autograd",
            "replicated": "serial (replicated)"}
    assert sorted(loops) == sorted(["mgrit", "exact"] + (["replicated"] if nprocs > 1
                                                         else [])), lines[0]
    for name, got in loops.items():
        assert got[1] == f"choice {want[name]}" and got[2] == "due0 False", got
        if name == "mgrit":
            assert got[3] != "checks -" and got[4] == "exact False", got
        else:
            assert got[3] == "checks -" and got[4] == "exact True", got
    engine = next(x for x in lines[0] if x.startswith("engine "))
    assert "`engine`='xbraid' with options='auto'" in engine, engine


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2])
def test_bound_holds_for_the_trained_loss_without_tune(nprocs: int) -> None:
    """Batch norm in the blocks, no `tune` call, MGRIT "faster" by a fake clock: the
    setting auto runs after the first batch's check has a gradient error on the
    training loss of its tuning batch within the bound that tuning printed.  (It tuned
    on a surrogate loss and printed "relative error <= 0.05" for a choice 0.125 off on
    the real loss.)  Here the first tuning, at the first backward, is first order (its
    choice 0.211 off against 0.2), so the check due at once tunes again on the loss
    itself."""
    proc = run_mpi(WORKERS / "lp_auto_bn_bound.py", nprocs, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = rank_lines(proc.stdout)
    assert sorted(lines) == list(range(nprocs)), proc.stdout
    assert all(lines[r] == lines[0] for r in lines), lines
    real = next(x.split() for x in lines[0] if x.startswith("real "))
    err, cos, bound, min_cos = (float(real[k]) for k in (1, 2, 4, 5))
    assert err <= bound and cos >= min_cos, real
    assert real[7] == "L2", real  # an MGRIT setting: its error is a real one


def test_one_batch_numbering_and_the_last_check_line(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """Tunings, the chosen setting's controller and the checks count training batches
    as the training loop does (evaluation passes between them count for none: the
    tunings counted every pass, and the controller counted from its own creation, so
    ``layerpar train --auto`` printed tunings at 574 and 937 beside adaptive lines at
    94 and 171 of one run).  The last check's line names its own batch and, above
    the bound, says so and what auto did."""
    import torch
    from test_autotune import _fixed_cost, _stiff_batch

    from layerpar.apps.train import _auto_check_note, last_check_line
    from layerpar.parallel import LayerParallel
    from layerpar.parallel.adaptive import AccuracyPolicy

    _fixed_cost(monkeypatch)
    net, x, y = _stiff_batch(1.0)
    loss = torch.nn.functional.cross_entropy
    model = LayerParallel(net, None, "auto", accuracy=AccuracyPolicy(max_rel_error=0.05))
    model.tune(x, y, loss)
    tuner = model.tuner
    assert tuner.results[0].batch == 1  # tuned on the first batch, before it trained
    c = tuner.results[0].choice
    for batch in range(1, 6):
        loss(model(x), y).backward()
        model.eval()
        with torch.no_grad():  # an evaluation between training batches
            model(x)
            model(x)
        model.train()
        assert tuner.batches == batch and tuner.chosen.batch == batch
    # outside a tighter bound: the first check changes nothing, the second tunes again
    tuner.policy = AccuracyPolicy(max_rel_error=c.rel_error / 2)
    got = model.check_gradients(x, y, loss)
    note = _auto_check_note(model, 5, got)
    assert note is not None and note.startswith(
        f"above the bound (relative error <= {c.rel_error / 2:.3g}, cosine >= 0.99): auto "
        f"kept {c.candidate.name(1)}: one check's error is a noisy estimate"), note
    for _ in range(6, 8):
        loss(model(x), y).backward()
    got = model.check_gradients(x, y, loss)
    assert [r.batch for r in tuner.results] == [1, 7]
    note = _auto_check_note(model, 7, got)
    assert note is not None and "auto tuned again on this batch and chose " \
        f"{tuner.choice_name(1)}" in note, note
    assert tuner.chosen.batch == 7  # the new setting's controller counts on from there
    loss(model(x), y).backward()
    assert tuner.chosen.batch == 8
    events = [e.batch for e in model.accuracy.log]
    assert all(1 <= b <= 8 for b in events), events
    line = last_check_line({"batch": 7, "exact": False, "cosine": got.cos,
                            "rel_error": got.error, "mgrit_cosine": got.cos,
                            "mgrit_rel_error": got.error, "note": note})
    assert line.startswith(f"last gradient check (batch 7): cosine {got.cos:.4f}, "
                           f"relative error {got.error:.3g}; above the bound"), line
    assert _auto_check_note(model, 6, got) is None  # (not the last check's batch)
    model.close()
