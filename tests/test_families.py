"""Every family's tiny preset: capture and teacher on both backends equal an independent reference
(HF's own full forward with output_hidden_states and logits), family quirks, and a full run per family."""

from __future__ import annotations

import json

import pytest
import torch

from specforge_lite.config import available_presets
from specforge_lite.compose import load_config
from specforge_lite.data.images import image_inputs
from specforge_lite.data.vocab import DraftVocab
from specforge_lite.draft.objective import shift_left
from specforge_lite.targets import build_target
from specforge_lite.targets import HFTarget, Teacher

TINY = [p for p in available_presets("model") if p.endswith("_tiny")]
# families with our own (lean) forward
LEAN = {"llama3_tiny", "mistral_tiny", "phi3_tiny", "qwen2_5_tiny", "qwen3_tiny", "gemma3_tiny"}
AUX = [0, 2, 5, 8]  # the embedding output, two middle layers and the pre-norm final state (8 layers)

_targets: dict = {}


def hf_target(preset: str, aux=AUX):
    key = (preset, tuple(aux))
    if key not in _targets:
        _targets[key] = build_target(load_config([f"model={preset}", "tracker=none"]), aux_layer_ids=list(aux))
    return _targets[key]


def batch(vocab: int = 49152, seed: int = 0):
    """Three right-padded rows (lengths 40, 30, 13): longer than the tiny presets' 16-token windows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    mask[2, 13:] = 0
    return ids, mask


def reference(target, ids, mask):
    """Aux states and logits from HF's full forward: output_hidden_states[i] is the input of layer i for
    i < L; the pre-final-norm state (id L) comes from a forward pre-hook on the final norm."""
    seen = {}
    norm = target.family.final_norm(target.model)
    handle = norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    try:  # (our capture hooks stay idle outside capture())
        with torch.no_grad():
            out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    L = target.num_layers
    return [out.hidden_states[i] if i < L else seen["x"] for i in target.aux_layer_ids], out.logits


def spread_vocab(target, size=512):
    ids = torch.linspace(0, target.vocab_size - 1, size).long().unique()
    return DraftVocab(ids, target.vocab_size, float("nan"))


def close(a, b, rel=1e-5):
    scale = max(float(b.abs().max()), 1.0)
    return float((a - b).abs().max()) <= rel * scale


@pytest.mark.parametrize("preset", TINY)
def test_capture_and_teacher_equal_the_hf_reference_on_both_backends(preset):
    hf = hf_target(preset)
    lean = HFTarget(hf.model, hf.family, AUX, hf.location, backend="lean")
    assert (lean.lean is None) == (preset not in LEAN)  # no lean forward: the HF modules run
    ids, mask = batch(hf.vocab_size)
    real = mask.bool()
    needed = shift_left(mask, 1).bool() & real
    vocab = spread_vocab(hf)
    got = {}
    for name, target in (("hf", hf), ("lean", lean)):
        cap = target.capture(ids, mask)
        logits, in_vocab = Teacher(target, vocab.draft_to_target, vocab.t2d)(cap, needed)
        got[name] = (cap, logits, in_vocab)
    ref_aux, ref_logits = reference(hf, ids, mask)
    ref_teacher = ref_logits[..., vocab.draft_to_target]
    ref_in_vocab = vocab.t2d[ref_logits.argmax(-1)]
    for name, (cap, logits, in_vocab) in got.items():
        for i, (mine, theirs) in enumerate(zip(cap.aux, ref_aux)):
            assert close(mine[real], theirs[real]), f"{name}: aux id {AUX[i]} differs from the reference"
        assert close(logits[needed], ref_teacher[needed], 1e-4), f"{name}: teacher differs from HF logits"
        assert torch.equal(in_vocab[needed], ref_in_vocab[needed]), name
    # and the two backends agree with each other tightly
    for a, b in zip(got["hf"][0].aux + [got["hf"][0].final_hidden], got["lean"][0].aux + [got["lean"][0].final_hidden]):
        assert close(a[real], b[real], 1e-5)


@pytest.mark.parametrize("preset", ["qwen3_next_tiny", "qwen3_5_tiny", "qwen3_moe_tiny", "gpt_oss_tiny", "llama4_tiny"])
def test_a_samples_states_do_not_depend_on_its_batch(preset):
    """Recurrent (linear-attention) state and MoE routing must not carry anything between samples."""
    target = hf_target(preset)
    ids, mask = batch(target.vocab_size, seed=1)
    together = target.capture(ids, mask)
    for row in range(3):
        n = int(mask[row].sum())
        alone = target.capture(ids[row : row + 1, :n], mask[row : row + 1, :n])
        for a, b in zip(together.aux + [together.final_hidden], alone.aux + [alone.final_hidden]):
            assert close(a[row, :n], b[0], 1e-5), f"row {row} changes with its batch companions"


def test_hybrid_family_refuses_left_padding():
    target = hf_target("qwen3_next_tiny")
    ids, mask = batch(target.vocab_size)
    with pytest.raises(ValueError, match="right-padded"):
        target.capture(ids, mask.flip(1))


def test_gemma_draft_takes_the_raw_embedding_table_like_the_servers():
    """Gemma's embedding module multiplies by sqrt(hidden); SGLang/vLLM hand the draft the raw table."""
    from specforge_lite.run import build_draft

    for preset in ("gemma3_tiny", "gemma4_tiny"):
        target = hf_target(preset)
        config = load_config([f"model={preset}", "tracker=none", "draft.draft_vocab_size=512"])
        vocab = spread_vocab(target)
        draft = build_draft(config, target, vocab)
        ids = torch.tensor([[5, 17, 400]])
        table = target.model.get_input_embeddings().weight
        assert torch.equal(draft.embed(ids), table[ids])
        scaled = target.model.get_input_embeddings()(ids)
        assert torch.allclose(scaled, table[ids] * target.hidden_size ** 0.5, rtol=1e-3)


