"""``inference.torch.sleep_frees_weights``: sleep drops the packed-only weights' packed copies (all but one per
shape), the sync after it brings them back with the new values, and nothing can read a freed weight before that
(wake-up, scoring, `named_weights`)."""

from __future__ import annotations

import weakref

import pytest
import torch

from tandem.core.protocols import EngineAsleepError
from tandem.ops import native
from tandem.ops.linear import CAN_PACK, PackedOnlyWeight
from tests.engines.torch_helpers import make_engine, prompts, requests

pytestmark = pytest.mark.skipif(not CAN_PACK or native.load("pack") is None,
                                reason="no oneDNN packing or no C compiler: no packed-only weights to free")

SAMPLED = dict(temperature=0.9, max_new_tokens=12, seed=4)


def _outputs(engine, ps):
    return [(c.token_ids, c.log_probs) for r in engine.generate(requests(ps, **SAMPLED)) for c in r.completions]


def _packed_only(engine) -> dict[str, torch.Tensor]:
    return {n: w for n, w in engine._weights.items() if type(w) is PackedOnlyWeight}


def _freed_names(engine) -> list[str]:
    return sorted(n for n, w in engine._weights.items() if id(w) in engine._freed)


def _new_weights(engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype))
            for n, t in engine.named_weights().items()]


@pytest.mark.parametrize("dtype,deterministic", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_a_sync_into_freed_weights_gives_the_bits_of_an_engine_that_kept_them(dtype, deterministic):
    ps = prompts([6, 19, 11], seed=8)
    with make_engine(dtype=dtype, deterministic=deterministic, sleep_frees_weights=True) as freeing, \
            make_engine(dtype=dtype, deterministic=deterministic) as keeping:
        assert keeping.config.sleep_frees_weights is False  # the default keeps them
        for version, seed in ((1, 3), (2, 9)):  # two colocated turns: sleep, a sync while asleep, wake
            new = _new_weights(keeping, seed)
            for engine in (freeing, keeping):
                engine.sleep()
                engine.update_weights(new, version)
                assert engine.health()["freed_weight_bytes"] == 0  # every freed weight rewritten
                engine.wake_up()
            assert _outputs(freeing, ps) == _outputs(keeping, ps)
            a, b = freeing.named_weights(), keeping.named_weights()
            assert all(torch.equal(a[n], b[n]) for n in b)


def test_sleep_drops_every_packed_copy_but_one_per_shape_and_the_sync_brings_them_back():
    with make_engine(sleep_frees_weights=True) as engine:
        weights = _packed_only(engine)
        assert len(weights) == 10  # tiny-llama: q/o/gate/up/down of both layers, three shapes
        dropped = [weakref.ref(engine._packed[id(w)]) for w in weights.values()]
        engine.sleep()
        freed = _freed_names(engine)
        assert len(freed) == 7 and not any(id(weights[n]) in engine._packed for n in freed)
        kept = sorted(set(weights) - set(freed))  # the first weight of each shape: the layout template
        assert [n.split(".", 2)[2] for n in kept] == ["0.mlp.down_proj.weight", "0.mlp.gate_proj.weight",
                                                      "0.self_attn.q_proj.weight"]
        assert sum(r() is None for r in dropped) == 7  # their memory is back with the allocator
        nbytes = sum(w.numel() * w.element_size() for n, w in weights.items() if n in freed)
        assert engine.health()["freed_weight_bytes"] == nbytes
        update = [(n, torch.randn(w.shape)) for n, w in weights.items()]
        engine.update_weights(update, version=1)
        assert not engine._freed and all(id(w) in engine._packed for w in weights.values())
        engine.wake_up()
        assert all(torch.equal(engine.named_weights()[n], t) for n, t in update)


def test_a_freed_weight_cannot_be_read_until_a_sync_rewrites_it():
    with make_engine(sleep_frees_weights=True) as engine:
        new = dict(_new_weights(engine, seed=5))
        engine.sleep()
        freed = _freed_names(engine)
        with pytest.raises(EngineAsleepError, match=r"wake_up\(\) refused: 7 weight\(s\) freed at sleep .*"
                                                     r"model\.layers\.0\.mlp\.up_proj\.weight.*\(\+4 more\).*full "
                                                     r"weight update"):
            engine.wake_up()
        assert engine.health()["status"] == "sleeping"
        with pytest.raises(EngineAsleepError, match=r"score\(\) refused"):
            engine.score([([1, 2, 3, 4], 2)])
        view = engine.named_weights()
        with pytest.raises(EngineAsleepError, match="model.layers.1.mlp.up_proj.weight: its memory was freed"):
            view["model.layers.1.mlp.up_proj.weight"]
        assert torch.equal(view["model.embed_tokens.weight"], engine._weights["model.embed_tokens.weight"])
        engine.update_weights([(n, new[n]) for n in freed[:3]], version=1)  # one bucket of several
        with pytest.raises(EngineAsleepError, match=r"4 weight\(s\) freed"):
            engine.wake_up()
        engine.update_weights(list(new.items()), version=2)
        engine.wake_up()
        assert engine.health()["status"] == "ok" and engine.score([([1, 2, 3, 4], 2)])
        assert all(torch.equal(engine.named_weights()[n], new[n]) for n in _packed_only(engine))


def test_a_run_with_freed_weights_trains_to_the_same_numbers(tmp_path):
    """A colocated sync-mode run (the engine sleeps through every training step, a full sync follows) gives the
    same metrics with the setting as without it, and the engine ends holding the trainer's weights."""
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics
    from tests.runtime.test_loop import _cfg, _engine_weights, _weights

    rows = {}
    for frees in (True, False):
        run = Run(_cfg(f"inference.torch.sleep_frees_weights={str(frees).lower()}"), tmp_path / str(frees))
        assert run.engine.config.sleep_frees_weights is frees and run.engine.config.deterministic is False
        frees_seen: list[int] = []  # how many weights each sleep freed

        def sleep(engine=run.engine, real=run.engine.sleep, seen=frees_seen):
            real()
            seen.append(len(engine._freed))

        run.engine.sleep = sleep
        run.train(close=False)
        engine, trainer = _engine_weights(run), _weights(run)
        run.close()
        assert all(torch.equal(engine[k], trainer[k]) for k in trainer)
        assert len(frees_seen) == 3 and all(n > 0 for n in frees_seen) is frees
        rows[frees] = [{k: v for k, v in r.items() if k.startswith(("reward/", "train/", "rollout/response", "kl/"))
                        and not k.endswith("_s")} for r in read_metrics(tmp_path / str(frees))]
    assert len(rows[True][0]) > 10 and rows[True] == rows[False]


def test_a_run_whose_syncs_would_not_rewrite_every_weight_is_refused():
    from tandem.config import ConfigError, load_config
    from tandem.runtime import builders
    from tandem.runtime.config import RunConfig
    from tests.runtime.test_loop import RECIPE

    def filled(*overrides):
        return builders.plan_engines(load_config(RunConfig, RECIPE, list(overrides))).engine_config.sleep_frees_weights

    assert filled() is False  # off unless asked for
    assert filled("inference.torch.sleep_frees_weights=true") is True
    with pytest.raises(ConfigError, match=r"sleep_frees_weights.*delta \(sync\.delta: true\).*could not wake up"):
        filled("sync.delta=true", "inference.torch.sleep_frees_weights=true")
