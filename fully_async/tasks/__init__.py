"""Built-in tasks that need more than a line of fully_async/data.py: the arithmetic word problems (arith.py)."""
