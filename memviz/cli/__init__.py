"""The command line: ``memviz run`` (run.py, with the sample of sample.py),
``memviz report`` (report.py) and ``memviz diff`` (diff.py: the command;
diff_compare.py: the comparison; diff_render.py: its text). What the verbs
share is in common.py.

See docs/architecture.md for the floors and what each may import."""
