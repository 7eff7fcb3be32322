"""Dense perception supervision for the visual tokens of a model trained from scratch.

Why this exists (measured on the embedded tiny Qwen2.5-VL, 2-core CPU): trained only on
the language-model loss, the vision tower's output collapses within ~10 SFT steps to one
large vector shared by every image (spread across images < 1% of its norm, from 25-34% at
init), the LM learns to ignore it, and exact match with images shuffled across examples
equals exact match with the true images. The LM gradient that reaches the tower early on
is mostly noise -- the LM has not learned to look yet -- so nothing keeps the features
informative while the LM is learning where to look.

The fix is the one real VLMs get for free from a pretrained encoder: the tower is told
what is in the picture. The synthetic renderer knows exactly what it drew
(``Example.marks``, data/render.py) and where, so every merged visual token gets labels
for the image cell it covers:

    object   which shape is centred in the cell: none, or (kind, colour) -- 1 + 3 x 5 classes
    number   which number is centred in the cell: none, 0..99, or "other" (floats, ...)
    colour   the fraction of the cell's pixels nearest each palette colour (soft label)
    row, col where the cell is, on a 4 x 4 lattice of the picture (0..3 each)

A linear head on each merged token predicts them (cross-entropy; soft cross-entropy for
colour), and its loss is added to the LM's. Linear on purpose: what a linear head can
read, the LM's first attention layer can read too. Measured with bench/perception_probe.py
on this model (1-6 circles, "how many shapes?", 300 steps x 32): without the head 0.15
with true images vs 0.14 shuffled (chance 1/6); with it 1.00 vs 0.16. Position labels
(row, col) are what made "row 2, column 1" table reads learnable (0.95 after 600 steps,
~0.3 without); bench/EXPERIMENTS.md has every measurement.

Costs: one [n_tokens, d] x [d, 128] matmul per image on features the forward computes
anyway (captured by a forward hook, so the tower runs once). The head is thrown away
after the warm-up; the GRPO phases freeze the tower (LoRA adapts the LM only), so the
features the warm-up taught are the ones RL sees.

It applies only where labels exist (the synthetic curriculum) and only to a tower that
trains (the embedded model's warm-up); a pretrained model already sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from data.render import COLOURS, SHAPES
from data.schema import Example

# Pixel palette of the renderer (data/render.py), nearest-colour classes for the colour label.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (255, 255, 255), (0, 0, 0), (170, 170, 170), (215, 215, 215), (175, 205, 255),
    *COLOURS.values(),
)
COLOUR_NAMES = tuple(COLOURS)
N_OBJECT = 1 + len(SHAPES) * len(COLOUR_NAMES)  # 0 = no shape centred in the cell
MAX_NUMBER = 99
N_NUMBER = MAX_NUMBER + 3  # 0 = none, 1 + v for integers 0..99, last = any other number
N_COLOUR = len(PALETTE)
N_POS = 4  # position buckets per axis: the 4 x 4 token grid of a 112 px image
HEAD_WIDTH = N_OBJECT + N_NUMBER + N_COLOUR + 2 * N_POS


@dataclass
class TokenLabels:
    """Per merged visual token labels of a batch, in the order the vision tower emits tokens."""

    object: torch.Tensor  # [n] long, 0..N_OBJECT-1
    number: torch.Tensor  # [n] long, 0..N_NUMBER-1
    colour: torch.Tensor  # [n, N_COLOUR] float, rows sum to 1
    row: torch.Tensor  # [n] long, 0..N_POS-1
    col: torch.Tensor  # [n] long, 0..N_POS-1


def _object_class(mark: dict) -> int | None:
    if mark.get("kind") not in SHAPES or mark.get("colour") not in COLOUR_NAMES:
        return None
    return 1 + SHAPES.index(mark["kind"]) * len(COLOUR_NAMES) + COLOUR_NAMES.index(mark["colour"])


def _number_class(text: str) -> int:
    return 1 + int(text) if text.isdigit() and int(text) <= MAX_NUMBER else N_NUMBER - 1


def _cell_colours(image: Image.Image, rows: int, cols: int) -> torch.Tensor:
    """[rows * cols, N_COLOUR]: share of each cell's pixels nearest each palette colour."""
    small = image.convert("RGB").resize((cols * 28, rows * 28), Image.NEAREST)
    px = torch.tensor(np.asarray(small), dtype=torch.float32)  # [rows*28, cols*28, 3]
    pal = torch.tensor(PALETTE, dtype=torch.float32)  # [P, 3]
    nearest = torch.cdist(px.view(-1, 3), pal).argmin(1).view(rows, 28, cols, 28)
    onehot = F.one_hot(nearest, N_COLOUR).float()  # [rows, 28, cols, 28, P]
    return onehot.mean(dim=(1, 3)).reshape(rows * cols, N_COLOUR)


