"""``python -m itemjournal``: the ``itemjournal`` command."""

from ._cli import main

if __name__ == "__main__":
    main()
