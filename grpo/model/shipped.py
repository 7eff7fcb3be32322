"""The shipped tiny model: where it lies, how it is checked, how a pretraining run becomes it.

``--model tiny`` (the default) is a pretrained checkpoint that ships inside the package, in
``grpo/tiny_model/``: an ordinary ``save_pretrained`` directory (config, safetensors,
tokenizer, image processor) with a model card (MODEL_CARD.md), the provenance of its build
(pretrain.json) and a ``SHA256SUMS`` manifest in ``sha256sum`` format. It was built once,
offline, by ``python -m grpo.pretrain`` from ``--model tiny-random`` (the same architecture
with random weights), the way a real RL fine-tune starts from a model someone pretrained.

Every load checks the manifest first: a missing, truncated or altered file (a tokenizer
from another build included) is one ModelLoadError naming the file and how to get a good
copy back, never a model that silently means something else. Hashing the ~6 MB costs a few
milliseconds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tiny_model"
MANIFEST = "SHA256SUMS"
# the files a Qwen2.5-VL save_pretrained directory needs, plus our card and provenance
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json")
REBUILD = "python -m grpo.pretrain"
# what a build writes beside the model that is not the model: wall times make them differ
# between two builds of the same weights, so the manifest leaves them out
NOT_MODEL_FILES = ("MODEL_CARD.md", "pretrain.json")


class ShippedModelError(RuntimeError):
    """The shipped model directory is missing a file or a file does not match its digest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} from ``SHA256SUMS`` ("<digest>  <name>" per line)."""
    out = {}
    for n, line in enumerate((model_dir / MANIFEST).read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name or "/" in name or name.startswith("."):
            raise ShippedModelError(f"{model_dir / MANIFEST} line {n} is not '<sha256>  <file name>'")
        out[name] = digest
    return out


def write_manifest(model_dir: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """Digest every file of the directory (the manifest and ``exclude`` aside) into SHA256SUMS."""
    skip = {MANIFEST, *exclude}
    digests = {p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.is_file() and p.name not in skip}
    (model_dir / MANIFEST).write_text("".join(f"{d}  {n}\n" for n, d in digests.items()))
    return digests


def _fix(model_dir: Path) -> str:
    if model_dir.resolve() == SHIPPED_DIR.resolve():
        return (f"restore it (`git checkout -- {_shown(model_dir)}`, or reinstall the package) or rebuild it "
                f"with `{REBUILD}` (about an hour on 2 CPU cores)")
    return f"rebuild it with `{REBUILD} --out {model_dir}`"


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def verify(model_dir: Path | None = None) -> Path:
    """``model_dir`` (default: the shipped one) if every file its manifest lists is present
    and intact; else one ShippedModelError line naming the first bad file and what to do."""
    model_dir = Path(model_dir) if model_dir is not None else SHIPPED_DIR
    where = _shown(model_dir)
    if not (model_dir / MANIFEST).is_file():
        raise ShippedModelError(f"the shipped tiny model {where} has no {MANIFEST} (missing or not a model "
                                f"directory); {_fix(model_dir)}")
    manifest = read_manifest(model_dir)
    for name in REQUIRED:
        if name not in manifest:
            raise ShippedModelError(f"{where}/{MANIFEST} does not list {name}; {_fix(model_dir)}")
    for name, digest in manifest.items():
        path = model_dir / name
        if not path.is_file():
            raise ShippedModelError(f"the shipped tiny model lacks {where}/{name}; {_fix(model_dir)}")
        actual = sha256_file(path)
        if actual != digest:
            raise ShippedModelError(f"the shipped tiny model's {where}/{name} is damaged or from another build "
                                    f"(sha256 {actual[:12]}..., {MANIFEST} says {digest[:12]}...); "
                                    f"{_fix(model_dir)}")
    return model_dir
