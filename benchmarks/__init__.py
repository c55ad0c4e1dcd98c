"""Benchmarks of autoparallel: run each as ``python -m benchmarks.<name>``; their figures go to
``benchmarks/results/<name>.jsonl`` and ``python -m benchmarks.render`` writes the docs from them."""
