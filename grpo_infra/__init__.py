"""The project's lowest floor: how a file is replaced and how a command stops.

    atomic.py   write-then-rename: the one way a file or a directory is replaced
    signals.py  SIGINT / SIGTERM: the one handler every command uses

Infrastructure every layer above uses (data/, eval/, grpo/, bench/); it imports nothing of
the project.
"""
