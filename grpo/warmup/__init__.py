"""The supervised warm-up (R1-VL's first stage) and the perception supervision it can add.
"""
