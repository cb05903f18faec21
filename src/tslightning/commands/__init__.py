"""Commands that drive the loop or the learner end to end: ``bench`` (every schedule on one workload, side by side),
``validate`` (pass@k of a checkpoint on the dev split) and ``verify`` (streamed vs batch-synchronous, App. G).

Layer: the top, below only :mod:`tslightning.cli`. May import the loop and everything below it.
"""
