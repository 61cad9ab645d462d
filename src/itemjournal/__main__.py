"""``python -m itemjournal``: the ``itemjournal`` command."""

from ._operator.cli.app import main

if __name__ == "__main__":
    main()
