import sys

from .app import main

if __name__ == "__main__":  # worker processes (--workers) import this module again without running it
    sys.exit(main())
