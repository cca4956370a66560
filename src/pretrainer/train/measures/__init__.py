"""Measurements taken around the step and logged, never acted on: the gradient noise scale (`noise_scale`), per-layer
gradient, update and parameter norms (`layers`), and the optimizer's update sizes (`probe`)."""
