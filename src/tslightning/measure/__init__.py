"""Measuring libraries: release-trace files and their replay (Eqs. 14-15), the analytical speedup model
(Eqs. 16-28, App. F) and its plots, learner FLOPs for MFU (Eq. 10), timelines, and pass@k (Eq. 31).

Layer: at the bottom, beside ``objectives``: imports nothing else of tslightning, so the loop, the callbacks and the
commands can all use it. (The commands that *drive* the loop — ``bench``, ``validate``, ``verify`` — live in
``tslightning.commands``.)
"""
