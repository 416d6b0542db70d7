"""The command line: ``memviz run`` (run.py, with the sample of sample.py),
``memviz report`` (report.py; report_ranks.py, several ranks' files merged),
``memviz diff`` (diff.py: the command; diff_compare.py: the comparison;
diff_render.py: its text) and ``memviz export`` (export.py: Parquet). What the verbs
share is in common.py.

See docs/architecture.md for the floors and what each may import."""
