"""plot.svg: parsed as XML, checked panel by panel, and rendered for real with rsvg-convert (librsvg2-bin).

scripts/test.sh installs rsvg-convert when it is missing (apt-get, as root); the PNG it writes is decoded here
with the stdlib (zlib + the PNG row filters), so the test needs no imaging package.
"""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

import pytest

from align.run import plot
from align.run.plot import write_plot

SVG = "{http://www.w3.org/2000/svg}"
MIN_INK_FRAC = 0.01  # share of a panel's data area that curves and markers cover (measured ~0.03 here)
INK_DELTA = 60  # a pixel is ink when a channel differs from white by more (grid lines #e5e5e5 are not ink)
COLOR_DELTA = 40  # max per-channel distance for "this series' colour"
MIN_COLOR_PIXELS = 20  # pixels of one series' colour inside the data area for it to count as visible
EVAL_KEYS = ("eval/pass@1", "eval/avg@4", "eval/pass@4")
PANEL_IDS = ("reward", "loss", "entropy", "length", "truncation", "throughput")


def _records() -> list[dict]:
    recs = []
    for s in range(21):
        if s:
            recs.append(
                {
                    "step": s,
                    "reward_mean": 0.2 + 0.03 * s if s != 7 else math.nan,  # a step where nothing was scorable
                    "loss": 0.5 / s - 0.1,
                    "kl": 0.01 * s,
                    "entropy": 2 - 0.05 * s,
                    "completion_len_mean": 5 + 0.2 * s,
                    "truncated_frac": 0.0,
                    "tokens_per_s": 1000 + 30 * math.sin(s),
                    "step_time": 0.5,
                }
            )
        if s % 5 == 0:  # eval/avg@4 equals eval/pass@1 at every point: the case that used to hide a curve
            v = 0.1 + 0.03 * s
            recs.append({"step": s, "eval/pass@1": v, "eval/avg@4": v, "eval/pass@4": v + 0.15, "eval/lag_steps": 1})
    return recs


def _panels(root) -> dict[str, ET.Element]:
    return {g.get("id").removeprefix("panel-"): g for g in root.iter(f"{SVG}g") if g.get("class") == "panel"}


def _offset(panel) -> tuple[float, float]:
    x, y = panel.get("transform").removeprefix("translate(").removesuffix(")").split(",")
    return float(x), float(y)


def test_plot_has_every_panel_and_metric_with_legends_beside_the_data(tmp_path):
    path = tmp_path / "plot.svg"
    write_plot(path, _records(), title="align GRPO: <run & co>")
    root = ET.parse(path).getroot()  # well-formed XML, the title escaped
    assert root.tag == f"{SVG}svg"
    panels = _panels(root)
    assert tuple(panels) == PANEL_IDS
    names = {
        pid: [g.get("data-name") for g in p.iter(f"{SVG}g") if g.get("class") == "series"] for pid, p in panels.items()
    }
    assert names["reward"] == ["reward_mean", "eval/pass@1", "eval/pass@4", "eval/avg@4"]  # not eval/lag_steps
    assert names["loss"] == ["loss", "kl"] and names["throughput"] == ["tokens_per_s"]
    assert names["length"] == ["completion_len_mean"] and names["truncation"] == ["truncated_frac"]
    right = plot.PLOT_LEFT + plot.PLOT_W
    for pid, p in panels.items():
        legend = next(g for g in p.iter(f"{SVG}g") if g.get("class") == "legend")
        xs = [float(e.get("x", e.get("x1", e.get("cx", "nan")))) for e in legend if e.tag != f"{SVG}polygon"]
        assert xs and min(xs) > right, (pid, xs)  # every legend item starts right of the data area
    # coinciding curves are drawn differently: colour, dash and width all differ
    series = {g.get("data-name"): g.find(f"{SVG}polyline") for g in panels["reward"].iter(f"{SVG}g")
              if g.get("class") == "series"}  # fmt: skip
    a, b = series["eval/pass@1"], series["eval/avg@4"]
    assert a.get("points") == b.get("points")
    for attr in ("stroke", "stroke-dasharray", "stroke-width"):
        assert a.get(attr) != b.get(attr), attr
    assert "nan" not in path.read_text()  # the unscorable step is left out, not drawn at NaN


