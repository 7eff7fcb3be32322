"""``python -m grpo.evaluate``: the evaluation command under the name users run; its code is
grpo/evaluation/evaluate.py (``--help`` there)."""

if __name__ == "__main__":  # before torch and transformers load: a release out of range is one line
    from grpo.deps import exit_on_unsupported_stack

    exit_on_unsupported_stack()

    from grpo.evaluation.evaluate import main

    raise SystemExit(main())
