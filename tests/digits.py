"""A small real image set written as an ImageFolder tree: scikit-learn's handwritten digits.

1797 grayscale 8x8 scans (UCI's optical digits, shipped inside scikit-learn, so nothing is
downloaded), 10 classes, upscaled to 16x16 PNGs; every fifth image of a class goes to val/.

    python tests/digits.py /tmp/digits      # writes /tmp/digits/{train,val}/<digit>/<n>.png
"""

from __future__ import annotations

import sys
from pathlib import Path

SIZE = 16


def write_digits_tree(root: Path, *, size: int = SIZE) -> Path:
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen = np.zeros(10, dtype=int)
    for pixels, label in zip(digits.images, digits.target):
        split = "val" if seen[label] % 5 == 4 else "train"
        seen[label] += 1
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), mode="L")
        image.resize((size, size), Image.BILINEAR).save(folder / f"{seen[label]:03d}.png")
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/digits.py DIR")
    write_digits_tree(Path(sys.argv[1]))
