"""Rollouts: G completions per prompt from the policy (KV-cache sampler, static-cache decode,
merged-copy sampling) and DAPO's dynamic sampling.
"""
