"""``python -m eval``: the evaluation CLI (eval/evaluate.py)."""

from eval.evaluate import main

raise SystemExit(main())
