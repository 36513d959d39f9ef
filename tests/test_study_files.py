"""Study files (issue 10, item 1): resuming never destroys data.

A damaged ``results.csv`` (no header, a row cut short, two rows run together, a word
where a number belongs), a worker log with a partial last line, or a damaged
ping-pong cache is refused with a message naming the file and line, before anything
is measured, and the file is left byte for byte as it was.  An unusable ``--out`` is
one line on stderr with exit status 2.  A write that fails half way (here: the file
size limit, as a full disk would) leaves the old file whole.

No MPI: measurements are replaced by a function that fails the test if called.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from layerpar.apps.studies import cli, runner
from layerpar.apps.studies import perfmodel as pmodel
from layerpar.apps.studies.files import StudyFileError, append_line, read_jsonl
from layerpar.apps.studies.runs import config

GRID = {"ranks": [1], "layers": [4, 8], "width": 2, "batch": 2, "steps": 1, "warmup": 0,
        "diag_iters": 0}


class Measured(Exception):
    """Raised by the stand-ins of every measurement: the study got past its checks."""


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: Any, **kwargs: Any) -> Any:
        raise Measured("a measurement started")

    monkeypatch.setattr(runner, "serial_baseline", measured)
    monkeypatch.setattr(pmodel, "measure_costs", measured)
    monkeypatch.setattr(runner, "_launch", measured)
    monkeypatch.setattr(runner, "run_pingpong", measured)


def _row(layers: int) -> dict[str, Any]:
    """A finished run's row as a study writes it (the numbers are made up, the form is
    the real one)."""
    cfg = config({"ranks": 1, "layers": layers, "width": 2, "batch": 2, "steps": 1,
                  "warmup": 0, "diag_iters": 0})
    meas = {c: 0.5 for c in runner.REQUIRED_COLUMNS if c not in cfg}
    meas["predicted_seconds_per_batch"] = None  # before the model is fitted: empty
    meas.update({c: 1e-6 for c in pmodel.COST_COLUMNS.values()})
    return {**cfg, **meas, "ranks": 1, "scaling": "strong", "serial_threads": 1,
            "fwd_residual_history": [1e-3, 1e-5]}


def _study_csv(folder: Path, layers: tuple[int, ...] = (4,)) -> Path:
    path = folder / "results.csv"
    runner._write_rows(path, [_row(n) for n in layers])
    return path


def _refused(csv_path: Path, pattern: str, out_dir: Path | None = None) -> None:
    before = {p: p.read_bytes() for p in csv_path.parent.iterdir() if p.is_file()}
    with pytest.raises(StudyFileError, match=pattern):
        runner.run_study(GRID, csv_path, out_dir=out_dir, progress=False, plots=False)
    after = {p: p.read_bytes() for p in csv_path.parent.iterdir() if p.is_file()}
    assert after == before  # nothing rewritten, nothing added


def test_valid_csv_reads_back_and_resumes(tmp_path: Path) -> None:
    path = _study_csv(tmp_path, (4, 8))
    rows = runner.read_rows(path)
    assert [int(r["layers"]) for r in rows] == [4, 8]
    res = runner.run_study(GRID, path, progress=False, plots=False)  # nothing to measure
    assert res.launched == 0 and res.skipped == 2 and len(res.rows) == 2


def test_csv_without_header_is_refused(tmp_path: Path, no_measuring: None) -> None:
    path = _study_csv(tmp_path)
    path.write_bytes(path.read_bytes().split(b"\n", 1)[1])  # the header line lost
    _refused(path, r"results\.csv: line 1 is not a study header.*lacks the column\(s\) "
                   r"ranks.*Nothing was changed")


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_csv_cut_inside_a_row_is_refused(tmp_path: Path, no_measuring: None,
                                         keep: float) -> None:
    path = _study_csv(tmp_path)
    data = path.read_bytes()
    head, row = data.split(b"\n", 1)
    path.write_bytes(head + b"\n" + row[:int(len(row) * keep)])  # a write interrupted
    _refused(path, r"results\.csv: line 2 is incomplete .*interrupted.*delete or repair")


def test_csv_rows_run_together_are_refused(tmp_path: Path, no_measuring: None) -> None:
    path = _study_csv(tmp_path, (4, 8))
    lines = path.read_bytes().split(b"\r\n")
    glued = lines[0] + b"\r\n" + lines[1][: len(lines[1]) // 2] + lines[2] + b"\r\n"
    path.write_bytes(glued)  # a cut row, then the next run appended onto it
    _refused(path, r"results\.csv: line 2 has \d+ fields, the header has \d+")


@pytest.mark.parametrize("column,value", [("ranks", "abc"), ("layers", "4.5"),
                                          ("seconds_per_batch", "fast"), ("lr", "inf"),
                                          ("model", "resnet")])
def test_csv_with_a_bad_value_is_refused(tmp_path: Path, no_measuring: None, column: str,
                                         value: str) -> None:
    path = _study_csv(tmp_path, (4, 8))
    rows = runner.read_rows(path)
    rows[1][column] = value
    runner._write_rows(path, rows)
    _refused(path, rf"results\.csv: line 3 has `{column}` '{value}'")


def test_partial_worker_log_line_is_refused(tmp_path: Path, no_measuring: None) -> None:
    path = _study_csv(tmp_path)
    log = tmp_path / "worker-1.jsonl"
    log.write_text('{"layers": 4, "seconds_per_batch": 0.5}\n{"layers": 8, "secon')
    _refused(path, r"worker-1\.jsonl: line 2 is incomplete.*delete that line")
    log.write_text('{"layers": 4}\nnot json\n')
    _refused(path, r"worker-1\.jsonl: line 2 is not valid JSON")


def test_damaged_pingpong_cache_is_refused(tmp_path: Path, no_measuring: None) -> None:
    path = _study_csv(tmp_path)
    (tmp_path / "pingpong.json").write_text('{"alpha_s": 1e-6, "be')
    _refused(path, r"pingpong\.json: cannot be read.*delete it to measure them again")


def _scale(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    args = cli.build_parser().parse_args(argv + ["--no-progress", "--no-plots"])
    code = cli.run(args)
    return code, capsys.readouterr().err


def test_out_that_is_a_file_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               no_measuring: None) -> None:
    target = tmp_path / "taken"
    target.write_text("not a folder")
    for out in (target, target / "below"):
        code, err = _scale(["--quick", "--out", str(out)], capsys)
        assert code == 2, err
        assert err.count("\n") == 1 and "error: `--out`" in err, err
    assert target.read_text() == "not a folder"


def test_results_csv_that_is_a_folder_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture,
                                                 no_measuring: None) -> None:
    (tmp_path / "results.csv").mkdir()
    code, err = _scale(["--quick", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "results.csv is a folder" in err, err


def test_damaged_csv_through_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              no_measuring: None) -> None:
    path = _study_csv(tmp_path)
    path.write_bytes(path.read_bytes()[:-40])
    before = path.read_bytes()
    code, err = _scale(["--quick", "--ranks", "1", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "results.csv: line 2 is incomplete" in err
    assert path.read_bytes() == before


# A write that fails half way: the file size limit stops it (as a full disk would).
# Run in a child process, which alone gets the limit.
_LIMITED_APPEND = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from test_study_files import _row
    from layerpar.apps.studies import runner
    from layerpar.apps.studies.files import append_line
    path = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
    size = path.stat().st_size
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 64, resource.RLIM_INFINITY))
    try:
        if sys.argv[2] == "csv":
            runner._append_row(path, _row(8))
        else:
            append_line(path, '{"layers": 8, "note": "' + "x" * 500 + '"}')
    except OSError as exc:
        print("failed:", exc)
""")


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_interrupted_append_leaves_the_old_file_whole(tmp_path: Path, kind: str) -> None:
    if kind == "csv":
        path = _study_csv(tmp_path)
    else:
        path = tmp_path / "worker-1.jsonl"
        append_line(path, '{"layers": 4}')
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _LIMITED_APPEND, str(path), kind,
                           str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=60)
    assert "failed:" in proc.stdout, proc.stdout + proc.stderr  # the write did fail
    assert path.read_bytes() == before  # ... and left no half row behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nor a temp file
    if kind == "csv":
        assert len(runner.read_rows(path)) == 1
    else:
        assert read_jsonl(path, "") == [{"layers": 4}]


