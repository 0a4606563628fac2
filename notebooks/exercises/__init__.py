"""Exercises for the notebooks: the learner writes a stage's key function, and a check runs it
against the stage's own code and says, in plain words, what is wrong.

One module per notebook (`ex01` ... `ex07`) holds the checks; `solutions/` holds a reference
solution for each exercise, under the same name. In a notebook::

    from exercises import ex03, run

    def slot_mapping(block_table, start, end, block_size):
        raise NotImplementedError  # your code here

    slot_mapping = run(ex03.check_slot_mapping, slot_mapping)

`run` (in report.py) prints a tick and what was checked, or stops with the first wrong answer
(which input, what was expected, what came back). While the stub still raises
NotImplementedError, the verdict is a different one, "\N{WHITE CIRCLE} not written yet \N{EM DASH} reference
shown", never a tick: the check runs on the reference solution instead, so the notebook runs top
to bottom unattended (as nbval runs it) and the cells below get a working function. Set
EXERCISES_STRICT=1 to make an unwritten stub an error. `run` returns the function that passed
(yours, or the reference), for the cells below to use.

Each notebook has short exercises (one function, a few lines) and one stretch exercise of real
size (a class or a loop of 20-60 lines: a block manager, a scheduler, a Triton kernel).
"""

import warnings

from .report import ExerciseFailed, run

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's, when a stage is imported in Jupyter

__all__ = ["ExerciseFailed", "run"]
