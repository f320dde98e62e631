"""The vLLM server as a context manager: argv, process group, health, metrics, logs.

Knows nothing of Ray or MLflow.
"""
