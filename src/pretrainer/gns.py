"""The simple gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A).

From the squared gradient norms at two batch sizes, B_small < B_big:

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)

Both are unbiased but very noisy per step, so each is smoothed (bias-corrected EMA) before the ratio is taken, as
the paper recommends. With batch sizes in tokens, B_simple is in tokens: an estimate of the critical batch.
"""

from __future__ import annotations


def gns_terms(b_small: float, b_big: float, sq_small: float, sq_big: float) -> tuple[float, float]:
    """(|G|², tr Σ) estimates from one pair of measurements."""
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class NoiseScale:
    def __init__(self, beta: float = 0.95):
        self.beta = beta
        self.g2 = self.trace = 0.0
        self.n = 0

    def update(self, b_small: float, b_big: float, sq_small: float, sq_big: float) -> float | None:
        """Add one measurement; returns the smoothed B_simple (None while |G|² is not yet positive)."""
        g2, trace = gns_terms(b_small, b_big, sq_small, sq_big)
        self.n += 1
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.trace = self.beta * self.trace + (1 - self.beta) * trace
        return self.value()

    def value(self) -> float | None:
        if self.n == 0:
            return None
        corr = 1 - self.beta**self.n  # the same bias correction for both: it cancels in the ratio
        g2, trace = self.g2 / corr, self.trace / corr
        return trace / g2 if g2 > 0 else None

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.trace, self.n = state["g2"], state["trace"], state["n"]
