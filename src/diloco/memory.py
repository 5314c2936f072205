"""What one GPU holds during a run, estimated from the config (issue 53): the plan prints it and a dry run
refuses, in one line, a layout that cannot fit `launch.gpu_memory_gib`.

Per parameter, on CUDA (bf16 autocast, float32 master weights): weights 4 bytes, gradients 4, AdamW's two
moments 8; DiLoCo adds the float32 global copy and the outer momentum, 4 + 4 bytes, on the GPU only with
`global_copy_device: device` (the default keeps them in host memory). With DDP every rank holds all of it;
with FSDP (`worker_parallel: fsdp`) each of the G ranks a 1/G shard, plus the bf16 parameters of the
layers it has gathered at a time (two decoder layers: the one computing and the one prefetched).

Activations of one micro-batch of b sequences of s tokens, bf16 (2 bytes), per decoder layer of width h
and MLP width i, with attention through SDPA's fused kernels (no s x s score matrix kept):
`2 * s * b * (10 h + 3 i)` bytes (the layer's inputs, the q/k/v/o projections and norms, the SwiGLU's three
i-wide tensors), plus the logits and their float32 loss, `s * b * V * 6` bytes. With activation
checkpointing a layer keeps only its input (`2 * s * b * h`) and one layer's full activations exist at a
time during its recomputation. A rough model (within tens of percent of measured peaks is what it is for):
it decides whether a layout is worth trying, not the last gigabyte; the allocator's fragmentation and
the CUDA context (about 1 GiB) come on top, so a layout is refused above 90% of the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
USABLE = 0.9  # of launch.gpu_memory_gib: the rest for the CUDA context, workspaces and fragmentation


@dataclass(frozen=True)
class GpuMemory:
    weights: float
    grads: float
    adamw: float
    global_copy: float
    momentum: float
    gathered: float  # FSDP: the bf16 layers gathered at a time
    activations: float

    @property
    def total(self) -> float:
        return sum(vars(self).values())

    def line(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in vars(self).items() if v)
        return f"{self.total / GiB:.1f} GiB per GPU ({parts})"


def parameters(model) -> tuple[int, int]:
    """(all parameters, those of one decoder layer) of a Llama config."""
    h, i, layers, v = model.hidden_size, model.intermediate_size, model.num_hidden_layers, model.vocab_size
    kv = h * model.num_key_value_heads // model.num_attention_heads
    layer = h * (2 * h + 2 * kv) + 3 * h * i + 2 * h  # q, o, k, v; gate, up, down; two RMSNorms
    embeddings = v * h * (1 if model.tie_word_embeddings else 2)
    return layers * layer + embeddings + h, layer


def estimate(
    model,
    *,
    micro_batch: int,
    seq_len: int,
    shards: int,
    diloco: bool,
    global_on_gpu: bool,
    checkpointing: bool,
) -> GpuMemory:
    """One GPU's bytes (the module docstring); `shards`: G with FSDP, 1 with DDP."""
    n, layer = parameters(model)
    per = n / shards
    outer = 4 * per if diloco and global_on_gpu else 0.0
    h, i, layers = model.hidden_size, model.intermediate_size, model.num_hidden_layers
    one_layer = 2 * seq_len * micro_batch * (10 * h + 3 * i)
    kept = 2 * seq_len * micro_batch * h * layers + one_layer if checkpointing else one_layer * layers
    logits = seq_len * micro_batch * model.vocab_size * 6
    return GpuMemory(
        weights=4 * per,
        grads=4 * per,
        adamw=8 * per,
        global_copy=outer,
        momentum=outer,
        gathered=2 * 2 * layer if shards > 1 else 0.0,
        activations=kept + logits,
    )


def of_config(cfg) -> GpuMemory:
    """The estimate for a composed config (its distributed mode and layout)."""
    d = cfg.distributed
    fsdp = d.get("worker_parallel", "ddp") == "fsdp"
    if d.mode == "diloco":
        g = d.ranks_per_worker or cfg.launch.gpus_per_node
    else:
        g = cfg.launch.nodes * cfg.launch.gpus_per_node
    return estimate(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.data.seq_len,
        shards=g if fsdp else 1,
        diloco=d.mode in ("diloco", "dumb_diloco"),
        global_on_gpu=d.get("global_copy_device", "cpu") == "device",
        checkpointing=bool(cfg.train.get("activation_checkpointing", False)),
    )


def refusal(cfg) -> str | None:
    """Why this layout cannot fit the GPU (one line), or None."""
    mem, limit = of_config(cfg), float(cfg.launch.gpu_memory_gib) * GiB
    if mem.total <= USABLE * limit:
        return None
    return (
        f"{cfg.model.name} with {cfg.distributed.get('worker_parallel', 'ddp')} needs about {mem.line()}, over "
        f"{USABLE:.0%} of launch.gpu_memory_gib={cfg.launch.gpu_memory_gib:g}: shard it (distributed."
        "worker_parallel=fsdp over more ranks), checkpoint activations (train.activation_checkpointing=true) "
        "or lower train.micro_batch_size"
    )
