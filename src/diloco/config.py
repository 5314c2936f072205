"""Every config check, for every mode, in one place; it runs before any tokenizer, data set or model
is built.

The types and defaults are declared once in `diloco.schema` (Hydra composes `configs/` on top of it, so
an unknown key or a value of the wrong type is refused while composing). `validate` re-checks the
types against the schema (a config assembled by hand gets the same answer) and adds the ranges and
the cross-field rules; every problem is one readable line naming the key (ConfigError).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from diloco import schema
from diloco.assets import register_resolvers  # noqa: F401  (configs use ${diloco_asset:...})

# DiLoCo's pseudo-gradient wire dtypes (diloco.comm: the floats, all-reduced; diloco.quant: int8/int4, all-gathered)
WIRE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
GLOBAL_COPY_DEVICES = ("cpu", "device")
DUMB_DILOCO_ROLES = ("master", "worker", "single")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the problem."""


def print_error(message: str, *, every_rank: bool = False) -> None:
    """`error: message` on stderr. Under torchrun every rank finds the same config error: only rank 0
    prints it, unless `every_rank` (an error that may be one rank's own, e.g. its data shard)."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- keys


def _schema_keys(node_type: type, prefix: str) -> dict[str, bool]:
    """Every dotted key below `node_type` -> whether anything may go below it (an Any value)."""
    hints = typing.get_type_hints(node_type)
    keys: dict[str, bool] = {}
    for f in dataclasses.fields(node_type):
        t, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(t):
            keys[key] = False
            keys.update(_schema_keys(t, key + "."))
        elif node_type is schema.Config and f.name == "distributed":  # typed by the mode: any mode's key
            keys[key] = False
            for mode_type in schema.DISTRIBUTED_SCHEMAS.values():
                keys.update(_schema_keys(mode_type, key + "."))
        else:
            keys[key] = t is Any or Any in typing.get_args(t)
    return keys


@cache
def schema_keys() -> dict[str, bool]:
    return _schema_keys(schema.Config, "")


def nearest_key(key: str, candidates: list[str]) -> str | None:
    """The candidate a typo most likely meant: the closest last part (`max_step` -> `max_steps`,
    `nnodes` -> `launch.nodes`), ties going to the same block; None when nothing is close."""
    block, _, leaf = key.rpartition(".")
    best, best_score = None, 0.0
    for c in candidates:
        c_block, _, c_leaf = c.rpartition(".")
        score = difflib.SequenceMatcher(None, leaf, c_leaf).ratio() + 0.1 * (c_block == block)
        score += 0.05 * difflib.SequenceMatcher(None, key, c).ratio()
        if score > best_score:
            best, best_score = c, score
    return best if best_score >= 0.75 else None


def unknown_key_error(key: str, candidates: list[str] | None = None, where: str = "a config key") -> str:
    """The one line that refuses `key`, naming the nearest valid key when there is one."""
    near = nearest_key(key, list(schema_keys()) if candidates is None else candidates)
    return f"{key} is not {where}" + (f"; did you mean {near}?" if near else " (see src/diloco/schema.py)")


def _configs_dir() -> Path:
    import diloco.configs  # configs/, installed as this package (pyproject.toml)

    return Path(diloco.configs.__file__).parent


def config_groups() -> list[str]:
    """The config groups (configs/<group>/*.yaml): `model=...` chooses a file, it sets no key."""
    return sorted(d.name for d in _configs_dir().iterdir() if d.is_dir() and not d.name.startswith("_"))


def experiment_names() -> list[str]:
    root = _configs_dir() / "experiment"
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def help_choices() -> str:
    """The choices `python -m diloco.train --help` lists, written as they are typed on the command line
    (Hydra's own list shows `experiment/150m: ddp_1x`, a form the command line does not accept)."""
    root = _configs_dir()
    lines = ["experiment=NAME, one paper run each (its file's header says which result and what to expect):"]
    lines += [f"  experiment={name}" for name in experiment_names()]
    for group in ("model", "data", "distributed"):
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        lines.append(f"{group}={'|'.join(names)}")
    return "\n".join(lines)


if not OmegaConf.has_resolver("diloco_help_choices"):  # configs/config.yaml: hydra.help.template
    OmegaConf.register_new_resolver("diloco_help_choices", help_choices)


def check_command_line(args: list[str]) -> str | None:
    """Why these command-line overrides cannot compose, in one line, or None. Hydra itself would
    answer a key the schema lacks with "To append to your config use +key=value", and a `+` then
    adds it; here no key outside the schema passes, with or without `+`, and a typo names the
    nearest valid key. Flags (--help, --cfg job, ...) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    overrides = [a for a in args if not a.startswith("-")]
    if "--cfg" in args or "-c" in args or "--info" in args or "--help" in args or "-h" in args:
        return None
    groups = config_groups()
    for arg in overrides:  # experiment/150m=ddp_1x: the group's sub-folder belongs to the value
        key, _, value = arg.partition("=")
        group, _, sub = key.lstrip("+~").partition("/")
        if sub and group in groups:
            return f"{arg} is not how a file of the {group} group is chosen: write {group}={sub}/{value}"
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return " ".join(str(e).split()).split(" See https://")[0]
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or key in groups:
            continue
        keys = schema_keys()
        parts = key.split(".")
        if not (key in keys or any(keys.get(".".join(parts[:i])) for i in range(1, len(parts)))):
            return unknown_key_error(key)
        if parts[0] == "distributed" and len(parts) > 1:  # a key of some mode: of this run's?
            mode = _mode_of([a for a in overrides if a.partition("=")[0].lstrip("+~") in groups])
            mode_keys = _schema_keys(schema.DISTRIBUTED_SCHEMAS[mode], "distributed.") if mode else {}
            if mode and key not in mode_keys:
                return unknown_key_error(key, list(mode_keys), f"a key of distributed mode {mode}")
    return None


def _mode_of(group_choices: list[str]) -> str | None:
    """distributed.mode of the config these group choices compose (None if they do not compose)."""
    from hydra import compose, initialize_config_module

    try:
        with initialize_config_module(config_module="diloco.configs", version_base="1.3"):
            return compose(config_name="config", overrides=group_choices).distributed.mode
    except Exception:  # Hydra names a bad choice itself
        return None


def check_batch_split(batch_size: int, micro_batch_size: int, ranks_per_worker: int) -> None:
    """train.batch_size is per DiLoCo worker (global for DDP): each of the worker's ranks must get a
    whole number of micro-batches."""
    per_rank = batch_size // ranks_per_worker
    if per_rank * ranks_per_worker != batch_size or per_rank % micro_batch_size:
        raise ConfigError(
            f"train.batch_size={batch_size} does not split into {ranks_per_worker} ranks "
            f"x whole micro-batches of train.micro_batch_size={micro_batch_size}"
        )


def schedule_notice(cfg: Any) -> str | None:
    """One line announcing a learning-rate schedule that train.max_steps cuts short (deliberate in a
    demo or in the 1.1B runs judged half-way; a surprise otherwise), or None. A run longer than the
    schedule is refused by `validate` (the cosine would climb back up)."""
    max_steps, total, warmup = cfg.train.max_steps, cfg.optim.total_steps, cfg.optim.warmup_steps
    if max_steps >= total:
        return None
    if max_steps < warmup:
        where = f"still warming up ({max_steps}/{warmup} warmup steps)"
    else:
        progress = (max_steps - warmup) / max(1, total - warmup)
        where = f"at {0.5 * (1 + math.cos(math.pi * progress)):.0%} of the peak lr"
    return (
        f"train.max_steps={max_steps} stops the lr schedule before it ends (optim.total_steps={total}): "
        f"the run ends {where}; set optim.total_steps={max_steps} to finish it"
    )


def typed(block: Any, node_type: type, prefix: str) -> Any:
    """`block` (a DictConfig or a dict) checked against the schema dataclass `node_type` and returned as
    an instance of it (defaults filled in). Raise ConfigError naming the first bad key. A boolean
    must be one (OmegaConf would read the string "yes" as true)."""
    for f in dataclasses.fields(node_type):
        value = block.get(f.name) if hasattr(block, "get") else None
        if f.type == "bool" and value is not None and not isinstance(value, bool):
            raise ConfigError(f"{prefix}{f.name} must be true or false, got {value!r}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(node_type), block)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        if isinstance(e, ConfigKeyError) and key:  # a key the schema does not declare
            candidates = [prefix + k for k in _schema_keys(node_type, "")]
            mode = f"a key of distributed mode {block.get('mode')}"
            where = mode if prefix == "distributed." else "a config key"
            raise ConfigError(unknown_key_error(prefix + key, candidates, where)) from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{prefix}{key}: {reason}" if key else f"{prefix.rstrip('.')}: {reason}") from None


def _number(
    block: Any,
    key: str,
    prefix: str,
    lo: float,
    *,
    strict: bool = True,
    integer: bool = False,
    hi: float | None = None,
) -> None:
    """block.key must be a finite number (an integer if asked) above lo (or at least lo) and below hi."""
    v = getattr(block, key)
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if strict else v >= lo) and (hi is None or v < hi)
    if not ok or (integer and not isinstance(v, int)):
        if lo == 0 and not integer and hi is None:
            want = "a positive number" if strict else "a non-negative number"
        else:
            want = f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {lo:g}"
        raise ConfigError(f"{prefix}{key} must be {want}{f' and < {hi:g}' if hi else ''}, got {v!r}")


def _one_of(block: Any, key: str, prefix: str, allowed: tuple[str, ...]) -> None:
    v = getattr(block, key)
    if v not in allowed:
        choices = f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise ConfigError(f"{prefix}{key} must be {choices}, got {v!r}")


# --------------------------------------------------------------------------- the modes


def check_distributed(block: Any) -> Any:
    """The `distributed:` block of any mode, typed and range-checked; returns the typed block."""
    mode = block.get("mode") if hasattr(block, "get") else getattr(block, "mode", None)
    if mode not in schema.DISTRIBUTED_SCHEMAS:
        raise ConfigError(
            f"distributed.mode must be one of {', '.join(schema.DISTRIBUTED_SCHEMAS)}, got {mode!r}"
        )
    if isinstance(block, DictConfig):  # resolve interpolations (${train.log_every}) against the whole config
        try:
            block = OmegaConf.to_container(block, resolve=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"distributed: {str(e).splitlines()[0]}") from None
    d = typed(block, schema.DISTRIBUTED_SCHEMAS[mode], "distributed.")
    p = "distributed."
    if mode in ("ddp", "diloco"):
        _number(d, "timeout_seconds", p, 0)
        if d.ddp_bucket_cap_mb is not None:
            _number(d, "ddp_bucket_cap_mb", p, 0)
    if mode == "ddp":
        _number(d, "comm_log_every", p, 0, strict=False, integer=True)
    if mode == "diloco":
        _number(d, "inner_steps", p, 1, strict=False, integer=True)
        _number(d, "outer_lr", p, 0)
        _number(d, "outer_momentum", p, 0, strict=False, hi=1)
        _check_quantization(d, p, WIRE_DTYPES)
        _number(d, "fragments", p, 1, strict=False, integer=True, hi=d.inner_steps + 1)
        _number(d, "overlap_steps", p, 0, strict=False, integer=True, hi=d.inner_steps)
        _number(d, "fragment_alpha", p, 0, strict=False, hi=1)
        _one_of(d, "global_copy_device", p, GLOBAL_COPY_DEVICES)
        _number(d, "bucket_size_mb", p, 0)
        _number(d, "cosine_sample_size", p, 0, strict=False, integer=True)
        if d.ranks_per_worker is not None:
            _number(d, "ranks_per_worker", p, 1, strict=False, integer=True)
    if mode == "dumb_diloco":
        check_dumb_diloco(d)
    return d


def _check_quantization(d: Any, p: str, dtypes: tuple[str, ...]) -> None:
    _one_of(d, "pseudo_grad_dtype", p, dtypes)  # DiLoCo's and DumbDiLoCo's (both diloco.quant)
    if d.error_feedback and d.pseudo_grad_dtype not in ("int8", "int4"):
        raise ConfigError(f"{p}error_feedback applies to pseudo_grad_dtype int8 or int4 only")
    _number(d, "quant_block_size", p, 2, strict=False, integer=True)
    if d.quant_block_size % 2:
        raise ConfigError(f"{p}quant_block_size must be even (4-bit codes are packed in pairs)")


def check_dumb_diloco(d: Any) -> None:
    """Ranges of a typed DumbDiLoCo block (schema.DumbDiLoCoConfig or its runtime Settings)."""
    from diloco.dumb_diloco.tensor_format import validate_node_id  # light: no torch.distributed, no Hub

    p = "distributed."
    _one_of(d, "role", p, DUMB_DILOCO_ROLES)
    for key, ids in (("node_id", [d.node_id]), ("collaborators", list(d.collaborators))):
        for node_id in ids:
            try:
                validate_node_id(node_id)
            except ValueError as err:
                raise ConfigError(f"{p}{key}: {err}") from None
    if not isinstance(d.repo_id, str) or not d.repo_id.strip():
        raise ConfigError(f"{p}repo_id must be a Hub repo id or a directory, got {d.repo_id!r}")
    if d.token is not None and (not isinstance(d.token, str) or not d.token):
        raise ConfigError(f"{p}token must be a string or null (prefer the HF_TOKEN environment variable)")
    _number(d, "inner_steps", p, 1, strict=False, integer=True)
    _number(d, "poll_interval", p, 0)
    _number(d, "outer_lr", p, 0)
    _number(d, "outer_momentum", p, 0, strict=False, hi=1)
    _number(d, "startup_timeout", p, 0)
    for key in ("shutdown_timeout", "drain_timeout", "lease_seconds", "expected_step_seconds",
                "install_wait_seconds"):  # fmt: skip
        _number(d, key, p, 0, strict=False)
    _number(d, "request_timeout", p, 0)
    for key in ("min_deltas_per_round", "keep_deltas", "max_pending_snapshots"):
        _number(d, key, p, 0, strict=False, integer=True)
    _number(d, "delayed_nesterov_period", p, 1, strict=False, integer=True)
    _number(d, "timeout_seconds", p, 0)
    _one_of(d, "install", p, ("replace", "translate"))
    _one_of(d, "budget", p, ("local", "global"))
    _check_quantization(d, p, ("float32", "int8", "int4"))  # what the master decodes (delta_codec)
    for key, other, value, why in (
        ("install_when_staged", "install", "translate", "a replace mid-round loses work"),
        ("dynamic_local_steps", "budget", "global", "a slow node would train alone at the end"),
    ):
        if getattr(d, key) and getattr(d, other) != value:
            raise ConfigError(f"{p}{key} needs {p}{other}={value} ({why})")
    wait = d.shutdown_timeout + (d.drain_timeout if d.role == "master" else 0)
    what = "drain_timeout + shutdown_timeout" if d.role == "master" else "shutdown_timeout"
    if d.timeout_seconds < wait:
        raise ConfigError(
            f"{p}timeout_seconds ({d.timeout_seconds:g}) must be at least {what} ({wait:g}): a node's other "
            "ranks wait that long for its rank 0 at the end"
        )
    if d.max_file_bytes is not None:
        _number(d, "max_file_bytes", p, 0, integer=True)
    _number(d.retry, "max_attempts", p + "retry.", 1, strict=False, integer=True)
    for key in ("base_delay_s", "max_delay_s", "max_total_s"):
        _number(d.retry, key, p + "retry.", 0, strict=False)
    for key in ("reset_inner_optimizer", "async_delta_upload", "async_global_poll", "publish_hf_config",
                "staleness_weighting", "delayed_nesterov", "publish_master_state", "dynamic_local_steps"):  # fmt: skip
        if not isinstance(getattr(d, key), bool):
            raise ConfigError(f"{p}{key} must be true or false, got {getattr(d, key)!r}")
    if not d.state_dir:
        raise ConfigError(f"{p}state_dir must be a directory path")


# --------------------------------------------------------------------------- the whole config


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first problem of any key of any mode. Builds nothing."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as e:  # missing mandatory value, bad interpolation
        raise ConfigError(f"config does not resolve: {str(e).splitlines()[0]}") from None
    d = check_distributed(resolved.pop("distributed"))
    resolved.pop("hydra", None)
    c = typed(resolved, schema.Config, "")
    for key in ("optim.lr", "train.batch_size", "train.micro_batch_size", "data.seq_len", "eval.tokens",
                "eval.micro_batch_size", "optim.total_steps", "launch.ranks_per_gpu"):  # fmt: skip
        block, name = key.split(".")
        _number(getattr(c, block), name, f"{block}.", 0)
    for key in ("optim.weight_decay", "optim.grad_clip", "optim.warmup_steps", "train.max_steps",
                "train.log_every", "train.eval_every", "train.checkpoint_every"):  # fmt: skip
        block, name = key.split(".")
        _number(getattr(c, block), name, f"{block}.", 0, strict=False)
    _number(c.train, "slowdown", "train.", 1, strict=False)  # a factor on a slow shard's step time
    _number(c.train, "step_seconds", "train.", 0, strict=False)  # an emulated device's time per step
    betas = list(c.optim.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {betas}")
    if c.train.batch_size % c.train.micro_batch_size:
        raise ConfigError(
            f"train.batch_size={c.train.batch_size} is not a multiple of "
            f"train.micro_batch_size={c.train.micro_batch_size}"
        )
    if c.train.max_steps > c.optim.total_steps:
        raise ConfigError(
            f"train.max_steps={c.train.max_steps} runs past optim.total_steps={c.optim.total_steps}, where the "
            "cosine schedule ends (it would climb back up): raise optim.total_steps"
        )
    _one_of(c, "device", "", ("auto", "cpu", "cuda"))
    _one_of(c, "precision", "", ("auto", "bf16", "fp32"))
    _check_data(c.data)
    _check_model(c.model)
    if (n := c.data.seq_len) > (m := c.model.max_position_embeddings):
        raise ConfigError(f"data.seq_len={n} exceeds model.max_position_embeddings={m}")
    if d.mode == "diloco":
        _check_evaluated_steps_are_boundaries(c.train, d.inner_steps)
    if d.mode == "dumb_diloco":
        _check_dumb_diloco_run(cfg)


def _check_dumb_diloco_run(cfg: DictConfig) -> None:
    """What a DumbDiLoCo block needs of the whole config: a global budget, the node count (data.num_shards,
    else launch.nodes); on the Hub, a plan within the repository's commit limit (refused before it runs)."""
    from diloco.dumb_diloco.budget import config_budget, on_hub  # light: no Hub client

    if cfg.distributed.get("budget") == "global" and (cfg.data.get("num_shards") or cfg.launch.nodes) == 1:
        raise ConfigError("distributed.budget=global needs nodes: data.num_shards or launch.nodes above 1")
    verdict = budget.verdict() if (budget := config_budget(cfg)) is not None else None
    if verdict and verdict[0] == "refuse" and on_hub((d := cfg.distributed).repo_id):
        raise ConfigError(f"distributed.expected_step_seconds={d.expected_step_seconds:g}: {verdict[1]}")


def _check_data(data: schema.DataConfig) -> None:
    for key, choices in (("sharding", "iid|noniid"), ("noniid_key", "domain|page"), ("eval_subset", "all|report|tune")):  # fmt: skip
        if (value := getattr(data, key)) not in choices.split("|"):
            raise ConfigError(f"data.{key} must be {choices.replace('|', ' or ')}, got {value!r}")
    shard, num = data.shard, data.num_shards
    if (shard is None) != (num is None):
        raise ConfigError("data.shard and data.num_shards must be set together (or both null)")
    if shard is not None and not (num >= 1 and 0 <= shard < num):
        raise ConfigError(f"data.shard={shard} must be in [0, data.num_shards={num})")


def _check_model(model: schema.ModelConfig) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings"):  # fmt: skip
        _number(model, key, "model.", 0, integer=True)
    hidden, heads, kv_heads = model.hidden_size, model.num_attention_heads, model.num_key_value_heads
    if hidden % heads:
        raise ConfigError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}")
    if heads % kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={heads} is not divisible by model.num_key_value_heads={kv_heads}"
        )


def _check_evaluated_steps_are_boundaries(train: schema.TrainConfig, h: int) -> None:
    """DiLoCo workers hold averaged weights only right after an outer step. Periodic evaluations must
    fall there; a run that ends between two outer steps evaluates the last global weights
    (DiLoCo.eval_weights)."""
    if train.eval_every % h:
        raise ConfigError(
            f"train.eval_every={train.eval_every} is not a multiple of distributed.inner_steps={h}: "
            "DiLoCo evaluates the averaged model, which exists only every H steps"
        )
