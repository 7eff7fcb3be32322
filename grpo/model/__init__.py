"""The model: building and loading Qwen2.5-VL (the tiny one or a real one), prompts, the policy
(base -> 4-bit -> LoRA) and the log-probs of completions under it.
"""
