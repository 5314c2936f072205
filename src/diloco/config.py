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
from diloco.errors import ConfigError

# DiLoCo's pseudo-gradient wire dtypes (diloco.comm: the floats, all-reduced; diloco.quant: int8/int4,
# reduce-scattered and all-gathered; diloco.sparse: topk2, all-gathered)
WIRE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4", "topk2")
ERROR_FEEDBACK_DTYPES = ("int8", "int4", "topk2")
GLOBAL_COPY_DEVICES = ("cpu", "device")
FRAGMENT_LAYOUTS = ("strided", "sequential", "flat")
WORKER_PARALLEL = (
    "ddp",
    "fsdp",
)  # how a worker's ranks share its model (distributed.worker_parallel)  # Streaming DiLoCo's fragments (diloco.fragment_pieces)
DUMB_DILOCO_ROLES = ("master", "worker", "single")


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
    return group_options("experiment")


def group_options(group: str) -> list[str]:
    """The files of a config group as the command line names them (sub-folders included: 150m/ddp_1x)."""
    root = _configs_dir() / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def unknown_option_error(group: str, value: str) -> str | None:
    """`model=2b` names no file of its group: one line with the nearest and every option; None if it does
    (or names none: `experiment=null`)."""
    options = group_options(group)
    if value in ("", "null") or value in options:
        return None
    near = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
    hint = f" (did you mean {group}={near[0]}?)" if near else ""
    return f"{group}={value}: no such {group}{hint}; the {group} options are: {', '.join(options)}"


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
        if (
            key in groups
            and isinstance(value := o.value(), str)
            and (error := unknown_option_error(key, value))
        ):
            return error  # Hydra's own answer lists only the group's top folder (`demo`), in 5 lines, exit 1
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
    return type_error(overrides)


def type_error(overrides: list[str]) -> str | None:
    """A value of the wrong type for its key (`train.max_steps=abc`) in one line, found by composing the
    config as Hydra is about to (whose own answer is five lines and exit 1); None when it composes, or
    fails for another reason (Hydra reports that itself)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_module(config_module="diloco.configs", version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except ConfigCompositionException as e:
        cause = e.__cause__
        if not isinstance(cause, ValidationError) or not cause.full_key:
            return None
        node = cause.object_type
        want = _kind(typing.get_type_hints(node).get(cause.key)) if dataclasses.is_dataclass(node) else None
        values = [
            o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == cause.full_key
        ]
        if want is None:
            return f"{cause.full_key}: {str(cause).splitlines()[0]}"
        return f"{cause.full_key} must be {want}" + (f", got {values[-1]!r}" if values else "")
    except Exception:
        return None
    return None


def _kind(t: Any) -> str | None:
    """What a value of schema type `t` is, in words (None for a type without a short name)."""
    args = typing.get_args(t)
    if type(None) in args and len(args) == 2:  # Optional[X]
        inner = _kind(next(a for a in args if a is not type(None)))
        return f"{inner} or null" if inner else None
    origin = typing.get_origin(t) or t
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if origin in (list, tuple):
        return "a list, e.g. '[a,b]'"
    if origin is dict:
        return "a mapping, e.g. '{a: 1}'"
    return names.get(origin)


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
    key: str,
    v: Any,
    lo: float,
    *,
    strict: bool = True,
    integer: bool = False,
    hi: float | None = None,
) -> None:
    """The value `v` of the dotted `key` must be a finite number (an integer if asked) above lo (or at
    least lo) and below hi."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if strict else v >= lo) and (hi is None or v < hi)
    if not ok or (integer and not isinstance(v, int)):
        if lo == 0 and not integer and hi is None:
            want = "a positive number" if strict else "a non-negative number"
        else:
            want = f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {lo:g}"
        raise ConfigError(f"{key} must be {want}{f' and < {hi:g}' if hi else ''}, got {v!r}")


def _one_of(key: str, v: Any, allowed: tuple[str, ...]) -> None:
    """The value `v` of the dotted `key` must be one of `allowed`."""
    if v not in allowed:
        choices = f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise ConfigError(f"{key} must be {choices}, got {v!r}")


