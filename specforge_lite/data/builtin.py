"""Bundled data: the chitchat-dataset conversations (MIT) converted once to ShareGPT JSONL."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import cache_dir

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
    tmp = out.with_suffix(".tmp")
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
    os.replace(tmp, out)
    return out
