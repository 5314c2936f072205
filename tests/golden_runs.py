"""The runs behind tests/test_golden.py: short, deterministic CPU trajectories and their fingerprints.

- `trainer_job` runs inside each of 2 gloo ranks (tests/mp_utils.py): `diloco.train.run` four times in a
  row (DDP, DiLoCo fp32, DiLoCo int8, Streaming DiLoCo P=2), each on a TCPStore of its own that the
  parent process bound to port 0 (`GOLDEN_PORTS`): a second `init_process_group` on the store of the
  first finds the first group's keys there and hangs.
- `dumb_diloco_run` is one DumbDiLoCo worker and the master's outer loop in one thread, over a shared
  directory, in a fixed order: the worker's inner step and `after_inner_step`, and after each of its
  boundaries one `OuterLoop.run_once`. Inline lanes and a fake clock: nothing depends on timing.
- `quantizer_codes` is diloco.quant's int8 and int4 payloads of a fixed tensor.
- `fingerprint` is what the fixtures keep of a model: per-tensor float64 sum and L2 norm, and a SHA-256
  of the float32 bytes of every tensor, in name order.

This driver may follow the code's API when it changes (a constructor's arguments, a renamed attribute);
the runs it drives, and so tests/golden/*.json, may not: see tests/test_golden.py for when they can be
rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

STEPS, H = 16, 4  # 4 rounds of DiLoCo; Streaming DiLoCo's 2 fragments sync at steps 2 and 4 of each
# the micro model on the bundled sample, 2 ranks x 2 micro-batches of 2 sequences of 64 tokens; written out
# here, not taken from trainer_utils.SMALL, so that a change there cannot move the goldens
COMMON = [
    "model=micro",
    "data=sample",
    "data.seq_len=64",
    "data.shuffle_seed=null",  # the files' own order, as recorded (the seeded order came later, issue 55)
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "eval.tokens=2048",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    f"optim.total_steps={STEPS + 4}",
    f"train.max_steps={STEPS}",
    "device=cpu",
    "wandb.mode=disabled",
]
DILOCO = ["distributed=diloco", f"distributed.inner_steps={H}", "distributed.ranks_per_worker=1"]
TRAINER_RUNS = {  # name -> the overrides on top of COMMON; all run by 2 gloo ranks
    "ddp_2ranks": ["distributed=ddp"],
    "diloco_fp32_2workers": [*DILOCO, "distributed.pseudo_grad_dtype=float32"],
    "diloco_int8_2workers": [
        *DILOCO,
        "distributed.pseudo_grad_dtype=int8",
        "distributed.error_feedback=true",
    ],
    "diloco_stream_p2_2workers": [
        *DILOCO,
        "distributed.pseudo_grad_dtype=float32",
        "distributed.fragments=2",
        "distributed.fragment_layout=flat",  # as recorded (the paper's block fragments came later, issue 55)
    ],
}


def fingerprint(state: dict[str, torch.Tensor]) -> dict:
    """Per-tensor float64 sum and L2 norm, and the SHA-256 of all float32 bytes in sorted name order."""
    digest, tensors = hashlib.sha256(), {}
    for name in sorted(state):
        t = state[name].detach().cpu()
        digest.update(name.encode() + b"\0" + t.float().contiguous().numpy().tobytes())
        t64 = t.double()
        tensors[name] = {"sum": t64.sum().item(), "norm": t64.norm().item()}
    return {"sha256": digest.hexdigest(), "tensors": tensors}


@contextmanager
def one_thread():
    """Torch's intra-op math on one thread, as in the gloo ranks (mp_utils): the bits cannot depend on the
    machine's core count, and a loaded machine is not oversubscribed further."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------------- the trainer, 2 gloo ranks
def trainer_job(out_dir: str) -> dict:
    """One rank's part of every trainer run (the module docstring); returns where diloco came from."""
    from trainer_utils import compose_cfg

    import diloco
    from diloco.train import run

    ports = os.environ["GOLDEN_PORTS"].split(",")
    for port, (name, overrides) in zip(ports, TRAINER_RUNS.items(), strict=True):
        os.environ["MASTER_PORT"] = port  # this run's own store (the module docstring)
        cfg = compose_cfg([*COMMON, *overrides, f"out_dir={out_dir}", f"run_name={name}"])
        assert run(cfg) == 0, name
    return {"diloco": diloco.__file__}


def run_trainer_job(out_dir: Path, timeout: float = 240) -> list[dict]:
    """`trainer_job` in 2 gloo ranks, with one TCPStore per trainer run (bound to port 0, kept bound)."""
    import mp_utils
    from torch.distributed import TCPStore

    stores = [
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False) for _ in TRAINER_RUNS
    ]
    env = {"GOLDEN_PORTS": ",".join(str(s.port) for s in stores)}
    with tempfile.TemporaryDirectory() as tmp:
        args = Path(tmp) / "args.pkl"
        args.write_bytes(pickle.dumps({"out_dir": str(out_dir)}))
        outs = [Path(tmp) / f"out{r}.pkl" for r in range(2)]
        cmds = [
            [sys.executable, mp_utils.__file__, "golden_runs:trainer_job", str(args), str(o)] for o in outs
        ]
        mp_utils.check(
            mp_utils.wait(mp_utils.start(cmds, per_node=1, env=env), timeout), "golden trainer runs"
        )
        return [pickle.loads(o.read_bytes()) for o in outs]


