"""Rows with images before they reach the model: every image form loads to the same pixels, TRL's two
vision-language row shapes load, bad images are skipped and counted, and the drawn count_shapes task counts right."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import subprocess
import sys

import pytest
from PIL import Image

from unison.config import InvalidInputError, MissingInputError
from unison.tasks import DataConfig, load_rows, load_task
from unison.tasks.visual import COLOURS
from unison.vision.images import encode_image, image_digest, load_image
from unison.vision.messages import chat_messages, user_content


def _picture(seed: int = 0) -> Image.Image:
    image = Image.new("RGB", (5, 3))
    image.putdata([((17 * i + seed) % 256, (31 * i) % 256, (7 * i + 100) % 256) for i in range(15)])
    return image


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_image_form_loads_the_same_pixels_and_digest(tmp_path):
    picture = _picture()
    path = tmp_path / "p.png"
    path.write_bytes(_png(picture))
    forms = [picture, picture.convert("RGBA"), _png(picture), bytearray(_png(picture)), str(path), path,
             encode_image(picture), {"bytes": _png(picture), "path": None}, {"bytes": None, "path": str(path)}]
    for form in forms:
        image = load_image(form)
        assert image.mode == "RGB" and image.size == (5, 3), type(form)
        assert image.tobytes() == picture.tobytes(), type(form)
        assert image_digest(image) == image_digest(picture), type(form)
    assert len(image_digest(picture)) == 16
    changed = picture.copy()
    changed.putpixel((4, 2), (0, 0, 0))
    assert image_digest(changed) != image_digest(picture)
    assert image_digest(picture.resize((3, 5))) != image_digest(picture)
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG")
    assert load_image(buffer.getvalue()).size == (5, 3)  # lossy, but it decodes


def test_bad_images_raise_input_errors_naming_the_culprit(tmp_path):
    png = _png(_picture())
    bad = [(tmp_path / "missing.png", "missing.png does not exist"), (str(tmp_path), "is not a file"),
           (b"not an image at all", re.escape(repr(b"not an image at "))), (png[:40], "does not decode"),
           (42, "got int"), ({"path": None}, "needs 'bytes' or 'path'"), ("https://x.org/a.png", "not fetched"),
           ("data:text/plain;base64,aGk=", "is not data:image"), ("data:image/png;base64,@@@", "invalid base64"),
           ("data:image/png;base64,aGVsbG8=", "does not decode")]
    for value, match in bad:
        with pytest.raises(InvalidInputError, match=match):
            load_image(value)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_with_image_paths_data_urls_and_one_image(tmp_path):
    a, b = _picture(1), _picture(2)
    (tmp_path / "a.png").write_bytes(_png(a))  # relative to the data file, not to the working directory
    rows = [{"prompt": "How many?", "images": ["a.png"], "answer": "1"},
            {"prompt": "Which?", "image": encode_image(b), "answer": "2"},
            {"prompt": "Both?", "images": [str(tmp_path / "a.png"), encode_image(b)], "answer": "3"},
            {"prompt": "Text only", "answer": "4"}]
    loaded = load_rows(_write_jsonl(tmp_path / "data.jsonl", rows))
    assert [len(r["images"]) for r in loaded[:3]] == [1, 1, 2] and "images" not in loaded[3]
    assert "image" not in loaded[1] and loaded[1]["prompt"] == "Which?" and loaded[1]["answer"] == "2"
    pixels = [[image.tobytes() for image in r["images"]] for r in loaded[:3]]
    assert pixels == [[a.tobytes()], [b.tobytes()], [a.tobytes(), b.tobytes()]]
    assert all(isinstance(image, Image.Image) and image.mode == "RGB" for r in loaded[:3] for image in r["images"])


def test_parquet_rows_with_the_image_feature_storage_dicts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = _picture(3), _picture(4)
    images = [[{"bytes": _png(a), "path": None}], [{"bytes": _png(a), "path": None}, {"bytes": _png(b), "path": None}]]
    table = pa.table({"prompt": ["one?", "two?"], "images": images, "answer": ["1", "2"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    loaded = load_rows(tmp_path / "rows.parquet")
    assert [[image.tobytes() for image in r["images"]] for r in loaded] == [[a.tobytes()], [a.tobytes(), b.tobytes()]]
    import datasets  # the Image feature decodes to PIL images: one `image` column

    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image(),
                                  "answer": datasets.Value("string")})
    datasets.Dataset.from_dict({"prompt": ["one?"], "image": [b], "answer": ["1"]}, features=features).to_parquet(
        str(tmp_path / "feature.parquet"))
    (row,) = load_rows(tmp_path / "feature.parquet")
    assert "image" not in row and [image.tobytes() for image in row["images"]] == [b.tobytes()]


def test_conversations_with_image_parts(tmp_path):
    a, b = _picture(5), _picture(6)
    (tmp_path / "a.png").write_bytes(_png(a))
    ask = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    carried = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": "a.png"},
                                            {"type": "image", "url": encode_image(b)}]}]
    plain = [{"role": "user", "content": "Describe it."}]
    rows = [{"prompt": ask, "images": ["a.png"], "answer": "red"}, {"prompt": carried, "answer": "same"},
            {"prompt": plain, "images": [encode_image(b)], "answer": "x"}]
    loaded = load_rows(_write_jsonl(tmp_path / "chat.jsonl", rows))
    assert len(loaded) == 3
    assert loaded[0]["prompt"] == ask and loaded[0]["images"][0].tobytes() == a.tobytes()
    assert [image.tobytes() for image in loaded[1]["images"]] == [a.tobytes(), b.tobytes()]
    assert loaded[1]["prompt"][1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"},
                                                 {"type": "image"}]  # the payloads moved to images
    system = {"role": "system", "content": [{"type": "text", "text": "Think."}]}
    assert chat_messages(loaded[0]["prompt"], loaded[0]["images"], "Think.") == [system, *ask]
    assert chat_messages(loaded[1]["prompt"], 2, "Think.")[0] == {"role": "system", "content": [
        {"type": "text", "text": "Be brief."}]}  # the conversation's own system message, not system_prompt
    assert chat_messages(loaded[2]["prompt"], loaded[2]["images"]) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    assert chat_messages("How many?", 2) == [{"role": "user", "content": user_content("How many?", 2)}]
    assert user_content("How many?", [a]) == [{"type": "image"}, {"type": "text", "text": "How many?"}]
    with pytest.raises(ValueError, match="2 image part"):
        chat_messages(loaded[1]["prompt"], 1)


def test_rows_with_unusable_images_are_skipped_and_reported(tmp_path, caplog):
    good = {"prompt": "ok?", "images": [encode_image(_picture())], "answer": "1"}
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    rows = [good,
            {"prompt": two_parts, "images": [encode_image(_picture())], "answer": "1"},  # 2 parts, 1 image
            {"prompt": "gone?", "images": ["nowhere.png"], "answer": "1"},
            {"prompt": "broken?", "images": ["data:image/png;base64,aGVsbG8="], "answer": "1"},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": 3}]}], "answer": "1"},  # text not str
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
             "answer": "1"},  # an image part with no image anywhere
            good]
    with caplog.at_level(logging.WARNING):
        loaded = load_rows(_write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert [r["prompt"] for r in loaded] == ["ok?", "ok?"]
    assert "skipped 5 row(s)" in caplog.text and "index 1, 2, 3, 4, 5" in caplog.text
    assert "unusable images (first: index 1, the conversation has 2 image part(s)" in caplog.text
    with pytest.raises(InvalidInputError, match=r"no row with a prompt .* image 0: image file nowhere.png"):
        load_rows(_write_jsonl(tmp_path / "bad.jsonl", rows[2:4]))


def _components(image: Image.Image) -> list[tuple[tuple, int, tuple]]:
    """(colour, pixel count, bounding box) of each 4-connected region that is not background."""
    w, h = image.size
    pixels, seen, out = image.load(), set(), []
    for start in ((x, y) for y in range(h) for x in range(w)):
        colour = pixels[start]
        if start in seen or colour == (255, 255, 255):
            continue
        seen.add(start)
        stack, region = [start], []
        while stack:
            x, y = stack.pop()
            region.append((x, y))
            for n in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= n[0] < w and 0 <= n[1] < h and n not in seen and pixels[n] == colour:
                    seen.add(n)
                    stack.append(n)
        xs, ys = [p[0] for p in region], [p[1] for p in region]
        out.append((colour, len(region), (min(xs), min(ys), max(xs), max(ys))))
    return out


def _kind(count: int, box: tuple) -> str:
    fill = count / ((box[2] - box[0] + 1) * (box[3] - box[1] + 1))  # square 1, circle ~pi/4, triangle ~1/2
    return "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"


def test_count_shapes_answers_match_a_recount_of_the_drawn_pixels():
    task = load_task(DataConfig(source="count_shapes", size=24, seed=3))
    names = {rgb: name for name, rgb in COLOURS.items()}
    asked = set()
    for row in task.rows:
        (image,) = row["images"]
        assert image.mode == "RGB" and image.size == (112, 112)
        found = _components(image)
        assert all(colour in names for colour, _, _ in found)  # only shape colours: no blending, no anti-aliasing
        shapes = row["metadata"]["shapes"]
        assert 1 <= len(found) == len(shapes) <= 6  # one region per shape: none overlap or touch
        assert sorted((names[c], _kind(n, box)) for c, n, box in found) == sorted(
            (s["colour"], s["kind"]) for s in shapes)
        question = row["prompt"].split("\n")[0]
        target = next((t for t in [*COLOURS, "circle", "square", "triangle"] if f" {t}" in question), None)
        recount = sum(target is None or names[c] == target or _kind(n, box) == target for c, n, box in found)
        assert row["answer"] == str(recount), question
        assert row["prompt"].endswith("<answer></answer> tags.")
        asked.add(row["metadata"]["asked"])
    assert asked == {"total", "colour", "kind"}


def test_count_shapes_is_deterministic_for_a_seed_and_held_out_by_fraction():
    def fingerprint(rows):
        return [(r["prompt"], r["answer"], image_digest(r["images"][0])) for r in rows]

    small = load_task(DataConfig(source="count_shapes", size=6, seed=1))
    assert fingerprint(small.rows) == fingerprint(load_task(DataConfig(source="count_shapes", size=6, seed=1)).rows)
    assert fingerprint(load_task(DataConfig(source="count_shapes", size=9, seed=1)).rows)[:6] == fingerprint(small.rows)
    assert fingerprint(load_task(DataConfig(source="count_shapes", size=6, seed=2)).rows) != fingerprint(small.rows)
    held = load_task(DataConfig(source="count_shapes", size=8, seed=1, eval_split=0.25))
    assert len(held.rows) == 6 and len(held.eval_rows) == 2
    whole = fingerprint(load_task(DataConfig(source="count_shapes", size=8, seed=1)).rows)
    assert sorted(fingerprint(held.rows) + fingerprint(held.eval_rows)) == sorted(whole)
    large = load_task(DataConfig(source="count_shapes", size=2, gym={"image_size": 224, "max_shapes": 9}))
    assert large.rows[0]["images"][0].size == (224, 224)
    for gym, match in [({"colours": 3}, "unknown key"), ({"max_shapes": 0}, "max_shapes"),
                       ({"image_size": 40, "max_shapes": 9}, "too small"), ({"min_shapes": 4, "max_shapes": 3}, ">")]:
        with pytest.raises(InvalidInputError, match=match):
            load_task(DataConfig(source="count_shapes", size=2, gym=gym))
    with pytest.raises(InvalidInputError, match="one split"):
        load_task(DataConfig(source="count_shapes", size=4, eval_split="test"))


def test_count_shapes_rewards_score_the_exact_number():
    task = load_task(DataConfig(source="count_shapes", size=4))
    gold = [int(r["answer"]) for r in task.rows]
    right = [f"I count them. <answer>{g}</answer>" for g in gold]
    wrong = [f"<answer>{g + 5}</answer>" for g in gold]
    exact = task.reward_fns[0][0]
    columns = {"answer": [r["answer"] for r in task.rows]}
    assert exact([r["prompt"] for r in task.rows], right, **columns) == [1.0] * 4
    assert exact([r["prompt"] for r in task.rows], wrong, **columns) == [0.0] * 4
    assert task.score(right, task.rows) == [pytest.approx(1.5)] * 4  # exact 1.0 + format 0.2 + closeness 0.3
    assert task.score(wrong, task.rows) == [pytest.approx(0.2 + 0.3 * math.exp(-5))] * 4
    assert task.score([str(g) for g in gold], task.rows) == [pytest.approx(1.3)] * 4  # the number, no tags
    assert task.score(["I cannot see it."] * 4, task.rows) == [0.0] * 4


def test_without_pillow_unison_imports_and_images_name_the_extra(monkeypatch):
    code = ("import sys; sys.modules['PIL'] = None\n"
            "import unison, unison.tasks, unison.tasks.visual, unison.vision.images, unison.vision.messages\n"
            "from unison.tasks import DataConfig, load_task\n"
            "try:\n    load_task(DataConfig(source='count_shapes', size=1))\n"
            "except FileNotFoundError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("MissingInputError") and "pip install 'unison[vision]'" in out
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(MissingInputError, match=r"unison\[vision\]"):
        load_image(b"\x89PNG")
