"""Programs run under a harness's own interpreter, with this folder as ``sys.path[0]``: standard library only."""