def test_append_line_refuses_to_glue_onto_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "worker-1.jsonl"
    path.write_text('{"layers": 4}\n{"lay')
    with pytest.raises(StudyFileError, match=r"line 2 is incomplete"):
        append_line(path, '{"layers": 8}')
    assert path.read_text() == '{"layers": 4}\n{"lay'
    append_line(tmp_path / "new.jsonl", '{"a": 1}')
    append_line(tmp_path / "new.jsonl", '{"a": 2}')
    assert read_jsonl(tmp_path / "new.jsonl", "") == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("name, plots", [("model.json", False), ("worker-1.json", False),
                                         ("speedup.png", True), ("model_map.png", True)])
def test_a_persons_file_of_a_studys_name_is_refused(tmp_path: Path, no_measuring: None,
                                                    name: str, plots: bool) -> None:
    """The model's summary, a launch's run list and the plots are written whole over
    whatever had their name: a person's notes or own plot there were replaced without
    a word (a new user's trial); now refused before any measurement, nothing changed."""
    (tmp_path / name).write_text("my own notes")
    with pytest.raises(StudyFileError, match=re.escape(f"{name} exists and was not "
                                                       "written by this study")):
        runner.run_study(GRID, tmp_path / "results.csv", out_dir=tmp_path,
                         progress=False, plots=plots)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert (tmp_path / name).read_text() == "my own notes"


