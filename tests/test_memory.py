"""The per-GPU memory estimate (issue 53, src/diloco/memory.py): its arithmetic by hand on a small shape,
DDP against FSDP, activation checkpointing, and the dry run's one-line refusal of a layout that cannot fit."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from diloco import memory
from diloco.experiments import run as replicate
from diloco.experiments.plan import compose_experiment, describe


def test_the_estimate_by_hand_on_a_small_shape():
    model = OmegaConf.create(
        dict(
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=2,
            vocab_size=10,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
        )
    )
    # a layer: q 8x8, o 8x8, k and v 8x4 each; gate, up, down 8x16 each; two norms of 8
    layer = 64 + 64 + 32 + 32 + 3 * 128 + 16
    n = 2 * layer + 2 * 10 * 8 + 8  # the layers, embedding and head, the final norm
    assert memory.parameters(model) == (n, layer)
    ddp = memory.estimate(
        model, micro_batch=3, seq_len=5, shards=1, diloco=True, global_on_gpu=True, checkpointing=False
    )
    assert (ddp.weights, ddp.grads, ddp.adamw, ddp.global_copy, ddp.momentum) == (
        4 * n,
        4 * n,
        8 * n,
        4 * n,
        4 * n,
    )
    one_layer = 2 * 5 * 3 * (10 * 8 + 3 * 16)
    assert ddp.activations == 2 * one_layer + 5 * 3 * 10 * 6 and ddp.gathered == 0
    fsdp = memory.estimate(
        model, micro_batch=3, seq_len=5, shards=4, diloco=True, global_on_gpu=True, checkpointing=True
    )
    assert fsdp.weights == n and fsdp.adamw == 2 * n and fsdp.gathered == 4 * layer
    assert fsdp.activations == 2 * 5 * 3 * 8 * 2 + one_layer + 5 * 3 * 10 * 6


def test_a_7b_worker_fits_only_sharded():
    fsdp = compose_experiment("7b/diloco_4w_fsdp8")
    ddp = compose_experiment("7b/diloco_4w_fsdp8", ["distributed.worker_parallel=ddp"])
    assert memory.refusal(fsdp) is None and memory.of_config(fsdp).total < 20 * memory.GiB
    why = memory.refusal(ddp)
    assert why is not None and "needs about 10" in why and "worker_parallel=fsdp" in why
    assert "GPU memory (estimated" in describe("7b/diloco_4w_fsdp8")


def test_a_dry_run_of_a_layout_that_cannot_fit_is_one_line(capsys):
    code = replicate.main(["--family", "7b", "--dry-run", "--override", "distributed.worker_parallel=ddp"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(err) == 1 and err[0].startswith("error: 7b/diloco_4w_fsdp8: does not fit one GPU")
    )


@pytest.mark.parametrize("name", ["150m/diloco_8w_h500", "1b/diloco_4w_h125"])
def test_the_paper_runs_fit_an_h100(name):
    assert memory.refusal(compose_experiment(name)) is None