def test_empty_run_still_draws_every_panel(tmp_path):
    write_plot(tmp_path / "plot.svg", [])
    panels = _panels(ET.parse(tmp_path / "plot.svg").getroot())
    assert tuple(panels) == PANEL_IDS
    assert all("no data" in "".join(p.itertext()) for p in panels.values())


# ---- rendering ----------------------------------------------------------------------------------------------------


def _decode_png(data: bytes) -> tuple[int, int, list[bytearray], int]:
    """(width, height, rows of bytes, bytes per pixel) of an 8-bit RGB/RGBA non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, head = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    w, h, depth, ctype, _, _, interlace = head
    assert depth == 8 and ctype in (2, 6) and interlace == 0, head
    bpp = 4 if ctype == 6 else 3
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray((u + v) & 255 for u, v in zip(line, prev))
        elif f == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif f == 4:
            for i in range(stride):
                a, b, c = (line[i - bpp], prev[i], prev[i - bpp]) if i >= bpp else (0, prev[i], 0)
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return w, h, rows, bpp


def _pixels(rows, bpp, x0, y0, x1, y1):
    for y in range(y0, y1):
        row = rows[y]
        for x in range(x0, x1):
            px = row[x * bpp : x * bpp + 3]
            alpha = row[x * bpp + 3] if bpp == 4 else 255
            yield tuple(255 - (255 - v) * alpha // 255 for v in px)  # over white


def _ink(rows, bpp, box) -> float:
    px = list(_pixels(rows, bpp, *box))
    return sum(1 for p in px if max(255 - v for v in p) > INK_DELTA) / len(px)


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))


def test_rendered_plot_is_not_blank_and_every_eval_curve_shows(tmp_path):
    exe = shutil.which("rsvg-convert")
    if exe is None:
        pytest.skip("rsvg-convert missing: apt-get install librsvg2-bin (scripts/test.sh installs it)")
    path = tmp_path / "plot.svg"
    write_plot(path, _records())
    png = tmp_path / "plot.png"
    subprocess.run([exe, str(path), "-o", str(png)], check=True, timeout=60)
    w, h, rows, bpp = _decode_png(png.read_bytes())
    root = ET.parse(path).getroot()
    assert (w, h) == (int(root.get("width")), int(root.get("height")))
    panels = _panels(root)
    inset = 3  # inside the frame
    boxes = {}
    for pid, p in panels.items():
        ox, oy = _offset(p)
        x0, y0 = int(ox + plot.PLOT_LEFT + inset), int(oy + plot.PLOT_TOP + inset)
        boxes[pid] = (x0, y0, x0 + plot.PLOT_W - 2 * inset, y0 + plot.PLOT_H - 2 * inset)
    for pid, box in boxes.items():
        ink = _ink(rows, bpp, box)
        assert ink > MIN_INK_FRAC, (pid, ink)
    # every eval series' own colour is visible in the reward panel's data area, also where two curves coincide
    reward = list(_pixels(rows, bpp, *boxes["reward"]))
    series = [g for g in panels["reward"].iter(f"{SVG}g") if g.get("class") == "series"]
    for g in series:
        want = _rgb(g.find(f"{SVG}polyline").get("stroke"))
        n = sum(1 for p in reward if max(abs(a - b) for a, b in zip(p, want)) <= COLOR_DELTA)
        assert n >= MIN_COLOR_PIXELS, (g.get("data-name"), n)
    # negative controls: a colour no series uses is absent, and an empty run's panels measure no ink
    unused = _rgb(plot.COLORS[-1])
    assert sum(1 for p in reward if max(abs(a - b) for a, b in zip(p, unused)) <= COLOR_DELTA) == 0
    write_plot(tmp_path / "empty.svg", [])
    subprocess.run([exe, str(tmp_path / "empty.svg"), "-o", str(tmp_path / "empty.png")], check=True, timeout=60)
    _, _, erows, ebpp = _decode_png((tmp_path / "empty.png").read_bytes())
    for pid, box in boxes.items():
        assert _ink(erows, ebpp, box) < MIN_INK_FRAC / 10, pid
