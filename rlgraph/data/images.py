"""Images of a vision-language data set: every row's images opened and checked before step 1.

    rows = load_image_rows("data/train.jsonl", max_pixels=32 * 32)
    rows[0].text, rows[0].images       # "how many squares=", [<PIL.Image.Image RGB 32x32>]

A row names its images in one field (`image_field`, default "image"): a path, relative to the data
file's directory (a `datasets` directory: relative to it) or absolute, or inline as a
`data:image/png;base64,...` URI; or a list of those. Rows come from any file `read_records` reads
(JSON lines, JSON, CSV, Parquet, `datasets`). Every image is decoded here, so a missing, unreadable
or oversized image stops the load with the file, row and field (`ImageError`), never a step later.
An image larger than `max_pixels` is refused rather than silently downscaled: the plan's
`pixel_budget` is what a run counts image tokens and memory by, so a file must fit it.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from rlgraph.data.prompts import DataError, _read_sourced

DATA_URI = "data:image/"


class ImageError(DataError):
    """An image of a row is missing, unreadable or larger than the pixel budget; names file, row and field."""


@attrs.frozen
class ImageRow:
    """One usable row: its text (`text_field`), its decoded RGB images in order, and where it came from."""

    text: str
    images: tuple[Any, ...]
    fields: dict[str, Any]
    source: str  # "file.jsonl:17": where to look when this row misbehaves


def load_image_rows(path: str | Path, *, max_pixels: int, text_field: str = "prompt", image_field: str = "image",
                    format: str = "auto", split: str | None = None) -> list[ImageRow]:
    """Every row of `path` with its images decoded to RGB and checked against `max_pixels` (width * height)."""
    if not (isinstance(max_pixels, int) and max_pixels >= 1):
        raise DataError(f"load_image_rows: max_pixels={max_pixels!r} is not a whole number of pixels >= 1",
                        fix="max_pixels=1003520 (1280 image tokens of 28x28 pixels), or the run's pixel_budget")
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    rows = []
    for source, record in _read_sourced(path, format, split):
        for field in (text_field, image_field):
            if field not in record:
                raise DataError(f"{source}: no field {field!r} (the row has {', '.join(map(repr, record)) or 'none'})",
                                fix=f"add {field!r} to every row, or name the field that holds it")
        images = _field_images(record[image_field], base, f"{source}, field {image_field!r}", max_pixels)
        rows.append(ImageRow(str(record[text_field]), images, dict(record), source))
    return rows


def _open(ref: Any, base: Path, where: str, max_pixels: int) -> Any:
    """One image reference decoded to RGB, or an `ImageError` naming `where` and what to do."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(ref, str) or not ref:
        raise ImageError(f"{where}: {ref!r} is not an image reference",
                         fix="give a path relative to the data file, or a data:image/png;base64,... URI")
    if ref.startswith(DATA_URI):
        _, _, payload = ref.partition(",")
        try:
            stream, shown = io.BytesIO(base64.b64decode(payload, validate=True)), "the inline image"
        except (binascii.Error, ValueError):
            raise ImageError(f"{where}: the inline image is not valid base64 ({len(payload)} characters)",
                             fix="write data:image/png;base64,<the file's bytes in base64>") from None
    else:
        file = (base / ref) if not Path(ref).is_absolute() else Path(ref)
        if not file.is_file():
            raise ImageError(f"{where}: image file {str(file)!r} does not exist",
                             fix=f"paths are relative to the data file's directory {str(base)!r}")
        stream, shown = file, f"image file {str(file)!r}"
    try:
        with Image.open(stream) as image:
            width, height = image.size  # from the header: no decoding yet
            if width * height > max_pixels:
                raise ImageError(f"{where}: {shown} is {width}x{height} = {width * height:,} pixels, over the pixel "
                                 f"budget of {max_pixels:,}",
                                 fix="downscale the image, or raise the pixel budget (its image tokens and "
                                     "memory grow)")
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
        raise ImageError(f"{where}: {shown} is not a readable image ({type(error).__name__}: {error})",
                         fix="re-save it as PNG or JPEG") from None


def image_rows_texts(rows: Sequence[ImageRow]) -> tuple[list[str], list[list[Any]]]:
    """(texts, images per row) as `rlgraph.backends.local.vlm.encode_vl_batch` takes them."""
    return [row.text for row in rows], [list(row.images) for row in rows]


def open_row_images(rows: Sequence[Any], path: str | Path, *, image_field: str, max_pixels: int
                    ) -> dict[str, tuple[Any, ...]]:
    """{row.source: its images decoded to RGB} for prompt rows of `path` (`load_prompts`'s rows, which
    keep `image_field` among their fields): every image opened and checked now, before step 1."""
    base = Path(path) if Path(path).is_dir() else Path(path).parent
    images = {}
    for row in rows:
        if image_field not in row.fields:
            raise DataError(f"{row.source}: no field {image_field!r} (the row has {', '.join(map(repr, row.fields))})",
                            fix=f"add {image_field!r} to every row, or set vision.image_field to the field that holds them")
        images[row.source] = _field_images(row.fields[image_field], base, f"{row.source}, field {image_field!r}",
                                           max_pixels)
    return images


def _field_images(value: Any, base: Path, where: str, max_pixels: int) -> tuple[Any, ...]:
    """The images one row's image field names (one reference or a list of them), decoded and checked."""
    if isinstance(value, list):
        return tuple(_open(ref, base, f"{where}[{i}]", max_pixels) for i, ref in enumerate(value))
    return (_open(value, base, where, max_pixels),)
