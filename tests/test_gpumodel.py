"""The GPU launch + work model (layerpar/studies/gpumodel.py): its H100 constants come
from the measured rows in docs/results/gpu as documented, it predicts the held-out rows of the
default run within the issue's 25%, names the regimes, and its command runs."""
from __future__ import annotations

import pytest

from layerpar.apps.studies import gpumodel as gm
from layerpar.apps.studies.cli import main as studies_main


def test_h100_constants_are_the_calibration_of_the_measured_rows() -> None:
    got = gm.calibrate(gm.read_rows())
    for name in ("latency_graph", "latency_eager", "conv_efficiency", "engine_step_host"):
        assert getattr(got, name) == pytest.approx(getattr(gm.H100, name), rel=0.01), name


def test_held_out_rows_of_the_default_run_within_25_percent() -> None:
    rows = gm.validate()
    held = [r for r in rows if r["file"] == "bench-gpu.csv" and not r["fitted"]]
    assert len(held) == 4  # dense MGRIT graph; conv eager serial, MGRIT graph and eager
    for r in held:
        assert abs(r["rel_error"]) <= 0.25, r
    assert sum(r["fitted"] for r in rows) == len(gm.FIT_ROWS)


def test_regimes_of_the_measured_nets() -> None:
    dense = gm.predict_gpu("dense", 1024, 256, 64, levels=4, serial_ops=16410, mgrit_ops=881)
    conv = gm.predict_gpu("conv", 256, 64, 16, 32, levels=3, serial_ops=2330, mgrit_ops=616)
    assert dense.regime.startswith("launch-bound") and dense.speedup_vs_graph > 5
    assert conv.regime.startswith("compute-bound") and conv.speedup_vs_graph < 1
    assert conv.work_ratio > 2  # MGRIT's extra arithmetic is why conv cannot win


def test_predict_gpu_command(capsys) -> None:
    assert studies_main(["predict-gpu", "--model", "transformer", "--layers", "8",
                         "--width", "8", "--heads", "2", "--size", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "predicted speedup" in out and "-bound" in out
    with pytest.raises(SystemExit) as e:
        studies_main(["predict-gpu", "--layers", "0"])
    assert e.value.code == 2
    assert "--layers must be >= 1" in capsys.readouterr().err


def test_validate_command(capsys) -> None:
    assert studies_main(["predict-gpu", "--validate"]) == 0
    assert "held-out rows" in capsys.readouterr().out


def test_bad_model_is_named() -> None:
    with pytest.raises(ValueError, match="`model`"):
        gm.step_work("rnn", 1, 1)


def test_bench_rows_have_the_models_prediction() -> None:
    from layerpar.apps import gpubench

    assert gpubench.model_args("transformer") == ("transformer", 256, 16, 128, 64, 4)
    assert gpubench.model_args("conv16") == ("conv", 1024, 16, 16, 16, 4)
    p = gpubench.prediction("conv16", serial_ops=9242, mgrit_ops=800)
    assert p.mgrit_graph > 0 and p.regime.endswith(")")
    assert set(gpubench.ROWS) == {"dense", "conv", "conv16", "transformer"}
