"""One look for every figure: Agg backend, paper-sized fonts, and series told apart without colour.

Every series gets a colour from the Okabe-Ito colour-blind-safe palette AND its own marker and line style,
so the figures still read when printed in greyscale. Bars get hatches for the same reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never open a window (CI, SSH, the demo)

from matplotlib.figure import Figure  # noqa: E402  (after the backend choice)

# Okabe & Ito (2008) palette, black first; distinct in colour-blind vision and mostly distinct in grey. Then eight
# more of Paul Tol's (muted: indigo, wine, green, olive, purple, sand, rose; and a brown), so that the 14+ hardware
# profiles of a report each get their own colour (markers and line styles still tell them apart in grey).
COLORS = ["#000000", "#E69F00", "#0072B2", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442",
          "#332288", "#882255", "#117733", "#999933", "#AA4499", "#8C564B", "#DDCC77", "#CC6677"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "p", "h", "d", "8"]  # 14 shapes: a dozen profiles stay apart
LINESTYLES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (5, 5))]
HATCHES = ["", "///", "...", "xxx", "\\\\\\", "+++", "ooo"]
GREYS = ["0.15", "0.45", "0.7", "0.9", "0.3", "0.6"]  # fills for stacked bars, dark to light

RC_PARAMS = {
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.3,
    "lines.markersize": 4.5,
    "legend.frameon": False,
    "pdf.fonttype": 42,  # embed TrueType so the PDF text stays editable/searchable
    "savefig.dpi": 200,
    "figure.dpi": 100,
}

SINGLE_COLUMN_IN = (3.5, 2.6)  # one column of a two-column paper
DOUBLE_COLUMN_IN = (7.2, 2.8)  # full page width


def series_style(index: int) -> dict:
    """Colour, marker and line style of the `index`-th series; the same index always looks the same."""
    return {
        "color": COLORS[index % len(COLORS)],
        "marker": MARKERS[index % len(MARKERS)],
        "linestyle": LINESTYLES[index % len(LINESTYLES)],
    }


def styled(draw: Callable[..., Figure]) -> Callable[..., Figure]:
    """Decorator for figure functions: draw under the project style without touching the caller's rcParams."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs) -> Figure:
        with matplotlib.rc_context(RC_PARAMS):
            return draw(*args, **kwargs)

    return wrapper


def new_figure(size_in: tuple[float, float] = SINGLE_COLUMN_IN) -> Figure:
    """A figure not attached to pyplot (no global state, freed when dropped), laid out without overlaps."""
    return Figure(figsize=size_in, layout="constrained")


def save_figure(figure: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Write `stem`.png (for the report) and `stem`.pdf (for papers); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    for path in paths:
        figure.savefig(path, dpi=RC_PARAMS["savefig.dpi"], bbox_inches="tight", pad_inches=0.03)
    return paths
