"""`fast_linear_scope` + `install_fast_linears`: the numerics of `fast_linear_mode` for nn.Linear layers and
`linear`, without a TorchFunctionMode (which costs ~1 us on every torch call of a decode step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.ops.linear import (
    fast_linear_mode,
    fast_linear_scope,
    install_fast_linears,
    linear,
    pack_weights,
    uses_onednn,
)


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64, bias=False))


def test_the_scope_gives_the_mode_bits_and_plain_f_linear_outside():
    net, x = _net(), torch.randn(5, 64)
    with torch.inference_mode():
        plain = net(x)
        packed = pack_weights(net)
        with fast_linear_mode(packed=packed):
            want = net(x)
        install_fast_linears(net)
        install_fast_linears(net)  # idempotent
        assert torch.equal(net(x), plain)  # outside a scope: F.linear as before
        with fast_linear_scope(packed):
            got = net(x)
            direct = linear(x, net[0].weight, net[0].bias)
        with fast_linear_scope(None):  # unpacked oneDNN
            unpacked = net(x)
    assert torch.equal(got, want)
    torch.testing.assert_close(unpacked, want, rtol=1e-5, atol=1e-5)
    if uses_onednn(x, net[0].weight):
        assert not torch.equal(got, plain)  # oneDNN, not MKL: the scope really switched the product
    with fast_linear_mode(packed=packed):
        assert torch.equal(direct, F.linear(x, net[0].weight, net[0].bias))


def test_the_scope_is_per_thread_and_restored():
    import threading

    net, x = _net(1), torch.randn(3, 64)
    install_fast_linears(net)
    seen = {}

    def other():
        seen["other"] = linear(x, net[0].weight)

    with torch.inference_mode(), fast_linear_scope(pack_weights(net)):
        inside = linear(x, net[0].weight)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert torch.equal(seen["other"], F.linear(x, net[0].weight))  # another thread: no scope
    assert torch.equal(linear(x, net[0].weight), F.linear(x, net[0].weight))  # restored on exit
    assert inside.shape == (3, 128)


def test_installed_layers_stay_linears_and_pickle():
    import io
    import pickle

    net = _net(3)
    install_fast_linears(net)
    assert all(isinstance(m, torch.nn.Linear) for m in (net[0], net[2]))
    copy = pickle.loads(pickle.dumps(net))
    x = torch.randn(2, 64)
    assert torch.equal(copy(x), net(x))
    buf = io.BytesIO()
    torch.save(net.state_dict(), buf)  # the state dict is unchanged: same keys as a plain Sequential
    assert set(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)) == set(_net(3).state_dict())


def test_gradients_flow_through_installed_layers_in_a_scope():
    net, x = _net(2), torch.randn(4, 64, requires_grad=True)
    install_fast_linears(net)
    with fast_linear_scope():
        net(x).sum().backward()
    assert x.grad is not None and net[0].weight.grad is not None