def test_the_studys_own_files_are_written_again(tmp_path: Path) -> None:
    """What the study wrote is its to replace: its model summary and run lists, its
    plots (their metadata says whose), and, in a folder it resumes, the plots it wrote
    before they carried that mark."""
    from layerpar.apps.studies import plots

    plt = plots._plt()
    fig = plt.figure()
    plots._save(fig, tmp_path / "speedup.png")
    plt.close(fig)
    (tmp_path / "model.json").write_text('{"call_overhead_s": 1e-4, "rows": []}')
    (tmp_path / "worker-2.json").write_text('{"out": "worker-2.jsonl", "runs": []}')
    runner._refuse_foreign(tmp_path, False, True, {2})  # nothing raised
    (tmp_path / "breakdown.png").write_bytes(b"\x89PNG an older study's plot")
    with pytest.raises(StudyFileError, match="breakdown.png exists"):
        runner._refuse_foreign(tmp_path, False, True, {2})
    runner._refuse_foreign(tmp_path, True, True, {2})  # resumed: the folder is a study's


def test_pingpong_refuses_a_persons_out_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """The standalone ping-pong replaced any file given to `--out`; now only an earlier
    ping-pong's JSON, refused in one line before any message otherwise."""
    from layerpar.apps.studies import pingpong

    for text in ("mine\n", '{"my": "notes"}'):
        mine = tmp_path / "mine.json"
        mine.write_text(text)
        with pytest.raises(SystemExit) as info:
            pingpong.main(["--quick", "--out", str(mine)])
        assert info.value.code == 2 and mine.read_text() == text
        err = capsys.readouterr().err
        assert "is not a ping-pong's JSON" in err and err.count("\n") == 1, err
    ours = tmp_path / "pp.json"
    ours.write_text('{"samples": [], "alpha_s": 1e-6, "beta_Bps": 1e9}')
    pingpong._check_out(ours)  # an earlier run's: accepted (it is measured again)
