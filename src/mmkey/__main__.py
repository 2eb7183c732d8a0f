"""``python -m mmkey``: the ``mmkey`` command."""

from mmkey.cli import main

if __name__ == "__main__":
    main()
