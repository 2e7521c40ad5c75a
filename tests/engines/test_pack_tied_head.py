"""``inference.torch.pack_tied_head: false``: a vocabulary projection tied to the input embedding gets no packed
copy (the lookup keeps the plain tensor anyway), through sleeps and syncs; an untied one is still packed; the
engine samples what the default engine samples."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import native
from tandem.ops.linear import CAN_PACK
from tests.engines.torch_helpers import make_engine, prompts, requests

pytestmark = pytest.mark.skipif(not CAN_PACK or native.load("pack") is None,
                                reason="no oneDNN packing here: no weight is packed either way")

GREEDY = dict(temperature=0.0, max_new_tokens=10)


def _outputs(engine, ps, **sampling):
    return [(c.token_ids, c.log_probs) for r in engine.generate(requests(ps, **sampling)) for c in r.completions]


def _head_packed(engine) -> bool:
    return id(engine.model.lm_head.weight) in engine._packed


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_tied_head_stays_plain_and_the_engine_samples_the_same_tokens(deterministic):
    ps = prompts([5, 17, 9], seed=2)
    with make_engine(deterministic=deterministic) as packed, \
            make_engine(deterministic=deterministic, pack_tied_head=False) as plain:
        assert plain.model.lm_head.weight is plain.model.model.embed_tokens.weight  # tiny-llama is tied
        assert _head_packed(packed) and not _head_packed(plain)
        head_bytes = plain.model.lm_head.weight.numel() * plain.model.lm_head.weight.element_size()
        assert packed.health()["packed_weight_bytes"] - plain.health()["packed_weight_bytes"] == head_bytes
        assert len(plain._packed) == len(packed._packed) - 1  # every other linear weight is still packed

        def same():
            a, b = _outputs(packed, ps, **GREEDY), _outputs(plain, ps, **GREEDY)
            assert [t for t, _ in a] == [t for t, _ in b]
            if deterministic:  # the batch-invariant products do not read packed copies: the same bits
                assert a == b
            else:
                for (_, la), (_, lb) in zip(a, b, strict=True):
                    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=0, atol=1e-4)

        same()
        g = torch.Generator().manual_seed(5)
        new = [(n, t + 0.02 * torch.randn(t.shape, generator=g)) for n, t in packed.named_weights().items()]
        for engine in (packed, plain):  # a colocated turn: sleep, a sync while asleep (the head too), wake
            engine.sleep()
            engine.update_weights(new, version=1)
            engine.wake_up()
        assert _head_packed(packed) and not _head_packed(plain)
        assert torch.equal(plain.named_weights()["lm_head.weight"], dict(new)["lm_head.weight"])
        same()


def test_an_untied_head_is_packed_whatever_the_setting():
    with make_engine("tiny-qwen3", pack_tied_head=False) as engine:
        assert engine.model.lm_head.weight is not engine.model.model.embed_tokens.weight
        assert _head_packed(engine)
