"""``python -m unison``: the same as the ``unison`` command."""

from unison.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
