"""The three stages a request passes through (encode, denoise, decode) and what they compute
with: trajectories, checkpoints, CFG reuse, output media."""
