"""Plots of a scaling study (PNG, matplotlib's Agg backend; no display needed).

- ``speedup.png``: speedup over the best serial baseline vs ranks, measured (solid)
  and predicted (dotted), with the ideal line speedup = ranks × threads.
- ``breakdown.png``: seconds per batch split into forward compute, backward compute
  (+ optimizer) and communication + idle, with the serial baseline as a marker.
- ``residuals.png``: MGRIT residual norm per iteration (forward and adjoint) from each
  run's diagnostic solve.
- ``predicted_vs_measured.png``: the model against the measurements, fit and
  validation rows marked apart.
- ``model_map.png``: the model's extrapolation over 64…4096 ranks and 1024…16384
  layers: speedup over serial, and MGRIT time against pipeline parallelism.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from . import perfmodel
from .files import write_bytes

__all__ = ["PLOT_NAMES", "PNG_MARKER", "plot_all", "plot_breakdown", "plot_map",
           "plot_predicted", "plot_residuals", "plot_speedup"]

#: the files `plot_all` writes
PLOT_NAMES = ("speedup.png", "breakdown.png", "residuals.png", "predicted_vs_measured.png",
              "model_map.png")
#: in every plot's metadata: how a re-run knows the file is a study's, not a person's
PNG_MARKER = "layerpar scaling study"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    """Save `fig` as a PNG at `path` whole or not at all (rendered in memory, then
    `files.write_bytes`), so an interrupted study leaves no truncated image."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png", metadata={"Software": PNG_MARKER})
    write_bytes(path, buf.getvalue())


def _f(r: dict[str, Any], k: str) -> float:
    try:
        return float(r[k])
    except (KeyError, TypeError, ValueError):
        return float("nan")


def _i(r: dict[str, Any], k: str) -> int:
    return int(_f(r, k))


def _label(r: dict[str, Any], with_ranks: bool = True) -> str:
    s = f"P{_i(r, 'ranks')}×{_i(r, 'threads')}t " if with_ranks else ""
    return (s + f"N{_i(r, 'layers')} L{_i(r, 'levels')} cf{_i(r, 'cfactor')} "
            f"it{_i(r, 'fwd_iters')}/{_i(r, 'bwd_iters')}")


def _history(v: Any) -> list[float]:
    if isinstance(v, (list, tuple)):
        return [float(x) for x in v]
    if not v:
        return []
    return [float(x) for x in str(v).split(";") if x]


