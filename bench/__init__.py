"""A reproducible benchmark suite of memory strategies for LLM training.

Pipeline: matrix.yaml -> spec -> cells -> runner (one worker process per cell) -> results -> report.
"""