def test_gemma4_teacher_is_softcapped_over_the_draft_vocab_only():
    target = hf_target("gemma4_tiny")
    assert target.family.logit_softcap(target.config) == 30.0
    vocab = spread_vocab(target, 256)
    teacher = Teacher(target, vocab.draft_to_target, vocab.t2d)
    assert teacher.draft_head.weight.shape[0] == 256  # only the draft rows are kept for the teacher
    h = torch.randn(1, 4, target.hidden_size) * 50
    logits = teacher.logits(h)
    raw = h @ target.full_head()[0][vocab.draft_to_target].T
    assert float(logits.abs().max()) < 30.0 and torch.allclose(logits, torch.tanh(raw / 30) * 30, atol=1e-4)


@pytest.mark.parametrize("preset", ["gemma4_tiny", "llama3_tiny"])
def test_in_bf16_the_teacher_reads_the_logits_the_targets_own_forward_gives(preset):
    """The one head-logit policy: in bf16 the teacher's logits (and so the lean decoder's, the same
    LogitHead) are bit-equal to HF's forward logits, Gemma 4's soft-cap rounded in bf16 as transformers and
    vLLM round it; the argmax it trains toward is the served model's, near ties included."""
    target = build_target(load_config([f"model={preset}", "tracker=none", "model.dtype=bfloat16"]), aux_layer_ids=AUX)
    assert target.model.dtype == torch.bfloat16
    ids, mask = batch(target.vocab_size)
    seen = {}
    norm = target.family.final_norm(target.model)
    handle = norm.register_forward_hook(lambda m, args, out: seen.__setitem__("h", out))
    try:
        with torch.no_grad():
            hf_logits = target.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        handle.remove()
    real = mask.bool()
    everything = torch.arange(target.vocab_size)
    teacher = Teacher(target, everything, torch.ones(target.vocab_size, dtype=torch.bool))
    mine = teacher.logits(seen["h"][real])
    assert mine.dtype == torch.float32
    assert torch.equal(mine, hf_logits[real].float()), "the teacher's bf16 logits differ from HF's forward"
    assert torch.equal(teacher.draft_head.argmax(seen["h"][real]), hf_logits[real].argmax(-1))


def test_qwen3_vl_capture_includes_the_deepstack_injection():
    """With an image, the state entering text layers 1..3 is the layer output plus the deepstack
    features at image positions (what the servers capture); HF's output_hidden_states are taken before."""
    target = hf_target("qwen3_vl_tiny", [1, 2, 3, 4])
    cfg = target.config
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 image tokens after 2x2 merging
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=g)
    text = torch.randint(0, 49152, (1, 10), generator=g)
    ids = torch.cat([text[:, :4], torch.tensor([[cfg.vision_start_token_id] + [cfg.image_token_id] * 4 +
                                                [cfg.vision_end_token_id]]), text[:, 4:]], dim=1)
    mask = torch.ones_like(ids)
    cap = target.capture(ids, mask, pixel_values=pixels, image_grid_thw=grid)
    with torch.no_grad():
        types = (ids == cfg.image_token_id).int()  # what the processor returns as mm_token_type_ids
        out = target.model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                           mm_token_type_ids=types, output_hidden_states=True, use_cache=False)
        deepstack = target.model.model.get_image_features(pixels, grid).deepstack_features
    image = ids[0] == cfg.image_token_id
    for k, layer_id in enumerate([1, 2, 3]):
        injected = out.hidden_states[layer_id][0].clone()
        injected[image] += torch.cat(deepstack[k], dim=0)
        assert close(cap.aux[k][0], injected), f"aux id {layer_id} is not the post-injection state"
        assert not close(cap.aux[k][0], out.hidden_states[layer_id][0])
    assert close(cap.aux[3][0], out.hidden_states[4][0])  # no injection after layer 3
    with pytest.raises(ValueError, match="unexpected inputs"):
        target.family.run_decoder(target.model, ids, mask, audio=pixels)


