"""The one typed definition of every config key, with its default, for every mode.

Hydra composes `configs/` on top of these dataclasses (registered below as structured configs):
the YAML files choose a model, a data set, a mode and an experiment and override values; the
defaults are written here and nowhere else. A key that is not declared here is refused when the
config is composed, and a value of the wrong type is refused by OmegaConf. The range and
cross-field checks (`diloco.config.validate`) read the same definitions.

Root defaults reproduce the OpenDiLoCo 150M setting (arXiv 2407.07852, Sec. 3): inner AdamW lr 4e-4,
betas (0.9, 0.95), wd 0.1, clip 1.0, 1000 warmup steps, cosine to 0 over 88,000 steps; sequences of
1024 tokens, 512 sequences per optimizer step (per DiLoCo worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional  # noqa: UP035  (OmegaConf reads Optional[...], not X | None, on 3.10)

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

# ruff: noqa: UP007, UP045


@dataclass
class OptimConfig:
    """Inner optimizer (AdamW) and its schedule."""

    lr: float = 4.0e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 1000
    total_steps: int = 88000  # cosine decays to 0 at this step
    foreach: Optional[bool] = None  # AdamW's multi-tensor kernels: None = torch's default; false saves memory
    fused: Optional[bool] = None  # AdamW's fused kernel: None = on for CUDA, off elsewhere


@dataclass
class TrainConfig:
    batch_size: int = 512  # sequences per optimizer step (per DiLoCo worker; global for DDP)
    micro_batch_size: int = 8  # sequences per forward/backward on one rank; accumulation fills the rest
    max_steps: int = II("optim.total_steps")  # stop after this many optimizer steps (may be < total_steps)
    log_every: int = 10
    eval_every: int = 1000  # 0 disables periodic eval; eval always runs at the end
    checkpoint_every: int = 1000  # 0 disables periodic checkpoints
    checkpoint_at_end: bool = True  # also write one when the run ends (false only for throwaway dry runs)
    keep_checkpoints: int = 2
    progress: bool = True  # tqdm progress line (rank 0 only)
    # recompute each decoder layer's activations in the backward instead of keeping them (transformers'
    # gradient checkpointing, non-reentrant torch.utils.checkpoint per layer): memory for compute
    activation_checkpointing: bool = False
    # heterogeneous workers (experiments): the data shards in slow_shards (a DiLoCo worker's rank, a
    # DumbDiLoCo node's data.shard) sleep after each step so that a step takes `slowdown` times as long
    slowdown: float = 1.0
    # > 0: every step takes at least this many seconds (a slow shard's: slowdown x this), emulating nodes with
    # hardware of their own on shared cores (timing.InjectedPace); 0: only the slow shards sleep
    step_seconds: float = 0.0
    slow_shards: list[int] = field(default_factory=list)


@dataclass
class EvalConfig:
    tokens: int = 1048576  # held-out tokens per evaluation (fixed, so perplexities are comparable)
    micro_batch_size: int = II("train.micro_batch_size")


@dataclass
class LaunchConfig:
    """What a run of this config needs; read by scripts/launch_node.sh and `make replicate-*`."""

    nodes: int = 1  # machines
    gpus_per_node: int = 1  # ranks per machine (torchrun --nproc_per_node)
    # ranks that share one GPU (>1: W workers on fewer GPUs, e.g. the one-GPU family; the process group
    # is then gloo, which takes CUDA tensors, since NCCL refuses two ranks on one GPU)
    ranks_per_gpu: int = 1
    family: Optional[str] = None  # runs compared in one report (results/<family>/), also the W&B group
    reference: Optional[str] = (
        None  # key of the paper number this run is checked against (results/reference.yaml)
    )
    report_step: Optional[int] = None  # step at which the paper reports (1.1B: 44k of 88k); None = the end
    gpu_memory_gib: float = 80  # one GPU's memory: a dry run refuses a layout estimated above 90% of it


@dataclass
class WandbConfig:
    project: str = "opendiloco-repro"
    entity: Optional[str] = None
    group: Optional[str] = II("launch.family")  # runs of one family share a group
    tags: list[str] = field(default_factory=list)
    mode: Optional[str] = None  # None: WANDB_MODE if set, else online with credentials, offline without


@dataclass
class ModelConfig:
    """A Llama shape (configs/model/*.yaml give the values)."""

    name: str = MISSING
    hidden_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1.0e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"


@dataclass
class DataConfig:
    """A data set and its tokenizer (configs/data/*.yaml give the values)."""

    name: str = MISSING
    path: str = MISSING  # `datasets` path (allenai/c4) or builder (json)
    config_name: Optional[str] = None
    data_files: Optional[Any] = None  # None: the hub dataset's own files; else {split: glob}
    train_split: str = "train"
    eval_split: str = "validation"
    eval_subset: str = (
        "all"  # all | report (its even-numbered documents) | tune (odd): tune on one, report the other
    )
    tokenizer: str = MISSING
    seq_len: int = 1024
    packing: bool = False  # false: pad each document to seq_len, pads masked out of the loss (OpenDiLoCo)
    sharding: str = "iid"  # iid | noniid
    noniid_key: str = "domain"  # noniid groups documents by URL host (domain) or source page (page)
    shard: Optional[int] = None  # None: this rank's shard (rank, world size); set for DumbDiLoCo nodes
    num_shards: Optional[int] = None
    # The training stream's order: its shard's files in a seeded order (datasets' shuffle) and its documents
    # through a seeded buffer of `shuffle_buffer` (data.DocumentShuffle). null: the files' own order.
    shuffle_seed: Optional[int] = II("seed")
    shuffle_buffer: int = 1000  # documents; 0: files shuffled, documents in file order


# --------------------------------------------------------------------------- distributed modes


@dataclass
class NoneDistConfig:
    """Single process, no distribution (the "1x batch" baseline when run with the paper's batch)."""

    enabled: bool = False
    mode: str = "none"


@dataclass
class DDPConfig:
    enabled: bool = True
    mode: str = "ddp"
    timeout_seconds: float = 600  # a collective that waits longer fails the run (dead or hung rank)
    ddp_bucket_cap_mb: Optional[float] = 25  # DDP gradient bucket size (MB); None = DDP's default
    comm_log_every: int = II("train.log_every")  # log comm/bytes_per_step and comm/total_bytes this often
    # ddp: every rank holds the whole model | fsdp: FSDP2 shards it over the ranks (each decoder layer and
    # the root; bf16 parameters and float32 reductions on CUDA, float32 on CPU)
    worker_parallel: str = "ddp"


@dataclass
class DiLoCoConfig:
    enabled: bool = True
    mode: str = "diloco"
    inner_steps: int = 500  # H (OpenDiLoCo 150M: 500; 1.1B: 125)
    outer_lr: float = 0.7  # outer SGD learning rate (DiLoCo's robust choice)
    outer_momentum: float = 0.9  # outer Nesterov momentum, in [0, 1)
    nesterov: bool = True  # Nesterov momentum in the outer SGD (ignored when outer_momentum is 0)
    # on the wire: float32 | float16 | bfloat16 | int8 | int4 (diloco.quant) | topk2 (diloco.sparse)
    pseudo_grad_dtype: str = "float32"
    # int8/int4/topk2: carry what quantization lost into the next round (topk2: always; false is refused)
    error_feedback: Optional[bool] = None
    quant_block_size: int = 256  # int8/int4: elements per bfloat16 scale
    topk_density: float = 0.015625  # topk2: the fraction of each chunk sent (SparseLoCo's 64 of 4,096)
    topk_chunk: int = 4096  # topk2: values per chunk (at most 4,096: 12-bit in-chunk indices)
    topk_normalize: str = "none"  # topk2: none | median (scale each worker's contribution to the median norm)
    # topk2: the carry is decayed by this before each round's pseudo-gradient joins it; SparseLoCo: 0.95 with
    # outer_momentum 0 (the carry stands in for the momentum); 1: plain error feedback
    topk_ef_decay: float = 1.0
    fragments: int = 1  # Streaming DiLoCo's P: fragment f syncs every H steps at offset (f+1)H/P
    # which parameters make fragment f: strided (the paper's: decoder blocks f, f+P, ...; embeddings with
    # fragment 0, final norm and head with fragment P-1) | sequential (P runs of consecutive blocks) | flat
    # (P equal runs of the flattened weights, tensors cut at the boundaries; this repository's before issue 55)
    fragment_layout: str = "strided"
    overlap_steps: int = 0  # tau: a fragment's outer step is applied tau inner steps after its sync
    fragment_alpha: float = 0.0  # after the outer step: local <- alpha * local + (1 - alpha) * global
    # Kale et al. 2025's eager updates (needs overlap_steps = inner_steps): step at once with this worker's
    # fresh pseudo-gradient standing in for its share of the mean, the others' shares one round late
    eager_updates: bool = False
    # inside each worker: ddp (every rank holds the whole model) | fsdp (FSDP2 shards it over the worker's
    # ranks; the pseudo-gradient, global copy and outer momentum are each rank's shard)
    worker_parallel: str = "ddp"
    fp16_scaling: bool = (
        True  # float16: per-tensor power-of-two scale agreed by all workers; false = plain cast
    )
    global_copy_device: str = "cpu"  # where the float32 global weights and outer momentum live: cpu | device
    reset_inner_optimizer: bool = (
        False  # clear AdamW state at every outer step (DumbDiLoCo spec); OpenDiLoCo keeps it
    )
    ranks_per_worker: Optional[int] = None  # G: ranks per worker (DDP inside); None = ranks per node
    timeout_seconds: float = 600  # a collective that waits longer fails the run (dead or hung rank)
    bucket_size_mb: float = 128  # float32 MB of pseudo-gradient per all-reduce
    ddp_bucket_cap_mb: Optional[float] = 25  # DDP bucket size (MB) inside a worker of G > 1 ranks
    cosine_sample_size: int = (
        65536  # coordinates all-gathered per round for the workers' mean pairwise cosine
    )
    cosine_sample_seed: int = 0  # which coordinates (the same on every rank)


@dataclass
class RetryConfig:
    """Hub retries: exponential backoff with jitter on 408/409/429/5xx and network errors."""

    max_attempts: int = 8
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    max_total_s: float = 900.0


@dataclass
class DumbDiLoCoConfig:
    """Asynchronous DumbDiLoCo (docs/dumb_diloco.md). The keys down to async_global_poll are the
    specification's, with its defaults; the rest are this implementation's own knobs."""

    enabled: bool = True
    mode: str = "dumb_diloco"
    role: str = "worker"  # master | worker | single (a forgotten role never starts a second master)
    node_id: str = MISSING  # unique, explicit, path-safe: [A-Za-z0-9][A-Za-z0-9._-]{0,63}, no '..'
    collaborators: list[str] = field(default_factory=list)  # master: node IDs it accepts; [] = every node
    repo_id: str = MISSING  # Hub model repo `namespace/name`, or a shared directory (path or file:///)
    token: Optional[str] = field(
        default=None, repr=False
    )  # prefer HF_TOKEN (or `hf auth login`); a token here is warned about
    inner_steps: int = 500  # H: a node uploads a delta every H local optimizer steps
    poll_interval: float = 60  # seconds between polls for a new global; also the master's outer-loop period
    outer_lr: float = 0.7  # master's outer SGD learning rate
    outer_momentum: float = 0.9  # master's outer Nesterov momentum (0 = plain SGD), in [0, 1)
    state_dir: str = ".speedtronic/diloco"  # master state in <state_dir>/<node_id>/
    reset_inner_optimizer: bool = True  # clear the AdamW state whenever a new global is installed
    async_delta_upload: bool = True  # v2: a background thread uploads; false = v1, on the training thread
    async_global_poll: bool = True  # v2: a background thread polls/downloads globals; false = v1
    # not in the specification:
    startup_timeout: float = 600  # seconds a worker waits for the repository and the first global
    shutdown_timeout: float = 120  # seconds close() waits for an in-flight upload/poll/outer round
    # master: at the end keep aggregating until every node's final delta is processed, at most this long
    drain_timeout: float = 600
    max_file_bytes: Optional[int] = None  # cap on any downloaded file; None = 2 x model size + 16 MiB
    request_timeout: float = 60  # seconds per Hub HTTP request
    retry: RetryConfig = field(default_factory=RetryConfig)
    publish_hf_config: bool = True  # master writes config.json + index so from_pretrained(repo) loads it
    # past the specification (docs/dumb_diloco.md "Past the specification"):
    min_deltas_per_round: int = 0  # master quorum: 0 = the spec (each poll with >= 1 delta steps)
    staleness_weighting: bool = False  # weight each delta by 1/(1+staleness), normalised
    delayed_nesterov: bool = False  # delayed Nesterov (arXiv 2401.09135)
    delayed_nesterov_period: int = 4  # momentum refreshed once per this many deltas (about the node count)
    publish_master_state: bool = True  # publish ledger.json and outer momentum with the global
    keep_deltas: int = 0  # master: keep the N newest processed deltas per node (0 = never delete)
    lease_seconds: float = 300  # single-master lease (0 = the spec: no lease)
    # seconds per inner step on the target hardware, for the Hub commit budget the plan prints and checks
    # (dumb_diloco/store/budget.py); 0 = unknown, no budget
    expected_step_seconds: float = 0
    install: str = "replace"  # replace (the spec: the global's weights) | translate (keep own progress)
    install_when_staged: bool = False  # translate only: install as soon as a global is staged, mid-round
    # at a boundary, wait at most this long for the global that includes the delta just uploaded (bounded
    # staleness: a node ahead of the others does not train on without it); 0 = never wait (the spec)
    install_wait_seconds: float = 0.0
    # translate: at most this many uploaded deltas that no installed global includes yet (a model-sized snapshot
    # each); a boundary past it is skipped and its steps go into the next delta, so a master that is down
    # for many rounds costs a worker no memory; 0 = no cap
    max_pending_snapshots: int = 2
    # local (the spec): every node trains train.max_steps steps; global: the nodes share num_shards x max_steps
    # node-steps (synchronous DiLoCo's tokens) and the lr follows the run's step (dumb_diloco/node/progress.py)
    budget: str = "local"
    # global budget only: a node's round is H x its speed / the fastest node's (Async Local-SGD's dynamic local
    # updates, arXiv 2401.09135), so a slow node's deltas arrive with the others' (dumb_diloco/node/progress.py)
    dynamic_local_steps: bool = False
    # deltas on the wire (issue 13; dumb_diloco/wire/delta_codec.py): float32 | int8 | int4 (diloco.quant)
    # | topk2 (diloco.sparse, issue 32)
    pseudo_grad_dtype: str = "float32"
    # int8/int4: on unless false; the node keeps what quantization lost (topk2: always; false is refused)
    error_feedback: Optional[bool] = None
    quant_block_size: int = 256  # int8/int4: elements per bfloat16 scale (even, >= 2)
    topk_density: float = 0.015625  # topk2: the fraction of each chunk sent (SparseLoCo's 64 of 4,096)
    topk_chunk: int = 4096  # topk2: values per chunk of each tensor (at most 4,096: 12-bit in-chunk indices)
    # topk2: each node's carry is decayed by this before its next delta joins it (SparseLoCo: 0.95, with
    # the master's outer_momentum 0), as distributed.topk_ef_decay of synchronous DiLoCo
    topk_ef_decay: float = 1.0
    # a node of G ranks (torchrun --nproc_per_node G): a collective inside the node that waits longer fails
    # it; at least drain_timeout + shutdown_timeout, which the node's other ranks may wait for its rank 0
    timeout_seconds: float = 2400


DISTRIBUTED_SCHEMAS: dict[str, type] = {
    "none": NoneDistConfig,
    "ddp": DDPConfig,
    "diloco": DiLoCoConfig,
    "dumb_diloco": DumbDiLoCoConfig,
}


@dataclass
class Config:
    run_name: str = "${model.name}-${distributed.mode}-seed${seed}"
    out_dir: str = "runs"  # each run writes into ${out_dir}/${run_name}
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on cuda, fp32 on cpu) | bf16 | fp32
    compile: Optional[bool] = None  # torch.compile the model; None = on for CUDA, off on the CPU
    resume: str = "auto"  # auto (latest checkpoint of the run dir, if any) | never | <checkpoint dir>
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    distributed: Any = None  # typed by the mode's schema (configs/distributed/<mode>.yaml pulls it in)


def register() -> None:
    """Make the schemas visible to Hydra: `config_schema` under the root config, and
    `distributed/<mode>_schema` under each configs/distributed/<mode>.yaml."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for mode, schema in DISTRIBUTED_SCHEMAS.items():
        cs.store(group="distributed", name=f"{mode}_schema", node=schema)


register()
