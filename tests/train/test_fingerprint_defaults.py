"""A model field added after a checkpoint was written counts as its default when resuming; other changes refuse."""
from __future__ import annotations

from k3train.checkpoint.fingerprint import fingerprint_diff


def test_field_missing_from_old_checkpoint_counts_as_its_default():
    new = {"model.hidden_size": 64, "model.residual": "attnres"}
    assert fingerprint_diff({"model.hidden_size": 64}, new) == []
    assert fingerprint_diff({"model.hidden_size": 64}, {**new, "model.residual": "standard"}) == \
        ["model.residual <absent> -> standard"]
    assert fingerprint_diff({"model.hidden_size": 32}, new) == ["model.hidden_size 32 -> 64"]
    assert fingerprint_diff({"data.path": "/a"}, {"data.path": "/a", "train.seed": 0}) == \
        ["train.seed <absent> -> 0"]
