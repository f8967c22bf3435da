"""The stand-in CUDA device of tests/support/_device_trace.py refuses what CUDA refuses, accepts the
rest."""

import torch

from tests.support._device_trace import DeviceTrace


def test_host_tensor_meeting_a_device_tensor_is_recorded():
    with DeviceTrace() as trace:
        w = torch.ones(3, 3, device="cuda")
        x = torch.ones(2, 3)  # forgot .to(device)
        _ = x @ w
    assert len(trace.violations) == 1 and "aten.mm" in trace.violations[0]


def test_moved_scalar_and_index_mixes_are_accepted():
    with DeviceTrace() as trace:
        w = torch.ones(4, 3, device=torch.cuda.current_device())
        x = torch.arange(6.0).view(2, 3).to(torch.cuda.current_device())
        y = (x + w[:2]) * torch.tensor(2.0)  # a 0-dim host scalar: fine on CUDA
        rows = w[torch.tensor([0, 2])]  # host indices: fine on CUDA
        host = y.cpu()
        assert trace.on_device(y) and trace.on_device(rows) and not trace.on_device(host)
        assert float(host.sum()) == float((torch.arange(6.0).view(2, 3) + 1).sum() * 2)
    assert not trace.violations, trace.report()


def test_a_transfer_is_a_copy_and_numpy_needs_the_host():
    with DeviceTrace() as trace:
        x = torch.ones(3)
        d = x.to("cuda")
        assert trace.on_device(d) and not trace.on_device(x)  # the host original stays host
        _ = x + d
        d.numpy()
    assert [v.split(" ")[0] for v in trace.violations] == ["aten.add.Tensor", "numpy()"]