def _image_conversation(folder):
    """Two drawn images of known size in one OpenAI-style row (paths relative to the data folder)."""
    from PIL import Image

    Image.new("RGB", (96, 64), (200, 30, 30)).save(folder / "wide.png")
    Image.new("RGB", (128, 128), (30, 30, 200)).save(folder / "square.png")
    return {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": "wide.png"},
                                     {"type": "text", "text": " and "}, {"type": "image", "image": "square.png"}]},
        {"role": "assistant", "content": "The first is red and wide, the second blue and square."},
        {"role": "user", "content": "Which is larger?"}, {"role": "assistant", "content": "The square one."}]}


def test_qwen3_vl_image_conversations_are_laid_out_as_the_model_reads_them(tmp_path):
    """Tokens, pixels and capture of an image+text conversation: each image's pad token is repeated once
    per merged patch group (computed here by hand from Qwen's 16-px patches and 2x2 merge), the loss skips
    the images, and the captured states equal HF's own forward on the same inputs."""
    from PIL import Image

    from specforge_lite.data.chat import tokenize_samples
    from specforge_lite.data.formats import normalize_conversation
    from specforge_lite.data.loader import collate
    from specforge_lite.targets import load_tokenizer

    target = hf_target("qwen3_vl_tiny")
    cfg, images = target.config, image_inputs(target)
    tok = load_tokenizer(target)
    messages = normalize_conversation(_image_conversation(tmp_path), base_dir=tmp_path)
    [(ids, mask, paths)] = tokenize_samples(tok, messages, 512, images)
    assert paths == [str(tmp_path / "wide.png"), str(tmp_path / "square.png")]
    runs, t = [], torch.tensor(ids)
    for start in (t == cfg.vision_start_token_id).nonzero().flatten().tolist():
        end = start + 1 + int((t[start + 1 :] != cfg.image_token_id).nonzero()[0])
        assert ids[end] == cfg.vision_end_token_id
        runs.append(end - start - 1)
    assert runs == [(64 // 16) * (96 // 16) // 4, (128 // 16) ** 2 // 4]  # 6 and 16 tokens
    assert not any(m for i, m in zip(ids, mask) if i == cfg.image_token_id)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "red and wide" in learned and "square one" in learned and "Compare" not in learned

    batch = collate([{"input_ids": ids, "loss_mask": mask, "images": paths}], 0, images)
    assert batch.inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8]]
    cap = target.capture(batch.input_ids, batch.attention_mask, **batch.inputs)
    pix = images.processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    with torch.no_grad():
        out = target.model(input_ids=batch.input_ids, pixel_values=pix["pixel_values"],
                           image_grid_thw=pix["image_grid_thw"],
                           mm_token_type_ids=(batch.input_ids == cfg.image_token_id).int(),
                           output_hidden_states=True, use_cache=False)
    assert close(cap.aux[0], out.hidden_states[0])  # embeddings with the image features merged in
    assert close(cap.aux[2], out.hidden_states[5])  # past the deepstack layers
    assert close(cap.final_hidden @ target.full_head()[0].T, out.logits, rel=1e-4)


def test_qwen3_vl_speculative_decoding_on_image_prompts_equals_hf_generate(tmp_path):
    """eval's speculative decoding with an image prompt reproduces HF generate's greedy output (image
    prefill, mrope offsets kept while decoding), and a text prompt after it is unaffected."""
    from conftest import tiny_draft

    from specforge_lite.data.chat import prompt_ids
    from specforge_lite.data.formats import normalize_conversation
    from specforge_lite.evaluate.spec_decode import speculative_generate
    from specforge_lite.generation import stop_ids
    from specforge_lite.targets import load_tokenizer

    target = hf_target("qwen3_vl_tiny")
    draft = tiny_draft(target, draft_vocab_size=512)
    tok, images = load_tokenizer(target), image_inputs(target)
    messages = normalize_conversation(_image_conversation(tmp_path), base_dir=tmp_path)
    stops = stop_ids(tok, target)
    text_prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                          add_generation_prompt=True, tokenize=False)
    cases = [prompt_ids(tok, messages, images), (tok(text_prompt, add_special_tokens=False)["input_ids"], [])]
    for prompt, paths in cases:
        inputs = images.pixels(paths)
        ids = torch.tensor([prompt])
        extra = {**inputs, "mm_token_type_ids": (ids == target.config.image_token_id).int()} if paths else {}
        with torch.no_grad():
            want = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=16, eos_token_id=sorted(stops), pad_token_id=0, **extra)
        got = speculative_generate(target, draft, prompt, 16, 3, stops, inputs)
        assert got.tokens == want[0, len(prompt):].tolist()


