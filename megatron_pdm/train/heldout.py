"""Held-out evaluation splits: the one rule that decides which problems training never sees.

A problem belongs to the held-out set iff a digest of its *content key* falls below
`fraction` of the digest range:

    heldout(key) = int(sha256("megatron-pdm-heldout-v1:" + key)[:8 bytes]) < fraction * 2^64

The key names what the problem *is*, not where it sits in a stream, so two streams that draw the
same problem agree on its side:

    addition      "add:{min(a, b)}+{max(a, b)}"      (a+b and b+a are one arithmetic fact)
    word problems "{op}:{a},{b}" with the operands as the problem states them, sorted for the
                  commutative add / multiply: the same fact in another name or object is the
                  same key, so the evaluation measures unseen arithmetic facts
    jsonl         the prompt text with whitespace folded (a prompt repeated in the file lands on
                  one side, see jsonl_task)

Training streams (`task.problems`, the warm-up, the warm-up's probe) draw candidates from their
generator and keep only the training side; `task.eval_problems` keeps only the held-out side. The
rule uses only the standard library (sha256), so the split is the same on every machine, torch
version and thread count. Changing the salt or a key format changes every split: bump the "v1".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

__all__ = ["DEFAULT_FRACTION", "HeldoutTooSmall", "heldout", "draw"]

SALT = "megatron-pdm-heldout-v1"
DEFAULT_FRACTION = 0.2
"""task.heldout_fraction's default: a fifth of the content keys are evaluation only."""


class HeldoutTooSmall(ValueError):
    """A stream could not find enough problems on its side of the split."""


def heldout(key: str, fraction: float) -> bool:
    """True iff the problem with content key `key` is in the held-out (evaluation) set."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction {fraction} must be in [0, 1)")
    digest = hashlib.sha256(f"{SALT}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0 ** 64


def draw(candidates: Iterable, key: Callable[[object], str], n: int, *, fraction: float,
         want_heldout: bool, distinct: bool | Callable[[object], str] = False, max_candidates: int | None = None,
         what: str = "problems") -> list:
    """The first `n` candidates on the wanted side of the split, in stream order.

    Args:
        candidates: an iterator of problems (deterministic: a seeded generator's stream).
        key: the problem's content key (module docstring).
        want_heldout: True for the evaluation stream, False for training streams.
        distinct: keep each problem once (the evaluation: n different problems): True compares
            content keys, a callable compares what it returns (e.g. the problem's text).
        max_candidates: give up after this many candidates (default 1000 * n + 10000).

    Raises:
        HeldoutTooSmall: the stream ran out, or `max_candidates` were drawn, before `n` were found
            (names `what`, the side, n and the fraction).
    """
    limit = max_candidates if max_candidates is not None else 1000 * n + 10000
    out: list = []
    seen: set[str] = set()
    tried = 0
    ident = key if distinct is True else distinct
    for problem in candidates:
        if len(out) == n:
            break
        tried += 1
        if tried > limit:
            break
        if heldout(key(problem), fraction) != want_heldout:
            continue
        if ident:
            k = ident(problem)
            if k in seen:
                continue
            seen.add(k)
        out.append(problem)
    if len(out) < n:
        side = "held-out" if want_heldout else "training"
        raise HeldoutTooSmall(
            f"{what}: found {len(out)} {'distinct ' if distinct else ''}{side} problems of the "
            f"{n} asked for after {tried} candidates (task.heldout_fraction={fraction}); "
            f"ask for fewer (train.eval_prompts) or change task.heldout_fraction")
    return out
