"""atelier: train and evaluate agentic coding models.

Continued pretraining on an open base model, then fully asynchronous RL inside
the same agent harness that the deployed agent uses, in isolated sandboxes,
measured on a benchmark of real engineering work.
"""

__version__ = "0.1.0"
