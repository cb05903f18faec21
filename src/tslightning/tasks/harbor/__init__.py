"""Reading the Harbor task format: ``task.toml``, Dockerfiles, compose projects, what an environment needs, and the
migration of older layouts.

Rule: reads files only; imports nothing that builds, fetches or runs (no sandbox runner, no ``environment/``).
One error policy: a file that cannot be read raises the parser's ``ValueError`` subclass with one line naming the
file, the field and the fix.
"""
