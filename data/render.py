"""Pillow drawing helpers for the synthetic curriculum: bold shapes and seven-segment digits.

Everything the generators draw goes through these few functions, in *unit coordinates*
(0..1 across the image) scaled to pixels only here. A family's parameters therefore
describe a picture independently of its size: the same example renders at 112 px for
the tiny embedded model and at 224/336/448 px for a real Qwen2.5-VL, and its content key
(which decides its split) does not change with the size.

Why seven-segment digits instead of a font: at 112 px a tiny model sees 8x8 patches of
14 px, so a digit must be a few thick strokes, not anti-aliased glyph detail. Segments
are plain rectangles, so the pixels are identical on every machine and Pillow version
(a FreeType font's rasterisation is not guaranteed to be), which is what makes "same
seed -> same image bytes" a testable promise. Nothing is anti-aliased, for the same reason.
"""

from __future__ import annotations

from PIL import Image, ImageDraw

RGB = tuple[int, int, int]

# Strong, mutually distinct colours that survive downscaling; the names are what the
# questions say ("the red bar"), so every name must be an everyday colour word.
COLOURS: dict[str, RGB] = {
    "red": (220, 20, 20),
    "blue": (20, 60, 220),
    "green": (0, 150, 40),
    "orange": (255, 140, 0),
    "purple": (140, 30, 180),
}
BLACK: RGB = (0, 0, 0)
WHITE: RGB = (255, 255, 255)
GREY: RGB = (170, 170, 170)
LIGHT_GREY: RGB = (215, 215, 215)

SHAPES = ("circle", "square", "triangle")

# Segments lit per character ("1" is drawn as one centred stroke instead): a top,
# b upper right, c lower right, d bottom, e lower left, f upper left, g middle.
_SEGMENTS = {
    "0": "abcdef", "2": "abdeg", "3": "abcdg", "4": "bcfg",
    "5": "acdfg", "6": "acdefg", "7": "abc", "8": "abcdefg", "9": "abcdfg", "-": "g",
}
_DIGIT_ASPECT = 0.55  # digit width / height
_GAP = 0.25  # space between characters, in digit heights


def colour_name(rgb: RGB | None) -> str | None:
    """The question-vocabulary name of a fill colour, or None for black / greys / white."""
    return next((name for name, c in COLOURS.items() if c == rgb), None)