def trainer_trajectory(run_dir: Path) -> dict:
    """Rank 0's per-step training loss (metrics.jsonl), the final eval loss and both ranks' final weights."""
    from diloco import checkpoint

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["Loss"] for r in rows if "Loss" in r]
    steps = [r["step"] for r in rows if "Loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = checkpoint.latest(run_dir)
    params = {}
    for rank in (0, 1):
        state = torch.load(ckpt / f"rank{rank}.pt", map_location="cpu", weights_only=True)
        params[f"rank{rank}"] = fingerprint(state["model"])
    return {"losses": losses, "final_eval_loss": summary["final_eval_loss"], "params": params}


# ------------------------------------------------------------------------------- DumbDiLoCo, one thread
DUMB_RUNS = {  # name -> the worker's settings past DUMB_SETTINGS
    "dumb_diloco_replace_fp32": {"install": "replace", "reset_inner_optimizer": True},
    "dumb_diloco_translate_int8": {
        "install": "translate",
        "reset_inner_optimizer": False,
        "pseudo_grad_dtype": "int8",
        "error_feedback": True,
    },
}
DUMB = {"steps": STEPS, "inner_steps": H, "outer_lr": 0.7, "outer_momentum": 0.9, "inner_lr": 3e-3}
DUMB |= {"batch": 4, "seq_len": 32, "model": "micro", "seed": 1337}
# v1 (inline upload and poll); with the fake clock the worker polls at its boundaries only
DUMB_SETTINGS = {
    "inner_steps": H,
    "poll_interval": 1.0,
    "async_delta_upload": False,
    "async_global_poll": False,
}


def micro_models(n: int) -> list[torch.nn.Module]:
    """n copies of the trainer's micro model at the trainer's default seed (the same initial weights)."""
    from trainer_utils import compose_cfg

    from diloco.model import build_model

    cfg = compose_cfg([f"model={DUMB['model']}", f"seed={DUMB['seed']}"])
    return [build_model(cfg.model, seed=cfg.seed) for _ in range(n)]


def token_batch(step: int) -> torch.Tensor:
    """The worker's batch at this step ([batch, seq_len] token ids): rows that count up from a random
    start by a stride of 1, 2 or 3, mod 1024, a pattern the model can learn; the same wherever it is made."""
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, 1024, (DUMB["batch"], 1), generator=g)
    stride = torch.randint(1, 4, (DUMB["batch"], 1), generator=g)
    return (start + stride * torch.arange(DUMB["seq_len"])) % 1024


@one_thread()
def dumb_diloco_run(tmp_path: Path, worker_settings: dict) -> dict:
    """A master (its outer loop) and one worker over a shared directory, driven in a fixed order."""
    from dumb_helpers import FakeClock, make_loop, settings

    from diloco.dumb_diloco.node.strategy import DumbDiLoCo
    from diloco.dumb_diloco.store.transport import DirectoryTransport

    repo = DirectoryTransport(tmp_path / "repo")
    master_model, model = micro_models(2)
    initial = master_model.state_dict()
    loop, _ = make_loop(
        repo,
        initial,
        lr=DUMB["outer_lr"],
        momentum=DUMB["outer_momentum"],
        max_file_bytes=2**26,
        publish=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=DUMB["inner_lr"])
    s = settings(tmp_path / "repo", node_id="w1", **DUMB_SETTINGS, **worker_settings)
    node = DumbDiLoCo(
        model, s, repo, optimizer=opt, clock=FakeClock(), tokens_per_step=128, samples_per_step=4
    )
    node.start()
    losses, rounds = [], []
    try:
        for step in range(1, STEPS + 1):
            ids = token_batch(step)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            node.after_inner_step(step)
            if step % H == 0:  # the worker uploaded its delta; the master's round applies it
                rounds.append(len(loop.run_once().applied))
    finally:
        node.close()
    entries = loop.state.ledger.entries()
    return {
        "losses": losses,
        "deltas_per_round": rounds,
        "outer_step": loop.state.outer_step,
        "ledger": [[e.node_id, e.local_step, e.status, e.outer_step] for e in entries],
        "delta_payload_sha256": [e.sha256 for e in entries],
        "installed_outer_step": node.installer.outer_step,
        "params": {"worker": fingerprint(model.state_dict()), "global": fingerprint(loop.state.weights)},
    }


# ------------------------------------------------------------------------------- the quantizer
def fixed_tensor(n: int = 1000) -> torch.Tensor:
    """[n] float32 of exact integer ratios (no RNG, no libm): three scales, an all-zero block, a last
    block that is padded (n is not a multiple of 256)."""
    i = torch.arange(n, dtype=torch.int64)
    x = ((i * 7919) % 1999 - 999).to(torch.float32) / 137.0
    x[256:512] *= 1e-3
    x[512:768] = 0.0
    x[768:] *= 1e3
    return x


@one_thread()
def quantizer_codes(block: int = 256) -> dict:
    """int8 and int4 payloads of fixed_tensor(): eagerly (quant.quantize) and through quant.encode with a
    carry (the CPU kernel where it builds), the codes' first values, the scales and the residual."""
    from diloco import quant

    x = fixed_tensor()
    carry = fixed_tensor().flip(0) * 1e-3
    out = {"n": x.numel(), "block": block}
    for name, bits in quant.QUANT_BITS.items():
        payload = quant.quantize(x, bits, block)
        cb = quant.code_bytes(x.numel(), bits, block)
        residual = torch.empty_like(x)
        with_carry, _ = quant.encode(x, bits, block, carry=carry, residual=residual)
        decoded = quant.dequantize(payload, x.numel(), bits, block)
        out[name] = {
            "payload_bytes": payload.numel(),
            "payload_sha256": sha256(payload),
            "first_codes": payload[:16].tolist(),
            "scales": payload[cb:].clone().view(torch.bfloat16).float().tolist(),
            "dequantized_sha256": sha256(decoded),
            "encode_with_carry_sha256": sha256(with_carry),
            "residual_sha256": sha256(residual),
        }
    return out
