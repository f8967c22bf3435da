"""The RL progress line (train/logging_utils.Progress) when stderr is not a terminal."""

import io

from megatron_pdm.train.logging_utils import Progress


def _lines(masked):
    stream = io.StringIO()
    progress = Progress(total=2, initial=0, enabled=True, stream=stream)
    progress.update(0.25, masked, 1e-5)
    progress.update(0.5, 0.125, 2e-5)
    return stream.getvalue().splitlines()


def test_a_batch_without_loss_tokens_prints_n_a_not_nan():
    # every group's rewards equal -> no token with A != 0 -> the masked fraction is undefined
    for undefined in (None, float("nan")):
        first, second = _lines(undefined)
        assert "masked n/a" in first and "nan" not in first.split("|")[0]
        assert "masked 0.1250" in second
