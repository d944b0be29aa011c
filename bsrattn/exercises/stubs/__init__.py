"""The pristine exercise files: a learner's copy starts as these (``python -m bsrattn.exercises start``)."""
