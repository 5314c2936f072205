"""Launch plans of experiment configs: topology, tokens, communication volume, the commands per node
(`scripts/plan.py` is its command line; `scripts/replicate.py`, the ladders and tests use it too).

Communication volume is analytic and counts the payload each worker puts on the wire per collective
(what `comm/total_bytes` measures): DDP all-reduces every gradient every step; DiLoCo all-reduces the
pseudo-gradient once every H steps in its wire dtype; a DumbDiLoCo node uploads one float32 delta per
boundary and downloads one float32 global model per outer step. The commit budget of a DumbDiLoCo
run (commits per hour to its repository, by writer: dumb_diloco/store/budget.py) is printed too; a Hub run
over the Hub's limit is refused.
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import diloco.configs
from diloco import memory, preflight
from diloco.errors import ConfigError
from diloco.layout import ranks_per_worker

CONFIGS = Path(diloco.configs.__file__).parent  # configs/ of the checkout, or of the installed package
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class PlanError(ValueError):
    pass


def experiments(family: str | None = None) -> list[str]:
    root = CONFIGS / "experiment"
    names = sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))
    return [n for n in names if family is None or n.startswith(family + "/")]


def compose_experiment(name: str, overrides: list[str] = ()) -> DictConfig:
    if name not in experiments():
        known = ", ".join(experiments())
        raise PlanError(f"unknown experiment {name!r}; known: {known}")
    return compose_overrides([f"experiment={name}", *overrides])


def compose_overrides(overrides: list[str]) -> DictConfig:
    """The config `python -m diloco.train <overrides>` composes; any refusal is one line (PlanError)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import diloco.assets  # noqa: F401  (registers the ${diloco_asset:...} resolver)
    import diloco.schema  # noqa: F401  (registers the structured configs)
    from diloco.config import check_command_line

    if (error := check_command_line(list(overrides))) is not None:
        raise PlanError(error)
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise PlanError(" ".join(str(e).split())) from None


def check_run(overrides: list[str]) -> str | None:
    """Validate `python -m diloco.train <overrides>` as the trainer will before it builds anything
    (the same `validate`, and the batch split over the ranks the launch gives each worker); returns
    the trainer's notice about the schedule, if any. Raises PlanError with the trainer's line."""
    from diloco.config import check_batch_split, schedule_notice, validate
    from diloco.dumb_diloco.store.budget import config_budget, on_hub

    cfg = compose_overrides(overrides)
    topo = topology(cfg)
    if topo["mode"] == "none" and topo["world_size"] > 1:  # what every rank would refuse (distributed.py)
        raise PlanError(
            f"launched with {topo['world_size']} ranks but distributed=none; choose distributed=ddp or diloco"
        )
    try:
        typed = validate(cfg)
        preflight.check(typed, Path(typed.out_dir) / typed.run_name, hub=False)  # before any folder exists
        check_batch_split(
            cfg.train.batch_size, cfg.train.micro_batch_size, topo["world_size"] // topo["workers"]
        )
    except ConfigError as e:
        raise PlanError(str(e)) from None
    budget = config_budget(cfg) if topo["mode"] == "dumb_diloco" else None
    verdict = budget.verdict() if budget is not None else None
    notes = [
        n for n in (schedule_notice(cfg), verdict and on_hub(cfg.distributed.repo_id) and verdict[1]) if n
    ]
    return "; ".join(notes) or None


def num_parameters(model_cfg) -> int:
    import torch

    from diloco.model import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(model_cfg, seed=0).parameters())


def unique_train_tokens(data_cfg) -> int:
    """Training tokens the data can give once (local data files only): every token of every document with
    its separator when packing, else each document's first seq_len (the rest is never read). Counted once
    per process for each (files, tokenizer, packing, seq_len): the model never enters it."""
    cap = None if data_cfg.packing else int(data_cfg.seq_len)
    return _unique_train_tokens(str(data_cfg.data_files[data_cfg.train_split]), str(data_cfg.tokenizer), cap)


@functools.cache
def _unique_train_tokens(files: str, tokenizer: str, cap: int | None) -> int:
    import glob
    import gzip
    import json

    from diloco.data import load_tokenizer

    tok = load_tokenizer(tokenizer)
    total = 0
    for path in sorted(glob.glob(files)):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        lengths = [len(ids) for ids in tok(texts).input_ids]  # as the stream encodes them (data.py)
        total += sum(n + 1 for n in lengths) if cap is None else sum(min(n, cap) for n in lengths)  # +1: </s>
    return total


