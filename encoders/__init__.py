"""Condition encoders: turn texts into cached embeddings, computing each one once cluster-wide."""
