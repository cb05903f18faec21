"""Pure math of the two objectives: GRPO group advantages and scales (Eqs. 4-7) and the scored-token
log-probabilities every source's surrogate is built on (Eqs. 4, 8).

Layer: the bottom of the learner. Imports torch only, nothing else of tslightning.
"""
