"""Learning-rate schedule shapes."""
import math

import pytest

from k3train.config import OptimConfig
from k3train.optim import lr_at


def _curve(total=100, **kw):
    cfg = OptimConfig(**{"lr": 1.0, "min_lr_ratio": 0.1, "warmup_steps": 10, **kw})
    return [lr_at(s, cfg, total) for s in range(total + 5)]


def test_warmup_is_linear_and_starts_above_zero():
    c = _curve(schedule="cosine")
    assert c[0] == pytest.approx(0.1) and c[4] == pytest.approx(0.5) and c[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(c[:9], c[1:10]))


def test_cosine_decays_monotonically_to_floor():
    c = _curve(schedule="cosine")
    assert c[10] == pytest.approx(1.0)
    assert c[55] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: midpoint of peak and floor
    assert all(b <= a + 1e-12 for a, b in zip(c[10:100], c[11:101]))
    assert c[100] == pytest.approx(0.1) and c[104] == pytest.approx(0.1)
    # curvature: cosine, not linear (above the straight line in the first half)
    assert c[30] > 1.0 - 0.9 * 20 / 90


def test_wsd_stable_then_linear_decay():
    c = _curve(schedule="wsd", wsd_decay_fraction=0.2)
    assert all(v == 1.0 for v in c[10:80])
    assert c[90] == pytest.approx(1.0 - 0.9 * 0.5)
    assert c[100] == pytest.approx(0.1)
    diffs = [c[i] - c[i + 1] for i in range(80, 99)]
    assert max(diffs) - min(diffs) < 1e-12  # linear


def test_constant_and_no_warmup():
    c = _curve(schedule="constant", warmup_steps=0)
    assert all(v == 1.0 for v in c)


def test_bad_inputs():
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_at(0, OptimConfig(schedule="linear", warmup_steps=0), 10)
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, OptimConfig(), 0)
    assert math.isfinite(lr_at(5, OptimConfig(warmup_steps=10), 3))
