import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def plain_train_logprobs(monkeypatch):
    """Each test starts with train.token_logprobs as train.py defines it (envace.token_logprobs): a
    run's setup binds the one its config chooses (train.chosen_logprobs), and that is undone here."""
    import envace
    import train
    monkeypatch.setattr(train, "token_logprobs", envace.token_logprobs)
