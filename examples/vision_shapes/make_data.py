"""Write train.jsonl and test.jsonl: "what colour is the largest shape?" over images drawn here.

    python examples/vision_shapes/make_data.py   # the files in this folder were written by this

Each image is 16x16 pixels on black (4 image tokens of the tiny Qwen2-VL: 4-pixel patches merged
2x2) with two rectangles of different colours, one at least twice the area of the other; rectangles
may overlap, the larger drawn first. The answer is the larger one's colour. Images are inline PNGs
(`data:image/png;base64,...`), so the data is two files. Rows: {"prompt": "colour=", "image": ...,
"answer": "red"}; a seeded generator, so the files are reproducible.
"""

import base64
import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIDE = 16
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240), "yellow": (240, 220, 40)}


def _rectangle(rng: random.Random, low: int, high: int) -> tuple[int, int, int, int]:
    width, height = rng.randint(low, high), rng.randint(low, high)
    left, top = rng.randint(0, SIDE - width), rng.randint(0, SIDE - height)
    return left, top, left + width - 1, top + height - 1


def _area(box: tuple[int, int, int, int]) -> int:
    return (box[2] - box[0] + 1) * (box[3] - box[1] + 1)


def draw(rng: random.Random) -> tuple[str, str]:
    """(the image as a data URI, the colour of its largest shape)."""
    big_colour, small_colour = rng.sample(sorted(COLOURS), 2)
    while True:
        big, small = _rectangle(rng, 5, 11), _rectangle(rng, 2, 6)
        if _area(big) >= 2 * _area(small):
            break
    image = Image.new("RGB", (SIDE, SIDE))
    pen = ImageDraw.Draw(image)
    pen.rectangle(big, fill=COLOURS[big_colour])
    pen.rectangle(small, fill=COLOURS[small_colour])
    stream = io.BytesIO()
    image.save(stream, format="PNG")
    return "data:image/png;base64," + base64.b64encode(stream.getvalue()).decode(), big_colour


def main(seed: int = 0, train_size: int = 1500, test_size: int = 200) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(train_size + test_size):
        uri, colour = draw(rng)
        rows.append({"prompt": "colour=", "image": uri, "answer": colour})
    for name, part in (("test.jsonl", rows[:test_size]), ("train.jsonl", rows[test_size:])):
        (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in part))


if __name__ == "__main__":
    main()
