"""The draft vocabulary: the N most frequent loss-masked target tokens, with d2t/t2d maps.

``d2t[i] = used[i] - i`` (an offset: target_id = draft_id + d2t[draft_id]) and ``t2d`` is a bool mask
over the target vocabulary, as SGLang, vLLM and speculators read them. ``used`` is sorted by id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..config import cache_dir
from ..files import write_then_rename


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # int64 [Vd], sorted target ids
    target_vocab_size: int
    coverage: float  # share of loss-masked training tokens inside the draft vocabulary

    @property
    def size(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_to_target - torch.arange(self.size, dtype=torch.long)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int) -> "DraftVocab":
        ids = d2t.long() + torch.arange(d2t.numel(), dtype=torch.long)
        return cls(ids, target_vocab_size, float("nan"))


def count_loss_tokens(input_ids: Iterable[list[int]], loss_masks: Iterable[list[int]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids, loss_masks):
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        np.add.at(counts, ids[mask], 1)
    return counts


def select_draft_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """Top ``size`` by count; ties and never-seen tokens are broken by lower id, which for BPE
    vocabularies (merges learned in frequency order) favours more common tokens."""
    order = np.lexsort((np.arange(counts.size), -counts))  # primary: count desc, secondary: id asc
    return np.sort(order[:size])


def build_draft_vocab(train, target_vocab_size: int, size: int, tokenizer_id: str, log=print) -> DraftVocab:
    """The vocabulary of ``train``, cached by the data's hash; a damaged cache file is said (``log``) and rebuilt."""
    size = min(size, target_vocab_size)
    h = hashlib.sha256(f"{tokenizer_id}|{target_vocab_size}|{size}|".encode())
    for ids, mask in zip(train["input_ids"], train["loss_mask"]):
        h.update(np.asarray(ids, dtype=np.int32).tobytes())
        h.update(np.asarray(mask, dtype=np.int8).tobytes())
    path = cache_dir() / "vocab" / f"{h.hexdigest()[:20]}.pt"
    if path.is_file():
        saved, problem = _read_cached(path, target_vocab_size, size)
        if problem is None:
            return saved
        log(f"[vocab] the cached draft vocabulary {path} is damaged ({problem}): rebuilt from the training data")
    counts = count_loss_tokens(train["input_ids"], train["loss_mask"], target_vocab_size)
    used = select_draft_tokens(counts, size)
    coverage = float(counts[used].sum() / max(counts.sum(), 1))
    vocab = DraftVocab(torch.from_numpy(used).long(), target_vocab_size, coverage)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {"draft_to_target": vocab.draft_to_target, "coverage": coverage}
    write_then_rename(path, lambda tmp: torch.save(saved, tmp))  # (another run may write it at the same moment)
    return vocab


def _read_cached(path, target_vocab_size: int, size: int) -> tuple[DraftVocab | None, str | None]:
    """(the cached vocabulary, None), or (None, what is wrong with the file): it must load as tensors and hold
    ``size`` ascending ids of the target vocabulary and a coverage."""
    try:
        saved = torch.load(path)
        ids, coverage = saved["draft_to_target"], float(saved["coverage"])
    except Exception as e:  # (a cut-short zip, a pickle refused by weights_only, another layout): all rebuilt
        return None, f"it does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'}"[:300]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() != size or ids.is_floating_point():
        held = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        return None, f"it holds {held} ids, not {size}"
    ids = ids.long()
    if bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
        return None, f"its ids are not {size} ascending ids of the target's {target_vocab_size}"
    return DraftVocab(ids, target_vocab_size, coverage), None


# Names of special tokens made to stand for nothing (a mask, reserved or unused slots), preferred in this order.
_MASK_LIKE = ("mask", "reserved", "unused")


def choose_mask_token(tokenizer, target_vocab_size: int) -> tuple[int, str]:
    """The token a draft's mask slots embed (P-EAGLE, DFlash), and why it was chosen. The slots are marked
    by their learned state, but their token's embedding is added to it: a frequent real token (id 0 is
    "!" in Llama 3 and the end-of-text token in SmolLM2) would tie the slot to that token's meaning.
    In order: the tokenizer's own mask token; a special token no conversation uses (not bos/eos/pad/unk,
    absent from the chat template), mask-, reserved- or unused-named ones first, lowest id first; an
    embedding row past the tokenizer's last id (no text encodes to it)."""
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    in_use = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = str(getattr(tokenizer, "chat_template", None) or "")
    unused = [(i, str(t)) for i, t in sorted(tokenizer.added_tokens_decoder.items())
              if getattr(t, "special", False) and i not in in_use and str(t) not in template]
    if unused:
        rank = lambda item: next((r for r, word in enumerate(_MASK_LIKE) if word in item[1].lower()), len(_MASK_LIKE))  # noqa: E731
        i, text = min(unused, key=lambda item: (rank(item), item[0]))
        return i, f"the special token {text!r}, which no conversation uses"
    if len(tokenizer) < target_vocab_size:
        return len(tokenizer), "the first embedding row past the tokenizer's ids"
    raise ValueError("no token to mark the mask slots with: the tokenizer has no mask token and no unused special "
                     "token; set draft.mask_token_id to a rare token of the target vocabulary")
