"""The typed tensor cache over Mooncake Store, and the embedded stack it runs on.

Builds on ``keys`` only; every worker and the API reach the store through ``TensorCache``.
"""
