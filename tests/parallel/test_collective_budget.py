"""The op's collective budget: exactly 2 all-reduces in forward (MAX of [N], then SUM of
[N, S+3]), 0 in backward.

As in Megatron's test_cross_entropy.py, a fake group of size 2 with patched
torch.distributed.all_reduce / get_world_size / get_rank runs the real code path in one process;
the patched all_reduce records every call (the tensors are left as they are, i.e. "the other
rank contributed zeros / -inf"). A third collective in forward or any in backward fails.
"""

import torch
import torch.distributed as dist

import megatron_pdm as pdm
from tests.support._cases import make_case, op_args


class _FakeGroup:
    pass


def test_two_collectives_forward_none_backward(monkeypatch):
    calls = []

    def fake_all_reduce(t, op=None, group=None, async_op=False):
        calls.append((op, tuple(t.shape)))

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    case = make_case(0, 8, 100, 4)
    logits = case["logits"][:, :50].clone().requires_grad_()
    stats = pdm.token_stats(logits, *op_args(case), tp_group=_FakeGroup(), vocab_size=100)
    assert [c[0] for c in calls] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM]
    assert calls[0][1] == (8,) and calls[1][1] == (8, 5 + 3)
    out = pdm.policy_loss(stats, torch.ones(8), case["behavior_logprob"],
                          torch.ones(8, dtype=torch.bool), pdm.PolicyLossConfig.preset("pdm-exact"))
    out[0].backward()
    assert len(calls) == 2, f"extra collectives: {calls[2:]}"
    assert logits.grad is not None


def test_no_collectives_without_group(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("collective on a single device")

    monkeypatch.setattr(dist, "all_reduce", forbidden)
    case = make_case(1, 4, 30, 2)
    logits = case["logits"].clone().requires_grad_()
    pdm.token_stats(logits, *op_args(case), tp_group=None, vocab_size=None).logprob.sum().backward()


def test_collectives_live_in_the_op_module_each_commented():
    """The per-shard math (parallel/shard_math.py) never communicates; every collective of the
    op is a call of parallel/collectives.all_reduce in the op module, each under a comment
    naming it; collectives.py itself holds the single dist.all_reduce."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "megatron_pdm" / "parallel"
    math_src = (root / "shard_math.py").read_text()
    imports = [n for n in ast.walk(ast.parse(math_src))
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    imported = {a.name if isinstance(n, ast.Import) else n.module for n in imports for a in n.names}
    assert not any(m and m.startswith("torch.distributed") for m in imported), imported
    assert "all_reduce" not in math_src and "dist." not in math_src
    door = (root / "collectives.py").read_text()
    assert door.count("dist.all_reduce(") == 1 and "all_gather" not in door
    op_lines = (root / "vocab_parallel.py").read_text().splitlines()
    calls = [i for i, line in enumerate(op_lines)
             if "all_reduce(" in line and not line.lstrip().startswith(("def ", "from "))]
    assert len(calls) == 2
    for i in calls:
        assert op_lines[i - 1].lstrip().startswith("# Collective"), op_lines[i - 1]
