"""The model: built from a Hugging Face config (no weights downloaded), RoPE per stage, inputs per packed document."""
