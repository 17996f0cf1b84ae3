"""Downstream evaluation with lm-eval-harness: Tessera's model as an lm-eval model (lm.py), the tasks a run names
(tasks.py), in-loop evaluation of the live model (loop.py) and `python -m tessera.eval` on a checkpoint."""
