"""Hidden states extracted by a serving engine, converted into our store.

    python -m specforge_lite.offline ingest --from vllm|speculators SRC [--layer-ids 2,14,27,30] \
        [hydra overrides] store=DIR

* vLLM ``extract_hidden_states``: one ``{req_id}.safetensors`` per request with ``hidden_states``
  [T, n_ids, H] (older builds: [n_ids, T, H], told apart by ``token_ids``' length) in the order of the
  ids vLLM was given. A file whose ``.lock`` is held by its writer is skipped (and counted).
* speculators: ``hs_{i}.safetensors`` with ``hidden_states`` [T, n_ids, H] and ``token_ids``
  (default ids [2, L//2, L-3, L]).

Both capture "input of layer i", id num_layers = the pre-norm final state: our convention, so ids map
one to one; ``--layer-ids`` names what the extraction was given, and every aux id of the run plus id
num_layers must be among them. Neither format records loss masks: each extracted sequence is matched
to the run's prepared training sample with the same tokens and takes its mask (unmatched ones are
skipped and counted). The target's parts (embedding, final norm, draft rows) and the in-vocabulary flags
come from the run's target, as in a dump.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ..targets.extraction import read_extraction, read_token_ids
from ..targets.store import ShardWriter, StoreError, teacher_record


def extraction_files(kind: str, src: Path) -> list[Path]:
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder of {kind} hidden-state files")
    if kind == "vllm":
        files = sorted(p for p in src.glob("*.safetensors"))
    elif kind == "speculators":
        files = sorted(src.glob("hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    else:
        raise ValueError(f"--from {kind!r}: use vllm or speculators")
    if not files:
        raise FileNotFoundError(f"no {kind} hidden-state files in {src}")
    return files


def ingest(run, kind: str, src: str | Path, layer_ids: list[int] | None = None, log=print) -> Path:
    """``run``: the online run (run.Run) whose prepared training data the extraction is matched to; its
    target gives the parts a store keeps and its teacher the in-vocabulary flags."""
    from .dump import data_settings, open_or_create, store_folder

    config, live, data, vocab, teacher = run.config, run.target, run.data, run.vocab, run.teacher
    sc, folder, src = config.store, store_folder(config, "ingest"), Path(src).expanduser()
    files = extraction_files(kind, src)
    L = live.num_layers
    aux_ids = list(live.aux_layer_ids)
    given = layer_ids or [2, L // 2, L - 3, L]
    missing = [i for i in [*aux_ids, L] if i not in given]
    if missing:
        raise StoreError(f"the extraction holds ids {given}; this run needs {aux_ids} and {L} (the pre-norm final "
                         f"state), missing {missing}. Extract with those ids, or set draft.aux_layer_ids / --layer-ids")
    pick = [given.index(i) for i in aux_ids]
    final_at = given.index(L)
    final_norm = live.family.final_norm(live.model)

    # First only the token ids, to match every file to its prepared sample; the states are then read one
    # file at a time as the store is written (an extraction can be far larger than memory).
    by_tokens = {tuple(ids): i for i, ids in enumerate(data.train["input_ids"])}
    found: dict[int, Path] = {}
    skipped = Counter()
    for path in files:
        ids = read_token_ids(path)
        if ids is None:
            skipped["being written (lock held)"] += 1
            continue
        index = by_tokens.get(tuple(ids.tolist()))
        if index is None:
            skipped["no prepared training sample with these tokens"] += 1
            continue
        found[index] = path
    if not found:
        raise StoreError(f"none of the {len(files)} files in {src} matched a prepared training sample "
                         f"({dict(skipped)}); "
                         "ingest with the model and data settings the extraction was made from")

    source = {"kind": f"ingest-{kind}", "model": config.model.name, "path": str(src), "layer_ids": given,
              "data": data_settings(config)}
    manifest = open_or_create(folder, live, vocab, aux_ids, sc, source, log)
    order = sorted(found)  # the prepared order, as a dump writes it
    writer = ShardWriter(folder, manifest, sc.samples_per_shard)
    with torch.no_grad():
        for index in order[manifest.num_samples:]:
            path = found[index]
            got = read_extraction(path)
            if got is None:
                raise StoreError(f"{path} was locked again by a writer while the store was written; re-run the "
                                 "ingest when the extraction has finished (it resumes)")
            ids, hs = got
            if hs.shape[1] != len(given) or hs.shape[2] != live.hidden_size:
                raise StoreError(f"{path}: hidden_states {tuple(hs.shape)}; expected [T, {len(given)} ids, "
                                 f"{live.hidden_size}] for --layer-ids {given} and this target's hidden size")
            hs = hs.to(live.device, live.dtype)
            final = hs[:, final_at]
            normed = final_norm(final)
            mask = torch.tensor(data.train[index]["loss_mask"])
            record = teacher_record(sc.teacher, sc.topk, final, lambda: teacher.logits(normed))
            writer.add(ids, mask, hs[:, pick], record, teacher.in_vocab(normed))
        writer.flush()
    log(f"[store] ingested {len(found)} {kind} sequences into {folder}" +
        (f"; skipped {sum(skipped.values())}: {dict(skipped)}" if skipped else ""))
    return folder