def plot_speedup(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Speedup vs ranks per configuration, with the ideal line."""
    plt = _plt()
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        base = _i(r, "layers") // (_i(r, "ranks") if r.get("scaling") == "weak" else 1)
        groups[(r.get("model"), r.get("scaling"), base, _i(r, "width"), _i(r, "batch"),
                _i(r, "levels"), _i(r, "cfactor"), _i(r, "fwd_iters"), _i(r, "bwd_iters"),
                _i(r, "threads"))].append(r)
    fig, ax = plt.subplots(figsize=(7, 5))
    pmax = max(_i(r, "ranks") * _i(r, "threads") for r in rows)
    for k, (g, rs) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        rs = sorted(rs, key=lambda r: _i(r, "ranks"))
        x = [_i(r, "ranks") for r in rs]
        color = plt.cm.tab20(k % 20) if len(groups) > 10 else f"C{k}"
        model, scaling, base, w, b, lv, cf, fi, bi, th = g
        name = (f"{model} {scaling} N{base}{'×P' if scaling == 'weak' else ''} w{w} b{b} "
                f"L{lv} cf{cf} it{fi}/{bi} {th}t")
        ax.plot(x, [_f(r, "speedup") for r in rs], "o-", color=color, label=name)
        pred = [_f(r, "serial_seconds_per_batch") / _f(r, "predicted_seconds_per_batch")
                for r in rs]
        ax.plot(x, pred, "x:", color=color)
    xs = sorted({_i(r, "ranks") for r in rows} | {1})
    ax.plot(xs, [x * 1.0 for x in xs], "k--", lw=1, label="ideal (speedup = ranks)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("speedup over best serial PyTorch (solid: measured, dotted: model)")
    ax.set_title(f"Layer-parallel speedup (up to {pmax} cores used)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_breakdown(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Stacked bars: forward compute, backward compute, communication + idle."""
    plt = _plt()
    rs = sorted(rows, key=lambda r: (_i(r, "layers"), _i(r, "levels"), _i(r, "ranks")))
    fwd = [max(0.0, _f(r, "forward_seconds") - _f(r, "fwd_comm_idle_seconds")) for r in rs]
    bwd = [max(0.0, _f(r, "backward_seconds") - _f(r, "bwd_comm_idle_seconds")) for r in rs]
    idle = [_f(r, "comm_idle_seconds") for r in rs]
    x = list(range(len(rs)))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rs) + 2), 5))
    ax.bar(x, fwd, label="forward compute", color="C0")
    ax.bar(x, bwd, bottom=fwd, label="backward compute + optimizer", color="C1")
    ax.bar(x, idle, bottom=[a + b for a, b in zip(fwd, bwd)], label="communication + idle",
           color="C3")
    ax.scatter(x, [_f(r, "serial_seconds_per_batch") for r in rs], marker="_", s=600,
               color="k", zorder=3, label="serial PyTorch (best threads)")
    ax.set_xticks(x)
    ax.set_xticklabels([_label(r) for r in rs], rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("seconds per batch (median over timed batches)")
    ax.set_title("Where the time goes (slowest rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_residuals(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Residual norm per MGRIT iteration, forward and adjoint."""
    plt = _plt()
    # the diagnostic solve depends on the hierarchy, not on the ranks or on the
    # iterations used in training: one curve per (model, depth, levels, cfactor)
    seen: dict[tuple, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: (_i(r, "ranks"), _i(r, "fwd_iters"))):
        seen.setdefault((r.get("model"), _i(r, "width"), _i(r, "layers"), _i(r, "levels"),
                         _i(r, "cfactor"), _i(r, "nrelax")), r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, col, title in ((axes[0], "fwd_residual_history", "forward solve"),
                           (axes[1], "bwd_residual_history", "adjoint solve")):
        for k, r in enumerate(seen.values()):
            h = _history(r.get(col))
            if h:
                # with skip, the history starts at r_1
                ax.semilogy(range(1, len(h) + 1), h, "o-", color=f"C{k % 10}", ms=3,
                            label=f"N{_i(r, 'layers')} L{_i(r, 'levels')} "
                                  f"cf{_i(r, 'cfactor')} (P{_i(r, 'ranks')})")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("iteration k")
        ax.set_ylabel("residual norm r_k")
        ax.set_title(f"{title} (diagnostic solve, no tolerance)")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(fontsize=6)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_predicted(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Predicted vs measured seconds per batch."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    allv = []
    for role, marker, color in (("fit", "o", "C0"), ("validate", "s", "C3")):
        rs = [r for r in rows if r.get("model_role") == role]
        if not rs:
            continue
        m = [_f(r, "seconds_per_batch") for r in rs]
        p = [_f(r, "predicted_seconds_per_batch") for r in rs]
        allv += m + p
        ax.scatter(m, p, marker=marker, color=color, label=f"{role} ({len(rs)} runs)")
        for r, a, b in zip(rs, m, p):
            ax.annotate(f"P{_i(r, 'ranks')} N{_i(r, 'layers')}", (a, b), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    vals = [v for v in allv if math.isfinite(v) and v > 0]
    if vals:
        lo, hi = min(vals) / 1.3, max(vals) * 1.3
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds per batch")
    ax.set_ylabel("predicted seconds per batch")
    ax.set_title("Performance model vs measurement")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_map(m: perfmodel.ExtrapolationMap, path: Path) -> Path:
    """Two heat maps over ranks × layers: log2 speedup of MGRIT over serial, and log2 of
    pipeline time / MGRIT time; the contour at 1 marks where MGRIT wins."""
    plt = _plt()
    import numpy as np

    mg = np.array(m.mgrit, dtype=float)
    serial = np.array(m.serial, dtype=float)[None, :]
    pipe = np.array(m.pipeline, dtype=float)
    panels = (
        (np.log2(serial / mg), "log2(serial / MGRIT): MGRIT beats serial where > 0"),
        (np.log2(pipe / mg), f"log2(pipeline / MGRIT), m = {m.micro_batches} micro-batches:"
                             "\nMGRIT beats pipeline where > 0"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (z, title) in zip(axes, panels):
        finite = z[np.isfinite(z)]
        lim = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
        im = ax.imshow(z, origin="lower", cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        if finite.size and finite.min() < 0 < finite.max():
            ax.contour(np.where(np.isfinite(z), z, -lim), levels=[0.0], colors="k",
                       linewidths=1.5)
        for i in range(z.shape[0]):
            for j in range(z.shape[1]):
                if np.isfinite(z[i, j]):
                    ax.text(j, i, f"{2 ** z[i, j]:.2g}×\nL{m.levels[i][j]}", ha="center",
                            va="center", fontsize=6)
                else:
                    ax.text(j, i, "P>N", ha="center", va="center", fontsize=6,
                            color="grey")
        ax.set_xticks(range(len(m.layers)))
        ax.set_xticklabels(m.layers)
        ax.set_yticks(range(len(m.ranks)))
        ax.set_yticklabels(m.ranks)
        ax.set_xlabel("layers")
        ax.set_ylabel("ranks")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    s = m.settings
    fig.suptitle(f"Model extrapolation (costs measured here: width {s.get('width')}, batch "
                 f"{s.get('batch')}; cf {s.get('cfactor')}, iterations "
                 f"{s.get('fwd_iters')}/{s.get('bwd_iters')}; best level count per cell, "
                 f"Lk; alpha {s.get('alpha_s', 0) * 1e6:.2g} us)", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def plot_all(rows: Sequence[dict[str, Any]], out_dir: Union[str, Path],
             fit: Optional[perfmodel.Fit] = None, *,
             map_ranks: Sequence[int] = perfmodel.MAP_RANKS,
             map_layers: Sequence[int] = perfmodel.MAP_LAYERS) -> list[Path]:
    """Write every plot of the study `rows` into `out_dir`; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if math.isfinite(_f(r, "seconds_per_batch"))]
    if not rows:
        return []
    speedup, breakdown, residuals, predicted, model_map = (out / n for n in PLOT_NAMES)
    paths = [plot_speedup(rows, speedup), plot_breakdown(rows, breakdown),
             plot_residuals(rows, residuals), plot_predicted(rows, predicted)]
    m = perfmodel.extrapolate(rows, fit, ranks=map_ranks, layers=map_layers)
    paths.append(plot_map(m, model_map))
    return paths
