"""Config checks that run before any model or data is built.

Hydra composes `configs/` (struct mode: an unknown key is refused by Hydra itself); this module adds
the cross-field checks and turns every problem into one readable line (ConfigError).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from diloco.assets import register_resolvers  # noqa: F401  (configs use ${diloco_asset:...})


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the problem."""


def _positive(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise ConfigError(
            f"{key} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
        )


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first problem. Distributed-mode checks live with each mode."""
    from diloco.model import llama_config

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as e:  # missing mandatory value, bad interpolation
        raise ConfigError(f"config does not resolve: {str(e).splitlines()[0]}") from None

    for key in (
        "optim.lr",
        "train.batch_size",
        "train.micro_batch_size",
        "data.seq_len",
        "eval.tokens",
        "eval.micro_batch_size",
        "optim.total_steps",
    ):
        _positive(cfg, key)
    for key in (
        "optim.weight_decay",
        "optim.grad_clip",
        "optim.warmup_steps",
        "train.max_steps",
        "train.log_every",
        "train.eval_every",
        "train.checkpoint_every",
    ):
        _positive(cfg, key, allow_zero=True)
    betas = list(cfg.optim.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {betas}")
    if cfg.train.batch_size % cfg.train.micro_batch_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not a multiple of "
            f"train.micro_batch_size={cfg.train.micro_batch_size}"
        )
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"precision must be auto, bf16 or fp32, got {cfg.precision!r}")
    if cfg.data.sharding not in ("iid", "noniid"):
        raise ConfigError(f"data.sharding must be iid or noniid, got {cfg.data.sharding!r}")
    if cfg.data.noniid_key not in ("domain", "page"):
        raise ConfigError(f"data.noniid_key must be domain or page, got {cfg.data.noniid_key!r}")
    if cfg.data.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}"
        )
    shard, num = cfg.data.shard, cfg.data.num_shards
    if (shard is None) != (num is None):
        raise ConfigError("data.shard and data.num_shards must be set together (or both null)")
    if shard is not None and not (isinstance(num, int) and num >= 1 and 0 <= shard < num):
        raise ConfigError(f"data.shard={shard} must be in [0, data.num_shards={num})")
    try:
        llama_config(cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
