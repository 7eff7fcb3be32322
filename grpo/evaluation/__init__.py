"""Evaluation of models and checkpoints, in one place (the scoring itself, model-free, is eval/).

    model_eval.py    the checkpoint-side evaluation a training phase runs (greedy decoding on a
                     held-out subset, the shuffled-image control): what the gates read
    final_report.py  the test-split report after training (every alias of every phase)
    evaluate.py      the command, ``python -m grpo.evaluate`` (grpo/evaluate.py runs it)
"""
