"""Training state on disk: checkpoints (registry, aliases, atomic writes), what their tensors
are, and where a phase starts (resume or warm start).
"""
