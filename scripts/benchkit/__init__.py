"""Benchmark machinery shared by the bench scripts (not part of the library): `harness` runs the pretrainer Trainer,
a plain PyTorch loop and the HF Trainer side by side; `report` writes the JSON and docs/BENCHMARKS.md."""
