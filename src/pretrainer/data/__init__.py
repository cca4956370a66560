"""Data: read sources, tokenize into token arrays, sample a deterministic mixture, build batches."""