def _boolean(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")


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
    if mode in ("ddp", "diloco"):
        _one_of("distributed.worker_parallel", d.worker_parallel, WORKER_PARALLEL)
        _number("distributed.timeout_seconds", d.timeout_seconds, 0)
        if d.ddp_bucket_cap_mb is not None:
            _number("distributed.ddp_bucket_cap_mb", d.ddp_bucket_cap_mb, 0)
    if mode == "ddp":
        _number("distributed.comm_log_every", d.comm_log_every, 0, strict=False, integer=True)
    if mode == "diloco":
        _number("distributed.inner_steps", d.inner_steps, 1, strict=False, integer=True)
        _number("distributed.outer_lr", d.outer_lr, 0)
        _number("distributed.outer_momentum", d.outer_momentum, 0, strict=False, hi=1)
        _check_quantization(d, WIRE_DTYPES)
        _check_topk(d)
        _one_of("distributed.topk_normalize", d.topk_normalize, ("none", "median"))
        _number("distributed.fragments", d.fragments, 1, strict=False, integer=True, hi=d.inner_steps + 1)
        tau_max = d.inner_steps + 1 if d.eager_updates else d.inner_steps  # eager updates: tau = H
        _number("distributed.overlap_steps", d.overlap_steps, 0, strict=False, integer=True, hi=tau_max)
        _number("distributed.fragment_alpha", d.fragment_alpha, 0, strict=False, hi=1)
        _one_of("distributed.fragment_layout", d.fragment_layout, FRAGMENT_LAYOUTS)
        if d.worker_parallel == "fsdp" and d.fragments > 1 and d.fragment_layout == "flat":
            raise ConfigError(
                "distributed.fragment_layout=flat cuts tensors across fragments, which FSDP's shards do not "
                "follow: with worker_parallel=fsdp use fragment_layout=strided or sequential"
            )
        if d.eager_updates and d.overlap_steps != d.inner_steps:
            raise ConfigError(
                "distributed.eager_updates overlaps the whole inner phase: it needs overlap_steps = "
                f"inner_steps ({d.inner_steps}), got overlap_steps={d.overlap_steps}"
            )
        _one_of("distributed.global_copy_device", d.global_copy_device, GLOBAL_COPY_DEVICES)
        _number("distributed.bucket_size_mb", d.bucket_size_mb, 0)
        _number("distributed.cosine_sample_size", d.cosine_sample_size, 0, strict=False, integer=True)
        if d.ranks_per_worker is not None:
            _number("distributed.ranks_per_worker", d.ranks_per_worker, 1, strict=False, integer=True)
    if mode == "dumb_diloco":
        check_dumb_diloco(d)
    return d


def _check_quantization(d: Any, dtypes: tuple[str, ...]) -> None:
    """DiLoCo's and DumbDiLoCo's pseudo-gradient codes (both diloco.quant)."""
    _one_of("distributed.pseudo_grad_dtype", d.pseudo_grad_dtype, dtypes)
    if d.error_feedback and d.pseudo_grad_dtype not in ERROR_FEEDBACK_DTYPES:
        allowed = [t for t in ERROR_FEEDBACK_DTYPES if t in dtypes]
        raise ConfigError(
            f"distributed.error_feedback applies to pseudo_grad_dtype {' or '.join(allowed)} only"
        )
    _number("distributed.quant_block_size", d.quant_block_size, 2, strict=False, integer=True)
    if d.quant_block_size % 2:
        raise ConfigError("distributed.quant_block_size must be even (4-bit codes are packed in pairs)")


def _check_topk(d: Any) -> None:
    """The sparse format (diloco.sparse) of DiLoCo and DumbDiLoCo: always with error feedback, k >= 1 of
    <= 4,096 per chunk."""
    _number("distributed.topk_density", d.topk_density, 0)
    if d.topk_density > 1:
        raise ConfigError(f"distributed.topk_density must be in (0, 1], got {d.topk_density!r}")
    _number("distributed.topk_chunk", d.topk_chunk, 1, strict=False, integer=True, hi=4097)
    _number("distributed.topk_ef_decay", d.topk_ef_decay, 0)
    if d.topk_ef_decay > 1:
        raise ConfigError(f"distributed.topk_ef_decay must be in (0, 1], got {d.topk_ef_decay!r}")
    if d.pseudo_grad_dtype == "topk2" and d.error_feedback is False:
        raise ConfigError(
            "distributed.error_feedback=false cannot go with pseudo_grad_dtype topk2 "
            "(it sends ~2% of each round: the rest must be carried)"
        )
    if round(d.topk_density * d.topk_chunk) < 1:
        raise ConfigError(
            f"distributed.topk_density x topk_chunk must keep at least 1 value per chunk, got "
            f"{d.topk_density!r} x {d.topk_chunk}"
        )


def check_dumb_diloco(d: Any) -> None:
    """Ranges of a typed DumbDiLoCo block (schema.DumbDiLoCoConfig or its runtime Settings)."""
    from diloco.dumb_diloco.wire.repo_paths import validate_node_id  # light: no torch.distributed, no Hub

    _one_of("distributed.role", d.role, DUMB_DILOCO_ROLES)
    for key, ids in (("node_id", [d.node_id]), ("collaborators", list(d.collaborators))):
        for node_id in ids:
            try:
                validate_node_id(node_id)
            except ValueError as err:
                raise ConfigError(f"distributed.{key}: {err}") from None
    if not isinstance(d.repo_id, str) or not d.repo_id.strip():
        raise ConfigError(f"distributed.repo_id must be a Hub repo id or a directory, got {d.repo_id!r}")
    if d.token is not None and (not isinstance(d.token, str) or not d.token):
        raise ConfigError(
            "distributed.token must be a string or null (prefer the HF_TOKEN environment variable)"
        )
    _number("distributed.inner_steps", d.inner_steps, 1, strict=False, integer=True)
    _number("distributed.poll_interval", d.poll_interval, 0)
    _number("distributed.outer_lr", d.outer_lr, 0)
    _number("distributed.outer_momentum", d.outer_momentum, 0, strict=False, hi=1)
    _number("distributed.startup_timeout", d.startup_timeout, 0)
    _number("distributed.shutdown_timeout", d.shutdown_timeout, 0, strict=False)
    _number("distributed.drain_timeout", d.drain_timeout, 0, strict=False)
    _number("distributed.lease_seconds", d.lease_seconds, 0, strict=False)
    _number("distributed.expected_step_seconds", d.expected_step_seconds, 0, strict=False)
    _number("distributed.install_wait_seconds", d.install_wait_seconds, 0, strict=False)
    _number("distributed.request_timeout", d.request_timeout, 0)
    _number("distributed.min_deltas_per_round", d.min_deltas_per_round, 0, strict=False, integer=True)
    _number("distributed.keep_deltas", d.keep_deltas, 0, strict=False, integer=True)
    _number("distributed.max_pending_snapshots", d.max_pending_snapshots, 0, strict=False, integer=True)
    _number("distributed.delayed_nesterov_period", d.delayed_nesterov_period, 1, strict=False, integer=True)
    _number("distributed.timeout_seconds", d.timeout_seconds, 0)
    _one_of("distributed.install", d.install, ("replace", "translate"))
    _one_of("distributed.budget", d.budget, ("local", "global"))
    _check_quantization(d, ("float32", "int8", "int4", "topk2"))  # what the master decodes (delta_codec)
    _check_topk(d)
    if d.install_when_staged and d.install != "translate":
        raise ConfigError(
            "distributed.install_when_staged needs distributed.install=translate "
            "(a replace mid-round loses work)"
        )
    if d.dynamic_local_steps and d.budget != "global":
        raise ConfigError(
            "distributed.dynamic_local_steps needs distributed.budget=global "
            "(a slow node would train alone at the end)"
        )
    wait = d.shutdown_timeout + (d.drain_timeout if d.role == "master" else 0)
    what = "drain_timeout + shutdown_timeout" if d.role == "master" else "shutdown_timeout"
    if d.timeout_seconds < wait:
        raise ConfigError(
            f"distributed.timeout_seconds ({d.timeout_seconds:g}) must be at least {what} ({wait:g}): "
            "a node's other ranks wait that long for its rank 0 at the end"
        )
    if d.max_file_bytes is not None:
        _number("distributed.max_file_bytes", d.max_file_bytes, 0, integer=True)
    _number("distributed.retry.max_attempts", d.retry.max_attempts, 1, strict=False, integer=True)
    _number("distributed.retry.base_delay_s", d.retry.base_delay_s, 0, strict=False)
    _number("distributed.retry.max_delay_s", d.retry.max_delay_s, 0, strict=False)
    _number("distributed.retry.max_total_s", d.retry.max_total_s, 0, strict=False)
    _check_dumb_diloco_switches(d)
    if not d.state_dir:
        raise ConfigError("distributed.state_dir must be a directory path")


def _check_dumb_diloco_switches(d: Any) -> None:
    """A DumbDiLoCo block's booleans (the runtime Settings are not typed by OmegaConf)."""
    _boolean("distributed.reset_inner_optimizer", d.reset_inner_optimizer)
    _boolean("distributed.async_delta_upload", d.async_delta_upload)
    _boolean("distributed.async_global_poll", d.async_global_poll)
    _boolean("distributed.publish_hf_config", d.publish_hf_config)
    _boolean("distributed.staleness_weighting", d.staleness_weighting)
    _boolean("distributed.delayed_nesterov", d.delayed_nesterov)
    _boolean("distributed.publish_master_state", d.publish_master_state)
    _boolean("distributed.dynamic_local_steps", d.dynamic_local_steps)


# --------------------------------------------------------------------------- the whole config


def validate(cfg: DictConfig) -> schema.Config:
    """Raise ConfigError on the first problem of any key of any mode. Builds nothing. Returns the typed
    config (schema.Config, interpolations resolved; `distributed` is the mode's typed block)."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as e:  # missing mandatory value, bad interpolation
        raise ConfigError(f"config does not resolve: {str(e).splitlines()[0]}") from None
    d = check_distributed(resolved.pop("distributed"))
    resolved.pop("hydra", None)
    c = typed(resolved, schema.Config, "")
    _number("optim.lr", c.optim.lr, 0)
    _number("train.batch_size", c.train.batch_size, 0)
    _number("train.micro_batch_size", c.train.micro_batch_size, 0)
    _number("data.seq_len", c.data.seq_len, 0)
    _number("eval.tokens", c.eval.tokens, 0)
    _number("eval.micro_batch_size", c.eval.micro_batch_size, 0)
    _number("optim.total_steps", c.optim.total_steps, 0)
    _number("launch.ranks_per_gpu", c.launch.ranks_per_gpu, 0)
    _number("optim.weight_decay", c.optim.weight_decay, 0, strict=False)
    _number("optim.grad_clip", c.optim.grad_clip, 0, strict=False)
    _number("optim.warmup_steps", c.optim.warmup_steps, 0, strict=False)
    _number("train.max_steps", c.train.max_steps, 0, strict=False)
    _number("train.log_every", c.train.log_every, 0, strict=False)
    _number("train.eval_every", c.train.eval_every, 0, strict=False)
    _number("train.checkpoint_every", c.train.checkpoint_every, 0, strict=False)
    _number("train.slowdown", c.train.slowdown, 1, strict=False)  # a factor on a slow shard's step time
    _number("train.step_seconds", c.train.step_seconds, 0, strict=False)  # an emulated device's time per step
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
            f"train.max_steps={c.train.max_steps} runs past optim.total_steps={c.optim.total_steps}, "
            "where the cosine schedule ends (it would climb back up): raise optim.total_steps"
        )
    _one_of("device", c.device, ("auto", "cpu", "cuda"))
    _one_of("precision", c.precision, ("auto", "bf16", "fp32"))
    _check_data(c.data)
    _check_model(c.model)
    if c.data.seq_len > c.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={c.data.seq_len} exceeds "
            f"model.max_position_embeddings={c.model.max_position_embeddings}"
        )
    if d.mode == "diloco":
        _check_evaluated_steps_are_boundaries(c.train, d.inner_steps)
        blocks = d.fragment_layout != "flat" and d.fragments > 1
        if blocks and d.fragments > c.model.num_hidden_layers:
            raise ConfigError(
                f"distributed.fragments={d.fragments} is more than the model's {c.model.num_hidden_layers} "
                f"decoder blocks, which fragment_layout={d.fragment_layout} groups: use at most "
                f"{c.model.num_hidden_layers} fragments, or fragment_layout=flat"
            )
    if d.mode == "dumb_diloco":
        _check_dumb_diloco_run(cfg)
        c.run_name = node_run_name(c.run_name, d)
    c.distributed = d
    return c


def node_run_name(run_name: str, d: Any) -> str:
    """A DumbDiLoCo node's run folder carries its node id (<run_name>-<node_id>, as launch_node.sh names
    it): two nodes on one machine never write one folder. Other modes, and role single, keep run_name."""
    if getattr(d, "mode", None) != "dumb_diloco" or d.role == "single":
        return run_name
    if run_name == d.node_id or run_name.endswith(f"-{d.node_id}"):  # it carries the node id already
        return run_name
    return f"{run_name}-{d.node_id}"


def run_dir_of(cfg: DictConfig) -> Path:
    """The run folder of a composed, unvalidated config (`out_dir`/the run name validate gives)."""
    return Path(cfg.out_dir) / node_run_name(str(cfg.run_name), cfg.distributed)


def _check_dumb_diloco_run(cfg: DictConfig) -> None:
    """What a DumbDiLoCo block needs of the whole config: a global budget, the node count (data.num_shards,
    else launch.nodes); on the Hub, a plan within the repository's commit limit (refused before it runs)."""
    from diloco.dumb_diloco.store.budget import config_budget, on_hub  # light: no Hub client

    d = cfg.distributed
    nodes = cfg.data.get("num_shards") or cfg.launch.nodes
    if d.get("budget") == "global" and nodes == 1:
        raise ConfigError("distributed.budget=global needs nodes: data.num_shards or launch.nodes above 1")
    if d.role != "single" and d.min_deltas_per_round > nodes:  # the master would wait for nodes never started
        raise ConfigError(
            f"distributed.min_deltas_per_round={d.min_deltas_per_round} is more than this run's {nodes} "
            "node(s) (data.num_shards, else launch.nodes): the master would wait for deltas no node sends; "
            f"set it to at most {nodes}"
        )
    budget = config_budget(cfg)
    if budget is None or not on_hub(d.repo_id):
        return
    verdict = budget.verdict()  # ("refuse" | "warn", why) or None
    if verdict is not None and verdict[0] == "refuse":
        raise ConfigError(f"distributed.expected_step_seconds={d.expected_step_seconds:g}: {verdict[1]}")


