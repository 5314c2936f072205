"""Streaming DiLoCo (fragments, overlap, mixing) against a by-hand simulation of the algorithm, its bytes
per sync, P=1 as plain DiLoCo, and exact resume with a fragment in flight."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from test_comm import run_threads
from test_diloco import TinyModel, diloco_for
from trainer_utils import final_weights, read_metrics, resumed_equals_uninterrupted, train

from diloco.comm import SoloCollective

W, H, STEPS = 2, 4, 9


def moves(worker: int, step: int) -> list[torch.Tensor]:
    """The "inner step" of a worker: a known change of every parameter."""
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return [torch.randn(p.shape, generator=gen) * 0.05 for p in TinyModel().parameters()]


def by_hand(
    fragments: int, tau: int, alpha: float, lr=0.7, mu=0.9, steps=STEPS, inner_steps=H
) -> list[list[torch.Tensor]]:
    """Every worker's final weights, simulated on the flattened parameters cut into P equal runs of
    elements (as fragment_buckets cuts), one torch.optim.SGD(nesterov=True) parameter per fragment."""
    theta0 = [p.detach().clone() for p in TinyModel().parameters()]
    flat0 = torch.cat([t.reshape(-1) for t in theta0])
    bounds = [f * flat0.numel() // fragments for f in range(fragments + 1)]

    def cut(x: torch.Tensor) -> list[torch.Tensor]:
        return [c.clone() for c in x.split([bounds[f + 1] - bounds[f] for f in range(fragments)])]

    glob = cut(flat0)
    sgd = torch.optim.SGD(glob, lr=lr, momentum=mu, nesterov=True)
    local = [cut(flat0) for _ in range(W)]
    offsets = {(f + 1) * inner_steps // fragments % inner_steps: f for f in range(fragments)}

    def apply(f: int, mean: torch.Tensor) -> None:
        for i, g in enumerate(glob):
            g.grad = mean if i == f else None
        sgd.step()
        for w in range(W):
            local[w][f] = alpha * local[w][f] + (1 - alpha) * glob[f] if alpha else glob[f].clone()

    in_flight = []  # (apply_at, fragment, mean pseudo-gradient of the fragment)
    for step in range(1, steps + 1):
        for w in range(W):
            d = cut(torch.cat([m.reshape(-1) for m in moves(w, step)]))
            local[w] = [t - dt for t, dt in zip(local[w], d)]
        for job in [j for j in in_flight if j[0] == step]:
            in_flight.remove(job)
            apply(job[1], job[2])
        f = offsets.get(step % inner_steps)
        if f is not None:
            mean = sum(glob[f] - local[w][f] for w in range(W)) / W
            if tau == 0:  # applied at once, like the loop above would one step later
                apply(f, mean)
            else:
                in_flight.append((step + tau, f, mean))
    sizes = [t.numel() for t in theta0]
    return [[v.view_as(t) for v, t in zip(torch.cat(lw).split(sizes), theta0)] for lw in local]


def simulated(fragments: int, tau: int, alpha: float) -> list[list[torch.Tensor]]:
    models = [TinyModel() for _ in range(W)]

    def worker(w, coll):
        model = models[w]
        opts = dict(inner_steps=H, fragments=fragments, overlap_steps=tau, fragment_alpha=alpha)
        algo, _ = diloco_for(model, coll, fragment_layout="flat", **opts)
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                for p, d in zip(model.parameters(), moves(w, step)):
                    p.sub_(d)
            algo.after_inner_step(step)
        return [p.detach().clone() for p in model.parameters()]

    return run_threads(W, worker)


@pytest.mark.parametrize(
    "fragments,tau,alpha", [(1, 0, 0.0), (2, 0, 0.0), (2, 1, 0.0), (3, 2, 0.5), (1, 1, 0.5)]
)
def test_flat_fragments_overlap_and_mixing_follow_the_algorithm(fragments, tau, alpha):
    for ours, ref in zip(simulated(fragments, tau, alpha), by_hand(fragments, tau, alpha)):
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_transfer_overlaps_the_next_inner_steps():
    """Worker 1 joins the averaging of step 2 only after worker 0 has returned from step 2's outer step
    and finished step 3's inner work: a blocking transfer would deadlock (the group's timeout fails the
    test); with the transfer thread both finish, with the by-hand result."""
    models = [TinyModel() for _ in range(W)]
    worker0_ahead = threading.Event()

    def worker(w, coll):
        model = models[w]
        algo, _ = diloco_for(model, coll, inner_steps=2, overlap_steps=2)
        for step in range(1, 6):
            if w == 1 and step == 2:
                assert worker0_ahead.wait(timeout=30)
            with torch.no_grad():
                for p, d in zip(model.parameters(), moves(w, step)):
                    p.sub_(d)
            algo.after_inner_step(step)
            if w == 0 and step == 3:  # step 2's transfer is still waiting for worker 1
                worker0_ahead.set()
        algo.close()
        return [p.detach().clone() for p in model.parameters()]

    ours = run_threads(W, worker, timeout=30)
    ref = by_hand(1, 2, 0.0, steps=5, inner_steps=2)
    for a_list, b_list in zip(ours, ref):
        for a, b in zip(a_list, b_list):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_fragment_no_overlap_is_plain_diloco_bit_for_bit():
    """The default path and fragments=1/overlap 0/alpha 0 spelled out give identical weights and state."""

    def run(**opts):
        model = TinyModel()
        algo, opt = diloco_for(model, SoloCollective(), **opts)
        for step in range(1, 7):
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            algo.after_inner_step(step)
        return [p.detach().clone() for p in model.parameters()], algo.global_params

    (wa, ga), (wb, gb) = run(), run(fragments=1, overlap_steps=0, fragment_alpha=0.0)
    assert all(torch.equal(a, b) for a, b in zip(wa + ga, wb + gb))


def test_a_sync_sends_one_fragment():
    sent = {}

    def worker(w, coll):
        algo, _ = diloco_for(TinyModel(), coll, inner_steps=4, fragments=2, fragment_layout="flat")
        out = []
        for step in range(1, 5):
            before = dict(coll.sent)
            algo.after_inner_step(step)
            out.append(coll.sent.get("pseudo_grad_float32", 0) - before.get("pseudo_grad_float32", 0))
        sent[w] = out
        return algo.summary()

    summaries = run_threads(2, worker)
    # TinyModel's 23 parameters: fragment 0 is the first 11 (of fc1.weight's 12), fragment 1 the other 12
    assert sent[0] == sent[1] == [0, 11 * 4, 0, 12 * 4]
    assert summaries[0]["comm/peak_bytes_per_sync"] == 12 * 4


@pytest.mark.parametrize(
    "stop", [5]
)  # H=4, P=2, tau=1: fragment 1 synced at 4 is applied at 5; 6 is in flight
def test_resumed_streaming_run_equals_uninterrupted_bit_for_bit(tmp_path, stop):
    opts = ["distributed=diloco", "distributed.cosine_sample_size=0", "distributed.inner_steps=4"]
    opts += ["distributed.fragments=2", "distributed.overlap_steps=1", "distributed.fragment_alpha=0.5"]
    full = train(tmp_path, "train.max_steps=8", *opts, name="full")
    part = train(tmp_path, "train.max_steps=6", *opts, name="part")
    train(tmp_path, "train.max_steps=8", *opts, name="part")
    wf, wp = final_weights(full), final_weights(part)
    assert all(torch.equal(wf[k], wp[k]) for k in wf)
    rounds = [(r["step"], r["outer/fragment"]) for r in read_metrics(full) if "outer/round" in r]
    # synced at 2, 4, 6, 8 and logged when applied, one step later: step 8's is still in flight at the end
    assert rounds == [(3, 0), (5, 1), (7, 0)]


def test_flat_fragments_are_equal_runs_of_elements_and_views_of_the_parameters():
    """fragment_layout flat: P fragments of the flattened parameters differ in size by at most one element, whatever the
    tensor sizes (the peak bytes per sync is 1/P of the model's); a tensor across a boundary is split
    into views that write through to the parameter."""
    from diloco.diloco import fragment_buckets, fragment_pieces

    params = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(3, 3))]
    pieces = fragment_pieces([("a", params[0]), ("b", params[1])], 4, "flat")
    buckets, ids = fragment_buckets(pieces, bucket_size_mb=1)
    sizes = [sum(t.numel() for b in f for t in buckets[b]) for f in ids]
    assert sizes == [4, 5, 5, 5]  # 19 elements: bounds 0, 4, 9, 14, 19
    pieces = [t for f in ids for b in f for t in buckets[b]]
    assert sum(t.numel() for t in pieces) == 19
    with torch.no_grad():
        for i, t in enumerate(pieces):
            t.fill_(i + 1)  # every piece writes into its own parameter
    assert torch.equal(torch.cat([p.reshape(-1) for p in params]), torch.cat([t.reshape(-1) for t in pieces]))
    assert all(t is p or t._base is p for t, p in zip(pieces, [params[0]] * 3 + [params[1]] * 2))


# ---------------------------------------------------------------------------------- eager updates


def by_hand_eager(fragments: int, alpha: float, lr=0.7, mu=0.9, steps=13, inner_steps=H) -> list:
    """Eager updates (Kale et al., arXiv 2502.12996) by hand: each worker keeps its own global weights and
    outer SGD; at a fragment's sync it steps with mean_{t-1} - own_{t-1} / W + own_t / W, the mean of this
    sync arriving at the next one (tau = H)."""
    theta0 = [p.detach().clone() for p in TinyModel().parameters()]
    flat0 = torch.cat([t.reshape(-1) for t in theta0])
    bounds = [f * flat0.numel() // fragments for f in range(fragments + 1)]

    def cut(x: torch.Tensor) -> list[torch.Tensor]:
        return [c.clone() for c in x.split([bounds[f + 1] - bounds[f] for f in range(fragments)])]

    glob = [cut(flat0) for _ in range(W)]
    sgd = [torch.optim.SGD(g, lr=lr, momentum=mu, nesterov=True) for g in glob]
    local = [cut(flat0) for _ in range(W)]
    offsets = {(f + 1) * inner_steps // fragments % inner_steps: f for f in range(fragments)}
    last: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # fragment -> (mean, each worker's own)
    for step in range(1, steps + 1):
        for w in range(W):
            d = cut(torch.cat([m.reshape(-1) for m in moves(w, step)]))
            local[w] = [t - dt for t, dt in zip(local[w], d)]
        f = offsets.get(step % inner_steps)
        if f is None:
            continue
        own = [glob[w][f] - local[w][f] for w in range(W)]
        for w in range(W):
            eager = own[w] / W if f not in last else last[f][0] - last[f][1][w] / W + own[w] / W
            for i, g in enumerate(glob[w]):
                g.grad = eager if i == f else None
            sgd[w].step()
            local[w][f] = alpha * local[w][f] + (1 - alpha) * glob[w][f] if alpha else glob[w][f].clone()
        last[f] = (sum(own) / W, own)
    sizes = [t.numel() for t in theta0]
    return [[v.view_as(t) for v, t in zip(torch.cat(lw).split(sizes), theta0)] for lw in local]


@pytest.mark.parametrize("fragments,alpha", [(1, 0.0), (2, 0.0), (4, 0.5)])
def test_eager_updates_follow_the_algorithm(fragments, alpha):
    """Each worker's weights after 13 steps (3 rounds per fragment, the exchange on the transfer thread)
    equal the by-hand eager updates, which differ from the same run without them."""
    models = [TinyModel() for _ in range(W)]

    def worker(w, coll):
        model = models[w]
        opts = dict(
            inner_steps=H, fragments=fragments, overlap_steps=H, fragment_alpha=alpha, fragment_layout="flat"
        )
        algo, _ = diloco_for(model, coll, eager_updates=True, **opts)
        for step in range(1, 14):
            with torch.no_grad():
                for p, d in zip(model.parameters(), moves(w, step)):
                    p.sub_(d)
            algo.after_inner_step(step)
        algo.close()
        return [p.detach().clone() for p in model.parameters()]

    ours, ref = run_threads(W, worker, timeout=60), by_hand_eager(fragments, alpha)
    for a_list, b_list in zip(ours, ref):
        for a, b in zip(a_list, b_list):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lazy = by_hand(fragments, H, alpha, steps=13)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ours[0], lazy[0]))


def test_eager_updates_need_the_whole_inner_phase_overlapped():
    with pytest.raises(ValueError, match="overlap_steps = inner_steps"):
        diloco_for(TinyModel(), SoloCollective(), inner_steps=4, overlap_steps=2, eager_updates=True)


def test_resumed_eager_run_equals_uninterrupted_bit_for_bit(tmp_path):
    """Stopped with both fragments' exchanges in flight (and their own pseudo-gradients), resumed."""
    opts = ["distributed=diloco", "distributed.cosine_sample_size=0", "distributed.inner_steps=4"]
    opts += ["distributed.fragments=2", "distributed.overlap_steps=4", "distributed.eager_updates=true"]
    state = resumed_equals_uninterrupted(tmp_path, opts, stop=6, steps=10)
    assert [job[4] is not None for job in state["in_flight"]] == [True, True]


def test_eager_updates_without_the_whole_phase_overlapped_is_one_config_line():
    from trainer_utils import compose_cfg

    from diloco.config import ConfigError, validate

    with pytest.raises(ConfigError, match="needs overlap_steps = inner_steps") as err:
        validate(compose_cfg(["experiment=tiny/diloco_stream_p4_eager", "distributed.overlap_steps=3"]))
    assert "\n" not in str(err.value)
    assert validate(compose_cfg(["experiment=tiny/diloco_stream_p4_eager"])).distributed.overlap_steps == 25


# ------------------------------------------------------------------------- the paper's block fragments


@functools.cache
def _llama_config(layers: int):
    from trainer_utils import compose_cfg

    return compose_cfg(["model=micro", f"model.num_hidden_layers={layers}"]).model


def _llama(layers: int = 4) -> torch.nn.Module:
    from diloco.model import build_model

    return build_model(_llama_config(layers), seed=0)


@functools.cache
def _shapes() -> list[torch.Size]:
    return [p.shape for p in _llama(4).parameters()]


def _module(name: str) -> str:
    """model.layers.2.mlp.up_proj.weight -> model.layers.2; lm_head.weight -> lm_head."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["layers"] else ".".join(parts[:-1])


@pytest.mark.parametrize(
    ("layout", "want"),
    [
        (
            "strided",  # the paper's: fragment f holds blocks f, f + P, ...
            [
                {"model.embed_tokens", "model.layers.0", "model.layers.2"},
                {"model.layers.1", "model.layers.3", "model.norm", "lm_head"},
            ],
        ),
        (
            "sequential",
            [
                {"model.embed_tokens", "model.layers.0", "model.layers.1"},
                {"model.layers.2", "model.layers.3", "model.norm", "lm_head"},
            ],
        ),
    ],
)
def test_block_fragments_hold_whole_decoder_blocks(layout, want):
    """Streaming DiLoCo's fragments (arXiv 2501.18512, Sec. 2) are groups of whole transformer blocks,
    the embeddings with the first and the final norm and head with the last fragment."""
    from diloco.diloco import fragment_pieces

    model = _llama(4)
    named = list(model.named_parameters())
    pieces = fragment_pieces(named, 2, layout)
    names = {id(p): n for n, p in named}
    assert [{_module(names[id(p)]) for _, p in f} for f in pieces] == want
    assert all(piece is p for f in pieces for piece, p in f)  # never a tensor cut in two
    assert sorted(id(p) for f in pieces for _, p in f) == sorted(id(p) for _, p in named)


def by_hand_blocks(fragment_of, tau: int, alpha: float, lr=0.7, mu=0.9) -> list[dict]:
    """Every worker's final weights with whole tensors per fragment (`fragment_of(name)`), one
    torch.optim.SGD(nesterov=True) per fragment over its tensors."""
    base = _llama(4)
    names = [n for n, _ in base.named_parameters()]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    frags = sorted({fragment_of(n) for n in names})
    sgd = {
        f: torch.optim.SGD([glob[n] for n in names if fragment_of(n) == f], lr=lr, momentum=mu, nesterov=True)
        for f in frags
    }
    local = [{n: t.clone() for n, t in glob.items()} for _ in range(W)]
    offsets = {(f + 1) * H // len(frags) % H: f for f in frags}

    def apply(f, mean):
        for n in names:
            glob[n].grad = mean[n] if fragment_of(n) == f else None
        sgd[f].step()
        for w in range(W):
            for n in names:
                if fragment_of(n) == f:
                    local[w][n] = alpha * local[w][n] + (1 - alpha) * glob[n] if alpha else glob[n].clone()

    in_flight = []
    for step in range(1, STEPS + 1):
        for w in range(W):
            for n, d in zip(names, block_moves(w, step)):
                local[w][n] = local[w][n] - d
        for job in [j for j in in_flight if j[0] == step]:
            in_flight.remove(job)
            apply(job[1], job[2])
        f = offsets.get(step % H)
        if f is not None:
            mean = {n: sum(glob[n] - local[w][n] for w in range(W)) / W for n in names if fragment_of(n) == f}
            if tau == 0:
                apply(f, mean)
            else:
                in_flight.append((step + tau, f, mean))
    return local


def block_moves(worker: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return [torch.randn(shape, generator=gen) * 0.05 for shape in _shapes()]


def _strided(name: str) -> int:
    parts = name.split(".")
    if parts[1:2] == ["layers"]:
        return int(parts[2]) % 2
    return 0 if "embed_tokens" in name else 1


@pytest.mark.parametrize(("tau", "alpha"), [(0, 0.0), (1, 0.5)])
def test_strided_fragments_follow_the_algorithm_by_hand(tau, alpha):
    models = [_llama(4) for _ in range(W)]
    _shapes()  # composed here: Hydra is not for threads

    def worker(w, coll):
        model = models[w]
        algo, _ = diloco_for(model, coll, inner_steps=H, fragments=2, overlap_steps=tau, fragment_alpha=alpha)
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                for p, d in zip(model.parameters(), block_moves(w, step)):
                    p.sub_(d)
            algo.after_inner_step(step)
        algo.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    ours, ref = run_threads(W, worker, timeout=60), by_hand_blocks(_strided, tau, alpha)
    for a, b in zip(ours, ref):
        for n in b:
            torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)


def test_more_fragments_than_decoder_blocks_is_one_line():
    from trainer_utils import compose_cfg

    from diloco.config import ConfigError, validate

    base = ["model=micro", "distributed=diloco", "distributed.inner_steps=4", "distributed.fragments=3"]
    with pytest.raises(ConfigError, match="fragments=3 is more than the model's 2 decoder blocks"):
        validate(compose_cfg(base))
    validate(compose_cfg([*base, "distributed.fragment_layout=flat"]))  # the flat cut has no such limit