def token_labels(examples: Sequence[Example], grid_thw: torch.Tensor, merge: int = 2) -> TokenLabels:
    """Labels for every merged visual token of ``examples`` (one image each).

    ``grid_thw`` [B, 3] is the processor's patch grid; the tower emits each image's
    (h / merge) x (w / merge) merged tokens in raster order, so token k of an image
    covers the cell (k // cols, k % cols) of its picture in unit coordinates.
    """
    if len(grid_thw) != len(examples):  # one grid row per IMAGE: a several-image prompt has no marks to label
        raise ValueError(f"perception labels: {len(examples)} examples but {len(grid_thw)} images; the caption "
                         "stage trains on one-image prompts (the synthetic curriculum)")
    objects, numbers, colours, rws, cls = [], [], [], [], []
    for ex, (_, h, w) in zip(examples, grid_thw.tolist()):
        rows, cols = h // merge, w // merge
        obj = torch.zeros(rows * cols, dtype=torch.long)
        num = torch.zeros(rows * cols, dtype=torch.long)
        for m in ex.marks:
            r = min(rows - 1, max(0, int(m["y"] * rows)))
            c = min(cols - 1, max(0, int(m["x"] * cols)))
            if m["kind"] == "number":
                num[r * cols + c] = _number_class(str(m["text"]))
            else:
                k = _object_class(m)
                if k is not None:
                    obj[r * cols + c] = k
        objects.append(obj)
        numbers.append(num)
        colours.append(_cell_colours(ex.image, rows, cols))
        k = torch.arange(rows * cols)
        rws.append((k // cols) * N_POS // rows)
        cls.append((k % cols) * N_POS // cols)
    return TokenLabels(torch.cat(objects), torch.cat(numbers), torch.cat(colours), torch.cat(rws), torch.cat(cls))


class PerceptionHead(nn.Module):
    """A linear read-out of each merged visual token: object, number and colour logits."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, HEAD_WIDTH)

    def loss(self, feats: torch.Tensor, labels: TokenLabels) -> torch.Tensor:
        logits = self.proj(feats.float())
        obj, num, colour, row, col = logits.split((N_OBJECT, N_NUMBER, N_COLOUR, N_POS, N_POS), dim=-1)
        dev = logits.device
        return (F.cross_entropy(obj, labels.object.to(dev))
                + F.cross_entropy(num, labels.number.to(dev))
                + F.cross_entropy(colour, labels.colour.to(dev))  # soft targets
                + F.cross_entropy(row, labels.row.to(dev))
                + F.cross_entropy(col, labels.col.to(dev)))

    @torch.no_grad()
    def accuracy(self, feats: torch.Tensor, labels: TokenLabels) -> dict[str, float]:
        """Read-out accuracy on the cells that hold something (empty cells are the easy majority)."""
        obj, num, _, _, _ = self.proj(feats.float()).split((N_OBJECT, N_NUMBER, N_COLOUR, N_POS, N_POS), dim=-1)
        out = {}
        for name, logits, y in (("object", obj, labels.object), ("number", num, labels.number)):
            held = y != 0
            out[name] = float((logits.argmax(-1)[held] == y[held]).float().mean()) if held.any() else float("nan")
        return out


@contextmanager
def capture_visual_tokens(model):
    """Keep the merged visual tokens of the next forward (with their graph) in a list.

    A forward hook on the vision tower: the LM forward computes the features anyway, so
    the perception loss costs no second tower pass.
    """
    captured: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        feats = getattr(output, "pooler_output", output)
        captured.append(torch.cat(feats, 0) if isinstance(feats, (list, tuple)) else feats)

    handle = model.model.visual.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()