def _check_data(data: schema.DataConfig) -> None:
    for key, value, allowed in (
        ("sharding", data.sharding, ("iid", "noniid")),
        ("noniid_key", data.noniid_key, ("domain", "page")),
        ("eval_subset", data.eval_subset, ("all", "report", "tune")),
    ):
        if value not in allowed:
            raise ConfigError(f"data.{key} must be {' or '.join(allowed)}, got {value!r}")
    shard, num = data.shard, data.num_shards
    if (shard is None) != (num is None):
        raise ConfigError("data.shard and data.num_shards must be set together (or both null)")
    if shard is not None and not (num >= 1 and 0 <= shard < num):
        raise ConfigError(f"data.shard={shard} must be in [0, data.num_shards={num})")
    _number("data.shuffle_buffer", data.shuffle_buffer, 0, strict=False, integer=True)


def _check_model(model: schema.ModelConfig) -> None:
    _number("model.hidden_size", model.hidden_size, 0, integer=True)
    _number("model.num_hidden_layers", model.num_hidden_layers, 0, integer=True)
    _number("model.num_attention_heads", model.num_attention_heads, 0, integer=True)
    _number("model.num_key_value_heads", model.num_key_value_heads, 0, integer=True)
    _number("model.intermediate_size", model.intermediate_size, 0, integer=True)
    _number("model.vocab_size", model.vocab_size, 0, integer=True)
    _number("model.max_position_embeddings", model.max_position_embeddings, 0, integer=True)
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