class Canvas:
    """An RGB image plus a drawer that takes unit coordinates (x right, y down, 0..1).

    ``marks`` is the renderer's own ground truth: one dict per shape and per number
    drawn, in unit coordinates (``{"kind": "circle", "colour": "red", "x": .3, "y": .6}``,
    ``{"kind": "number", "text": "34", "x": .5, "y": .2}``). The warm-up turns it into
    dense labels for the visual tokens (grpo/warmup/perception.py): it is what the picture
    shows, known exactly because we drew it.
    """

    def __init__(self, size: int, background: RGB = WHITE):
        if not isinstance(size, int) or size < 32:
            raise ValueError(f"image_size must be an int >= 32 pixels, got {size!r}")
        self.size = size
        self.image = Image.new("RGB", (size, size), background)
        self.draw = ImageDraw.Draw(self.image)
        self.marks: list[dict] = []
        # The image carries the live list, so a family's render() can keep returning a
        # plain PIL image and data/synthetic.py still finds the marks (not saved to PNG).
        self.image.info["marks"] = self.marks

    def px(self, u: float) -> int:
        return int(round(u * self.size))

    def box(self, x0: float, y0: float, x1: float, y1: float, fill: RGB | None = None,
            outline: RGB | None = None, width: float = 0.0) -> None:
        """Axis-aligned rectangle; ``width`` is the outline thickness in unit coordinates."""
        w = max(1, self.px(width)) if outline is not None else 0
        px0, py0 = self.px(x0), self.px(y0)
        # Half-open pixel box, but never thinner than 1 px (thin rules at small sizes).
        px1, py1 = max(px0, self.px(x1) - 1), max(py0, self.px(y1) - 1)
        self.draw.rectangle((px0, py0, px1, py1), fill=fill, outline=outline, width=w)

    def line(self, points: list[tuple[float, float]], fill: RGB, width: float) -> None:
        self.draw.line([(self.px(x), self.px(y)) for x, y in points], fill=fill,
                       width=max(1, self.px(width)))

    def polygon(self, points: list[tuple[float, float]], fill: RGB | None = None,
                outline: RGB | None = None, width: float = 0.0) -> None:
        self.draw.polygon([(self.px(x), self.px(y)) for x, y in points], fill=fill,
                          outline=outline, width=max(1, self.px(width)) if outline else 1)

    def disc(self, cx: float, cy: float, r: float, fill: RGB | None = None,
             outline: RGB | None = None, width: float = 0.0) -> None:
        self.draw.ellipse((self.px(cx - r), self.px(cy - r), self.px(cx + r), self.px(cy + r)),
                          fill=fill, outline=outline,
                          width=max(1, self.px(width)) if outline else 1)

    def shape(self, kind: str, cx: float, cy: float, r: float, fill: RGB) -> None:
        """A filled circle, square or triangle of 'radius' r centred on (cx, cy)."""
        self.marks.append({"kind": kind, "colour": colour_name(fill), "x": round(cx, 4), "y": round(cy, 4)})
        if kind == "circle":
            self.disc(cx, cy, r, fill=fill)
        elif kind == "square":
            s = 0.85 * r  # same visual weight as the circle
            self.box(cx - s, cy - s, cx + s, cy + s, fill=fill)
        elif kind == "triangle":
            self.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=fill)
        else:
            raise ValueError(f"unknown shape {kind!r}; expected one of {SHAPES}")

    def number(self, text: str, cx: float, cy: float, h: float, fill: RGB = BLACK) -> None:
        """Seven-segment number (digits, '-', '.') of height h, centred on (cx, cy)."""
        self.marks.append({"kind": "number", "text": text, "x": round(cx, 4), "y": round(cy, 4)})
        x = cx - text_width(text, h) / 2
        y = cy - h / 2
        t = _stroke(h)
        for ch in text:
            if ch == ".":
                self.box(x, y + h - t, x + t, y + h, fill=fill)
            elif ch == "1":  # a lone centred stroke: a right-aligned "1" reads as " 1"
                self.box(x, y, x + t, y + h, fill=fill)
            elif ch in _SEGMENTS:
                self._digit(_SEGMENTS[ch], x, y, h, fill)
            else:
                raise ValueError(f"cannot draw character {ch!r}; only digits, '-' and '.'")
            x += _char_width(ch, h) + _GAP * h

    def _digit(self, segments: str, x: float, y: float, h: float, fill: RGB) -> None:
        w, t = _DIGIT_ASPECT * h, _stroke(h)
        mid = y + (h - t) / 2
        rects = {
            "a": (x, y, x + w, y + t), "g": (x, mid, x + w, mid + t), "d": (x, y + h - t, x + w, y + h),
            "f": (x, y, x + t, mid + t), "b": (x + w - t, y, x + w, mid + t),
            "e": (x, mid, x + t, y + h), "c": (x + w - t, mid, x + w, y + h),
        }
        for s in segments:
            self.box(*rects[s], fill=fill)


def _stroke(h: float) -> float:
    return 0.17 * h  # thick strokes: a 14 px digit still has 2-3 px segments


def _char_width(ch: str, h: float) -> float:
    return _stroke(h) if ch in ".1" else _DIGIT_ASPECT * h


def text_width(text: str, h: float) -> float:
    """Width in unit coordinates of ``Canvas.number(text, ..., h)``."""
    if not text:
        return 0.0
    return sum(_char_width(ch, h) for ch in text) + _GAP * h * (len(text) - 1)
