"""What a training phase needs besides the algorithm: runtime set-up, schedule, files and log
records, progress, the non-finite guard, stops, prefetching, the phase's examples.
"""
