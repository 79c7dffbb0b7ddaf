"""`bench predict`: each cell's peak allocated GPU memory, predicted on a CPU from a fake run of its
training step (bench/predict/fake.py), counted as the CUDA caching allocator counts
(bench/predict/counter.py), for a GPU kind (bench/predict/gpus.py). Walked by
bench/predict/runner.py: many cells per process, one row per cell, a parquet per run.
"""