def topology(cfg: DictConfig) -> dict:
    """The launch's shape: nodes, ranks per node, GPUs each node needs, ranks in all, and workers (a
    DumbDiLoCo run's are its nodes, one torchrun each; the rest by `diloco.layout`, the runtime's rule)."""
    nodes, gpus = int(cfg.launch.nodes), int(cfg.launch.gpus_per_node)
    world = nodes * gpus
    mode = cfg.distributed.mode
    if mode == "dumb_diloco":
        workers = nodes
    elif mode == "diloco":
        try:
            workers = world // ranks_per_worker(mode, world, gpus, cfg.distributed.get("ranks_per_worker"))
        except ConfigError as e:
            raise PlanError(str(e)) from None
    else:
        workers = 1
    shared = int(cfg.launch.get("ranks_per_gpu") or 1)  # ranks sharing one GPU (the one-GPU family)
    return {
        "mode": mode,
        "nodes": nodes,
        "gpus_per_node": gpus,
        "gpus_needed": -(-gpus // shared),
        "world_size": world,
        "workers": workers,
    }


def wire_bytes(params: int, dcfg: DictConfig) -> float:
    """Bytes of one worker's pseudo-gradient on the wire: `pseudo_grad_dtype`'s size, or for int8/int4
    the codes plus one bfloat16 scale per `quant_block_size` values (diloco.quant.payload_bytes), or for
    topk2 the codes, indices and levels of every chunk (diloco.sparse.payload_bytes)."""
    from diloco import quant, sparse

    dtype = dcfg.get("pseudo_grad_dtype", "float32")
    if dtype in quant.QUANT_BITS:
        return quant.payload_bytes(params, quant.QUANT_BITS[dtype], dcfg.get("quant_block_size", 256))
    if dtype == sparse.TOPK_DTYPE:
        chunk = dcfg.get("topk_chunk", sparse.MAX_CHUNK)
        k = sparse.topk_count(dcfg.get("topk_density", 1 / 64), chunk)
        return sparse.payload_bytes(params, chunk, k)
    return params * DTYPE_BYTES[dtype]


def volume(cfg: DictConfig, params: int) -> dict:
    """Tokens and bytes per worker over the whole run (analytic)."""
    topo = topology(cfg)
    steps = int(cfg.train.max_steps)
    tokens = steps * cfg.train.batch_size * cfg.data.seq_len * topo["workers"]
    mode = topo["mode"]
    if mode == "ddp":
        per_step = params * 4
    elif mode in ("diloco", "dumb_diloco"):  # DumbDiLoCo: the upload; downloads add about as much again
        per_step = wire_bytes(params, cfg.distributed) / cfg.distributed.inner_steps
    else:
        per_step = 0
    return {
        "steps": steps,
        "tokens": tokens,
        "bytes_per_inner_step": per_step,
        "bytes_per_worker": per_step * steps,
        "parameters": params,
    }


def shell_vars(name: str, overrides: list[str]) -> str:
    cfg = compose_experiment(name, overrides)
    topo = topology(cfg)
    out = {
        "EXP_MODE": topo["mode"],
        "EXP_NODES": topo["nodes"],
        "EXP_GPUS_PER_NODE": topo["gpus_per_node"],
        "EXP_GPUS_NEEDED": topo["gpus_needed"],
        "EXP_WORKERS": topo["workers"],
        "EXP_RUN_NAME": cfg.run_name,
        "EXP_OUT_DIR": cfg.out_dir,
        "EXP_REPO_ID": OmegaConf.select(cfg, "distributed.repo_id", default="") or "",
    }
    return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in out.items())


def commit_budget_line(cfg: DictConfig) -> str:
    """The Hub commit budget of a DumbDiLoCo config, as one line (a warning appended above 100/hour);
    PlanError for a Hub repository (or none given yet) over the Hub's limit."""
    from diloco.dumb_diloco.store.budget import config_budget, on_hub

    budget = config_budget(cfg)
    if budget is None:
        return "Hub commits/hour/repo: unknown (set distributed.expected_step_seconds)"
    verdict = budget.verdict()
    if not on_hub(OmegaConf.select(cfg, "distributed.repo_id", default=None)):
        return budget.line() + " (a shared directory: no limit)"
    if verdict and verdict[0] == "refuse":
        raise PlanError(f"{cfg.run_name}: {verdict[1]}")
    return budget.line() + (f"\n   warning: {verdict[1]}" if verdict else "")


def _si(x: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:,.2f} {prefix}{unit}"
    return f"{x:,.0f} {unit}"


def describe(name: str) -> str:
    cfg = compose_experiment(name)
    topo, vol = topology(cfg), volume(cfg, num_parameters(cfg.model))
    lines = [
        f"== {name}: {cfg.run_name}",
        f"   model {cfg.model.name} ({vol['parameters'] / 1e6:.1f}M params), data {cfg.data.name}, "
        f"mode {topo['mode']}, {topo['nodes']} node(s) x {topo['gpus_per_node']} rank(s)"
        + (f" on {topo['gpus_needed']} GPU(s)" if topo["gpus_needed"] < topo["gpus_per_node"] else "")
        + f", {topo['workers']} worker(s)",
        f"   {vol['steps']:,} steps x {cfg.train.batch_size} seq x {cfg.data.seq_len} tokens"
        f" -> {_si(vol['tokens'], 'tokens')} in all",
        f"   communication per worker: {_si(vol['bytes_per_inner_step'], 'B')} per inner step, "
        f"{_si(vol['bytes_per_worker'], 'B')} over the run",
        f"   GPU memory (estimated, src/diloco/memory.py): {memory.of_config(cfg).line()} of "
        f"{cfg.launch.gpu_memory_gib:g} GiB",
    ]
    if (why := memory.refusal(cfg)) is not None:
        lines.append(f"   does not fit: {why}")
    if topo["mode"] == "dumb_diloco":
        lines.append("   " + commit_budget_line(cfg))
        lines.append(
            "   on each node i: scripts/launch_node.sh --experiment "
            + name
            + " --role <master|worker> --node-id <id> --repo-id <org/name> --shard i"
        )
    else:
        for r in range(topo["nodes"]):
            rdzv = "" if topo["nodes"] == 1 else " --rdzv <node0-host>:29500"
            lines.append(f"   node {r}: scripts/launch_node.sh --experiment {name} --node-rank {r}{rdzv}")
    return "\n".join(lines)