FAST = ["trainer.max_steps=2", "trainer.save_every=2", "trainer.progress_bar=false", "tracker=none",
        "data.max_length=96", "data.heldout_samples=4", "data.max_samples=24", "data.generation.max_conversations=8",
        "data.generation.max_new_tokens=8", "data.generation.batch_size=8", "draft.draft_vocab_size=1024",
        "eval.num_prompts=2", "eval.max_new_tokens=6", "eval.heldout_batches=2", "eval.prompt_sets=[heldout]"]


@pytest.mark.slow
@pytest.mark.parametrize("preset,extra", [(p, []) for p in TINY] + [
    ("gemma4_tiny", ["draft.use_aux_norm=true"]),
    ("qwen3_tiny", ["target.backend=lean"]),
    ("gemma3_tiny", ["target.backend=lean"]),
    # image+text conversations, kept as written (not regenerated): the random target's argmax is scored only
    # with its whole vocabulary as the draft's
    ("qwen3_vl_tiny", ["data=shapes", "draft.draft_vocab_size=1000000"]),
])
def test_every_family_trains_exports_and_evaluates(preset, extra, tmp_path):
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT))
    from specforge_lite.job import run

    # chit-chat only: the recipe's self-generated requests would make a random model write 4x the requests
    # it needs at 64 tokens each, never finishing one (tests/test_self_generated.py covers that source)
    source = [] if any(x.startswith("data=") for x in extra) else ["data.source=builtin_chitchat"]
    config = load_config([f"model={preset}", f"output_dir={tmp_path}", *FAST, *source, *extra])
    summary = run(config, tmp_path, log=lambda m: None)
    assert summary["step"] == 2
    # something was scored and trained on, not only run (a random target's argmax may lie outside a draft
    # vocabulary drawn from the data; the recipe's regenerated answers are the target's own tokens)
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["loss"] > 0 and m["grad_norm"] > 0 for m in steps), steps
    exported = json.loads((tmp_path / "final" / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "final" / "model.safetensors")
    assert ("fc_norm.0.weight" in weights) == ("draft.use_aux_norm=true" in extra)
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ev["mean_acceptance_length"] >= 1.0 and ev["prompts"] == 2


@pytest.mark.parametrize("preset", ["gemma3_tiny", "gpt_oss_tiny", "qwen3_next_tiny", "gemma4_tiny"])
def test_speculative_decoding_reproduces_greedy_with_caches_that_cannot_crop(preset):
    """Sliding-window and recurrent caches cannot drop rejected drafts; the snapshot-and-replay path must
    still give exactly the target's greedy output."""
    from conftest import tiny_draft

    from specforge_lite.evaluate.spec_decode import greedy_generate, speculative_generate

    target = hf_target(preset)
    draft = tiny_draft(target, draft_vocab_size=512)
    prompt = batch(target.vocab_size, seed=3)[0][0, :24].tolist()  # past the 16-token windows
    want = greedy_generate(target, prompt, 12, set())
    got = speculative_generate(target, draft, prompt, 12, 3, set())
    assert got.tokens == want and len(got.accepted) >= 1


def test_trust_remote_code_reaches_every_load_from_the_model_folder(monkeypatch):
    """model.trust_remote_code is the user's consent to run the checkpoint's own code: the tokenizer's load
    and a generator's own copy of the model (generation in another dtype) must be given it too, not only
    the target's load. (The loads are spied on and still run.)"""
    import transformers

    from specforge_lite.generation import LazyGenerator
    from specforge_lite.targets import load_tokenizer
    from specforge_lite.targets.families.base import TargetFamily

    seen = []
    real_tokenizer, real_load = transformers.AutoTokenizer.from_pretrained, TargetFamily.load

    def tokenizer_spy(*args, **kwargs):
        seen.append(("tokenizer", kwargs.get("trust_remote_code")))
        return real_tokenizer(*args, **kwargs)

    def load_spy(self, location, **kwargs):
        seen.append(("model", kwargs.get("trust_remote_code")))
        return real_load(self, location, **kwargs)

    config = load_config(["model=llama3_tiny", "tracker=none", "model.trust_remote_code=true", "model.dtype=float32",
                          "data.generation.dtype=bfloat16", "data.generation.engine=hf",
                          "data.generation.max_new_tokens=2"])
    target = build_target(config)  # (its own load was given the consent before; a first use builds the folder)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_spy)
    monkeypatch.setattr(TargetFamily, "load", load_spy)
    tokenizer = load_tokenizer(target)
    answers = LazyGenerator(config, target, tokenizer)([[{"role": "user", "content": "hi"}]])
    assert len(answers) == 1
    assert seen == [("tokenizer", True), ("model", True)], seen
