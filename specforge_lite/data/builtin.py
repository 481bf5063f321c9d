"""Bundled data: the chitchat-dataset conversations (MIT) converted once to ShareGPT JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import cache_dir
from ..files import write_folder_then_rename, write_then_rename

LICENSE_NOTICE = """The conversations in chitchat.sharegpt.jsonl are converted from chitchat-dataset 0.9.0
(https://github.com/BYU-PCCL/chitchat-dataset), MIT License,
Copyright (c) 2019 Perception, Control and Cognition Lab.

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction, including
without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the
following conditions: The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.
THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND.
"""


def chitchat_path() -> Path:
    """Convert on first use. Message groups alternate between the two people (sender ids are not
    reliable: many conversations carry one id for both), so even groups become the user and odd groups
    the assistant; a group's messages join with newlines."""
    out = cache_dir() / "data" / "chitchat.sharegpt.jsonl"
    if out.is_file():
        return out
    try:
        import chitchat_dataset
    except ImportError as e:
        raise RuntimeError("data.source=builtin_chitchat needs the chitchat-dataset package: "
                           "pip install chitchat-dataset==0.9.0 (scripts/setup.sh installs it)") from e
    raw = json.loads(Path(chitchat_dataset.__file__).with_name("dataset.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            for conv_id, conv in raw.items():
                turns = []
                for index, group in enumerate(conv["messages"]):
                    text = "\n".join(u["text"].strip() for u in group if u["text"].strip())
                    if not text:
                        continue
                    role = "human" if index % 2 == 0 else "gpt"
                    if turns and turns[-1]["from"] == role:
                        turns[-1]["value"] += "\n" + text
                    else:
                        turns.append({"from": role, "value": text})
                if len(turns) >= 2:  # about 3,150 conversations are a single message: nothing to answer
                    fh.write(json.dumps({"id": conv_id, "conversations": turns}) + "\n")

    (out.parent / "chitchat.LICENSE").write_text(LICENSE_NOTICE)
    write_then_rename(out, write)  # (under a name of this writer's own: another run may write it at once)
    return out


_COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
           "purple": (140, 60, 180), "orange": (245, 140, 30), "black": (20, 20, 20), "gray": (130, 130, 130)}
_BACKGROUNDS = {"white": (250, 250, 250), "light blue": (200, 225, 250), "beige": (240, 230, 200),
                "pale green": (210, 240, 210)}
_SHAPES = ("circle", "square", "triangle")
_NUMBERS = ("one", "two", "three")


def shapes_path(num_images: int = 120, seed: int = 0) -> Path:
    """A small image+text conversation set made here (no download): pictures of coloured shapes drawn
    with PIL, and conversations about them (what is shown, how many, which colour, where), some with a
    text-only follow-up turn. OpenAI ``messages`` rows with image parts; images beside the JSONL."""
    import random

    out_dir = cache_dir() / "data" / f"shapes-{num_images}-{seed}"
    out = out_dir / "shapes.jsonl"
    if out.is_file():
        return out
    from PIL import Image, ImageDraw

    rng = random.Random(seed)

    def write(tmp_dir: Path) -> None:
        (tmp_dir / "images").mkdir()
        rows = []
        for i in range(num_images):
            w, h = rng.choice((64, 96, 128)), rng.choice((64, 96, 128))
            bg_name, color_name, shape = rng.choice(list(_BACKGROUNDS)), rng.choice(list(_COLORS)), rng.choice(_SHAPES)
            count = rng.randint(1, 3)
            im = Image.new("RGB", (w, h), _BACKGROUNDS[bg_name])
            draw = ImageDraw.Draw(im)
            r = min(w, h) // 6
            centers = [(int(w * (k + 1) / (count + 1)), rng.randint(r + 2, h - r - 2)) for k in range(count)]
            for cx, cy in centers:
                box = (cx - r, cy - r, cx + r, cy + r)
                if shape == "circle":
                    draw.ellipse(box, fill=_COLORS[color_name])
                elif shape == "square":
                    draw.rectangle(box, fill=_COLORS[color_name])
                else:
                    draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=_COLORS[color_name])
            name = f"images/shape_{i:04d}.png"
            im.save(tmp_dir / name)
            noun = shape + ("s" if count > 1 else "")
            side = "left" if centers[0][0] < w / 3 else "right" if centers[0][0] > 2 * w / 3 else "middle"
            described = f"{_NUMBERS[count - 1]} {color_name} {noun} on a {bg_name} background"
            questions = [
                ("What is in this picture?", f"The picture shows {described}."),
                ("Describe the image in one sentence.", f"It is a simple drawing of {described}."),
                (f"How many {shape}s can you see?", f"I can see {_NUMBERS[count - 1]} {noun}."),
                ("What colour are the shapes?", f"The {noun} {'are' if count > 1 else 'is'} {color_name}."),
            ]
            for q, a in rng.sample(questions, 2):
                image_and_question = [{"type": "image", "image": name}, {"type": "text", "text": q}]
                messages = [{"role": "user", "content": image_and_question}, {"role": "assistant", "content": a}]
                if rng.random() < 0.5:
                    where = f"The first {shape} is on the {side} side of the image."
                    messages += [{"role": "user", "content": "Where is the first one?"},
                                 {"role": "assistant", "content": where}]
                rows.append({"id": f"shape-{i}-{len(rows)}", "messages": messages})
        with open(tmp_dir / "shapes.jsonl", "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")

    write_folder_then_rename(out_dir, write)  # (another run may write it at the same moment)
    return out
