import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def plain_train_logprobs():
    """Each test starts and ends with train.token_logprobs as train.py defines it
    (envace.token_logprobs): a run's setup binds the one its config chooses (train.chosen_logprobs),
    which must not reach the next test. Not through `monkeypatch`, whose undo() a test may call
    midway to drop its own patches."""
    import envace
    import train
    train.token_logprobs = envace.token_logprobs
    yield
    train.token_logprobs = envace.token_logprobs
