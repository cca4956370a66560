"""Evaluation: held-out losses (`validation`: per source, `val/ref`), loss by position (`context`), lm-eval scores
(`downstream`), and the same on any saved model (`offline`)."""
