"""``python -m torchautopsy ...``: the ``torchautopsy`` command itself (same output, same exit codes),
for environments where the script is not on PATH."""

from .analyzer.cli import main

if __name__ == "__main__":
    main()
