"""Image rows: paths relative to the data file and inline base64 decoded before step 1, turned into image
tokens by the processor; every bad image named with its file, row and field."""

import base64
import io
import json

import pytest
from PIL import Image

from rlgraph.data.images import ImageError, image_rows_texts, load_image_rows
from rlgraph.data.prompts import DataError


def _png(size, colour=(255, 0, 0)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _write(tmp_path, rows):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def images_dir(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(_png((32, 32)))
    (tmp_path / "img" / "big.png").write_bytes(_png((40, 40)))
    (tmp_path / "img" / "text.png").write_text("not a png")
    return tmp_path


def test_paths_and_inline_images_load_and_become_image_tokens(images_dir):
    from rlgraph.backends.local.vlm import (
        IMAGE_PAD, build_image_processor, build_vl_tokenizer, encode_vl_batch, vl_config,
    )

    inline = "data:image/png;base64," + base64.b64encode(_png((24, 40), (0, 0, 255))).decode()
    path = _write(images_dir, [{"prompt": "colour=", "image": "img/red.png"},
                               {"prompt": "two=", "image": [inline, "img/red.png"]}])
    rows = load_image_rows(path, max_pixels=32 * 32)
    assert [row.source for row in rows] == [f"{path}:1", f"{path}:2"]
    assert [[image.size for image in row.images] for row in rows] == [[(32, 32)], [(24, 40), (32, 32)]]
    assert rows[1].images[0].getpixel((0, 0)) == (0, 0, 255)
    tokenizer = build_vl_tokenizer()
    processor = build_image_processor(vl_config(None)[0], max_pixels=32 * 32)
    batch = encode_vl_batch(tokenizer, processor, *image_rows_texts(rows))
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert (batch.ids == pad).sum(-1).tolist() == [16, 15 + 16]  # 8x8 / 4 and 6x10 / 4 + 8x8 / 4


@pytest.mark.parametrize("image, message", [
    ("img/missing.png", r"train.jsonl:1, field 'image': image file .*missing.png' does not exist"),
    ("img/text.png", r"train.jsonl:1, field 'image': image file .*text.png' is not a readable image"),
    ("img/big.png", r"train.jsonl:1, field 'image': image file .*big.png' is 40x40 = 1,600 pixels, over the pixel "
                    r"budget of 1,024"),
    (["img/red.png", "data:image/png;base64,@@@"], r"train.jsonl:1, field 'image'\[1\]: the inline image is not valid"),
    (7, r"train.jsonl:1, field 'image': 7 is not an image reference"),
])
def test_a_bad_image_is_named_with_its_file_row_and_field(images_dir, image, message):
    path = _write(images_dir, [{"prompt": "colour=", "image": image}])
    with pytest.raises(ImageError, match=message):
        load_image_rows(path, max_pixels=32 * 32)


def test_missing_fields_and_bad_budgets_are_refused(images_dir):
    path = _write(images_dir, [{"prompt": "colour="}])
    with pytest.raises(DataError, match=r"train.jsonl:1: no field 'image'"):
        load_image_rows(path, max_pixels=1024)
    for bad in (0, 1.5, "1024"):
        with pytest.raises(DataError, match="max_pixels="):
            load_image_rows(path, max_pixels=bad)


def test_parquet_rows_name_their_row_number(images_dir):
    import pyarrow
    import pyarrow.parquet

    path = images_dir / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
        [{"prompt": "a=", "image": "img/red.png"}, {"prompt": "b=", "image": "img/gone.png"}]), path)
    with pytest.raises(ImageError, match=r"train.parquet row 2, field 'image': image file .*gone.png' does not exist"):
        load_image_rows(path, max_pixels=32 * 32)
    (images_dir / "img" / "gone.png").write_bytes(_png((8, 8)))
    assert [row.images[0].size for row in load_image_rows(path, max_pixels=32 * 32)] == [(32, 32), (8, 8)]
