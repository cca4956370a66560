import numpy as np
import pytest

from pretrainer.train.measures.noise_scale import NoiseScale, gns_terms


def test_known_noise_scale_within_20_percent():
    rng = np.random.default_rng(0)
    d, b_small, b_big = 2000, 64, 2048
    G = rng.standard_normal(d)
    G /= np.linalg.norm(G)  # |G|^2 = 1
    true_bsimple = 500.0  # tr(Sigma) / |G|^2 with Sigma = s2 * I
    s2 = true_bsimple / d
    est = NoiseScale(beta=0.98)
    for _ in range(400):
        small = G + rng.normal(0, np.sqrt(s2 / b_small), d)  # mean of b_small per-sample gradients
        big = G + rng.normal(0, np.sqrt(s2 / b_big), d)
        value = est.update(b_small, b_big, float(small @ small), float(big @ big))
    assert value == pytest.approx(true_bsimple, rel=0.2)


def test_terms_exact_in_expectation():
    # E|G_B|^2 = |G|^2 + tr(S)/B: plugging expectations in recovers both exactly
    g2, tr = 2.0, 300.0
    assert gns_terms(10, 100, g2 + tr / 10, g2 + tr / 100) == pytest.approx((g2, tr))


def test_state_roundtrip():
    a = NoiseScale()
    a.update(10, 100, 5.0, 2.5)
    b = NoiseScale()
    b.load_state_dict(a.state_dict())
    assert b.value() == a.value()
