"""Built-in visual tasks: images drawn on the fly with pillow (no download), answers checked exactly.

``count_shapes``: a plain white image with 1 to 6 filled shapes (circles, squares, triangles; red, green, blue or
yellow), and a question about them: how many shapes in all, how many of one colour, or how many of one kind (mostly
one that is there; the answer may be 0). Each shape lies inside its own cell of a grid over the image, 2 pixels
clear of the cell's edges, so no two shapes overlap or touch and every count is well defined; pillow draws without
anti-aliasing, so each shape's pixels are exactly its colour. Row ``i`` depends only on ``data.seed`` and ``i``
(``data.size`` rows). Rewards, as the default task's: the exact number (1.0; ``unison.tasks.rewards.extract_answer``
reads it), the ``<answer>`` format (0.2) and closeness (0.3: partial credit, so a group without a right answer still
has a reward spread)::

    unison train --data.source=count_shapes --data.gym='{"image_size": 224, "max_shapes": 9}'

``data.gym`` keys: ``image_size`` (pixels per side, 112), ``min_shapes`` (1), ``max_shapes`` (6). Rows:
``{"prompt": str, "images": [PIL.Image], "answer": "3", "metadata": {"shapes": [{"kind", "colour", "box"}, ...],
"asked": "total" | "colour" | "kind", "target": ...}}``; ``box`` is ``[x0, y0, x1, y1]``, inclusive.
"""

from __future__ import annotations

import math
import random

from unison.config import InvalidInputError
from unison.tasks.gym import ANSWER_FORMAT
from unison.tasks.rewards import ClosenessReward, ExactAnswerReward, FormatReward
from unison.tasks.task import DataConfig, Task
from unison.vision.images import pil

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 70, 220), "yellow": (235, 200, 20)}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)
OPTIONS = {"image_size": 112, "min_shapes": 1, "max_shapes": 6}
MIN_CELL = 16  # pixels per grid cell: a shape of at least 6 pixels a side, 2 clear of each edge


def count_shapes_task(cfg: DataConfig) -> Task:
    options = shape_options(cfg.gym)
    if cfg.size < 1:
        raise InvalidInputError(f"data.size must be >= 1, got {cfg.size}")
    rows = [count_shapes_row(random.Random(f"count_shapes/{cfg.seed}/{i}"), **options) for i in range(cfg.size)]
    fns = [(ExactAnswerReward(), 1.0), (FormatReward(), 0.2), (ClosenessReward(), 0.3)]
    return Task("count_shapes", rows, fns, cfg.system_prompt)


def shape_options(gym: dict) -> dict:
    """``OPTIONS`` with ``data.gym``'s values, checked."""
    unknown = sorted(set(gym) - set(OPTIONS))
    if unknown:
        raise InvalidInputError(f"data.gym for count_shapes: unknown key(s) {unknown}; it takes {sorted(OPTIONS)}")
    options = {**OPTIONS, **gym}
    for key, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidInputError(f"data.gym.{key} for count_shapes must be a whole number >= 1, got {value!r}")
    if options["min_shapes"] > options["max_shapes"]:
        raise InvalidInputError(f"data.gym for count_shapes: min_shapes ({options['min_shapes']}) > max_shapes "
                                f"({options['max_shapes']})")
    grid = math.isqrt(options["max_shapes"] - 1) + 1
    if options["image_size"] < MIN_CELL * grid:
        raise InvalidInputError(f"data.gym.image_size={options['image_size']} is too small for max_shapes="
                                f"{options['max_shapes']}: it needs at least {MIN_CELL * grid} pixels a side")
    return options


def count_shapes_row(rng: random.Random, image_size: int, min_shapes: int, max_shapes: int) -> dict:
    image, shapes = draw_shapes(rng, image_size, rng.randint(min_shapes, max_shapes), max_shapes)
    asked = rng.choice(("total", "colour", "kind"))
    if asked == "total":
        target, question, answer = None, "How many shapes are in the image?", len(shapes)
    elif asked == "colour":
        target = rng.choice(shapes)["colour"] if rng.random() < 0.75 else rng.choice(sorted(COLOURS))
        question, answer = f"How many {target} shapes are in the image?", sum(s["colour"] == target for s in shapes)
    else:
        target = rng.choice(shapes)["kind"] if rng.random() < 0.75 else rng.choice(KINDS)
        question, answer = f"How many {target}s are in the image?", sum(s["kind"] == target for s in shapes)
    return {"prompt": f"{question}\n{ANSWER_FORMAT}", "images": [image], "answer": str(answer),
            "metadata": {"shapes": shapes, "asked": asked, "target": target, "image_size": image_size}}


def draw_shapes(rng: random.Random, image_size: int, n: int, max_shapes: int):
    """An ``image_size`` square RGB image with ``n`` shapes, each in its own cell of a grid of at least
    ``max_shapes`` cells, and the shapes' ``{"kind", "colour", "box"}``."""
    Image = pil()
    from PIL import ImageDraw

    grid = math.isqrt(max_shapes - 1) + 1
    cell = image_size // grid
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    shapes = []
    for index in sorted(rng.sample(range(grid * grid), n)):
        row, col = divmod(index, grid)
        side = rng.randint(max(6, cell * 2 // 5), cell - 4)
        x0 = col * cell + rng.randint(2, cell - side - 2)
        y0 = row * cell + rng.randint(2, cell - side - 2)
        box = [x0, y0, x0 + side - 1, y0 + side - 1]
        kind, colour = rng.choice(KINDS), rng.choice(sorted(COLOURS))
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
        shapes.append({"kind": kind, "colour": colour, "box": box})
    return image, shapes


VISUAL_TASKS = {"count_shapes": count_shapes_task}
